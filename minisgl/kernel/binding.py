# Chapter 07 (07_stage1_milestone.ipynb): op_impls(), the kernels as an implementation set.
"""``op_impls()``: the fused kernels as an ``OpImpls`` (chapter 02's ``impls.py``).

The Engine calls it once, before it builds the model, and builds the model inside
``build_ops(...)``: each op's constructor then keeps its kernel, and the classes keep the
chapters' code. What each op gets (the functions live in ``__init__.py``):

- ``RMSNormFused`` -> ``add_rmsnorm`` (``rmsnorm`` / ``fused_add_rmsnorm``);
- ``RotaryEmbedding`` -> ``rope`` (``rope_inplace``);
- ``GatedMLP``'s silu -> ``silu_and_mul``;
- the linear ops and the LM head -> ``small_batch_linear`` (``linear``);
- the KV pool (built inside ``build_ops`` too) -> ``store_kv``;
- the Sampler's greedy path (built inside ``build_ops`` too) -> ``argmax`` (``argmax_rows``);
- and, called once by the Engine after loading, ``place_weights`` (``weights.py``): the weights
  in one buffer of 2 MB pages.
"""

from __future__ import annotations

from minisgl.layers import OpImpls

from . import (KernelBuildError, add_rmsnorm, argmax, load, rope, silu_and_mul,
               small_batch_linear, store_kv, unavailable_reason)
from .weights import place_weights


def op_impls() -> OpImpls:
    """The kernels' implementation set (built or found in the cache first). The kernels run on
    their own threads, as many as torch has (the Engine's ``num_threads``)."""
    if load() is None:
        raise KernelBuildError(f"the C++ kernels are unavailable: {unavailable_reason()}")
    return OpImpls(name="cpp", matmul=small_batch_linear, add_rmsnorm=add_rmsnorm, rope=rope,
                   silu_and_mul=silu_and_mul, store_kv=store_kv, argmax=argmax,
                   place_weights=place_weights)
