# Chapter 06 (06_engine_and_sampler.ipynb): EngineConfig.
"""Everything needed to build an Engine, checked before anything global is touched."""

from __future__ import annotations

import functools
import math
import numbers
import os
from dataclasses import dataclass
from typing import List

import torch

from minisgl.distributed import DistributedInfo
from minisgl.models import ModelConfig
from minisgl.models.weight import load_hf_config, resolve_model_path

_GiB = 1 << 30
_COUNTS = ("max_running_req", "page_size", "num_page_override", "max_seq_len_override",
           "num_threads", "cuda_graph_max_bs")  # whole numbers (None allowed where the default is)
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost")


def _is_count(value) -> bool:
    """An int (numpy's too), never a bool, float or string: ``True`` is an int in Python."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def loopback_host_port(addr: str) -> tuple[str, int]:
    """``tcp://127.0.0.1:PORT`` -> ("127.0.0.1", PORT); a clear error for any other address:
    the tp ranks run on one machine and listen on the loopback interface only."""
    scheme, _, rest = addr.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "tcp" or host not in _LOOPBACK_HOSTS or not port.isdigit() or not (
            0 < int(port) < 65536):
        raise ValueError(f"MINISGL_DIST_ADDR={addr!r}: the tp ranks meet on this machine only, at "
                         "tcp://127.0.0.1:PORT (they never listen on another interface); unset "
                         "it, or set it to e.g. tcp://127.0.0.1:29500.")
    return "127.0.0.1", int(port)


def total_memory(device: str) -> int:
    """Bytes of memory the device has in all (CPU: the machine's RAM)."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


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
        resolve_model_path(self.model_path)
        if not isinstance(self.tp_info, DistributedInfo):
            raise TypeError(f"tp_info must be a DistributedInfo, e.g. DistributedInfo(0, 1); got "
                            f"{self.tp_info!r}.")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise TypeError(f"dtype={self.dtype!r} is not a floating-point torch dtype: use "
                            "torch.float32 (CPU) or torch.bfloat16 / torch.float16 (GPU).")
        for name in _COUNTS:
            value = getattr(self, name)
            if not _is_count(value) and not (value is None and name not in (
                    "max_running_req", "page_size")):
                raise TypeError(f"{name}={value!r} is not an integer: use a whole number (an int, "
                                f"e.g. {name}=4), not a {type(value).__name__}.")
        if self.cuda_graph_bs is not None and not (
                isinstance(self.cuda_graph_bs, (list, tuple))
                and all(_is_count(b) and b >= 1 for b in self.cuda_graph_bs)):
            raise TypeError(f"cuda_graph_bs={self.cuda_graph_bs!r}: use a list of whole batch "
                            "sizes >= 1, e.g. [1, 2, 4], or None.")
        for name in ("memory_ratio", "distributed_timeout"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise TypeError(f"{name}={value!r} is not a number: use a float such as "
                                f"{'0.9' if name == 'memory_ratio' else '60.0'}.")
        if not self.distributed_timeout > 0 or not math.isfinite(self.distributed_timeout):
            raise ValueError(f"distributed_timeout={self.distributed_timeout}: use a positive "
                             "number of seconds, e.g. 60.0.")
        for name in ("attention_backend", "device"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name}={getattr(self, name)!r}: use a string such as 'auto'.")
        if self.max_running_req < 1:
            raise ValueError(f"max_running_req={self.max_running_req}: need at least 1.")
        if not isinstance(self.cpu_kernels, bool):
            raise TypeError(f"cpu_kernels={self.cpu_kernels!r}: use True (chapter 07's fused "
                            "C++ kernels) or False (the chapters' torch code, the default).")
        if self.cpu_kernels and self.dtype != torch.float32:
            raise ValueError(f"cpu_kernels=True with dtype={self.dtype}: the C++ kernels are "
                             "float32 only; use dtype=torch.float32, or cpu_kernels=False.")
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size={self.page_size!r}: a page holds at least one token; use "
                             "1, or a power of two such as 4 or 16.")
        if not 0.0 < self.memory_ratio <= 1.0:
            raise ValueError(f"memory_ratio={self.memory_ratio}: must be in (0, 1], the share of "
                             "available memory the weights and KV pool may use.")
        if self.num_page_override is not None and self.num_page_override < 1:
            raise ValueError(f"num_page_override={self.num_page_override}: need at least 1 page.")
        if self.max_seq_len_override is not None and self.max_seq_len_override < 1:
            raise ValueError(f"max_seq_len_override={self.max_seq_len_override}: need >= 1.")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads={self.num_threads}: need at least 1 (or None).")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"device={self.device!r}: use 'auto', 'cpu' or 'cuda'.")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"device={self.device!r} but CUDA is not available on this "
                               "machine: use device='cpu' (or 'auto').")
        if self.cpu_kernels and (self.device.startswith("cuda") or (
                self.device == "auto" and torch.cuda.is_available())):
            raise ValueError("cpu_kernels=True on a GPU: the kernels are CPU code; use "
                             "device='cpu', or cpu_kernels=False.")
        from minisgl.attention import validate_attn_backend

        if self.cpu_kernels or "cpp" in self.attention_backend.split(","):
            import minisgl.kernel  # noqa: F401  registers the "cpp" backend (compiles nothing)
        validate_attn_backend(self.attention_backend)
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
            loopback_host_port(self.distributed_addr)
        if mc.num_qo_heads % tp or (mc.num_kv_heads % tp and tp % mc.num_kv_heads):
            ok = [n for n in range(1, mc.num_qo_heads + 1) if mc.num_qo_heads % n == 0
                  and (mc.num_kv_heads % n == 0 or n % mc.num_kv_heads == 0)]
            raise ValueError(f"tensor parallel size {tp} does not divide this model's heads "
                             f"({mc.num_qo_heads} query heads, {mc.num_kv_heads} KV heads); "
                             f"sizes that work: {ok}.")
        if self.num_page_override is not None:  # a pool that can never fit: fail before loading
            device = self.device
            if device == "auto":
                device = "cuda" if torch.cuda.is_available() else "cpu"
            if device == "cuda":
                device = f"cuda:{self.tp_info.rank}"
            need = (self.num_page_override + 1) * self.kv_cache_bytes_per_page  # + dummy page
            have = total_memory(device)
            if need > have:
                raise MemoryError(
                    f"num_page_override={self.num_page_override} asks for a KV pool of "
                    f"{need / _GiB:.2f} GiB ({self.kv_cache_bytes_per_page} bytes per page) but "
                    f"{device} has only {have / _GiB:.2f} GiB in all: use fewer pages (or a "
                    "smaller page_size).")
