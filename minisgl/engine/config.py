# Chapter 06 (06_engine_and_sampler.ipynb): EngineConfig and its validation, the config boundary.
"""Everything needed to build an Engine, and ``validate()``: every field checked before an Engine
touches anything process-wide (the tp info, the global context, torch's threads and seed), so a
typo in a notebook cell fails with one clear message instead of a half-built Engine.
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass
from typing import List

import torch

from minisgl.distributed import DistributedInfo
from minisgl.models import ModelConfig
from minisgl.models.weight import load_hf_config, resolve_model_path
from minisgl.sampling_params import is_count  # one definition of "a whole number"
from minisgl.utils import read_env

_COUNTS = ("max_running_req", "page_size", "num_page_override", "max_seq_len_override",
           "num_threads", "cuda_graph_max_bs")  # whole numbers (None allowed where the default is)


def resolve_device(name: str, tp_rank: int) -> torch.device:
    """"auto" -> CUDA when available, else the CPU; "cuda" -> this rank's GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device("cuda", tp_rank) if name == "cuda" else torch.device(name)


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
        return read_env("MINISGL_DIST_ADDR", str, "tcp://127.0.0.1:2333")

    @property
    def tp_sizes(self) -> List[int]:
        """The tp sizes this model's heads split over: each rank a whole number of query heads,
        and a whole number of KV heads or one whole KV head shared with other ranks."""
        q, kv = self.model_config.num_qo_heads, self.model_config.num_kv_heads
        return [n for n in range(1, q + 1) if q % n == 0 and (kv % n == 0 or n % kv == 0)]

    def validate(self) -> None:
        """Raise a clear error for any field that cannot work (touches no global state)."""
        self._check_types()
        self._check_values()
        self._check_model()
# --- part 2: the checks, types first ---

    def _check_types(self) -> None:
        resolve_model_path(self.model_path)
        if not isinstance(self.tp_info, DistributedInfo):
            raise TypeError(f"tp_info must be a DistributedInfo, e.g. DistributedInfo(0, 1); got "
                            f"{self.tp_info!r}.")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise TypeError(f"dtype={self.dtype!r} is not a floating-point torch dtype: use "
                            "torch.float32 (CPU) or torch.bfloat16 / torch.float16 (GPU).")
        for name in _COUNTS:
            value = getattr(self, name)
            if not is_count(value) and not (value is None and name not in (
                    "max_running_req", "page_size")):
                raise TypeError(f"{name}={value!r} is not an integer: use a whole number (an "
                                f"int, e.g. {name}=4), not a {type(value).__name__}.")
        if self.cuda_graph_bs is not None and not (
                isinstance(self.cuda_graph_bs, (list, tuple))
                and all(is_count(b) and b >= 1 for b in self.cuda_graph_bs)):
            raise TypeError(f"cuda_graph_bs={self.cuda_graph_bs!r}: use a list of whole batch "
                            "sizes >= 1, e.g. [1, 2, 4], or None.")
        for name in ("memory_ratio", "distributed_timeout"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise TypeError(f"{name}={value!r} is not a number: use a float such as "
                                f"{'0.9' if name == 'memory_ratio' else '60.0'}.")
        for name in ("attention_backend", "device"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name}={getattr(self, name)!r}: use a string such as 'auto'.")
        if not isinstance(self.cpu_kernels, bool):
            raise TypeError(f"cpu_kernels={self.cpu_kernels!r}: use True (chapter 07's fused "
                            "C++ kernels) or False (the chapters' torch code, the default).")

    def _check_values(self) -> None:
        if not self.distributed_timeout > 0 or not math.isfinite(self.distributed_timeout):
            raise ValueError(f"distributed_timeout={self.distributed_timeout}: use a positive "
                             "number of seconds, e.g. 60.0.")
        if self.cpu_kernels and self.dtype != torch.float32:
            raise ValueError(f"cpu_kernels=True with dtype={self.dtype}: the C++ kernels are "
                             "float32 only; use dtype=torch.float32, or cpu_kernels=False.")
        if self.page_size < 1:
            raise ValueError(f"page_size={self.page_size!r}: a page holds at least one token; "
                             "use 1, or a power of two such as 4 or 16.")
        if not 0.0 < self.memory_ratio <= 1.0:
            raise ValueError(f"memory_ratio={self.memory_ratio}: must be in (0, 1], the share "
                             "of available memory the weights and KV pool may use.")
        for name in ("max_running_req", "num_page_override", "max_seq_len_override",
                     "num_threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: need at least 1.")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"device={self.device!r}: use 'auto', 'cpu' or 'cuda'.")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"device={self.device!r} but CUDA is not available on this "
                               "machine: use device='cpu' (or 'auto').")
        if self.cpu_kernels and resolve_device(self.device, 0).type != "cpu":
            raise ValueError("cpu_kernels=True on a GPU: the kernels are CPU code; use "
                             "device='cpu', or cpu_kernels=False.")
        from minisgl.attention import validate_attn_backend

        if self.cpu_kernels or "cpp" in self.attention_backend.split(","):
            import minisgl.kernel  # noqa: F401  chapter 07 registers "cpp" (compiles nothing)
        validate_attn_backend(self.attention_backend)
# --- part 3: what config.json allows ---

    def _check_model(self) -> None:
        mc = self.model_config  # reads config.json: unsupported fields fail here
        from minisgl.models.register import MODEL_REGISTRY

        if mc.architectures[0] not in MODEL_REGISTRY:
            raise ValueError(f"unsupported architecture {mc.architectures[0]!r}; supported: "
                             f"{', '.join(MODEL_REGISTRY.supported_names())}")
        positions = mc.rotary_config.max_position
        if self.max_seq_len_override is not None and self.max_seq_len_override > positions:
            raise ValueError(f"max_seq_len_override={self.max_seq_len_override} exceeds the "
                             f"model's {positions} positions (max_position_embeddings in "
                             "config.json: its rotary table covers no more): use at most "
                             f"{positions}, or None for the model's own limit.")
        tp = self.tp_info.size
        if tp > 1:
            from minisgl.distributed.group import loopback_host_port  # the optional tp section

            loopback_host_port(self.distributed_addr)
        if tp not in self.tp_sizes:
            raise ValueError(f"tensor parallel size {tp} does not divide this model's heads "
                             f"({mc.num_qo_heads} query heads, {mc.num_kv_heads} KV heads); "
                             f"sizes that work: {self.tp_sizes}.")
