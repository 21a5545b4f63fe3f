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
    """Page ids ``[n]`` -> their token slots ``[n * page_size]`` (page by page, in order)."""
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
    return torch.cat([torch.full((r.extend_len,), r.table_idx, dtype=torch.int64) for r in reqs])


def batch_out_loc(page_table: torch.Tensor, reqs: Sequence[Req],
                  positions: torch.Tensor | None = None) -> torch.Tensor:
    """``[T]`` int32: the KV slot each new token of the batch writes, read from the page table."""
    positions = batch_positions(reqs) if positions is None else positions
    # BEGIN SOLUTION 4.3: look up (row, position) for every token
    rows = batch_row_map(reqs).to(page_table.device)
    return page_table[rows, positions.to(page_table.device).long()]
    # END SOLUTION


def batch_input_ids(token_pool: torch.Tensor, reqs: Sequence[Req],
                    positions: torch.Tensor | None = None) -> torch.Tensor:
    """``[T]`` int32: the token ids of the new positions, read from the token pool."""
    positions = batch_positions(reqs) if positions is None else positions
    rows = batch_row_map(reqs).to(token_pool.device)
    return token_pool[rows, positions.to(token_pool.device).long()]
