# Chapter 07 (07_stage1_milestone.ipynb): the fused CPU kernels as a second implementation.
"""Fused CPU kernels: the CPU build's counterpart of the official ``minisgl.kernel`` (there,
CUDA kernels compiled just in time; here, ``csrc.cpp`` compiled on first use by ``build.py``).

Nothing here runs unless an Engine is built with ``EngineConfig(cpu_kernels=True)``. Then the
Engine asks ``op_impls()`` for the implementation set *before* it builds the model, every op
keeps the function its constructor found there, and the attention backend ``"cpp"`` (registered
below) replaces decode attention:

- ``RMSNormFused`` -> ``add_rmsnorm`` (``rmsnorm`` / ``fused_add_rmsnorm``: add + norm in one pass);
- ``RotaryEmbedding`` -> ``rope`` (``rope_inplace``: q and k rotated in one call);
- ``GatedMLP``'s activation -> ``silu_and_mul``;
- the linear ops and the LM head -> ``small_batch_linear`` (``linear``) for a decode's few rows;
- the KV pool's ``store_kv`` -> ``store_kv`` (one row copy per token);
- the ``Sampler``'s greedy path -> ``argmax`` (``argmax_rows``: ``torch.argmax``'s answer);
- backend ``"cpp"``: prefill is chapter 05's ``TorchBackend``; decode stores k, v with the pool's
  ``store_kv`` (chapter 04), then calls ``decode_attention``.

The files: ``csrc.cpp`` and ``csrc/*.h`` (the C++), ``cache.py`` (where the library is kept,
the build lock), ``build.py`` (compile, verify, load), this file (``load()`` and the Python side
of each kernel), ``weights.py`` (the weights in 2 MB pages), ``binding.py`` (``op_impls``) and
``attention.py`` (the ``"cpp"`` backend). A
default Engine never imports this package, so it runs exactly the chapters' code.
"""

from __future__ import annotations

import re
import sys
from types import ModuleType

import torch
import torch.nn.functional as F

from minisgl.utils.env import EnvVarError, read_env

from .build import KernelBuildError, cache_dir, load_or_build

_MODULE: ModuleType | None = None
_FAILED: str | None = None  # why the build failed (not retried in this process)
LINEAR_MAX_ROWS = 16  # up to here `linear` beats MKL; beyond, MKL's blocked GEMM wins
# The vector instructions the build targets (common.h, part 2), from MINISGL_KERNEL_ISA:
# "native" (the default): this CPU's widest; "no-avx512": AVX2 on an AVX-512 CPU (to measure
# both); "baseline": the architecture's base vectors (SSE2 on x86-64, NEON on aarch64).
ISA_FLAGS = {"native": ["-O3", "-march=native"],
             "no-avx512": ["-O3", "-march=native", "-mno-avx512f"],
             "baseline": ["-O3"]}
# Every loop starts a 64-byte line of code. Without this, an edit anywhere in the library could
# shift the 16-row matmul's inner loop within its line, and that alone made it 5% slower on a
# Zen 2 (the instructions unchanged).
ALIGN_LOOPS = ["-falign-loops=64"]


def build_flags() -> list[str]:
    """The compiler flags ``MINISGL_KERNEL_ISA`` asks for (default: ``native``)."""
    isa = read_env("MINISGL_KERNEL_ISA", str, "native", choices=tuple(ISA_FLAGS))
    return ISA_FLAGS[isa] + ALIGN_LOOPS


def load() -> ModuleType | None:
    """The compiled module (built on the first call, then cached on disk), or None when it
    cannot be built: then one line on stderr says why, and the torch code runs."""
    global _MODULE, _FAILED
    if _MODULE is not None or _FAILED is not None:
        return _MODULE
    errors = []
    for flags in (build_flags(), ISA_FLAGS["baseline"]):  # a compiler may reject -march=native
        try:
            _MODULE = load_or_build(flags)
            return _MODULE
        except EnvVarError:  # a MINISGL_* setting the user must fix: not a fallback
            raise
        except KernelBuildError as e:  # a busy or foreign cache: a clear message already
            errors.append(str(e))
            advice = ""  # the message says what to do; a compiler is not the problem
            break
        except Exception as e:  # no compiler, no ninja, a compile error
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
            # file:line:col: error: ... is the compiler rejecting the C++ (a rejected flag
            # reads "g++: error: ...", and the next flags may pass)
            first = next((ln for ln in lines if re.search(r":\d+:\d+: (fatal )?error:", ln)), None)
            if first is not None:
                errors.append(f"a compile error, the first: {first[:300]}")
                advice = (" Fix the C++ under minisgl/kernel/ (chapter 07's %%writefile cells "
                          "write it), then run again.")
                break  # other flags would fail the same way
            errors.append(f"{type(e).__name__}: {(lines or [''])[-1][:200]}")
            advice = (" The kernels need a C++ compiler (g++ or clang) and ninja "
                      "(`pip install ninja`).")
    _FAILED = errors[-1]
    print(f"minisgl.kernel: the C++ kernels could not be built ({_FAILED}); the Engine runs the "
          f"chapters' torch code.{advice}", file=sys.stderr, flush=True)
    return None


def unavailable_reason() -> str | None:
    """Why ``load()`` returned None (None when it has not failed)."""
    return _FAILED
# --- part 2: the ops' functions and the "cpp" backend ---


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float):
    """``RMSNormFused``'s contract: ``(norm(x), x)``, or add ``x`` into ``residual`` first."""
    if residual is None:
        return _MODULE.rmsnorm(x, weight, eps), x
    return _MODULE.fused_add_rmsnorm(x, residual, weight, eps), residual


def rope(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
         cos_sin_cache: torch.Tensor, head_size: int) -> None:
    """Rotate ``query [T, Hq*D]`` and ``key [T, Hkv*D]`` in place, in one call."""
    _MODULE.rope_inplace(positions, query, cos_sin_cache, head_size, key)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _MODULE.silu_and_mul(x)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out_loc: torch.Tensor) -> None:
    """The KV pool's ``store_kv`` (chapter 04): row ``j`` of ``k``, ``v`` into slot ``out_loc[j]``
    of one layer's caches."""
    _MODULE.store_kv(k_cache, v_cache, k, v, out_loc)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """The Sampler's greedy path: each row's ``torch.argmax``, in one vectorised pass."""
    if logits.dim() == 2 and logits.dtype == torch.float32 and logits.device.type == "cpu":
        return _MODULE.argmax_rows(logits)
    return torch.argmax(logits, dim=-1)


def small_batch_linear(x: torch.Tensor, w: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` with the kernel for up to ``LINEAR_MAX_ROWS`` rows (the weight is read once,
    in chunks of output features the threads share), MKL for more (a prefill)."""
    if x.dim() == 2 and x.shape[0] <= LINEAR_MAX_ROWS:
        return _MODULE.linear(x, w, bias)
    return F.linear(x, w, bias)


# ------------------------------------------------------------------ the "cpp" attention backend
def _register_backend() -> None:
    from minisgl.attention import SUPPORTED_ATTENTION_BACKENDS

    @SUPPORTED_ATTENTION_BACKENDS.register("cpp")
    def _create_cpp_backend(config):
        from .attention import CppDecodeBackend

        return CppDecodeBackend(config)


_register_backend()
from .binding import op_impls  # last: it imports the functions above

__all__ = ["ISA_FLAGS", "LINEAR_MAX_ROWS", "KernelBuildError", "add_rmsnorm", "argmax",
           "build_flags",
           "cache_dir", "load", "op_impls", "rope", "silu_and_mul", "small_batch_linear",
           "store_kv", "unavailable_reason"]
