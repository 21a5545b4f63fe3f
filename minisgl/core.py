# Chapter 01 (01_req_batch_context.ipynb): Context and the global context; re-exports the rest.
"""The context: what the layers read during a forward, which is why ``model.forward()`` takes no
arguments, and the process-wide context the Engine installs.

``SamplingParams``, ``Req`` and ``Batch`` live in their own files; they are re-exported here under
their official names (``from minisgl.core import Req``), as upstream keeps all four in core.py.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

import torch

from minisgl.batch import Batch
from minisgl.req import Req
from minisgl.sampling_params import SamplingParams

if TYPE_CHECKING:
    from minisgl.attention.base import BaseAttnBackend
    from minisgl.kvcache.base import BaseKVCachePool

__all__ = ["Batch", "Context", "Req", "SamplingParams", "get_global_ctx", "reset_global_ctx",
           "set_global_ctx", "try_get_global_ctx"]


@dataclass
class Context:
    """What the layers read during a forward: the active batch and the engine's shared parts."""

    page_size: int
    # Assigned by the Engine after construction:
    page_table: torch.Tensor | None = field(default=None, init=False)
    attn_backend: BaseAttnBackend | None = field(default=None, init=False)
    moe_backend: Any = field(default=None, init=False)
    kv_cache: BaseKVCachePool | None = field(default=None, init=False)
    _batch: Batch | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size={self.page_size!r}: a page holds at least one token; "
                             "use page_size=1 (or a power of two such as 4 or 16).")

    @property
    def batch(self) -> Batch:
        """The batch being computed; only valid inside ``with ctx.forward_batch(batch):``."""
        if self._batch is None:
            raise RuntimeError("no active batch: the model's forward() runs only inside "
                               "`with ctx.forward_batch(batch):` (Engine.forward_batch does this).")
        return self._batch

    @contextmanager
    def forward_batch(self, batch: Batch) -> Iterator[None]:
        """Make ``batch`` the active batch for the duration of the ``with`` block."""
        # BEGIN SOLUTION 1.4: install the batch, forbid nesting, always clear it afterwards
        if self._batch is not None:
            raise RuntimeError("nested forward_batch: a batch is already active; one forward "
                               "at a time (finish the current `with ctx.forward_batch(...)`).")
        self._batch = batch
        try:
            yield
        finally:
            self._batch = None
        # END SOLUTION


_GLOBAL_CTX: Context | None = None


def set_global_ctx(ctx: Context) -> None:
    """Install the process-wide context (the Engine does this once)."""
    global _GLOBAL_CTX
    if _GLOBAL_CTX is not None:
        raise RuntimeError("a global Context is already set (an Engine is live?): call "
                           "engine.shutdown() or reset_global_ctx() first.")
    _GLOBAL_CTX = ctx


def get_global_ctx() -> Context:
    if _GLOBAL_CTX is None:
        raise RuntimeError("no global Context: build an Engine first (or, in a test, "
                           "set_global_ctx(Context(page_size=1))).")
    return _GLOBAL_CTX


def try_get_global_ctx() -> Context | None:
    """The global context, or None when no Engine has set one."""
    return _GLOBAL_CTX


def reset_global_ctx() -> None:
    """Release the process-wide context (Engine.shutdown() calls this)."""
    global _GLOBAL_CTX
    _GLOBAL_CTX = None
