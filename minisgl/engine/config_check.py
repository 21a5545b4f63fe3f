# Chapter 06 (06_engine_and_sampler.ipynb): EngineConfig.validate(), the config boundary.
"""Every field of an EngineConfig checked before an Engine touches anything process-wide (the tp
info, the global context, torch's threads and seed): a typo in a notebook cell then fails with
one clear message instead of leaving a half-built Engine holding the globals.
"""

from __future__ import annotations

import math
import numbers

import torch

from minisgl.distributed import DistributedInfo
from minisgl.models.weight import resolve_model_path

from .setup import resolve_device, total_memory

_GiB = 1 << 30
_COUNTS = ("max_running_req", "page_size", "num_page_override", "max_seq_len_override",
           "num_threads", "cuda_graph_max_bs")  # whole numbers (None allowed where the default is)


def _is_count(value) -> bool:
    """An int (numpy's too), never a bool, float or string: ``True`` is an int in Python."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def validate_config(config) -> None:
    """Raise a clear error for any field of ``config`` that cannot work."""
    resolve_model_path(config.model_path)
    if not isinstance(config.tp_info, DistributedInfo):
        raise TypeError(f"tp_info must be a DistributedInfo, e.g. DistributedInfo(0, 1); got "
                        f"{config.tp_info!r}.")
    if not isinstance(config.dtype, torch.dtype) or not config.dtype.is_floating_point:
        raise TypeError(f"dtype={config.dtype!r} is not a floating-point torch dtype: use "
                        "torch.float32 (CPU) or torch.bfloat16 / torch.float16 (GPU).")
    for name in _COUNTS:
        value = getattr(config, name)
        if not _is_count(value) and not (value is None and name not in (
                "max_running_req", "page_size")):
            raise TypeError(f"{name}={value!r} is not an integer: use a whole number (an int, "
                            f"e.g. {name}=4), not a {type(value).__name__}.")
    if config.cuda_graph_bs is not None and not (
            isinstance(config.cuda_graph_bs, (list, tuple))
            and all(_is_count(b) and b >= 1 for b in config.cuda_graph_bs)):
        raise TypeError(f"cuda_graph_bs={config.cuda_graph_bs!r}: use a list of whole batch "
                        "sizes >= 1, e.g. [1, 2, 4], or None.")
    for name in ("memory_ratio", "distributed_timeout"):
        value = getattr(config, name)
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise TypeError(f"{name}={value!r} is not a number: use a float such as "
                            f"{'0.9' if name == 'memory_ratio' else '60.0'}.")
    if not config.distributed_timeout > 0 or not math.isfinite(config.distributed_timeout):
        raise ValueError(f"distributed_timeout={config.distributed_timeout}: use a positive "
                         "number of seconds, e.g. 60.0.")
    for name in ("attention_backend", "device"):
        if not isinstance(getattr(config, name), str):
            raise TypeError(f"{name}={getattr(config, name)!r}: use a string such as 'auto'.")
    if not isinstance(config.cpu_kernels, bool):
        raise TypeError(f"cpu_kernels={config.cpu_kernels!r}: use True (chapter 07's fused "
                        "C++ kernels) or False (the chapters' torch code, the default).")
    if config.cpu_kernels and config.dtype != torch.float32:
        raise ValueError(f"cpu_kernels=True with dtype={config.dtype}: the C++ kernels are "
                         "float32 only; use dtype=torch.float32, or cpu_kernels=False.")
    if config.page_size < 1:
        raise ValueError(f"page_size={config.page_size!r}: a page holds at least one token; use "
                         "1, or a power of two such as 4 or 16.")
    if not 0.0 < config.memory_ratio <= 1.0:
        raise ValueError(f"memory_ratio={config.memory_ratio}: must be in (0, 1], the share of "
                         "available memory the weights and KV pool may use.")
    for name in ("max_running_req", "num_page_override", "max_seq_len_override", "num_threads"):
        if getattr(config, name) is not None and getattr(config, name) < 1:
            raise ValueError(f"{name}={getattr(config, name)}: need at least 1.")
    if config.device not in ("auto", "cpu") and not config.device.startswith("cuda"):
        raise ValueError(f"device={config.device!r}: use 'auto', 'cpu' or 'cuda'.")
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device={config.device!r} but CUDA is not available on this "
                           "machine: use device='cpu' (or 'auto').")
    if config.cpu_kernels and (config.device.startswith("cuda") or (
            config.device == "auto" and torch.cuda.is_available())):
        raise ValueError("cpu_kernels=True on a GPU: the kernels are CPU code; use "
                         "device='cpu', or cpu_kernels=False.")
    from minisgl.attention import validate_attn_backend

    if config.cpu_kernels or "cpp" in config.attention_backend.split(","):
        import minisgl.kernel  # noqa: F401  registers the "cpp" backend (compiles nothing)
    validate_attn_backend(config.attention_backend)
    mc = config.model_config  # reads config.json: unsupported fields fail here
    from minisgl.models.register import MODEL_REGISTRY

    if mc.architectures[0] not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {mc.architectures[0]!r}; supported: "
                         f"{', '.join(MODEL_REGISTRY.supported_names())}")
    positions = mc.rotary_config.max_position
    if config.max_seq_len_override is not None and config.max_seq_len_override > positions:
        raise ValueError(f"max_seq_len_override={config.max_seq_len_override} exceeds the "
                         f"model's {positions} positions (max_position_embeddings in "
                         "config.json: its rotary table covers no more): use at most "
                         f"{positions}, or None for the model's own limit.")
    tp = config.tp_info.size
    if tp > 1:
        from .tp import loopback_host_port  # the optional tp section's file

        loopback_host_port(config.distributed_addr)
    if mc.num_qo_heads % tp or (mc.num_kv_heads % tp and tp % mc.num_kv_heads):
        ok = [n for n in range(1, mc.num_qo_heads + 1) if mc.num_qo_heads % n == 0
              and (mc.num_kv_heads % n == 0 or n % mc.num_kv_heads == 0)]
        raise ValueError(f"tensor parallel size {tp} does not divide this model's heads "
                         f"({mc.num_qo_heads} query heads, {mc.num_kv_heads} KV heads); "
                         f"sizes that work: {ok}.")
    if config.num_page_override is not None:  # a pool that can never fit: fail before loading
        device = str(resolve_device(config.device, config.tp_info.rank))
        need = (config.num_page_override + 1) * config.kv_cache_bytes_per_page  # + dummy page
        have = total_memory(device)
        if need > have:
            raise MemoryError(
                f"num_page_override={config.num_page_override} asks for a KV pool of "
                f"{need / _GiB:.2f} GiB ({config.kv_cache_bytes_per_page} bytes per page) but "
                f"{device} has only {have / _GiB:.2f} GiB in all: use fewer pages (or a "
                "smaller page_size).")
