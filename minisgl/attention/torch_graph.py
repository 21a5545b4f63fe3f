# Chapter 05 (05_attention_backends.ipynb, optional GPU section): TorchBackend's CUDA-graph hooks.
"""CUDA-graph hooks for the torch backend (``TorchBackend`` inherits them).

A graph replays fixed shapes and fixed addresses. Decode metadata has one shape that moves,
``Kmax`` = the longest ``device_len``; here it is pinned to ``W`` = the page-table width and every
field lives in a buffer allocated once; ``prepare_for_replay`` copies the step's metadata in.
The price: a captured step attends over all ``W`` columns for every request, masked at each
``device_len``, so its cost grows with ``W`` (keep ``max_seq_len`` modest, or use FlashInfer).
"""

from __future__ import annotations

import dataclasses
from typing import List

import torch

from minisgl.core import Batch


class TorchGraphHooks:
    """Mixed into ``TorchBackend``: uses its ``page_table`` and ``prepare_metadata``."""

    def init_capture_graph(self, max_seq_len: int, bs_list: List[int]) -> None:
        max_bs, dev, w = max(bs_list), self.page_table.device, max_seq_len
        self._graph_width = w
        self._g_kv_slots = torch.zeros(max_bs, w, dtype=torch.int64, device=dev)  # valid slots
        self._g_mask = torch.zeros(max_bs, 1, 1, w, dtype=torch.bool, device=dev)
        self._g_seq_lens = torch.ones(max_bs, dtype=torch.int64, device=dev)
        self._g_out_loc = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self._g_rows = torch.arange(max_bs + 1, dtype=torch.int64, device=dev)  # decode: cu = b
        self._g_cols = torch.arange(w, device=dev)

    def _refresh_graph_buffers(self, md) -> None:
        """Copy a decode batch's eager metadata into the static buffers (in place)."""
        bs, kmax = md.seq_lens.shape[0], md.max_kv_len
        if md.max_q_len != 1 or kmax > self._graph_width:
            raise ValueError(f"a CUDA graph replays decode batches of at most "
                             f"{self._graph_width} tokens per request; got max_q_len="
                             f"{md.max_q_len}, Kmax={kmax}")
        self._g_kv_slots[:bs, :kmax].copy_(md.kv_slots.view(bs, kmax))  # past Kmax: masked
        self._g_seq_lens[:bs].copy_(md.seq_lens)
        self._g_mask[:bs, 0, 0].copy_(self._g_cols[None, :] < md.seq_lens[:, None])
        self._g_out_loc[:bs].copy_(md.out_loc)

    def prepare_for_capture(self, batch: Batch) -> None:
        self.prepare_metadata(batch)  # the (dummy) batch's metadata, copied into the buffers
        self._refresh_graph_buffers(batch.attn_metadata)
        bs = batch.padded_size
        batch.attn_metadata = dataclasses.replace(
            batch.attn_metadata, cu_seqlens_q=self._g_rows[: bs + 1],
            seq_lens=self._g_seq_lens[:bs], out_loc=self._g_out_loc[:bs],
            kv_slots=self._g_kv_slots[:bs].view(-1), max_kv_len=self._graph_width, max_q_len=1,
            q_index=None, o_index=None, mask=self._g_mask[:bs], last_indices=self._g_rows[:bs])

    def prepare_for_replay(self, batch: Batch) -> None:
        self._refresh_graph_buffers(batch.attn_metadata)  # set by prepare_metadata(batch)
