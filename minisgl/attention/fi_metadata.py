# Chapter 05 (05_attention_backends.ipynb): FlashInfer's paged-KV metadata, in plain torch.
"""FlashInfer describes a batch by *pages*, not by slots. For the ``Bp`` requests of
``batch.padded_reqs`` (dummies included) it wants four index tensors:

- ``qo_indptr [Bp + 1]``: the query rows of request ``b`` are ``qo_indptr[b] .. qo_indptr[b+1] - 1``
  (the cumulative sum of ``extend_len``; the torch backend's ``cu_seqlens_q``);
- ``kv_indptr [Bp + 1]``: the pages of request ``b`` are ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``
  (the cumulative sum of ``ceil(device_len / ps)``);
- ``kv_indices [sum of pages]``: page ids, request after request, in position order;
- ``last_page_len [Bp]``: how many slots of each request's last page hold keys, ``1 .. ps``.

Expanding every page ``p`` of a request into its slots ``p * ps .. p * ps + ps - 1`` and cutting
the last page at ``last_page_len`` gives back exactly ``page_table[table_idx, :device_len]``,
the slots the torch backend gathers, provided the page table is *page-aligned*: position ``j``
lives at offset ``j % ps`` of a page, as the engine always fills it (``paged_reference.py``
checks both).

Everything here is plain torch and runs on the CPU, so it is tested there against the torch
backend; ``fi.py`` hands these tensors to FlashInfer's ``plan``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from minisgl.core import Req


@dataclass
class PagedKVMetadata:
    qo_indptr: torch.Tensor  # [Bp + 1] int32, CPU
    kv_indptr: torch.Tensor  # [Bp + 1] int32, CPU
    kv_indices: torch.Tensor  # [kv_indptr[-1]] int32, on the page table's device
    last_page_len: torch.Tensor  # [Bp] int32, CPU
    seq_lens: torch.Tensor  # [Bp] int32, CPU: device_len of each request

    @property
    def batch_size(self) -> int:
        return self.last_page_len.numel()


def indptr_of(counts: torch.Tensor) -> torch.Tensor:
    """``[n]`` counts -> ``[n + 1]`` int32 offsets starting at 0 (a CSR row pointer)."""
    out = torch.zeros(counts.numel() + 1, dtype=torch.int32)
    torch.cumsum(counts.to(torch.int32), 0, out=out[1:])
    return out


def num_pages(seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pages a request of ``device_len`` tokens spans: ``ceil(device_len / ps)``."""
    return (seq_lens + page_size - 1) // page_size


def last_page_lens(seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """Keys in each request's last page: ``1 .. ps`` (never 0: a request has >= 1 token)."""
    return (seq_lens - 1) % page_size + 1


def page_indices(page_table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                 page_size: int) -> torch.Tensor:
    """The page ids of every request, concatenated: ``[sum(ceil(device_len / ps))]`` int32.

    ``rows [Bp]`` are the requests' ``table_idx`` and ``seq_lens [Bp]`` their ``device_len`` (both
    on the CPU). Page ``j`` of a request holds its positions ``j*ps .. j*ps + ps - 1``, so its id
    is the slot of position ``j*ps`` divided by ``ps``. One gather from the page table, with index
    tensors built on the CPU (no loop over requests, no sync on a GPU).
    """
    # BEGIN SOLUTION 5.4: one gather of each page's first slot, divided by page_size
    counts = num_pages(seq_lens, page_size)  # [Bp]
    row_of_page = rows.long().repeat_interleave(counts)  # [P]: whose page each entry is
    first_of_req = indptr_of(counts)[:-1].long().repeat_interleave(counts)
    j = torch.arange(int(counts.sum())) - first_of_req  # page number inside its request
    dev = page_table.device
    first_slot = page_table[row_of_page.to(dev), (j * page_size).to(dev)]
    return (first_slot // page_size).to(torch.int32)
    # END SOLUTION


def build_paged_metadata(reqs: Sequence[Req], page_table: torch.Tensor,
                         page_size: int) -> PagedKVMetadata:
    """The four FlashInfer index tensors of ``reqs`` (``batch.padded_reqs``), read from the
    requests' lengths and the page table."""
    cached = torch.tensor([r.cached_len for r in reqs], dtype=torch.int32)
    seq_lens = torch.tensor([r.device_len for r in reqs], dtype=torch.int32)
    rows = torch.tensor([r.table_idx for r in reqs], dtype=torch.int64)
    return PagedKVMetadata(
        qo_indptr=indptr_of(seq_lens - cached),
        kv_indptr=indptr_of(num_pages(seq_lens, page_size)),
        kv_indices=page_indices(page_table, rows, seq_lens, page_size),
        last_page_len=last_page_lens(seq_lens, page_size).to(torch.int32),
        seq_lens=seq_lens)
