# Chapter 04 (04_kv_pool_and_page_table.ipynb): the page table, the token pool and batch helpers.
"""The page table says where each request's tokens live in the KV pool.

``page_table[row, pos]`` is the *token slot* holding the K/V of position ``pos`` of the request
whose ``table_idx`` is ``row`` — one entry per token even when ``page_size > 1`` (the entries of
one page are then consecutive: ``page * page_size + 0 .. page_size - 1``). The last row belongs
to the dummy request used for padding; every entry of it points at the dummy page.

The token pool has the same shape and holds token ids: ``token_pool[row, pos]``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from minisgl.core import Req
from minisgl.utils import align_ceil


def create_page_table(max_running_req: int, max_seq_len: int, dummy_slot: int,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """``[max_running_req + 1, align32(max_seq_len)]`` int32; the last row is the dummy's."""
    width = align_ceil(max_seq_len, 32)  # rows of 128 bytes
    table = torch.zeros(max_running_req + 1, width, dtype=torch.int32, device=device)
    table[max_running_req].fill_(dummy_slot)
    return table


def create_token_pool(page_table: torch.Tensor) -> torch.Tensor:
    """Token ids, laid out exactly like the page table."""
    return torch.zeros_like(page_table)


def pages_to_slots(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Page ids ``[n]`` -> their token slots ``[n * page_size]`` (page by page, in order), in the
    dtype and on the device of ``pages``."""
    # BEGIN SOLUTION 4.2: expand every page into its page_size consecutive slots
    offsets = torch.arange(page_size, dtype=pages.dtype, device=pages.device)
    return (pages[:, None] * page_size + offsets).flatten()
    # END SOLUTION


def batch_positions(reqs: Sequence[Req]) -> torch.Tensor:
    """``[T]`` int32: ``cached_len .. device_len - 1`` of each request, one request after another."""
    return torch.cat([torch.arange(r.cached_len, r.device_len, dtype=torch.int32)
                      for r in reqs])


def batch_row_map(reqs: Sequence[Req]) -> torch.Tensor:
    """``[T]`` int64: the page-table row (``table_idx``) of the request owning each token."""
    # BEGIN SOLUTION 4.3: each request's table_idx, repeated once per new token (extend_len)
    rows = torch.tensor([r.table_idx for r in reqs], dtype=torch.int64)
    return rows.repeat_interleave(torch.tensor([r.extend_len for r in reqs]))
    # END SOLUTION


def _lookup(table: torch.Tensor, reqs: Sequence[Req], positions: torch.Tensor | None):
    """``table[row of its request, its position]`` for every new token of ``reqs``."""
    positions = batch_positions(reqs) if positions is None else positions
    rows = batch_row_map(reqs).to(table.device)
    return table[rows, positions.to(table.device).long()]


def batch_out_loc(page_table: torch.Tensor, reqs: Sequence[Req],
                  positions: torch.Tensor | None = None) -> torch.Tensor:
    """``[T]`` int32: the KV slot each new token of the batch writes, read from the page table."""
    return _lookup(page_table, reqs, positions)


def batch_input_ids(token_pool: torch.Tensor, reqs: Sequence[Req],
                    positions: torch.Tensor | None = None) -> torch.Tensor:
    """``[T]`` int32: the token ids of the new positions, read from the token pool."""
    return _lookup(token_pool, reqs, positions)


def allocate_pages(page_table: torch.Tensor, req: Req, free_pages: list[int],
                   page_size: int) -> list[int]:
    """Before a forward: give ``req`` the pages it still lacks to hold its positions
    ``0 .. device_len - 1``. They come from the front of ``free_pages`` (removed from it, in
    place), and their slots go into row ``req.table_idx`` of the page table, at the positions
    they hold. Returns the pages taken (an empty list when the last page still has room)."""
    # BEGIN SOLUTION 4.4: pages held = ceil(cached_len / ps), needed = ceil(device_len / ps)
    have = -(-req.cached_len // page_size)
    need = -(-req.device_len // page_size)
    pages = free_pages[:need - have]
    del free_pages[:need - have]
    slots = pages_to_slots(torch.tensor(pages, dtype=page_table.dtype), page_size)
    page_table[req.table_idx, have * page_size:need * page_size] = slots.to(page_table.device)
    return pages
    # END SOLUTION
