"""Named model shapes for `dummy:<shape>`: random weights, real sizes, no download.

Each entry is a Hugging Face `config.json` dictionary, so a dummy model goes through the same
config parsing as a real one. Plain Python (no torch): `resolve_model`
(services/common/model_files.py: launcher, tokenizer and engine) validates names here, and the
engine builds its model config from them. A dummy model uses the default model's tokenizer
(SmolLM2, 49,152 tokens, eos id 2), so the loader widens a smaller vocabulary to that size; every
other size is the named model's own.
"""

from __future__ import annotations

from typing import Any

TOKENIZER_VOCAB_SIZE = 49152  # the default (SmolLM2) tokenizer's vocabulary
_SPECIAL_TOKENS = {"bos_token_id": 1, "eos_token_id": 2}

_LLAMA_3_70B: dict[str, Any] = {
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}

DUMMY_SHAPES: dict[str, dict[str, Any]] = {
    "llama-3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
    # Llama 3 / 3.1 70B: 64 query heads over 8 KV heads, ~141 GB in bf16 (2 x H200 at TP=2).
    "llama-3-70b": _LLAMA_3_70B,
    # The same layer, only 4 of them (~6 GB in bf16): fits one GPU, so TP=2 and TP=1 compare.
    "llama-3-70b-4l": {**_LLAMA_3_70B, "num_hidden_layers": 4},
    "llama-3.2-1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    },
    "llama-2-7b": {
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
    "smollm2-135m": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    },
    # Genuinely tiny, so the serving stack (not the model) is the limit in its benchmarks:
    # with the tokenizer's 49,152-token vocabulary the LM head (hidden x vocabulary) is most of
    # a step, so the hidden size is as small as it goes. Still 2 layers and grouped-query
    # attention (4 query heads over 2 KV heads of 16 dims), so every code path runs.
    "tiny": {
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 49152,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
}


def dummy_config(shape: str) -> dict[str, Any]:
    """The HF config dictionary of a named shape, vocabulary widened to the tokenizer's."""
    base = DUMMY_SHAPES[shape]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        **_SPECIAL_TOKENS,
        **base,
    }
    config["vocab_size"] = max(int(base["vocab_size"]), TOKENIZER_VOCAB_SIZE)
    return config
