# Chapter 05 (05_attention_backends.ipynb, optional GPU section): checking FlashInfer's page lists.
"""Plain-torch tools that check the page lists of ``fi_metadata.py`` on any machine.

``expand_to_slots`` undoes the paging (pages back to slots: they must equal the slots the torch
backend gathers), ``check_page_aligned`` says whether a page table has the layout paged kernels
assume, and ``paged_attention_reference`` computes, slowly, what a paged kernel computes from the
four index tensors. Tests and the notebook use them; the engine never does.
"""

from __future__ import annotations

from typing import List, Sequence

import torch

from minisgl.core import Req
from minisgl.kvcache import pages_to_slots


def expand_to_slots(md, page_size: int) -> List[torch.Tensor]:
    """Undo the paging of ``md`` (a ``PagedKVMetadata``): each request's key slots
    ``[device_len]`` (int64), read from ``kv_indices`` through ``kv_indptr`` and cut at
    ``last_page_len``."""
    out = []
    indices = md.kv_indices.cpu().long()
    for b in range(md.batch_size):
        lo, hi = int(md.kv_indptr[b]), int(md.kv_indptr[b + 1])
        n = (hi - lo - 1) * page_size + int(md.last_page_len[b])
        out.append(pages_to_slots(indices[lo:hi], page_size)[:n])
    return out


def check_page_aligned(page_table: torch.Tensor, reqs: Sequence[Req], page_size: int) -> None:
    """Raise ``ValueError`` unless every request's positions ``0 .. device_len - 1`` sit at
    offset ``position % ps`` of their pages, the layout paged kernels assume."""
    for r in reqs:
        slots = page_table[r.table_idx, : r.device_len].long().cpu()
        pos = torch.arange(r.device_len)
        bad = (slots % page_size != pos % page_size).nonzero()
        if bad.numel() == 0:  # offsets right: a page's slots must also share one page id
            first = slots[pos - pos % page_size]
            bad = (slots - first != pos % page_size).nonzero()
        if bad.numel():
            j = int(bad[0])
            raise ValueError(
                f"Req(uid={r.uid}): page_table[{r.table_idx}, {j}] = {int(slots[j])} is not at "
                f"offset {j % page_size} of the page that holds position {j - j % page_size}: "
                f"paged kernels (FlashInfer) need position j at offset j % page_size "
                f"({page_size}) of its page. Fill page-table rows page by page "
                "(kvcache.pages_to_slots).")


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              md, page_size: int) -> torch.Tensor:
    """What a paged kernel computes from this metadata, in plain torch (slow: a loop over
    requests; for tests and pictures). ``q [T, Hq, D]``; ``k_cache, v_cache`` one layer of the
    pool ``[num_pages, ps, Hkv, D]``; causal, bottom-right aligned -> ``[T, Hq, D]`` float32."""
    hkv, d = k_cache.shape[-2], k_cache.shape[-1]
    g = q.shape[1] // hkv
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b, slots in enumerate(expand_to_slots(md, page_size)):
        lo, hi = int(md.qo_indptr[b]), int(md.qo_indptr[b + 1])
        slots = slots.to(k_cache.device)
        k = k_cache.reshape(-1, hkv, d)[slots].float().repeat_interleave(g, dim=1)  # [S, Hq, D]
        v = v_cache.reshape(-1, hkv, d)[slots].float().repeat_interleave(g, dim=1)
        s = torch.einsum("thd,shd->hts", q[lo:hi].float(), k) / d ** 0.5  # [Hq, n, S]
        n, total = hi - lo, slots.numel()
        hidden = torch.ones(n, total, dtype=torch.bool, device=q.device).triu(total - n + 1)
        out[lo:hi] = torch.einsum("hts,shd->thd", s.masked_fill(hidden, float("-inf")).softmax(-1),
                                  v)
    return out
