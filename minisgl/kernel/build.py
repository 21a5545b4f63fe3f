# Chapter 07 (07_stage1_milestone.ipynb): compile csrc.cpp aside, verify it, load it.
"""Build ``csrc.cpp`` with ``torch.utils.cpp_extension.load`` into the cache (``cache.py``).

Two rules, on top of the cache's lock, keep a build from crashing the process:

- **Builds happen aside.** Each build runs in its own ``build-<pid>`` folder; only a finished
  library is moved into place, so a half-written one is never at the place we load from.
- **Only a verified library is loaded.** The build records the library's sha256 in
  ``build.json``; a library whose bytes differ (truncated, corrupt, from another build) is
  deleted and rebuilt instead of loaded (loading a truncated one can kill the process).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType

from .cache import (SOURCE, KernelBuildError, _locked, _private_dir, build_key, cache_dir,
                    lock_timeout, source_bytes)

__all__ = ["KernelBuildError", "build_key", "cache_dir", "load_or_build", "source_bytes"]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _verified(folder: Path, name: str) -> Path | None:
    """The cached library, if ``build.json`` records exactly its bytes; else None."""
    lib = folder / f"{name}.so"
    try:
        record = json.loads((folder / "build.json").read_text())
        ok = record.get("name") == name and record.get("sha256") == _sha256(lib)
    except (OSError, ValueError, AttributeError):
        return None
    return lib if ok else None


def _compile(name: str, folder: Path, flags: list[str]) -> ModuleType:
    """Compile in ``folder/build-<pid>``, then move the finished library into ``folder``."""
    from torch.utils.cpp_extension import load

    bindir = str(Path(sys.executable).parent)  # where pip put `ninja`, even in an unactivated venv
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    work = folder / f"build-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(mode=0o700)
    try:
        module = load(name, sources=[str(SOURCE)], extra_cflags=flags, build_directory=str(work),
                      verbose=False)
        lib = folder / f"{name}.so"
        os.replace(work / f"{name}.so", lib)
        tmp = folder / "build.json.tmp"
        tmp.write_text(json.dumps({"name": name, "sha256": _sha256(lib), "flags": flags}))
        os.replace(tmp, folder / "build.json")
        return module
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_or_build(flags: list[str]) -> ModuleType:
    """The compiled module for ``flags``: a verified cached library, or a fresh build."""
    key = build_key(source_bytes(), flags)
    name = f"minisgl_cpu_kernels_{key}"
    root, timeout = cache_dir(), lock_timeout()  # the settings first: a bad value touches nothing
    _private_dir(root)
    folder = _private_dir(root / key)
    with _locked(folder, timeout):
        lib = _verified(folder, name)
        if lib is not None:
            return _import(name, lib)
        # anything here is a dead or unfinished build (we hold the lock): start clean
        for p in folder.iterdir():
            if p.name != "build.lock":
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        print(f"minisgl.kernel: compiling the C++ kernels once (about a minute on 2 cores; "
              f"cached in {folder})", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        module = _compile(name, folder, flags)
        print(f"minisgl.kernel: compiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr,
              flush=True)
        return module
