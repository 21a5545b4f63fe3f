# Chapter 01 (01_req_batch_context.ipynb): Req, one request and the three lengths that drive it.
"""One request: its tokens on the host and the three lengths that say what the next forward does.

``minisgl.core`` re-exports ``Req``: ``from minisgl.core import Req`` is the official name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from minisgl.sampling_params import SamplingParams, is_count


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
        ids, me = self.input_ids, f"Req(uid={self.uid})"  # checked once, when the request is made
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"{me}: input_ids must be a torch.Tensor of token ids, got "
                            f"{type(ids).__name__}; use torch.tensor(ids, dtype=torch.int32).")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"{me}: input_ids has dtype {ids.dtype}; token ids are integers: use "
                            "torch.tensor(ids, dtype=torch.int32).")
        if ids.device.type != "cpu" or ids.dim() != 1:
            raise ValueError(f"{me}: input_ids must be 1-D [tokens] and on the CPU (a Req keeps "
                             f"its tokens on the host: pass input_ids.cpu()), got shape "
                             f"{tuple(ids.shape)} on {ids.device}.")
        for name in ("table_idx", "cached_len", "output_len"):
            if not is_count(getattr(self, name)):
                raise TypeError(f"{me}: {name}={getattr(self, name)!r} is not an integer; "
                                f"pass a whole number such as {name}=0.")
        # BEGIN SOLUTION 1.1: derive device_len and max_device_len from input_ids and output_len
        self.device_len = len(ids)
        self.max_device_len = len(ids) + self.output_len
        # END SOLUTION
        self.check_invariant()
        if self.output_len < 1:
            raise ValueError(f"{me}: output_len={self.output_len} leaves nothing to generate; "
                             "every forward samples one token per request, so use "
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

        The token fills the position that ``complete_one`` opened, so ``input_ids`` never holds
        more than ``device_len`` tokens (it may lag behind while a copy is in flight).
        """
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
