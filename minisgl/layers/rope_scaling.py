# Chapter 02 (02_op_layer.ipynb): the llama3 and yarn frequency scalings of the rotary embedding.
"""Longer contexts for RoPE: ``llama3`` and ``yarn`` only change the inverse frequencies.

Each returns ``(inv_freq, scale)``: the new frequencies and the factor that multiplies the cos/sin
table (1 for llama3, yarn's attention factor). Hugging Face ``transformers`` is the reference.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Dict, Tuple

import torch

PostProcess = Callable[[torch.Tensor], Tuple[torch.Tensor, float]]


def scaling_post_process(rope_scaling: Dict[str, Any] | None, rotary_dim: int,
                         base: float) -> PostProcess | None:
    """The frequency transform a config's ``rope_scaling`` dict asks for (None: the default)."""
    if rope_scaling is None:
        return None
    params = dict(rope_scaling)
    kind = params.pop("rope_type", params.pop("type", "default"))
    params.pop("rope_theta", None)
    if kind == "llama3":
        return functools.partial(_llama3, **params)
    if kind == "yarn":
        return functools.partial(_yarn, rotary_dim=rotary_dim, base=base, **params)
    if kind != "default":
        raise ValueError(f"rope_type {kind!r} is not supported; supported: default, llama3, yarn.")
    return None


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
