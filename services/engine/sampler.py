"""Picks each sequence's next token from its logits, vectorized over the batch.

Semantics follow vLLM: logprobs are the log-softmax of the raw logits (before penalties and
temperature); repetition penalty applies to tokens seen in the prompt or the output (divide a
positive logit, multiply a negative one), presence and frequency penalties to tokens of the
output; min_tokens masks the EOS and stop token ids until reached; then temperature, top-k,
top-p and min-p; greedy rows (temperature 0) take the argmax.

Sampling inverts the cumulative distribution with one uniform per row (cheap on CPU, no host
sync on CUDA). A seeded request draws its uniform from its own torch.Generator, so the same seed
gives the same tokens whatever else is in the batch. The only host sync is reading the chosen
token ids (and the logprobs when asked); on CPU, a top-p-only row first looks at its best
TOP_P_CANDIDATES tokens and reads back whether they hold enough mass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.errors import SluiceError
from services.common.protocol.sampling_params import SamplingParams
from services.engine.outputs import TokenLogprob
from services.engine.sequence import Sequence

# Candidates tried in turn for top-p-only rows on CPU before the whole vocabulary (a full sort
# of a large vocabulary costs far more there than a top-k of a few hundred).
TOP_P_CANDIDATES = (512, 4096)


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
            raise SluiceError(f"logits of shape {tuple(logits.shape)} for {len(seqs)} sequences")
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
            rows = to_device([row for row, _ in banned], torch.long, device)
            cols = to_device([token for _, token in banned], torch.long, device)
            logits[rows, cols] = float("-inf")

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
        chosen = logits.argmax(dim=-1)  # the greedy rows' answer; others are overwritten
        full_rows, cut_rows = [], []
        for row, p in enumerate(params):
            if greedy_rows[row]:
                continue
            (cut_rows if p.top_k > 0 or p.top_p < 1.0 else full_rows).append(row)
        temperatures = to_device(
            [p.temperature if p.temperature > 0 else 1.0 for p in params], torch.float32, device
        )
        scaled = logits / temperatures.unsqueeze(1)
        for rows, pass_ in ((full_rows, self._sample_full), (cut_rows, self._sample_cut)):
            if rows:
                index = to_device(rows, torch.long, device)
                picked = pass_(scaled.index_select(0, index), [seqs[row] for row in rows])
                chosen = chosen.index_copy(0, index, picked)
        return chosen

    def _sample_full(self, scaled: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Rows without top-k/top-p: sample the whole (min-p filtered) distribution."""
        probs = torch.softmax(scaled, dim=-1)
        probs = _apply_min_p(probs, [seq.params.min_p for seq in seqs], probs.amax(-1))
        return self._draw(probs, seqs)

    def _sample_cut(self, scaled: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Rows with top-k and/or top-p: work on each row's best candidates, sorted.

        A row with top-k looks at its k best tokens; a row with only top-p at the
        TOP_P_CANDIDATES best on CPU (widening, up to the whole vocabulary, while a row's
        candidates hold less than p of the mass), the whole vocabulary on other devices (no
        host sync).
        """
        vocab = scaled.shape[1]
        params = [seq.params for seq in seqs]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        p_only = [p.top_k == 0 for p in params]
        on_cpu = scaled.device.type == "cpu"
        guesses = [width for width in TOP_P_CANDIDATES if width < vocab] if on_cpu else []
        guesses.append(vocab)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        only_p_rows = torch.tensor(p_only)
        for guess in guesses if any(p_only) else [vocab]:
            width = max(guess if only_p else k for k, only_p in zip(top_k, p_only, strict=True))
            probs, indices, mass = self._candidates(scaled, params, top_k, width)
            if guess == vocab or not bool(((mass < top_p) & only_p_rows).any()):
                break  # every top-p row's cut lies within its candidates (CPU: no device sync)
        best = self._draw(probs, seqs)
        return indices.gather(1, best.unsqueeze(1)).squeeze(1)

    @staticmethod
    def _candidates(
        scaled: torch.Tensor, params: list[SamplingParams], top_k: list[int], width: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's `width` best tokens with their top-k/top-p/min-p filtered probabilities,
        and the probability mass the candidates hold before the top-p cut."""
        device = scaled.device
        values, indices = torch.topk(scaled, width, dim=-1)  # sorted, best first
        positions = torch.arange(width, device=device).unsqueeze(0)
        k_tensor = to_device(top_k, torch.long, device).unsqueeze(1)
        values = values.masked_fill(positions >= k_tensor, float("-inf"))
        # Top-k rows renormalise over their k tokens; top-p-only rows over the full vocabulary.
        normaliser = torch.logsumexp(values, dim=-1)
        if not all(p.top_k > 0 for p in params):
            has_k = to_device([p.top_k > 0 for p in params], torch.bool, device)
            normaliser = torch.where(has_k, normaliser, torch.logsumexp(scaled, dim=-1))
        probs = torch.exp(values - normaliser.unsqueeze(1))
        mass = probs.sum(dim=-1)
        top_p = to_device(
            [p.top_p if p.top_p < 1.0 else 2.0 for p in params], torch.float32, device
        )
        mass_before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(mass_before >= top_p.unsqueeze(1), 0.0)
        probs = _apply_min_p(probs, [p.min_p for p in params], probs[:, 0])
        return probs, indices, mass

    def _draw(self, probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """One draw per row from unnormalised `probs` by inverting the cumulative sum.

        A seeded row takes exactly one uniform from its own generator per draw, so its tokens
        do not depend on its companions; the others share the sampler's generator.
        """
        device = probs.device
        uniform = torch.rand(len(seqs), generator=self._generator(device), device=device)
        for row, seq in enumerate(seqs):
            if seq.params.seed is None:
                continue
            if seq.generator is None:
                seq.generator = torch.Generator(device=device)
                seq.generator.manual_seed(seq.params.seed)
            uniform[row] = torch.rand(1, generator=seq.generator, device=device)[0]
        cumulative = probs.cumsum(dim=-1)
        # Strictly below the total, so the pick is never past the last token with mass.
        targets = uniform * cumulative[:, -1] * (1.0 - 2.0**-20)
        picked = torch.searchsorted(cumulative, targets.unsqueeze(1), right=True)
        return picked.clamp_(max=probs.shape[1] - 1).squeeze(1)

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.seed)
            self._generators[device] = generator
        return generator


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition (prompt + output), presence and frequency (output) penalties, in place.

    Sparse: only the (row, token) entries a penalised sequence has seen are touched.
    """
    device = logits.device
    rows_seen: list[int] = []
    ids_seen: list[int] = []
    rows_out: list[int] = []
    ids_out: list[int] = []
    repetition: list[float] = []
    frequency: list[float] = []
    presence_pairs: list[tuple[int, int]] = []
    presence: list[float] = []
    for row, seq in enumerate(seqs):
        p = seq.params
        if p.repetition_penalty != 1.0:
            rows_seen.extend([row] * len(seq.token_ids))
            ids_seen.extend(seq.token_ids)
            repetition.extend([p.repetition_penalty] * len(seq.token_ids))
        if p.frequency_penalty != 0.0 and seq.output_token_ids:
            rows_out.extend([row] * len(seq.output_token_ids))
            ids_out.extend(seq.output_token_ids)
            frequency.extend([-p.frequency_penalty] * len(seq.output_token_ids))
        if p.presence_penalty != 0.0 and seq.output_token_ids:
            unique = sorted(set(seq.output_token_ids))
            presence_pairs.extend((row, token) for token in unique)
            presence.extend([-p.presence_penalty] * len(unique))
    if ids_seen:
        index = (_long(rows_seen, device), _long(ids_seen, device))
        values = logits[index]
        penalty = to_device(repetition, logits.dtype, device)
        logits[index] = torch.where(values > 0, values / penalty, values * penalty)
    if ids_out:
        index = (_long(rows_out, device), _long(ids_out, device))
        logits.index_put_(index, to_device(frequency, logits.dtype, device), True)
    if presence_pairs:
        rows, ids = zip(*presence_pairs, strict=True)
        index = (_long(list(rows), device), _long(list(ids), device))
        logits.index_put_(index, to_device(presence, logits.dtype, device), True)
    return logits


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.long, device)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on `device`; on CUDA through pinned memory, asynchronously,
    so the copy does not wait for the work already queued on the stream."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def _apply_min_p(probs: torch.Tensor, min_p: list[float], top_prob: torch.Tensor) -> torch.Tensor:
    """Zero the tokens whose probability is below min_p times the row's top probability."""
    if not any(value > 0 for value in min_p):
        return probs
    factors = to_device(min_p, torch.float32, probs.device)
    return probs.masked_fill(probs < (top_prob * factors).unsqueeze(1), 0.0)


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
