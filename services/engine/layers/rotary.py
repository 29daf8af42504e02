"""Rotary position embedding (NeoX / Hugging Face "rotate half" layout) with rope scaling.

Cos and sin are precomputed once for every position up to max_model_len and looked up by each
token's absolute position, so a flat batch mixing prefill chunks and decodes needs no padding.
Supported scalings: default, linear, llama3 (Llama 3.1/3.2). Others raise at load time.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from services.common.errors import FailedPreconditionError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim // 2] in float32, after rope scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])  # type: ignore[index]
    if rope_type == "llama3":
        return _llama3_inverse_frequencies(inv_freq, scaling)  # type: ignore[arg-type]
    raise FailedPreconditionError(
        f"rope scaling {rope_type!r} is not supported "
        f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
    )


def _llama3_inverse_frequencies(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    original_max = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = original_max / low_freq_factor
    high_freq_wavelen = original_max / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Apply rotary embedding to flat query/key tensors [T, heads, head_dim] in place of copies."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        cos, sin = self._tables(None)  # on the meta device when the model is built there
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)
        self._last: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def begin_step(self) -> None:
        """Forget the last step's cos/sin rows (the model calls this at each forward)."""
        self._last = None

    def reset_cache(self, device: torch.device | str) -> None:
        """Recompute the tables on `device` (after building the model on the meta device)."""
        self.cos_cache, self.sin_cache = self._tables(torch.device(device))
        self._last = None

    def _tables(self, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = inverse_frequencies(self.head_dim, self.theta, self.scaling)
        positions = torch.arange(self.max_positions, dtype=torch.int64).to(torch.float32)
        angles = torch.outer(positions, inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if device is not None:
            cos, sin = cos.to(device), sin.to(device)
        return cos, sin

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._lookup(positions, query.dtype)
        return _rotate(query, cos, sin), _rotate(key, cos, sin)

    def rotate(self, positions: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """Rotate one [T, heads, head_dim] tensor, e.g. query and key heads side by side."""
        cos, sin = self._lookup(positions, heads.dtype)
        return _rotate(heads, cos, sin)

    def _lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin rows [T, 1, head_dim]: sin with its first half negated, so that
        rotate_half(x) * sin == swap_halves(x) * signed_sin (one op less per call, exact)."""
        # Every layer of a step passes the same positions tensor: look the rows up once.
        cached = self._last
        if cached is not None and cached[0] is positions and cached[1] == dtype:
            return cached[2], cached[3]
        half = self.head_dim // 2
        cos = self.cos_cache.index_select(0, positions).unsqueeze(1).to(dtype)
        sin = self.sin_cache.index_select(0, positions).unsqueeze(1)
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).to(dtype)
        self._last = (positions, dtype, cos, signed_sin)
        return cos, signed_sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1] = [x2, x1] * sign."""
    half = x.shape[-1] // 2
    if x.device.type == "cpu":  # two fused ops instead of five small ones
        return torch.addcmul(x * cos, torch.roll(x, half, dims=-1), signed_sin)
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * signed_sin
