# Chapter 01 (01_req_batch_context.ipynb): Batch, the requests of one forward pass.
"""A ``Batch``: the requests computed in one forward pass and the [T] tensors that describe it.

``minisgl.core`` re-exports it: ``from minisgl.core import Batch`` is the official name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, List, Literal

import torch

from minisgl.req import Req

if TYPE_CHECKING:
    from minisgl.attention.base import BaseAttnMetadata


@dataclass
class Batch:
    """The requests of one forward pass, in order, and the tensors that describe it.

    Token-level tensors are laid out request after request in ``padded_reqs`` order.
    """

    reqs: List[Req]
    phase: Literal["prefill", "decode"]
    # Filled after construction, before the forward (by the caller, or stage 2's scheduler):
    input_ids: torch.Tensor | None = field(default=None, init=False)  # [T] int32
    positions: torch.Tensor | None = field(default=None, init=False)  # [T] int32
    out_loc: torch.Tensor | None = field(default=None, init=False)  # [T] int32: KV slot per token
    padded_reqs: List[Req] | None = field(default=None, init=False)  # set by GraphRunner.pad_batch
    attn_metadata: BaseAttnMetadata | None = field(default=None, init=False)  # by the backend

    def __post_init__(self) -> None:
        if self.phase not in ("prefill", "decode"):
            raise ValueError(f"Batch phase must be 'prefill' or 'decode', got {self.phase!r}.")
        if not isinstance(self.reqs, list):
            raise TypeError(f"Batch(reqs=...) takes a list of Req, got {type(self.reqs).__name__}; "
                            "pass list(reqs), e.g. Batch(reqs=[req], phase='prefill').")
        if len(self.reqs) == 0:
            raise ValueError("an empty Batch: give it at least one Req (a forward with no "
                             "requests has nothing to compute).")

    @property
    def is_prefill(self) -> bool:
        return self.phase == "prefill"

    @property
    def is_decode(self) -> bool:
        return self.phase == "decode"

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def padded_size(self) -> int:
        if self.padded_reqs is None:
            raise RuntimeError("batch.padded_reqs is not set: call engine.graph_runner.pad_batch("
                               "batch) first.")
        return len(self.padded_reqs)
