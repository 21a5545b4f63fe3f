# Chapter 01 (01_req_batch_context.ipynb): Req, Batch, Context and SamplingParams.
"""The state every later module reads: requests, the batch being computed, and the context.

A ``Req`` is one sequence with its own lengths; a ``Batch`` is the list of requests computed in
one forward pass plus the token-level tensors that describe that pass; the ``Context`` is the one
object the model's layers read during a forward (the active batch, the KV pool, the attention
backend, the page table), which is why ``model.forward()`` takes no arguments.
"""

from __future__ import annotations

import math
import numbers
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, List, Literal

import torch

if TYPE_CHECKING:
    from minisgl.attention.base import BaseAttnBackend, BaseAttnMetadata
    from minisgl.kvcache.base import BaseKVCachePool


def _is_count(value: Any) -> bool:
    """A whole number given as an integer (bool is an int in Python, but never a count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    """A real number (int or float, numpy's included), not a bool or a string."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """How to pick the next token of one request.

    ``temperature <= 0`` or ``top_k == 1`` means greedy; ``top_k == -1`` means no top-k cut;
    ``top_p == 1.0`` means no top-p cut.
    """

    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    ignore_eos: bool = False
    max_tokens: int = 1024

    def __post_init__(self) -> None:
        for name, example in (("temperature", "0.7 (0 for greedy)"), ("top_p", "0.9 (1.0 keeps "
                                                                          "every token)")):
            value = getattr(self, name)
            if not _is_real(value):
                raise TypeError(f"SamplingParams: {name}={value!r} is not a number; pass a float "
                                f"such as {name}={example}.")
            if not math.isfinite(value):
                raise ValueError(f"SamplingParams: {name}={value!r} is not a finite number; pass "
                                 f"a float such as {name}={example}.")
        for name, example in (("top_k", "40 (-1 for no top-k cut)"), ("max_tokens", "64")):
            value = getattr(self, name)
            if not _is_count(value):
                raise TypeError(f"SamplingParams: {name}={value!r} is not an integer; pass a whole "
                                f"number such as {name}={example}.")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams: temperature={self.temperature} is negative; "
                             "use 0 for greedy decoding or a positive value to sample.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams: top_p={self.top_p} is outside (0, 1]; use 1.0 to "
                             "keep every token, or e.g. 0.9 to keep the smallest set holding 90%.")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams: top_k={self.top_k} is invalid; use -1 for no "
                             "top-k cut, 1 for greedy, or k >= 1 to keep the k likeliest tokens.")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams: max_tokens={self.max_tokens} must be at least 1.")

    @property
    def is_greedy(self) -> bool:
        return (self.temperature <= 0.0 or self.top_k == 1) and self.top_p == 1.0


@dataclass(eq=False)  # eq=False: requests compare (and hash) by identity, so they fit in sets
class Req:
    """One request: its tokens on the host and the three lengths that drive every forward.

    ``cached_len``: leading positions whose K/V is already in the KV pool.
    ``device_len``: positions whose token ids are known; ``[cached_len, device_len)`` is what the
    next forward computes.  ``max_device_len``: the prompt plus ``output_len`` new tokens.
    Invariant: ``0 <= cached_len < device_len <= max_device_len``.
    """

    input_ids: torch.Tensor  # [device_len] int32 on the CPU: the tokens known so far
    table_idx: int  # this request's row in the page table and the token pool
    cached_len: int
    output_len: int  # how many new tokens at most
    uid: int
    sampling_params: SamplingParams | None
    cache_handle: Any = None  # the prefix-cache handle (stage 2); None here

    def __post_init__(self) -> None:
        ids = self.input_ids
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"Req(uid={self.uid}): input_ids must be a torch.Tensor of token ids, "
                            f"got {type(ids).__name__}; use torch.tensor(ids, dtype=torch.int32).")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"Req(uid={self.uid}): input_ids has dtype {ids.dtype}; token ids are "
                            "integers: use torch.tensor(ids, dtype=torch.int32).")
        if ids.device.type != "cpu":
            raise ValueError(f"Req(uid={self.uid}): input_ids is on {ids.device}; a Req keeps its "
                             "tokens on the host: pass input_ids.cpu().")
        if ids.dim() != 1:
            raise ValueError(f"Req(uid={self.uid}): input_ids must be 1-D [tokens], got shape "
                             f"{tuple(ids.shape)}.")
        for name in ("table_idx", "cached_len", "output_len"):
            if not _is_count(getattr(self, name)):
                raise TypeError(f"Req(uid={self.uid}): {name}={getattr(self, name)!r} is not an "
                                "integer; pass a whole number (an int).")
        # BEGIN SOLUTION 1.1: derive device_len and max_device_len from input_ids and output_len
        self.device_len = len(ids)
        self.max_device_len = len(ids) + self.output_len
        # END SOLUTION
        self.check_invariant()
        if self.output_len < 1:
            raise ValueError(f"Req(uid={self.uid}): output_len={self.output_len} leaves nothing to "
                             "generate; every forward samples one token per request, so use "
                             "output_len >= 1 (the most new tokens this request may produce).")

    def check_invariant(self) -> None:
        """Raise a clear error unless ``0 <= cached_len < device_len <= max_device_len``."""
        if not 0 <= self.cached_len < self.device_len <= self.max_device_len:
            raise ValueError(
                f"Req(uid={self.uid}) breaks 0 <= cached_len < device_len <= max_device_len: "
                f"cached_len={self.cached_len}, device_len={self.device_len}, "
                f"max_device_len={self.max_device_len}. A request must have at least one token "
                "to compute (cached_len < device_len) and output_len >= 1.")

    @property
    def remain_len(self) -> int:
        """How many more tokens this request may still produce."""
        return self.max_device_len - self.device_len

    @property
    def extend_len(self) -> int:
        """How many query tokens this request contributes to the next forward."""
        # BEGIN SOLUTION 1.2: the number of tokens the next forward computes for this request
        return self.device_len - self.cached_len
        # END SOLUTION

    @property
    def can_decode(self) -> bool:
        return self.remain_len > 0

    def complete_one(self) -> None:
        """Called by the Engine right after a forward: what was computed is now cached, and the
        token just sampled becomes the next position to compute."""
        # BEGIN SOLUTION 1.3: advance the lengths after one forward
        self.cached_len = self.device_len
        self.device_len += 1
        # END SOLUTION

    def append_host(self, next_token: torch.Tensor) -> None:
        """Append the sampled token (a 1-element integer tensor) to ``input_ids`` (host only).

        The token fills a position that ``complete_one`` already opened, so ``input_ids`` never
        holds more than ``device_len`` tokens (it may lag behind while a copy is in flight).
        """
        if not isinstance(next_token, torch.Tensor) or next_token.numel() != 1:
            raise ValueError(f"Req(uid={self.uid}).append_host takes one sampled token as a "
                             f"1-element tensor, got {next_token!r}.")
        if next_token.dtype.is_floating_point or next_token.dtype.is_complex:
            raise ValueError(f"Req(uid={self.uid}).append_host: the token has dtype "
                             f"{next_token.dtype}; token ids are integers.")
        if len(self.input_ids) >= self.device_len:
            raise ValueError(
                f"Req(uid={self.uid}).append_host: input_ids already holds {len(self.input_ids)} "
                f"tokens and device_len={self.device_len}, so no position is open for a new "
                "token; call complete_one() after each forward first (Engine.forward_batch does).")
        token = next_token.reshape(1).to(device="cpu", dtype=self.input_ids.dtype)
        self.input_ids = torch.cat([self.input_ids, token])

    def __repr__(self) -> str:
        return (f"Req(uid={self.uid}, table_idx={self.table_idx}, cached_len={self.cached_len}, "
                f"device_len={self.device_len}, max_device_len={self.max_device_len})")


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


def reset_global_ctx() -> None:
    """Release the process-wide context (Engine.shutdown() calls this)."""
    global _GLOBAL_CTX
    _GLOBAL_CTX = None
