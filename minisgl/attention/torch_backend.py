# Chapter 05 (05_attention_backends.ipynb): the pure-torch reference attention backend.
"""Paged attention in plain torch, for any batch: prefill with or without a cached prefix,
decode, grouped-query attention, padding requests, any page size.

``prepare_metadata`` does the bookkeeping once per batch: each request's key slots
``kv_slots [Bp, Kmax]`` from the page table (``Kmax`` = the longest ``device_len``; shorter rows
are padded with valid slots, masked out), the query rows of each request, the mask. ``forward``
(once per layer) then stores, gathers and calls one ``scaled_dot_product_attention`` for the
whole batch. Grouped-query attention is folded into the query rows: the ``G = Hq / Hkv`` query
heads that share a KV head become ``G`` times more rows of that KV head, so K and V are never
repeated. The CUDA-graph hooks come from ``torch_graph.py`` (the optional GPU section).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisgl.core import Batch, get_global_ctx
from minisgl.distributed import get_tp_info
from minisgl.models import ModelConfig
from minisgl.utils import div_even

from .base import BaseAttnBackend, BaseAttnMetadata
from .mask import build_mask
from .torch_graph import TorchGraphHooks


@dataclass
class TorchAttnMetadata(BaseAttnMetadata):
    cu_seqlens_q: torch.Tensor  # [Bp + 1] int64: query rows of request b are cu[b] .. cu[b+1]-1
    seq_lens: torch.Tensor  # [Bp] int64: device_len of each request (keys it attends to)
    out_loc: torch.Tensor  # [T] int64: slot each new token's k/v is written to
    kv_slots: torch.Tensor  # [Bp * Kmax] int64: flattened [Bp, Kmax] slots of every key position
    max_kv_len: int  # Kmax
    max_q_len: int  # Qmax
    q_index: torch.Tensor | None  # [Bp * Qmax] int64 rows of q per request; None in pure decode
    o_index: torch.Tensor | None  # [T] int64: where each real query row sits in [Bp * Qmax]
    mask: torch.Tensor | None  # [Bp, 1, G * Qmax, Kmax] bool (True = may attend) or None
    last_indices: torch.Tensor  # [Bp] int64: cu_seqlens_q[1:] - 1

    def get_last_indices(self, bs: int) -> torch.Tensor:
        return self.last_indices[:bs]


class TorchBackend(TorchGraphHooks, BaseAttnBackend):

    def __init__(self, config: ModelConfig) -> None:
        ctx = get_global_ctx()
        if ctx.kv_cache is None or ctx.page_table is None:
            raise RuntimeError("create the KV pool and the page table (ctx.kv_cache, "
                               "ctx.page_table) before the attention backend.")
        tp = get_tp_info().size
        self.kv_cache = ctx.kv_cache
        self.page_table = ctx.page_table
        self.num_qo_heads = div_even(config.num_qo_heads, tp)
        self.num_kv_heads = div_even(config.num_kv_heads, tp, allow_replicate=True)
        self.group = self.num_qo_heads // self.num_kv_heads
        self.head_dim = config.head_dim

    def prepare_metadata(self, batch: Batch) -> None:
        reqs = batch.padded_reqs if batch.padded_reqs is not None else batch.reqs
        device, rows_total = self.page_table.device, self.page_table.shape[0]
        bad = [r for r in reqs if not 0 <= r.table_idx < rows_total]
        if bad:  # this runs before forward_batch's checks: the first place a bad row is met
            raise IndexError(f"Req(uid={bad[0].uid}).table_idx={bad[0].table_idx} is outside the "
                             f"page table's rows 0..{rows_total - 1}.")
        # the per-request counts as Python ints, each list made a tensor once: every torch op
        # costs microseconds, and in a decode step this is a handful of numbers
        cached = [r.cached_len for r in reqs]
        lens = [r.device_len for r in reqs]
        extend = [n - c for n, c in zip(lens, cached)]  # new tokens (query rows) per request
        cu = [0, *itertools.accumulate(extend)]  # request b's query rows: cu[b] .. cu[b+1]-1
        max_q, max_kv = max(extend), max(lens)
        seq_lens = torch.tensor(lens, dtype=torch.int64)
        # BEGIN SOLUTION 5.2: every request's key slots, padded to [Bp, Kmax], from the page table
        rows = torch.tensor([r.table_idx for r in reqs], dtype=torch.int64, device=device)
        kv_slots = self.page_table[rows, :max_kv].long()  # [Bp, Kmax]; past device_len: masked
        # END SOLUTION
        if batch.is_decode and max_q == 1:  # one query per request: no gather, mask only lengths
            q_index = o_index = None
            ragged = any(n != max_kv for n in lens)
            mask = (torch.arange(max_kv)[None, :] < seq_lens[:, None]).view(
                len(reqs), 1, 1, max_kv) if ragged else None
        else:
            starts = torch.tensor(cu[:-1], dtype=torch.int64)
            counts = torch.tensor(extend, dtype=torch.int64)
            offs = torch.arange(max_q)
            q_index = (starts[:, None] + offs).clamp(max=cu[-1] - 1)  # [Bp, Qmax]
            valid = offs[None, :] < counts[:, None]
            o_index = (torch.arange(len(reqs))[:, None] * max_q + offs)[valid]  # [T]
            q_index = q_index.flatten()
            mask = build_mask(torch.tensor(cached, dtype=torch.int64), counts, seq_lens, max_q,
                              max_kv)  # [Bp, Qmax, Kmax]
            # the G query heads of a KV head are G blocks of Qmax rows: repeat the mask per block
            mask = mask[:, None].expand(-1, self.group, -1, -1).reshape(
                len(reqs), 1, self.group * max_q, max_kv)
        batch.attn_metadata = TorchAttnMetadata(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int64, device=device),
            seq_lens=seq_lens.to(device),
            out_loc=batch.out_loc.to(device=device, dtype=torch.int64),
            kv_slots=kv_slots.flatten(), max_kv_len=max_kv, max_q_len=max_q,
            q_index=None if q_index is None else q_index.to(device),
            o_index=None if o_index is None else o_index.to(device),
            mask=None if mask is None else mask.to(device),
            last_indices=torch.tensor([c - 1 for c in cu[1:]], dtype=torch.int64, device=device))
# --- part 2: forward, once per layer ---

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: Batch) -> torch.Tensor:
        md: TorchAttnMetadata = batch.attn_metadata
        hkv, g, d = self.num_kv_heads, self.group, self.head_dim
        bp, kmax, qmax = md.seq_lens.shape[0], md.max_kv_len, md.max_q_len
        # BEGIN SOLUTION 5.3: store first, gather each request's keys, one batched SDPA
        self.kv_cache.store_kv(k, v, md.out_loc, layer_id)
        k_all = self.kv_cache.k_cache(layer_id).view(-1, hkv, d).index_select(0, md.kv_slots)
        v_all = self.kv_cache.v_cache(layer_id).view(-1, hkv, d).index_select(0, md.kv_slots)
        k_all = k_all.view(bp, kmax, hkv, d).transpose(1, 2)  # [Bp, Hkv, Kmax, D]
        v_all = v_all.view(bp, kmax, hkv, d).transpose(1, 2)
        if md.q_index is None:  # decode: q [Bp, Hq, D] -> [Bp, Hkv, G, D]
            o = F.scaled_dot_product_attention(q.view(bp, hkv, g, d), k_all, v_all,
                                               attn_mask=md.mask)
            return o.reshape(bp, hkv * g, d)
        qb = q.index_select(0, md.q_index).view(bp, qmax, hkv, g, d)
        qb = qb.permute(0, 2, 3, 1, 4).reshape(bp, hkv, g * qmax, d)  # rows: (g, i)
        o = F.scaled_dot_product_attention(qb, k_all, v_all, attn_mask=md.mask)
        o = o.view(bp, hkv, g, qmax, d).permute(0, 3, 1, 2, 4).reshape(bp * qmax, hkv * g, d)
        return o.index_select(0, md.o_index)  # [T, Hq, D]
        # END SOLUTION
