# Chapter 07 (07_stage1_milestone.ipynb): the "cpp" attention backend (fused decode attention).
"""``CppDecodeBackend``: chapter 05's ``TorchBackend`` with decode attention in C++.

Prefill, metadata and the CUDA-graph hooks are inherited unchanged. A decode batch (one query per
request, ``q_index is None``) first writes this step's k, v through the pool's ``store_kv`` (the
pool has one writer), then ``decode_attention`` reads each request's keys through ``kv_slots``,
one task per (request, KV head), so the ``G`` query heads of a KV head read each key once.
"""

from __future__ import annotations

import torch

from minisgl.attention import TorchBackend
from minisgl.core import Batch

from . import load, unavailable_reason


class CppDecodeBackend(TorchBackend):
    def __init__(self, config) -> None:
        self._module = load()
        if self._module is None:
            raise RuntimeError(f"attention backend 'cpp' needs chapter 07's C++ kernels, which "
                               f"could not be built ({unavailable_reason()}): use 'torch'.")
        super().__init__(config)
        if self.kv_cache.device.type != "cpu" or self.kv_cache.dtype != torch.float32:
            raise ValueError("attention backend 'cpp' runs on the CPU in float32 only; use "
                             "'torch' (or 'fi' on a GPU).")
        # each layer's caches as [slots, Hkv * D] rows, viewed once here: a view costs about a
        # microsecond, four per layer and step otherwise
        row = self.num_kv_heads * self.head_dim
        pool = self.kv_cache
        self._rows = [(pool.k_cache(i).view(-1, row), pool.v_cache(i).view(-1, row))
                      for i in range(pool.num_layers)]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: Batch) -> torch.Tensor:
        md = batch.attn_metadata
        if md.q_index is not None:  # prefill (or a decode with several queries): chapter 05's
            return super().forward(q, k, v, layer_id, batch)
        self.kv_cache.store_kv(k, v, md.out_loc, layer_id)
        k_rows, v_rows = self._rows[layer_id]
        # q [Bp, Hq, D] -> o [Bp, Hq, D]
        return self._module.decode_attention(q, k_rows, v_rows, md.kv_slots, md.seq_lens,
                                             md.max_kv_len, self.head_dim)
