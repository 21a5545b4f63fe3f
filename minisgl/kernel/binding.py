# Chapter 07 (07_stage1_milestone.ipynb): bind(model), each op handed its fused implementation.
"""``bind(model)``: walk the model's ops once and hand each the kernel that replaces its code.

The choice happens here, once, while the Engine is built; afterwards each op simply calls what it
holds. What is bound (the functions live in ``__init__.py``):

- ``RMSNormFused.forward`` -> ``_rmsnorm_fused_forward`` (``rmsnorm`` / ``fused_add_rmsnorm``);
- ``RotaryEmbedding.forward`` -> ``_rope_forward`` (``rope_inplace``), on a copy of the op;
- ``GatedMLP._act_fn`` -> ``silu_and_mul``;
- the linear ops' and the LM head's ``_matmul`` -> ``small_batch_linear`` (``linear``).
"""

from __future__ import annotations

from types import MethodType

import torch

from . import (KernelBuildError, _rmsnorm_fused_forward, _rope_forward, load, silu_and_mul,
               small_batch_linear, unavailable_reason)


def bind(model) -> int:
    """Give ``model``'s ops their fused implementations; returns how many ops were bound.

    Called once by the Engine (``cpu_kernels=True``) after it built and loaded the model. Ops are
    changed one by one (an instance's ``forward`` or its ``_matmul`` / ``_act_fn``); the class
    keeps the chapter's code. The rope table, shared by all layers (and cached for later models),
    is copied rather than changed.
    """
    from minisgl.layers import AttentionLayer, ParallelLMHead, RMSNormFused, silu_and_mul as silu
    from minisgl.layers.base import BaseOP, OPList
    from minisgl.layers.linear import _LinearTPImpl
    from minisgl.models.utils import GatedMLP

    module = load()
    if module is None:
        raise KernelBuildError(f"the C++ kernels are unavailable: {unavailable_reason()}")
    threads_ok = bool(module.has_openmp()) or torch.get_num_threads() == 1
    bound, ropes, seen, todo = 0, {}, set(), [model]
    while todo:
        op = todo.pop()
        if id(op) in seen:
            continue
        seen.add(id(op))
        children = op.op_list if isinstance(op, OPList) else list(op.__dict__.values())
        todo += [c for c in children if isinstance(c, BaseOP)]
        if isinstance(op, RMSNormFused):
            op.forward = MethodType(_rmsnorm_fused_forward, op)
        elif isinstance(op, (_LinearTPImpl, ParallelLMHead)) and threads_ok:
            op._matmul = small_batch_linear  # without OpenMP it would run on one thread: keep MKL
        elif isinstance(op, GatedMLP) and op._act_fn is silu:
            op._act_fn = silu_and_mul
        elif isinstance(op, AttentionLayer) and op.rotary._cos_sin_cache.is_cpu:
            if id(op.rotary) not in ropes:  # one bound copy of each shared table
                rope = ropes[id(op.rotary)] = object.__new__(type(op.rotary))
                rope.__dict__.update(op.rotary.__dict__)
                rope.forward = MethodType(_rope_forward, rope)
            op.rotary = ropes[id(op.rotary)]
        else:
            continue
        bound += 1
    return bound
