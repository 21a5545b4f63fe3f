# Chapter 04 (04_kv_pool_and_page_table.ipynb): the KV pool interface and the prefix-cache handle.
"""What every KV pool offers the attention backends, whatever its memory layout."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


class BaseKVCachePool(ABC):
    @abstractmethod
    def k_cache(self, index: int) -> torch.Tensor:
        """Layer ``index``'s keys, ``[num_pages, page_size, Hkv, D]``."""

    @abstractmethod
    def v_cache(self, index: int) -> torch.Tensor:
        """Layer ``index``'s values, ``[num_pages, page_size, Hkv, D]``."""

    @abstractmethod
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor,
                 layer_id: int) -> None:
        """Write row ``j`` of ``k`` / ``v`` (``[T, Hkv*D]``) into token slot ``out_loc[j]``."""

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype: ...

    @property
    @abstractmethod
    def num_layers(self) -> int: ...


@dataclass(frozen=True)
class BaseCacheHandle(ABC):
    """A matched prefix in the prefix cache (stage 2): how long, and which slots hold it."""

    cached_len: int

    @abstractmethod
    def get_matched_indices(self) -> torch.Tensor: ...
