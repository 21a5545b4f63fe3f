# Chapter 01 (01_req_batch_context.ipynb): small utilities shared by later chapters.
"""Integer helpers, a name registry, a default-dtype context manager and the environment reader."""

from .env import EnvVarError, read_env
from .misc import align_ceil, align_down, div_ceil, div_even, torch_dtype
from .registry import Registry

__all__ = ["EnvVarError", "Registry", "align_ceil", "align_down", "div_ceil", "div_even", "read_env",
           "torch_dtype"]
