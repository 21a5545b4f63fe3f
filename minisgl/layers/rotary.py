# Chapter 02 (02_op_layer.ipynb): rotary position embedding: the op, its table, get_rope.
"""Rotary position embedding (RoPE), NeoX "rotate-half" convention.

Each head vector is split into two halves ``x1, x2``; at position ``p`` pair ``i`` is rotated by
the angle ``p * inv_freq[i]``: ``(x1 * cos - x2 * sin, x2 * cos + x1 * sin)``. The cos/sin of
every position up to ``max_position`` is computed once, in float32, and looked up per token.
Scaled variants (``llama3``, ``yarn``, in ``rope_scaling.py``) only change ``inv_freq`` (and,
for yarn, scale cos/sin).
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Tuple

import torch

from .base import StateLessOP
from .impls import current_ops
from .rope_scaling import PostProcess, scaling_post_process


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
        self._kernel = current_ops().rope  # None: the code below (impls.py)

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``query [T, Hq*D]`` and ``key [T, Hkv*D]`` in place; returns them."""
        if self._kernel is not None:  # a fused kernel this op was built with
            self._kernel(positions, query, key, self._cos_sin_cache, self.head_size)
            return query, key
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


_ROPE_DEVICE: torch.device = torch.device("cpu")


def set_rope_device(device: torch.device | str) -> None:
    """Where rope tables are built (the Engine sets its device before building the model)."""
    global _ROPE_DEVICE
    _ROPE_DEVICE = torch.device(device)


def get_rope_device() -> torch.device:
    return _ROPE_DEVICE


def _get_rope(head_dim: int, rotary_dim: int, max_position: int, base: float,
              rope_scaling: Dict[str, Any] | None) -> RotaryEmbedding:
    post_process = scaling_post_process(rope_scaling, rotary_dim, base)
    return RotaryEmbedding(head_dim, rotary_dim, max_position, base, post_process,
                           device=_ROPE_DEVICE)


@functools.cache
def _cached_rope(head_dim: int, rotary_dim: int, max_position: int, base: float,
                 rope_scaling: Tuple[Tuple[str, Any], ...] | None,
                 device: torch.device, kernel: Any) -> RotaryEmbedding:
    return _get_rope(head_dim, rotary_dim, max_position, base,
                     dict(rope_scaling) if rope_scaling is not None else None)


def get_rope(head_dim: int, rotary_dim: int, max_position: int, base: float,
             rope_scaling: Tuple[Tuple[str, Any], ...] | Dict[str, Any] | None = None
             ) -> RotaryEmbedding:
    """One shared RotaryEmbedding per distinct configuration (all layers share one table; one
    per implementation it is built with, too)."""
    if isinstance(rope_scaling, dict):
        rope_scaling = tuple(sorted(rope_scaling.items()))
    return _cached_rope(head_dim, rotary_dim, max_position, float(base), rope_scaling,
                        _ROPE_DEVICE, current_ops().rope)
