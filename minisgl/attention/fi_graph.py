# Chapter 05 (05_attention_backends.ipynb, optional GPU section): FlashInferBackend's CUDA graphs.
"""CUDA-graph hooks for the FlashInfer backend (``FlashInferBackend`` inherits them).

A graph replays fixed kernels on fixed addresses, so decode metadata must live in buffers
allocated once. FlashInfer's decode wrapper has a graph mode for exactly that: one wrapper per
captured batch size, each bound to static ``kv_indptr``, ``kv_indices`` and ``last_page_len``
buffers. Planning it again with a step's page lists rewrites those buffers in place; ``plan``
itself never runs inside a graph.
"""

from __future__ import annotations

import dataclasses
from typing import List

import torch

from minisgl.core import Batch


class FlashInferGraphHooks:
    """Mixed into ``FlashInferBackend``: uses its pool, workspace, page size and ``_plan``."""

    def init_capture_graph(self, max_seq_len: int, bs_list: List[int]) -> None:
        """One decode wrapper per captured batch size, planned into static index buffers sized
        for requests of up to ``max_seq_len`` tokens (FlashInfer's graph mode)."""
        device = self.kv_cache.device
        max_pages = -(-max_seq_len // self.page_size)
        self._g_out_loc = torch.zeros(max(bs_list), dtype=torch.int64, device=device)
        for bs in bs_list:
            self.graph_wrappers[bs] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, kv_layout="NHD", use_cuda_graph=True,
                use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=device),
                paged_kv_indices_buffer=torch.zeros(bs * max_pages, dtype=torch.int32,
                                                    device=device),
                paged_kv_last_page_len_buffer=torch.zeros(bs, dtype=torch.int32, device=device))

    def _to_graph(self, md, bs: int):
        if md.is_prefill or bs not in self.graph_wrappers:
            raise ValueError(f"no CUDA graph for this batch (decode={not md.is_prefill}, "
                             f"padded size {bs}; captured sizes {sorted(self.graph_wrappers)})")
        self._g_out_loc[:bs].copy_(md.out_loc)
        graph_md = dataclasses.replace(md, out_loc=self._g_out_loc[:bs],
                                       wrapper=self.graph_wrappers[bs])
        self._plan(graph_md)  # writes this batch's indices into the wrapper's static buffers
        return graph_md

    def prepare_for_capture(self, batch: Batch) -> None:
        self.prepare_metadata(batch)
        batch.attn_metadata = self._to_graph(batch.attn_metadata, batch.padded_size)

    def prepare_for_replay(self, batch: Batch) -> None:
        self._to_graph(batch.attn_metadata, batch.padded_size)
