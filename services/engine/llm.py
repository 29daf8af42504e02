"""The offline API: `LLM(model).generate(prompts, params)`, like vLLM's `LLM`, for batch inference.

It owns one LLMEngine and the model's tokenizer, submits every prompt at once, drives the engine
until all are done and returns one CompletionOutput per prompt, in the prompts' order. Prompts
are strings (encoded with the model's tokenizer, special tokens added as the model expects) or
lists of token ids; text is decoded with special tokens skipped.

LoRA adapters: `LLM(model, adapter_root=DIR, max_loras=N, ...)` serves PEFT adapters from under
DIR; `add_adapter(name, path)` checks and registers one (path relative to DIR), and
`generate(prompts, params, adapters=...)` runs each prompt with its adapter (one name for all,
or one per prompt, None for the base model), all in the same batches.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceType
from typing import Any

from services.common.errors import InvalidArgumentError
from services.common.protocol.adapter_record import AdapterRecord
from services.common.protocol.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.outputs import CompletionOutput

Prompt = str | list[int]
# How long the offline loop sleeps at most while every request waits for an adapter load.
ADAPTER_LOAD_WAIT_S = 0.05


class LLM:
    """A model loaded in this process, for offline generation."""

    def __init__(self, model: str | None = None, backend: str = "torch", **config_fields: Any):
        try:
            self.config = EngineConfig(model=model, backend=backend, **config_fields)
        except TypeError as exc:  # an unknown keyword
            raise InvalidArgumentError(f"LLM: {exc}") from exc
        self.engine = LLMEngine(self.config)
        self._tokenizer: Any = None
        self._request_ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: LLMEngine, tokenizer: Any = None) -> LLM:
        """Wrap an existing engine (and optionally a tokenizer), e.g. one over a custom runner."""
        llm = cls.__new__(cls)
        llm.config = engine.config
        llm.engine = engine
        llm._tokenizer = tokenizer
        llm._request_ids = itertools.count()
        return llm

    @property
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (loaded on first use)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            files = self.engine.model_files
            if files is None:
                from services.common.model_files import resolve_model

                files = resolve_model(self.config.model)
            self._tokenizer = AutoTokenizer.from_pretrained(str(files.tokenizer_dir))
        return self._tokenizer

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def add_adapter(self, name: str, path: str | None = None) -> AdapterRecord:
        """Check the PEFT adapter at `path` (relative to adapter_root; default: `name`) against
        the model and register it as `name`; its record (rank, modules, checksum)."""
        record = self.engine.inspect_adapter(name, name if path is None else path)
        self.engine.register_adapter(record)
        return record

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        adapters: str | SequenceType[str | None] | None = None,
    ) -> list[CompletionOutput]:
        """Generate for every prompt; one CompletionOutput per prompt, in order.

        `adapters`: a registered adapter name for every prompt, or one name (or None for the
        base model) per prompt."""
        token_prompts = [self._to_token_ids(prompt) for prompt in _as_prompt_list(prompts)]
        if not token_prompts:
            return []
        params_list = _as_params_list(params, len(token_prompts))
        adapter_list = _as_adapter_list(adapters, len(token_prompts))
        outputs: dict[str, CompletionOutput] = {}
        order: list[str] = []
        try:
            for token_ids, sampling, adapter in zip(
                token_prompts, params_list, adapter_list, strict=True
            ):
                request_id = f"llm-{next(self._request_ids)}"
                self.engine.add_request(request_id, token_ids, sampling, adapter=adapter)
                order.append(request_id)
                outputs[request_id] = CompletionOutput(
                    request_id=request_id,
                    prompt_token_ids=token_ids,
                    logprobs=[] if sampling.logprobs is not None else None,
                    adapter=adapter,
                )
            self._run(outputs, use_tqdm)
        except BaseException:
            for request_id in order:
                self.engine.abort(request_id)
            while self.engine.has_unfinished():  # drain the abort reports
                self.engine.step()
            raise
        for output in outputs.values():
            output.text = self.tokenizer.decode(output.token_ids, skip_special_tokens=True)
        return [outputs[request_id] for request_id in order]

    def _run(self, outputs: dict[str, CompletionOutput], use_tqdm: bool) -> None:
        progress = None
        if use_tqdm:
            from tqdm.auto import tqdm

            progress = tqdm(total=len(outputs), desc="generating", unit="prompt")
        try:
            while self.engine.has_unfinished():
                if self.engine.waiting_for_adapters():  # sleep until a load ends
                    self.engine.wait_for_adapter_load(ADAPTER_LOAD_WAIT_S)
                for delta in self.engine.step().deltas:
                    output = outputs.get(delta.request_id)
                    if output is None:
                        continue
                    output.token_ids.extend(delta.new_token_ids)
                    if output.logprobs is not None and delta.logprobs:
                        output.logprobs.extend(delta.logprobs)
                    output.num_cached_prompt_tokens = delta.num_cached_prompt_tokens
                    if delta.error:
                        output.error = delta.error
                    if delta.finished:
                        output.finish_reason = delta.finish_reason
                        if progress is not None:
                            progress.update(1)
        finally:
            if progress is not None:
                progress.close()

    def _to_token_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidArgumentError("the prompt is empty")
            return self.encode(prompt)
        return list(prompt)


def _as_prompt_list(prompts: Any) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, SequenceType):
        raise InvalidArgumentError("prompts must be a string, a list of token ids, or a list")
    if prompts and all(isinstance(item, int) and not isinstance(item, bool) for item in prompts):
        return [list(prompts)]
    result: list[Prompt] = []
    for item in prompts:
        if isinstance(item, str) or (isinstance(item, SequenceType) and not isinstance(item, str)):
            result.append(item if isinstance(item, str) else list(item))
        else:
            raise InvalidArgumentError(
                "each prompt must be a string or a list of token ids, got " + type(item).__name__
            )
    return result


def _as_adapter_list(adapters: Any, count: int) -> list[str | None]:
    if adapters is None or isinstance(adapters, str):
        return [adapters or None] * count
    if not isinstance(adapters, SequenceType):
        raise InvalidArgumentError("adapters must be a name, or a list of names (or None)")
    names = list(adapters)
    if len(names) != count:
        raise InvalidArgumentError(
            f"got {len(names)} adapters for {count} prompts; give one or one per prompt"
        )
    for name in names:
        if name is not None and not isinstance(name, str):
            raise InvalidArgumentError("each adapter must be a name or None")
    return [name or None for name in names]


def _as_params_list(
    params: SamplingParams | list[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise InvalidArgumentError(
            f"got {len(params)} sampling params for {count} prompts; give one or one per prompt"
        )
    for item in params:
        if not isinstance(item, SamplingParams):
            raise InvalidArgumentError("params must be SamplingParams objects")
    return params
