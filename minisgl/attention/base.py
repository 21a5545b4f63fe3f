# Chapter 05 (05_attention_backends.ipynb): the attention backend interface and HybridBackend.
"""An attention backend turns a batch into metadata once, then attends once per layer.

``prepare_metadata(batch)`` runs once per batch, before the forward (and before the Engine's
``complete_one`` changes the requests' lengths): it derives everything the kernels need from the
batch and the page table. ``forward(q, k, v, layer_id, batch)`` runs once per layer: it first
stores this layer's new k, v into the KV pool at ``batch.out_loc`` (the new tokens attend to
themselves), then attends over each request's cached tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import List

import torch

from minisgl.core import Batch


@dataclass
class BaseAttnMetadata(ABC):
    @abstractmethod
    def get_last_indices(self, bs: int) -> torch.Tensor:
        """For the first ``bs`` requests: the index (into the T token axis) of each request's
        last query token, i.e. ``cu_seqlens_q[1:bs + 1] - 1``."""


class BaseAttnBackend(ABC):
    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: Batch) -> torch.Tensor:
        """``q [T, Hq, D]``, ``k, v [T, Hkv*D]`` -> ``o [T, Hq, D]``; stores k, v first."""

    @abstractmethod
    def prepare_metadata(self, batch: Batch) -> None:
        """Set ``batch.attn_metadata`` from ``batch.padded_reqs`` and the page table."""

    # CUDA-graph hooks (chapter 06 / the GPU section). A backend without graph support keeps
    # these defaults; the GraphRunner never captures on the CPU.
    def init_capture_graph(self, max_seq_len: int, bs_list: List[int]) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_capture(self, batch: Batch) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_replay(self, batch: Batch) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")


class HybridBackend(BaseAttnBackend):
    """One backend for prefill batches, another for decode batches."""

    def __init__(self, prefill_backend: BaseAttnBackend, decode_backend: BaseAttnBackend) -> None:
        self.prefill_backend = prefill_backend
        self.decode_backend = decode_backend

    def _pick(self, batch: Batch) -> BaseAttnBackend:
        return self.prefill_backend if batch.is_prefill else self.decode_backend

    def forward(self, q, k, v, layer_id, batch):
        return self._pick(batch).forward(q, k, v, layer_id, batch)

    def prepare_metadata(self, batch: Batch) -> None:
        self._pick(batch).prepare_metadata(batch)

    def init_capture_graph(self, max_seq_len: int, bs_list: List[int]) -> None:
        self.decode_backend.init_capture_graph(max_seq_len, bs_list)

    def prepare_for_capture(self, batch: Batch) -> None:
        self.decode_backend.prepare_for_capture(batch)

    def prepare_for_replay(self, batch: Batch) -> None:
        self.decode_backend.prepare_for_replay(batch)
