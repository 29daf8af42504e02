"""Picks each sequence's next token from its logits, vectorized over the batch.

Semantics follow vLLM: logprobs are the log-softmax of the raw logits (before penalties and
temperature); repetition penalty applies to tokens seen in the prompt or the output (divide a
positive logit, multiply a negative one), presence and frequency penalties to tokens of the
output; min_tokens masks the EOS and stop token ids until reached; then temperature, top-k,
top-p and min-p; greedy rows (temperature 0) take the argmax.

Sampling uses the exponential race (argmax of probs / Exp(1) noise), which draws from the
distribution without a host sync. A seeded request draws its noise from its own
torch.Generator, so the same seed gives the same tokens whatever else is in the batch. The only
host sync is reading the chosen token ids (and the logprobs when asked).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.outputs import TokenLogprob
from services.engine.sequence import Sequence


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    """Stateless apart from the generator used for unseeded requests."""

    def __init__(self, eos_token_ids: tuple[int, ...] = (), seed: int = 0):
        self.eos_token_ids = tuple(eos_token_ids)
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """`logits` is float32 [len(seqs), vocab]; row i belongs to seqs[i]."""
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits of shape {tuple(logits.shape)} for {len(seqs)} sequences")
        params = [seq.params for seq in seqs]
        device = logits.device
        raw_logprobs = None
        if any(p.logprobs is not None for p in params):
            raw_logprobs = torch.log_softmax(logits.float(), dim=-1)

        logits = logits.float()
        modified = False
        if any(
            p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            for p in params
        ):
            logits = apply_penalties(logits.clone(), seqs)
            modified = True
        banned = self._min_tokens_bans(seqs)
        if banned:
            if not modified:
                logits = logits.clone()
            rows = torch.tensor([row for row, _ in banned], dtype=torch.long)
            cols = torch.tensor([token for _, token in banned], dtype=torch.long)
            logits[rows.to(device), cols.to(device)] = float("-inf")

        greedy_rows = [p.temperature == 0.0 for p in params]
        if all(greedy_rows):
            chosen = logits.argmax(dim=-1)
        else:
            chosen = self._sample_random(logits, seqs, greedy_rows)

        token_ids = chosen.tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(seqs)
        if raw_logprobs is not None:
            logprobs = _gather_logprobs(raw_logprobs, chosen, params)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    def _min_tokens_bans(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        banned: list[tuple[int, int]] = []
        for row, seq in enumerate(seqs):
            p = seq.params
            if seq.num_output_tokens >= p.min_tokens:
                continue
            stops = set(p.stop_token_ids)
            if not p.ignore_eos:
                stops.update(self.eos_token_ids)
            banned.extend((row, token) for token in sorted(stops))
        return banned

    def _sample_random(
        self, logits: torch.Tensor, seqs: list[Sequence], greedy_rows: list[bool]
    ) -> torch.Tensor:
        params = [seq.params for seq in seqs]
        device = logits.device
        greedy_choice = logits.argmax(dim=-1) if any(greedy_rows) else None
        temperatures = torch.tensor(
            [p.temperature if p.temperature > 0 else 1.0 for p in params], dtype=torch.float32
        ).to(device)
        logits = logits / temperatures.unsqueeze(1)
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        if any(p < 1.0 for p in top_p):
            logits = apply_top_k_top_p(logits, top_k, top_p)
        elif any(k > 0 for k in top_k):
            logits = apply_top_k(logits, top_k)
        probs = torch.softmax(logits, dim=-1)
        min_p = [p.min_p for p in params]
        if any(m > 0 for m in min_p):
            min_p_tensor = torch.tensor(min_p, dtype=torch.float32).to(device)
            threshold = probs.amax(dim=-1, keepdim=True) * min_p_tensor.unsqueeze(1)
            probs = probs.masked_fill(probs < threshold, 0.0)

        noise = torch.empty_like(probs)
        noise.exponential_(generator=self._generator(device))
        for row, seq in enumerate(seqs):
            if seq.params.seed is not None and not greedy_rows[row]:
                if seq.generator is None:
                    seq.generator = torch.Generator(device=device)
                    seq.generator.manual_seed(seq.params.seed)
                noise[row].exponential_(generator=seq.generator)
        chosen = (probs / noise).argmax(dim=-1)
        if greedy_choice is not None:
            mask = torch.tensor(greedy_rows, dtype=torch.bool).to(device)
            chosen = torch.where(mask, greedy_choice, chosen)
        return chosen

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.seed)
            self._generators[device] = generator
        return generator


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition (prompt + output), presence and frequency (output) penalties, in place."""
    device = logits.device
    num_rows, vocab = logits.shape
    rows_seen, ids_seen, rows_out, ids_out = [], [], [], []
    for row, seq in enumerate(seqs):
        rows_seen.extend([row] * len(seq.token_ids))
        ids_seen.extend(seq.token_ids)
        rows_out.extend([row] * len(seq.output_token_ids))
        ids_out.extend(seq.output_token_ids)
    counts = torch.zeros(num_rows, vocab, dtype=torch.float32, device=device)
    if ids_out:
        counts.index_put_(
            (torch.tensor(rows_out).to(device), torch.tensor(ids_out).to(device)),
            torch.ones(len(ids_out), dtype=torch.float32, device=device),
            accumulate=True,
        )
    seen = torch.zeros(num_rows, vocab, dtype=torch.bool, device=device)
    seen[torch.tensor(rows_seen).to(device), torch.tensor(ids_seen).to(device)] = True

    params = [seq.params for seq in seqs]
    repetition = torch.tensor([p.repetition_penalty for p in params]).to(device).unsqueeze(1)
    presence = torch.tensor([p.presence_penalty for p in params]).to(device).unsqueeze(1)
    frequency = torch.tensor([p.frequency_penalty for p in params]).to(device).unsqueeze(1)
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    logits -= frequency * counts
    logits -= presence * (counts > 0).float()
    return logits


def apply_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Keep each row's k largest logits (ties at the k-th value kept); k = 0 keeps all."""
    vocab = logits.shape[1]
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    max_k = max(ks)
    values = torch.topk(logits, max_k, dim=-1).values
    index = torch.tensor([k - 1 for k in ks], dtype=torch.long).to(logits.device)
    threshold = values.gather(1, index.unsqueeze(1))
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Top-k then top-p (smallest set whose probability reaches p), via one sort."""
    device = logits.device
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if any(k > 0 for k in top_k):
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], dtype=torch.long)
        kth = sorted_logits.gather(1, (vocab - ks.to(device)).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    cumulative = probs.cumsum(dim=-1)
    p = torch.tensor(top_p, dtype=torch.float32).to(device).unsqueeze(1)
    drop = cumulative <= 1.0 - p
    drop[:, -1] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _gather_logprobs(raw: torch.Tensor, chosen: torch.Tensor, params: list) -> list:
    max_n = max((p.logprobs or 0) for p in params)
    chosen_logprob = raw.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    top_values: list[list[float]] = [[] for _ in params]
    top_ids: list[list[int]] = [[] for _ in params]
    if max_n > 0:
        values, ids = torch.topk(raw, max_n, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    chosen_ids = chosen.tolist()
    result: list[TokenLogprob | None] = []
    for row, p in enumerate(params):
        if p.logprobs is None:
            result.append(None)
            continue
        n = p.logprobs
        top = tuple(zip(top_ids[row][:n], top_values[row][:n], strict=True))
        result.append(TokenLogprob(chosen_ids[row], chosen_logprob[row], top))
    return result
