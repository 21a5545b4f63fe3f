# Chapter 01 (01_req_batch_context.ipynb): small utilities shared by later chapters.
"""Integer helpers, a name registry and a default-dtype context manager."""

from .misc import align_ceil, align_down, div_ceil, div_even, torch_dtype
from .registry import Registry

__all__ = ["Registry", "align_ceil", "align_down", "div_ceil", "div_even", "torch_dtype"]
