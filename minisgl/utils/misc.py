# Chapter 01 (01_req_batch_context.ipynb): integer helpers and a default-dtype context manager.
"""Tiny helpers: exact division for sharding, rounding up/down, and ``torch_dtype``."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


def div_even(a: int, b: int, allow_replicate: bool = False) -> int:
    """``a / b`` when ``b`` divides ``a`` exactly (how many heads or rows each of ``b`` ranks gets).

    With ``allow_replicate`` and more ranks than items (``b > a``, ``b % a == 0``), every rank keeps
    one whole item (e.g. one KV head copied on several ranks) and the result is 1.
    """
    # BEGIN SOLUTION 1.5: exact division, or 1 when replicating is allowed and b is a multiple of a
    if allow_replicate and b > a:
        if b % a != 0:
            raise ValueError(f"cannot replicate {a} items over {b} ranks: {b} is not a multiple "
                             f"of {a}.")
        return 1
    if a % b != 0:
        raise ValueError(f"{a} is not divisible by {b}: cannot split {a} items evenly over "
                         f"{b} ranks.")
    return a // b
    # END SOLUTION


def div_ceil(a: int, b: int) -> int:
    return (a + b - 1) // b


def align_ceil(a: int, b: int) -> int:
    """Round ``a`` up to a multiple of ``b``."""
    return div_ceil(a, b) * b


def align_down(a: int, b: int) -> int:
    """Round ``a`` down to a multiple of ``b``."""
    return (a // b) * b


@contextmanager
def torch_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Temporarily make ``dtype`` torch's default floating-point dtype."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
