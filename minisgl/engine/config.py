# Chapter 06 (06_engine_and_sampler.ipynb): EngineConfig.
"""Everything needed to build an Engine; ``validate()`` (config_check.py) checks it before anything
global is touched."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import List

import torch

from minisgl.distributed import DistributedInfo
from minisgl.models import ModelConfig
from minisgl.models.weight import load_hf_config


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    tp_info: DistributedInfo
    dtype: torch.dtype
    max_running_req: int = 256
    attention_backend: str = "auto"
    moe_backend: str = "auto"
    cuda_graph_bs: List[int] | None = None
    cuda_graph_max_bs: int | None = None
    page_size: int = 1
    memory_ratio: float = 0.9
    distributed_timeout: float = 60.0
    use_dummy_weight: bool = False
    use_pynccl: bool = True
    max_seq_len_override: int | None = None
    num_page_override: int | None = None
    # CPU-build additions:
    device: str = "auto"  # "auto": CUDA when available, else CPU
    num_threads: int | None = None  # None: every CPU core this process may use
    cpu_kernels: bool = False  # True: chapter 07's fused C++ kernels (CPU, float32)

    @functools.cached_property
    def hf_config(self):
        return load_hf_config(self.model_path)

    @functools.cached_property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_hf(self.hf_config)

    @property
    def max_seq_len(self) -> int:
        if self.max_seq_len_override is not None:
            return self.max_seq_len_override
        return self.model_config.rotary_config.max_position

    @property
    def max_forward_len(self) -> int:
        return self.max_seq_len

    @property
    def kv_cache_bytes_per_page(self) -> int:
        """One page of the KV pool: K and V, every layer, this rank's KV heads, page_size tokens."""
        mc = self.model_config
        kv_heads = max(1, mc.num_kv_heads // self.tp_info.size)  # replicated when tp > Hkv
        return 2 * mc.num_layers * self.page_size * kv_heads * mc.head_dim * self.dtype.itemsize

    @property
    def distributed_addr(self) -> str:
        """Where the tp ranks meet (rank 0 listens there, on 127.0.0.1 only):
        ``$MINISGL_DIST_ADDR`` when set (the launcher sets it to a free port), else a fixed local
        port."""
        return os.environ.get("MINISGL_DIST_ADDR", "tcp://127.0.0.1:2333")

    def validate(self) -> None:
        """Raise a clear error for any field that cannot work (touches no global state)."""
        from .config_check import validate_config

        validate_config(self)
