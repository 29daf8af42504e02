"""The engine library: model, paged KV cache, scheduler and sampler, usable in-process.

`from services.engine import LLM, SamplingParams` is the offline API (`SamplingParams` is the
protocol layer's, services/common/protocol/sampling_params.py). Names are imported on first use:
every `services.engine.*` import runs this file first, and the processes that import the engine
without running a model (the launcher of `sluice up --ray`, which drives Ray, imports
`services.engine.worker`; `sluice serve engine` parses flags and logs its config before it builds
the engine) must not pay for torch, Ray or Redis up front.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.common.protocol.sampling_params import SamplingParams
    from services.engine.config import EngineConfig
    from services.engine.llm import LLM
    from services.engine.llm_engine import EngineInfo, LLMEngine
    from services.engine.outputs import CompletionOutput, FinishReason

_EXPORTS = {
    "LLM": "services.engine.llm",
    "LLMEngine": "services.engine.llm_engine",
    "EngineInfo": "services.engine.llm_engine",
    "EngineConfig": "services.engine.config",
    "SamplingParams": "services.common.protocol.sampling_params",
    "CompletionOutput": "services.engine.outputs",
    "FinishReason": "services.engine.outputs",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineInfo",
    "FinishReason",
    "LLMEngine",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'services.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
