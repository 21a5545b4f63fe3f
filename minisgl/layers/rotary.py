# Chapter 02 (02_op_layer.ipynb): rotary position embedding with default, llama3 and yarn scaling.
"""Rotary position embedding (RoPE), NeoX "rotate-half" convention.

Each head vector is split into two halves ``x1, x2``; at position ``p`` pair ``i`` is rotated by
the angle ``p * inv_freq[i]``: ``(x1 * cos - x2 * sin, x2 * cos + x1 * sin)``. The cos/sin of
every position up to ``max_position`` is computed once, in float32, and looked up per token.
Scaled variants (``llama3``, ``yarn``) only change ``inv_freq`` (and, for yarn, scale cos/sin);
Hugging Face ``transformers`` is the reference for both.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Dict, Tuple

import torch

from .base import StateLessOP

PostProcess = Callable[[torch.Tensor], Tuple[torch.Tensor, float]]


class RotaryEmbedding(StateLessOP):
    def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                 post_process: PostProcess | None = None,
                 device: torch.device | str | None = None) -> None:
        if rotary_dim != head_size:
            raise ValueError(f"rotary_dim={rotary_dim} != head_size={head_size}: partial rotary "
                             "embedding is not supported.")
        if head_size % 2:
            raise ValueError(f"head_size={head_size} must be even: RoPE rotates pairs.")
        device = torch.device(device or _ROPE_DEVICE)
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / base ** (
            torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim)
        scale = 1.0
        if post_process is not None:
            inv_freq, scale = post_process(inv_freq)
        positions = torch.arange(max_position_embeddings, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq)  # [max_pos, D/2]
        # underscore: a table, not a weight, so it stays out of state dicts
        self._cos_sin_cache = torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``query [T, Hq*D]`` and ``key [T, Hkv*D]`` in place; returns them."""
        cos_sin = self._cos_sin_cache.index_select(0, positions)  # [T, D]
        half = self.rotary_dim // 2
        cos = cos_sin[:, None, :half]  # [T, 1, D/2], broadcast over heads
        sin = cos_sin[:, None, half:]
        for x in _rotation_targets(query, key):
            x = x.view(x.shape[0], -1, self.head_size)  # [T, H, D]
            # BEGIN SOLUTION 2.8: rotate each (x1, x2) pair by the token's angle, in place
            x1, x2 = x[..., :half], x[..., half:]
            o1 = torch.addcmul(x1 * cos, x2, sin, value=-1)  # x1 * cos - x2 * sin
            o2 = torch.addcmul(x2 * cos, x1, sin)  # x2 * cos + x1 * sin
            x1.copy_(o1)
            x2.copy_(o2)
            # END SOLUTION
        return query, key


def _rotation_targets(query: torch.Tensor, key: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """What to rotate: q and k, or -- when k sits right after q in every row, as it does in the
    fused qkv output -- one ``[T, (Hq + Hkv) * D]`` view covering both, rotated in one pass
    (half the small ops per layer; the arithmetic is identical)."""
    if (query.dim() == key.dim() == 2 and query.stride() == key.stride()
            and query.stride(1) == 1 and query.shape[0] == key.shape[0]
            and key.data_ptr() == query.data_ptr() + query.shape[1] * query.element_size()):
        both = query.as_strided((query.shape[0], query.shape[1] + key.shape[1]), query.stride())
        return (both,)
    return (query, key)


def _llama3(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
            high_freq_factor: float, original_max_position_embeddings: int,
            **_: Any) -> Tuple[torch.Tensor, float]:
    """Llama 3: long wavelengths slowed down by ``factor``, short ones kept, smooth in between."""
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _yarn(inv_freq: torch.Tensor, rotary_dim: int, base: float, factor: float,
          original_max_position_embeddings: int, beta_fast: float | None = None,
          beta_slow: float | None = None, attention_factor: float | None = None,
          mscale: float | None = None, mscale_all_dim: float | None = None,
          truncate: bool = True, **_: Any) -> Tuple[torch.Tensor, float]:
    """YaRN: blend interpolated (``/factor``) and original frequencies with a linear ramp
    over the dimensions, and scale cos/sin by an attention factor (as HF computes it)."""

    def mscale_of(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = mscale_of(factor, mscale) / mscale_of(factor, mscale_all_dim)
        else:
            attention_factor = mscale_of(factor)
    beta_fast, beta_slow = beta_fast or 32, beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return (rotary_dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi))
                ) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32, device=inv_freq.device) - low)
            / (high - low)).clamp(0, 1)
    keep_original = 1 - ramp  # 1 for high-frequency dims (extrapolate), 0 for low (interpolate)
    blended = (inv_freq / factor) * (1 - keep_original) + inv_freq * keep_original
    return blended, float(attention_factor)


_ROPE_DEVICE: torch.device = torch.device("cpu")


def set_rope_device(device: torch.device | str) -> None:
    """Where rope tables are built (the Engine sets its device before building the model)."""
    global _ROPE_DEVICE
    _ROPE_DEVICE = torch.device(device)


def _get_rope(head_dim: int, rotary_dim: int, max_position: int, base: float,
              rope_scaling: Dict[str, Any] | None) -> RotaryEmbedding:
    post_process = None
    if rope_scaling is not None:
        params = dict(rope_scaling)
        kind = params.pop("rope_type", params.pop("type", "default"))
        params.pop("rope_theta", None)
        if kind == "llama3":
            post_process = functools.partial(_llama3, **params)
        elif kind == "yarn":
            post_process = functools.partial(_yarn, rotary_dim=rotary_dim, base=base, **params)
        elif kind != "default":
            raise ValueError(f"rope_type {kind!r} is not supported; supported: default, llama3, "
                             "yarn.")
    return RotaryEmbedding(head_dim, rotary_dim, max_position, base, post_process,
                           device=_ROPE_DEVICE)


@functools.cache
def _cached_rope(head_dim: int, rotary_dim: int, max_position: int, base: float,
                 rope_scaling: Tuple[Tuple[str, Any], ...] | None,
                 device: torch.device) -> RotaryEmbedding:
    return _get_rope(head_dim, rotary_dim, max_position, base,
                     dict(rope_scaling) if rope_scaling is not None else None)


def get_rope(head_dim: int, rotary_dim: int, max_position: int, base: float,
             rope_scaling: Tuple[Tuple[str, Any], ...] | Dict[str, Any] | None = None
             ) -> RotaryEmbedding:
    """One shared RotaryEmbedding per distinct configuration (all layers share one table)."""
    if isinstance(rope_scaling, dict):
        rope_scaling = tuple(sorted(rope_scaling.items()))
    return _cached_rope(head_dim, rotary_dim, max_position, float(base), rope_scaling,
                        _ROPE_DEVICE)
