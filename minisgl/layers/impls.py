# Chapter 02 (02_op_layer.ipynb): the implementation set an op is built with.
"""Which function an op calls is decided when the op is built, never while it runs.

``OpImpls`` names the few functions a faster implementation may provide. The default,
``TORCH_OPS``, is this workbook's own torch code: every op then runs what its chapter wrote. An
Engine picks the set before it builds the model (``with build_ops(impls): create_model(...)``),
and each op's constructor takes what it needs from ``current_ops()`` and keeps it, as the
official ops keep FlashInfer's functions. Nothing reads the set during a forward pass.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch.nn.functional as F


@dataclass(frozen=True)
class OpImpls:
    name: str = "torch"
    matmul: Callable = F.linear  # linear ops and the LM head: (x, weight, bias) -> y
    # RMSNormFused: (x, residual or None, weight, eps) -> (y, residual); None: the op's own code
    add_rmsnorm: Callable | None = None
    # RotaryEmbedding: (positions, query, key, cos_sin_cache, head_size), both rotated in place;
    # None: the op's own code
    rope: Callable | None = None
    silu_and_mul: Callable | None = None  # the MLP's silu activation; None: layers.silu_and_mul
    # the KV pool's store_kv (chapter 04): (k_layer, v_layer, k, v, out_loc), the layer's slots
    # written in place; the Engine builds its pool inside build_ops too. None: the pool's code
    store_kv: Callable | None = None
    # the Sampler's greedy path (chapter 06): logits [B, V] -> int64 [B], torch.argmax's answer
    # (first index on a tie); None: torch.argmax
    argmax: Callable | None = None
    # called once by the Engine, after loading: (model) -> None, moves the weights where this
    # set reads them fastest (chapter 07: one buffer of 2 MB pages); None: they stay where the
    # loader put them
    place_weights: Callable | None = None


TORCH_OPS = OpImpls()
_BUILDING: OpImpls = TORCH_OPS


def current_ops() -> OpImpls:
    """The set the op being built takes its functions from (read in constructors only)."""
    return _BUILDING


@contextlib.contextmanager
def build_ops(impls: OpImpls) -> Iterator[OpImpls]:
    """Build ops with ``impls`` inside the ``with`` block; the default set again after it."""
    global _BUILDING
    before, _BUILDING = _BUILDING, impls
    try:
        yield impls
    finally:
        _BUILDING = before
