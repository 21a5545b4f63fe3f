# Chapter 04 (04_kv_pool_and_page_table.ipynb): the multi-head-attention KV pool.
"""One pre-allocated buffer holds every layer's keys and values:

    _kv_buffer [2, num_layers, num_pages, page_size, Hkv, D]     (index 0 = K, 1 = V)

A token's K/V lives in one *slot* per layer: slot ``s`` is page ``s // page_size``, offset
``s % page_size``. Seen flat, a layer is ``[num_pages * page_size, Hkv, D]`` and ``store_kv`` is a
row scatter: row ``j`` of ``k`` goes to slot ``out_loc[j]``. Nothing is ever copied to make room:
requests own slots anywhere in the pool and the page table remembers where.
"""

from __future__ import annotations

import torch

from minisgl.distributed import get_tp_info
from minisgl.layers.impls import current_ops
from minisgl.utils import div_even

from .base import BaseKVCachePool


class MHAKVCache(BaseKVCachePool):
    def __init__(self, num_kv_heads: int, num_layers: int, head_dim: int, num_pages: int,
                 page_size: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.num_kv_heads = div_even(num_kv_heads, get_tp_info().size, allow_replicate=True)
        self.head_dim = head_dim
        self.num_pages = num_pages
        self.page_size = page_size
        self._num_layers = num_layers
        self._kv_buffer = torch.zeros(2, num_layers, num_pages, page_size, self.num_kv_heads,
                                      head_dim, dtype=dtype, device=device)
        self._k_buffer = self._kv_buffer[0]
        self._v_buffer = self._kv_buffer[1]
        # each layer's view, made once: indexing a tensor costs a microsecond, a list nothing
        self._k_layers = list(self._k_buffer.unbind(0))
        self._v_layers = list(self._v_buffer.unbind(0))
        self._kernel = current_ops().store_kv  # None: the code of store_kv below (impls.py)

    @property
    def num_slots(self) -> int:
        """Token slots in the pool (the dummy page included, when the Engine adds one)."""
        return self.num_pages * self.page_size

    def k_cache(self, index: int) -> torch.Tensor:
        return self._k_layers[index]

    def v_cache(self, index: int) -> torch.Tensor:
        return self._v_layers[index]

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor,
                 layer_id: int) -> None:
        """Scatter ``k``, ``v`` (``[T, Hkv*D]``, possibly strided views) into slots ``out_loc``
        (``[T]``, int32 or int64) of layer ``layer_id``; no other slot changes."""
        if self._kernel is not None:  # a fused kernel this pool was built with
            self._kernel(self._k_layers[layer_id], self._v_layers[layer_id], k, v, out_loc)
            return
        # BEGIN SOLUTION 4.1: view the layer as flat slots and copy row j into slot out_loc[j]
        index = out_loc if out_loc.dtype == torch.int64 else out_loc.long()
        shape = (-1, self.num_kv_heads, self.head_dim)
        self._k_buffer[layer_id].view(shape).index_copy_(0, index, k.view(shape))
        self._v_buffer[layer_id].view(shape).index_copy_(0, index, v.view(shape))
        # END SOLUTION

    @property
    def device(self) -> torch.device:
        return self._kv_buffer.device

    @property
    def dtype(self) -> torch.dtype:
        return self._kv_buffer.dtype

    @property
    def num_layers(self) -> int:
        return self._num_layers


def create_kvcache_pool(model_config, num_pages: int, page_size: int, dtype: torch.dtype,
                        device: torch.device | str) -> MHAKVCache:
    return MHAKVCache(model_config.num_kv_heads, model_config.num_layers, model_config.head_dim,
                      num_pages, page_size, dtype, device)
