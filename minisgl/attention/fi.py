# Chapter 05 (05_attention_backends.ipynb): the FlashInfer backend (NVIDIA GPUs only).
"""Paged attention with FlashInfer's CUDA kernels, behind the same two calls as TorchBackend.

FlashInfer reads keys and values straight from the KV pool, page by page: each layer's cache
``[num_pages, ps, Hkv, D]`` is exactly its "NHD" paged layout, so nothing is gathered or copied.
A *wrapper* object runs the kernels: ``plan(...)`` once per batch (it splits the work over the
GPU's multiprocessors from the index tensors of ``fi_metadata.py``, on the CPU), then
``run(q, (k_cache, v_cache))`` once per layer. Prefill batches (any mix of new prompts and cached
prefixes; the causal mask is bottom-right aligned) use the paged *prefill* wrapper; decode
batches the paged *decode* wrapper.

This backend plans lazily, in the first layer's ``forward``: a batch that a CUDA graph replays
never runs ``forward``'s Python, so it never pays for an eager plan it would not use.

Limits: FlashInfer's kernels take 16-bit inputs only (``torch.bfloat16`` or ``torch.float16``),
so the Engine must be built with one of those dtypes (use the torch backend in float32); head
dims 64, 128 and 256 are supported. ``flashinfer`` is imported inside the constructor, never at
module level: ``minisgl.attention`` imports this module only after it has checked for CUDA and
FlashInfer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict

import torch

from minisgl.core import Batch, get_global_ctx
from minisgl.distributed import get_tp_info
from minisgl.models import ModelConfig
from minisgl.utils import div_even

from .base import BaseAttnBackend, BaseAttnMetadata
from .fi_graph import FlashInferGraphHooks
from .fi_metadata import PagedKVMetadata, build_paged_metadata

WORKSPACE_BYTES = 128 << 20  # FlashInfer's scratch space for split-KV partial results
SUPPORTED_HEAD_DIMS = (64, 128, 256)


@dataclass
class FIAttnMetadata(BaseAttnMetadata):
    paged: PagedKVMetadata  # qo_indptr, kv_indptr, kv_indices, last_page_len
    out_loc: torch.Tensor  # [T] int64 on the device: slot of each new token's k/v
    last_indices: torch.Tensor  # [Bp] int64 on the device: qo_indptr[1:] - 1
    is_prefill: bool
    wrapper: Any  # the FlashInfer wrapper that runs this batch
    planned: bool = False

    def get_last_indices(self, bs: int) -> torch.Tensor:
        return self.last_indices[:bs]


class FlashInferBackend(FlashInferGraphHooks, BaseAttnBackend):
    def __init__(self, config: ModelConfig) -> None:
        import flashinfer  # only here: this module must import on machines without it

        ctx = get_global_ctx()
        if ctx.kv_cache is None or ctx.page_table is None:
            raise RuntimeError("create the KV pool and the page table (ctx.kv_cache, "
                               "ctx.page_table) before the attention backend.")
        self.kv_cache, self.page_table = ctx.kv_cache, ctx.page_table
        self.page_size = ctx.page_size
        self.dtype = self.kv_cache.dtype
        if self.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"FlashInfer's attention kernels take 16-bit inputs only, and the KV "
                             f"pool is {self.dtype}: build the Engine with dtype=torch.bfloat16 "
                             "(or float16), or use attention_backend='torch'.")
        tp = get_tp_info().size
        self.num_qo_heads = div_even(config.num_qo_heads, tp)
        self.num_kv_heads = div_even(config.num_kv_heads, tp, allow_replicate=True)
        self.head_dim = config.head_dim
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim={self.head_dim}: FlashInfer's kernels support head dims "
                             f"{SUPPORTED_HEAD_DIMS}; use attention_backend='torch'.")
        self.sm_scale = self.head_dim ** -0.5
        # the decode kernel without tensor cores serves small GQA groups best
        self.use_tensor_cores = self.num_qo_heads // self.num_kv_heads > 4
        device = self.kv_cache.device
        self._fi = flashinfer
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, kv_layout="NHD")
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, kv_layout="NHD", use_tensor_cores=self.use_tensor_cores)
        self.graph_wrappers: Dict[int, Any] = {}  # batch size -> decode wrapper with static buffers

    def prepare_metadata(self, batch: Batch) -> None:
        reqs = batch.padded_reqs if batch.padded_reqs is not None else batch.reqs
        device = self.kv_cache.device
        paged = build_paged_metadata(reqs, self.page_table, self.page_size)
        batch.attn_metadata = FIAttnMetadata(
            paged=paged, out_loc=batch.out_loc.to(device=device, dtype=torch.int64),
            last_indices=(paged.qo_indptr[1:].long() - 1).to(device),
            is_prefill=batch.is_prefill,
            wrapper=self.prefill_wrapper if batch.is_prefill else self.decode_wrapper)

    def _plan(self, md: FIAttnMetadata) -> None:
        """Plan ``md.wrapper`` for this batch (CPU work plus small copies; never inside a graph)."""
        p = md.paged
        common = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.sm_scale)
        if md.is_prefill:
            md.wrapper.plan(p.qo_indptr, p.kv_indptr, p.kv_indices, p.last_page_len,
                            self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size,
                            causal=True, **common)
        else:
            md.wrapper.plan(p.kv_indptr, p.kv_indices, p.last_page_len, self.num_qo_heads,
                            self.num_kv_heads, self.head_dim, self.page_size, **common)
        md.planned = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: Batch) -> torch.Tensor:
        md: FIAttnMetadata = batch.attn_metadata
        self.kv_cache.store_kv(k, v, md.out_loc, layer_id)  # the new tokens attend to themselves
        if not md.planned:  # the first layer of an eager batch
            self._plan(md)
        kv = (self.kv_cache.k_cache(layer_id), self.kv_cache.v_cache(layer_id))
        return md.wrapper.run(q.contiguous(), kv)  # [T, Hq, D]
