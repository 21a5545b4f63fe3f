# Chapter 05 (05_attention_backends.ipynb): the backend registry and create_attention_backend.
"""Pick an attention backend by name: ``"torch"`` (any device), ``"fi"`` (FlashInfer, CUDA only),
``"prefill,decode"`` for a HybridBackend, or ``"auto"``."""

from __future__ import annotations

import importlib.util

import torch

from minisgl.models import ModelConfig
from minisgl.utils import Registry

from .base import BaseAttnBackend, BaseAttnMetadata, HybridBackend
from .torch_backend import TorchAttnMetadata, TorchBackend

SUPPORTED_ATTENTION_BACKENDS: Registry = Registry("attention backend")


@SUPPORTED_ATTENTION_BACKENDS.register("torch")
def _create_torch_backend(config: ModelConfig) -> BaseAttnBackend:
    return TorchBackend(config)


def flashinfer_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None


@SUPPORTED_ATTENTION_BACKENDS.register("fi")
def _create_flashinfer_backend(config: ModelConfig) -> BaseAttnBackend:
    if not torch.cuda.is_available():
        raise RuntimeError("attention backend 'fi' (FlashInfer) needs an NVIDIA GPU with CUDA, "
                           "and this machine has none: use attention_backend='torch' (or "
                           "'auto').")
    if importlib.util.find_spec("flashinfer") is None:
        raise RuntimeError("attention backend 'fi' needs FlashInfer, which is not installed: "
                           "`pip install -e '.[gpu]'`, or use attention_backend='torch'.")
    from .fi import FlashInferBackend  # imported only here: never on a CPU machine

    return FlashInferBackend(config)


def resolve_attn_backend(name: str, device: torch.device,
                         dtype: torch.dtype | None = None) -> str:
    """``"auto"`` -> ``"fi"`` on a GPU with FlashInfer installed, unless ``dtype`` is not 16-bit
    (FlashInfer's kernels take bfloat16 / float16 only); else ``"torch"``."""
    if name != "auto":
        return name
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16):
        return "torch"
    return "fi" if device.type == "cuda" and flashinfer_available() else "torch"


def validate_attn_backend(name: str, allow_auto: bool = True) -> None:
    if allow_auto and name == "auto":
        return
    for part in name.split(","):
        if part not in SUPPORTED_ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {part!r}; supported: "
                             f"{', '.join(SUPPORTED_ATTENTION_BACKENDS.supported_names())}"
                             + (", auto" if allow_auto else "")
                             + " (or 'prefill_name,decode_name')")


def create_attention_backend(name: str, config: ModelConfig) -> BaseAttnBackend:
    validate_attn_backend(name, allow_auto=False)
    parts = name.split(",")
    if len(parts) == 2 and parts[0] != parts[1]:
        return HybridBackend(SUPPORTED_ATTENTION_BACKENDS[parts[0]](config),
                             SUPPORTED_ATTENTION_BACKENDS[parts[1]](config))
    return SUPPORTED_ATTENTION_BACKENDS[parts[0]](config)


__all__ = [
    "BaseAttnBackend",
    "BaseAttnMetadata",
    "HybridBackend",
    "SUPPORTED_ATTENTION_BACKENDS",
    "TorchAttnMetadata",
    "TorchBackend",
    "create_attention_backend",
    "flashinfer_available",
    "resolve_attn_backend",
    "validate_attn_backend",
]
