# Chapter 04 (04_kv_pool_and_page_table.ipynb): the kvcache package's public names.
"""The paged KV pool, the page table and the token pool."""

from .base import BaseCacheHandle, BaseKVCachePool
from .mha_pool import MHAKVCache, create_kvcache_pool
from .page_table import (
    allocate_pages,
    batch_input_ids,
    batch_out_loc,
    batch_positions,
    batch_row_map,
    create_page_table,
    create_token_pool,
    pages_to_slots,
)

__all__ = [
    "BaseCacheHandle",
    "BaseKVCachePool",
    "MHAKVCache",
    "allocate_pages",
    "batch_input_ids",
    "batch_out_loc",
    "batch_positions",
    "batch_row_map",
    "create_kvcache_pool",
    "create_page_table",
    "create_token_pool",
    "pages_to_slots",
]
