# Chapter 07 (07_stage1_milestone.ipynb): fused CPU kernels, compiled on first use.
"""Fused CPU kernels: the CPU build's counterpart of the official ``minisgl.kernel`` (there,
CUDA kernels compiled just in time; here, C++ compiled just in time by
``torch.utils.cpp_extension`` and cached on disk).

The layers keep their torch code -- the code the chapters teach, and the fallback. Each one asks
``kernel.applies(x)`` first; that is true only while an Engine has switched the kernels on
(``EngineConfig.cpu_kernels``), for float32 CPU tensors, after the C++ built. So a chapter's own
tests, which call the layers directly, always run the torch code; an Engine on the CPU runs the
kernels. Without a C++ compiler, or with ``MINISGL_KERNELS=0``, everything runs the torch code
(one line says why).

Kernels (each replaces torch code of one decoder layer):

- ``fused_add_rmsnorm(x, residual, w, eps)``: ``residual += x`` in place, then RMSNorm of it
  (``residual=None``: RMSNorm of ``x``, which becomes the residual);
- ``silu_and_mul(x)``: ``silu(gate) * up``;
- ``rope_inplace(positions, x, cos_sin_cache, head_size)``: rotate q/k in place;
- ``store_and_decode_attention(...)``: write this step's k, v into the pool, then one query per
  request attends to its keys through the page table's slots;
- ``linear(x, w, bias)``: ``F.linear`` for a decode batch (up to ``LINEAR_MAX_ROWS`` rows),
  reading ``w`` in the checkpoint's ``[out, in]`` layout. The linear layers keep that layout when
  the kernels are on at load time (the Engine switches them on before loading), and the LM head
  then needs no oneDNN copy.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Tuple

import torch

from .csrc import FUNCTIONS, SOURCE

_ENABLED = False
_MODULE: ModuleType | None = None
_FAILED: str | None = None  # why the build failed (once failed, not retried in this process)
_PARALLEL = False  # built with OpenMP: at::parallel_for can use every thread
# -fopenmp: at::parallel_for splits rows over threads only when compiled with OpenMP
_FLAGS = ["-O3", "-march=native", "-fopenmp"]


def cache_dir() -> Path:
    """Where the compiled kernels live: ``$MINISGL_KERNEL_CACHE`` or ~/.cache/minisgl/kernels."""
    root = os.environ.get("MINISGL_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "minisgl" / "kernels"


def _cpu_id() -> str:
    """The CPU's model and instruction sets: a cache built with -march=native on another CPU
    (a shared home directory) must not be loaded here."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.platform() + platform.processor()


def _build(flags) -> ModuleType:
    from torch.utils.cpp_extension import load_inline

    bindir = str(Path(sys.executable).parent)  # where pip put `ninja`, even in an unactivated venv
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    key = hashlib.sha256("\0".join([SOURCE, torch.__version__, sys.version, _cpu_id(), *flags])
                         .encode()).hexdigest()[:16]
    build_dir = cache_dir() / key
    build_dir.mkdir(parents=True, exist_ok=True)
    fresh = not any(build_dir.glob("*.so"))
    if fresh:
        print(f"minisgl.kernel: compiling the C++ kernels once (about 30 s on 2 cores; cached in "
              f"{build_dir})", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    mod = load_inline(f"minisgl_cpu_kernels_{key}", cpp_sources=SOURCE, functions=FUNCTIONS,
                      extra_cflags=list(flags), build_directory=str(build_dir), verbose=False,
                      extra_ldflags=["-fopenmp"] if "-fopenmp" in flags else [])
    if fresh:
        print(f"minisgl.kernel: compiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return mod


def load() -> ModuleType | None:
    """The compiled module (built on first call), or None when it cannot be built."""
    global _MODULE, _FAILED, _PARALLEL
    if _MODULE is not None or _FAILED is not None:
        return _MODULE
    if os.environ.get("MINISGL_KERNELS", "1") == "0":
        _FAILED = "MINISGL_KERNELS=0"
        return None
    errors = []
    for flags in (_FLAGS, ["-O3"]):  # some compilers reject -march=native or -fopenmp
        try:
            _MODULE = _build(flags)
            _PARALLEL = bool(_MODULE.has_openmp())
            return _MODULE
        except Exception as e:  # no compiler, no ninja, a compile error: the torch ops remain
            last = (str(e).strip().splitlines() or [""])[-1]
            errors.append(f"{type(e).__name__}: {last[:200]}")
    _FAILED = errors[-1]
    print(f"minisgl.kernel: the C++ kernels could not be built ({_FAILED}); the layers run their "
          "torch code (slower). The kernels need a C++ compiler (g++ or clang) and `pip install "
          "ninja`; set MINISGL_KERNELS=0 to skip them without this message.", file=sys.stderr)
    return None


def unavailable_reason() -> str | None:
    """Why ``load()`` returned None (None when it has not failed)."""
    return _FAILED


def set_enabled(on: bool) -> bool:
    """Switch the kernels on or off for this process; returns whether they are now on (on
    needs ``load()`` to succeed). The Engine calls this; so can a test or a benchmark."""
    global _ENABLED
    _ENABLED = bool(on) and load() is not None
    return _ENABLED


def enabled() -> bool:
    return _ENABLED


def applies(x: torch.Tensor) -> bool:
    """Should a layer hand ``x`` to a kernel? Only when switched on and for float32 CPU rows."""
    return (_ENABLED and x.device.type == "cpu" and x.dtype == torch.float32
            and x.dim() == 2 and x.stride(-1) == 1)


# Up to this many rows (a decode batch, or a prefill's last tokens in the LM head) ``linear``
# beats MKL here; beyond it MKL's blocked GEMM wins (benchmarks/README.md has the numbers).
LINEAR_MAX_ROWS = 16


def linear_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Should ``F.linear(x, w)`` go to ``linear``? A few float32 CPU rows, a float32 CPU weight
    whose rows are contiguous (``[out, in]``, not ``input_major``), and threads to split it over
    (a build without OpenMP would run it on one thread: slower than MKL on two)."""
    return (applies(x) and x.shape[0] <= LINEAR_MAX_ROWS and w.dim() == 2 and w.stride(-1) == 1
            and w.device.type == "cpu" and w.dtype == torch.float32
            and (_PARALLEL or torch.get_num_threads() == 1))


# ------------------------------------------------------------------ the kernels
def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                      eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """``RMSNormFused.forward`` in one pass: returns ``(norm, residual)``."""
    if residual is None:
        return _MODULE.rmsnorm(x, weight, eps), x
    return _MODULE.fused_add_rmsnorm(x, residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _MODULE.silu_and_mul(x)


def rope_inplace(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor,
                 head_size: int) -> None:
    """Rotate every ``head_size`` block of each row of ``x`` by its token's position."""
    _MODULE.rope_inplace(positions, x, cos_sin_cache, head_size)


def store_and_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               k_cache: torch.Tensor, v_cache: torch.Tensor,
                               out_loc: torch.Tensor, kv_slots: torch.Tensor,
                               seq_lens: torch.Tensor, max_kv_len: int,
                               head_dim: int) -> torch.Tensor:
    """Decode attention over the paged pool: ``q [B, Hq*D]``, ``k, v [B, Hkv*D]``; caches seen
    as ``[slots, Hkv*D]``; request ``b`` attends to slots ``kv_slots[b*L : b*L + seq_lens[b]]``
    (its new token included, stored first at ``out_loc[b]``). Returns ``[B, Hq*D]``."""
    return _MODULE.store_and_decode_attention(q, k, v, k_cache, v_cache, out_loc, kv_slots,
                                              seq_lens, max_kv_len, head_dim)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for a few rows: ``x [M, K]``, ``w [N, K]`` with contiguous rows.
    Each weight byte is read once, 4 output features at a time, the features split over the
    threads; see ``linear_applies``."""
    return _MODULE.linear(x, w, bias)
