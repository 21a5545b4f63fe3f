# Chapter 07 (07_stage1_milestone.ipynb): compile csrc.cpp once, cache it, load it safely.
"""Build ``csrc.cpp`` with ``torch.utils.cpp_extension.load`` into a private cache, and load it.

The cache is ``$MINISGL_KERNEL_CACHE`` or ``~/.cache/minisgl/kernels``, one folder per *key*
(a hash of the sources, the compiler flags, torch's and Python's versions and the CPU), readable
by this user only. Three rules keep a build from hanging or crashing the process:

- **One builder at a time, and a dead one never blocks.** A builder holds an ``flock`` on
  ``build.lock``; the operating system releases it when the builder exits *or is killed*, so a
  build interrupted at any moment leaves nothing to wait for. A live builder is waited for, up to
  ``MINISGL_KERNEL_LOCK_TIMEOUT`` seconds (default 300), then the wait ends with a message.
- **Builds happen aside.** Each build runs in its own ``build-<pid>`` folder; only a finished
  library is moved into place, so a half-written one is never at the place we load from.
- **Only a verified library is loaded.** The build records the library's sha256 in
  ``build.json``; a library whose bytes differ (truncated, corrupt, from another build) is
  deleted and rebuilt instead of loaded (loading a truncated one can kill the process).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Iterator, List

import torch

SOURCE = Path(__file__).with_name("csrc.cpp")  # it #includes the headers in csrc/


def source_bytes() -> bytes:
    """csrc.cpp and every header it may include: what the build key hashes."""
    files = [SOURCE, *sorted(SOURCE.with_name("csrc").glob("*.h"))]
    return b"".join(f.name.encode() + b"\0" + f.read_bytes() for f in files)


class KernelBuildError(RuntimeError):
    """The kernels could not be built or loaded; the message says why and what to do."""


def cache_dir() -> Path:
    root = os.environ.get("MINISGL_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "minisgl" / "kernels"


def _cpu_id() -> str:
    """The CPU's model and instruction sets: a library built for another CPU is not loaded."""
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(sorted({ln for ln in f if ln.startswith(("model name", "flags",
                                                                    "Features"))}))
    except OSError:
        return platform.platform() + platform.processor()


def build_key(source: bytes, flags: List[str]) -> str:
    parts = [hashlib.sha256(source).hexdigest(), torch.__version__, sys.version, _cpu_id(), *flags]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _private_dir(path: Path) -> Path:
    """Create ``path`` (and its parents) readable by this user only; refuse another user's."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise KernelBuildError(f"the kernel cache {path} belongs to another user: set "
                               "MINISGL_KERNEL_CACHE to a folder of your own.")
    if st.st_mode & 0o077:
        path.chmod(0o700)
    return path


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextlib.contextmanager
def _locked(folder: Path, timeout: float) -> Iterator[None]:
    """Hold ``folder/build.lock``; released by the OS if this process dies."""
    with open(folder / "build.lock", "a+") as f:
        start, told = time.monotonic(), False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "another process"
                waited = time.monotonic() - start
                if waited > timeout:
                    raise KernelBuildError(
                        f"{holder} has been building the kernels in {folder} for over "
                        f"{timeout:.0f} s. Wait for it to finish, or stop that process; or set "
                        "MINISGL_KERNEL_CACHE to another folder (or raise "
                        "MINISGL_KERNEL_LOCK_TIMEOUT).") from None
                if not told:
                    print(f"minisgl.kernel: waiting for {holder}, which is building the kernels "
                          f"in {folder} (at most {timeout:.0f} s)", file=sys.stderr, flush=True)
                    told = True
                time.sleep(0.5)
        f.seek(0)
        f.truncate()
        f.write(f"process {os.getpid()}")
        f.flush()
        try:
            yield
        finally:
            f.truncate(0)
            fcntl.flock(f, fcntl.LOCK_UN)


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _verified(folder: Path, name: str) -> Path | None:
    """The cached library, if ``build.json`` records exactly its bytes; else None."""
    lib = folder / f"{name}.so"
    try:
        record = json.loads((folder / "build.json").read_text())
        ok = record.get("name") == name and record.get("sha256") == _sha256(lib)
    except (OSError, ValueError, AttributeError):
        return None
    return lib if ok else None


def _compile(name: str, folder: Path, flags: List[str]) -> ModuleType:
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
                      extra_ldflags=["-fopenmp"] if "-fopenmp" in flags else [], verbose=False)
        built = work / f"{name}.so"
        lib = folder / f"{name}.so"
        os.replace(built, lib)
        tmp = folder / "build.json.tmp"
        tmp.write_text(json.dumps({"name": name, "sha256": _sha256(lib), "flags": flags}))
        os.replace(tmp, folder / "build.json")
        return module
    finally:
        shutil.rmtree(work, ignore_errors=True)


def load_or_build(flags: List[str]) -> ModuleType:
    """The compiled module for ``flags``: a verified cached library, or a fresh build."""
    key = build_key(source_bytes(), flags)
    name = f"minisgl_cpu_kernels_{key}"
    _private_dir(cache_dir())
    folder = _private_dir(cache_dir() / key)
    timeout = float(os.environ.get("MINISGL_KERNEL_LOCK_TIMEOUT", "300"))
    with _locked(folder, timeout):
        lib = _verified(folder, name)
        if lib is None:
            # anything here is a dead or unfinished build (we hold the lock): start clean
            for p in folder.iterdir():
                if p.name != "build.lock":
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
            print(f"minisgl.kernel: compiling the C++ kernels once (about a minute on 2 cores; "
                  f"cached in {folder})", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            module = _compile(name, folder, flags)
            print(f"minisgl.kernel: compiled in {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)
            return module
        return _import(name, lib)
