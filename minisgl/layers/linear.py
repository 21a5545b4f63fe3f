# Chapter 02 (02_op_layer.ipynb): linear layers with tensor-parallel sharding.
"""Linear layers, each knowing how its weight is split across tensor-parallel ranks.

Column-parallel layers split the *output* features (each rank computes some heads, or part of
the MLP's hidden width; no communication). Row-parallel layers split the *input* features; each
rank's output is a partial sum, added up with an all-reduce. Weights are created as placeholders
(under a ``meta`` device when the Engine builds the model) with the *local* shape
``[local_out, local_in]``, and replaced by real tensors when the checkpoint is loaded.
"""

from __future__ import annotations

from typing import List

import torch

from minisgl.distributed import DistributedCommunicator, get_tp_info
from minisgl.utils import div_even

from .base import BaseOP
from .impls import current_ops


class _LinearTPImpl(BaseOP):
    """Shared by every linear layer: the four sizes, the weight, the optional bias."""

    def __init__(self, full_isize: int, full_osize: int, local_isize: int, local_osize: int,
                 has_bias: bool) -> None:
        self.full_input_size = full_isize
        self.full_output_size = full_osize
        self.local_input_size = local_isize
        self.local_output_size = local_osize
        self.weight = torch.empty(local_osize, local_isize)
        self.bias = torch.empty(local_osize) if has_bias else None
        # the matmul this op runs, chosen when it is built (F.linear, or chapter 07's kernel for
        # an Engine with cpu_kernels=True); underscore: not a weight
        self._matmul = current_ops().matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.weight, self.bias)  # [T, local_in] -> [T, local_out]


class LinearReplicated(_LinearTPImpl):
    """A full copy on every rank (no split, no communication)."""

    def __init__(self, input_size: int, output_size: int, has_bias: bool) -> None:
        super().__init__(input_size, output_size, input_size, output_size, has_bias)


class LinearColParallelMerged(_LinearTPImpl):
    """Several column-parallel projections fused into one (gate and up of the MLP).

    Each component's output features are split evenly over the ranks, so rank ``r`` holds the
    ``r``-th slice of every component, concatenated in component order.
    """

    def __init__(self, input_size: int, output_sizes: List[int], has_bias: bool) -> None:
        tp = get_tp_info().size
        # BEGIN SOLUTION 2.3: each component's output is split over the tp ranks
        local_osize = sum(div_even(size, tp) for size in output_sizes)
        # END SOLUTION
        super().__init__(input_size, sum(output_sizes), input_size, local_osize, has_bias)


class LinearQKVMerged(_LinearTPImpl):
    """q, k and v projections fused into one column-parallel layer, split by heads.

    Local output layout: ``[Hq * D | Hkv * D | Hkv * D]``. With more ranks than KV heads, each
    rank keeps one whole KV head (replicated), as the official layers do.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_qo_heads: int, num_kv_heads: int,
                 has_bias: bool) -> None:
        tp = get_tp_info().size
        # BEGIN SOLUTION 2.4: local query and KV head counts (KV heads may be replicated)
        local_qo = div_even(num_qo_heads, tp)
        local_kv = div_even(num_kv_heads, tp, allow_replicate=True)
        # END SOLUTION
        full_osize = (num_qo_heads + 2 * num_kv_heads) * head_dim
        local_osize = (local_qo + 2 * local_kv) * head_dim
        super().__init__(hidden_size, full_osize, hidden_size, local_osize, has_bias)


class _RowParallel(_LinearTPImpl):
    """Input features split over ranks; partial outputs summed with an all-reduce."""

    def __init__(self, input_size: int, output_size: int, has_bias: bool) -> None:
        tp_info = get_tp_info()
        local_isize = div_even(input_size, tp_info.size)
        super().__init__(input_size, output_size, local_isize, output_size, has_bias)
        self._tp_size = tp_info.size
        self._comm = DistributedCommunicator()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x, self.weight)  # [T, out]: this rank's partial sum
        if self._tp_size > 1:
            y = self._comm.all_reduce(y)
        if self.bias is not None:  # once, after the sum (per rank, it would count tp times)
            y = y + self.bias
        return y


class LinearOProj(_RowParallel):
    """The attention output projection (row parallel over the heads)."""


class LinearRowParallel(_RowParallel):
    """The MLP's down projection (row parallel over the hidden width)."""
