"""The engine library: model, paged KV cache, scheduler and sampler, usable in-process.

`from services.engine import LLM, SamplingParams` is the offline API. Names are imported on first
use, so importing this package stays cheap (no torch, Ray or Redis until needed).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.engine.config import EngineConfig
    from services.engine.llm import LLM
    from services.engine.llm_engine import EngineInfo, LLMEngine
    from services.engine.outputs import CompletionOutput, FinishReason
    from services.engine.sampling_params import SamplingParams

_EXPORTS = {
    "LLM": "services.engine.llm",
    "LLMEngine": "services.engine.llm_engine",
    "EngineInfo": "services.engine.llm_engine",
    "EngineConfig": "services.engine.config",
    "SamplingParams": "services.engine.sampling_params",
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
