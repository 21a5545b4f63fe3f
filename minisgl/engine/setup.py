# Chapter 06 (06_engine_and_sampler.ipynb): what the Engine resolves and loads around its build.
"""Small decisions ``Engine.__init__`` takes before and during the build: which device, how many
threads, whether chapter 07's optional kernels run, and the weights it loads (the load boundary:
a checkpoint tensor that does not fit the Engine's dtype is refused here, by name).
"""

from __future__ import annotations

import os

import torch

from minisgl.models import load_weight


def resolve_device(name: str, tp_rank: int) -> torch.device:
    """"auto" -> CUDA when available, else the CPU; "cuda" -> this rank's GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device("cuda", tp_rank) if name == "cuda" else torch.device(name)


def total_memory(device: str) -> int:
    """Bytes of memory the device has in all (CPU: the machine's RAM)."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_count() -> int:
    """CPU cores this process may run on (all cores where the OS cannot tell, e.g. macOS)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def want_cpu_kernels(config) -> bool:
    """``cpu_kernels=True``: build (or find) chapter 07's kernels now and pick the ``"cpp"``
    backend for ``"auto"``; the Engine binds them to the model after the build. Where they cannot
    be built, one line says why and the chapters' code runs. The default imports nothing."""
    if not config.cpu_kernels:
        return False
    from minisgl import kernel

    if kernel.load() is None:
        return False
    if config.attention_backend == "auto":
        object.__setattr__(config, "attention_backend", "cpp")
    return True


def weight_state_dict(model, config, device: torch.device) -> dict:
    """The checkpoint's tensors in ``config.dtype`` (random ones with ``use_dummy_weight``)."""
    if config.use_dummy_weight:
        return {k: torch.randn(v.shape, dtype=v.dtype, device=device) * 0.02
                for k, v in model.state_dict().items()}
    state = {}
    for name, t in load_weight(config.model_path, device):  # finite floats (checked)
        if t.dtype != config.dtype:
            was, t = t.dtype, t.to(config.dtype)
            if not bool(torch.isfinite(t).all()):
                wider = ", or torch.float32" if was != torch.float32 else ""
                raise ValueError(f"weight {name} does not fit in {config.dtype}: converted from "
                                 f"the checkpoint's {was}, it holds inf; build the Engine "
                                 f"with dtype={was}{wider}.")
        state[name] = t
    return state
