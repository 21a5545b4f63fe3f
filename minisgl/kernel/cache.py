# Chapter 07 (07_stage1_milestone.ipynb): where the compiled kernels are kept, and the build lock.
"""The kernel cache: one private folder per build key, and one builder at a time.

``$MINISGL_KERNEL_CACHE`` or ``~/.cache/minisgl/kernels``, readable by this user only, holds one
folder per *key*: a hash of the sources, the compiler flags, torch's and Python's versions and
the CPU, so that a library is only ever loaded by the setup it was built for. A builder holds an
``flock`` on the folder's ``build.lock``; the operating system releases it when the builder exits
*or is killed*, so an interrupted build leaves nothing to wait for. A live builder is waited for,
up to ``MINISGL_KERNEL_LOCK_TIMEOUT`` seconds (default 300), then the wait ends with a message.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from minisgl.utils.env import read_env

SOURCE = Path(__file__).with_name("csrc.cpp")  # it #includes the headers in csrc/


class KernelBuildError(RuntimeError):
    """The kernels could not be built or loaded; the message says why and what to do."""


def source_bytes() -> bytes:
    """csrc.cpp and every header it may include: what the build key hashes."""
    files = [SOURCE, *sorted(SOURCE.with_name("csrc").glob("*.h"))]
    return b"".join(f.name.encode() + b"\0" + f.read_bytes() for f in files)


def cache_dir() -> Path:
    """``$MINISGL_KERNEL_CACHE``, else ``~/.cache/minisgl/kernels`` (a bad value is refused)."""
    root = read_env("MINISGL_KERNEL_CACHE", Path)
    return root if root is not None else Path.home() / ".cache" / "minisgl" / "kernels"


def lock_timeout() -> float:
    """How long to wait for another builder: ``$MINISGL_KERNEL_LOCK_TIMEOUT`` seconds, finite and
    at most a day (``nan``, ``inf`` or ``-1`` would wait forever or never), default 300."""
    return read_env("MINISGL_KERNEL_LOCK_TIMEOUT", float, 300.0, low=0, high=86400)


def _cpu_id() -> str:
    """The CPU's model and instruction sets: a library built for another CPU is not loaded."""
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(sorted({ln for ln in f if ln.startswith(("model name", "flags",
                                                                    "Features"))}))
    except OSError:
        return platform.platform() + platform.processor()


def build_key(source: bytes, flags: list[str]) -> str:
    parts = [hashlib.sha256(source).hexdigest(), torch.__version__, sys.version, _cpu_id(), *flags]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _private_dir(path: Path) -> Path:
    """Create ``path`` (and its parents) readable by this user only; refuse another user's."""
    if path.exists() and not path.is_dir():
        raise KernelBuildError(f"the kernel cache {path} is a file, not a folder: set "
                               "MINISGL_KERNEL_CACHE to a folder (or move that file away).")
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
    except OSError as e:
        raise KernelBuildError(f"cannot create the kernel cache folder {path} "
                               f"({e.strerror or e}): set MINISGL_KERNEL_CACHE to a folder you "
                               "can write.") from None
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise KernelBuildError(f"the kernel cache {path} belongs to another user: set "
                               "MINISGL_KERNEL_CACHE to a folder of your own.")
    if st.st_mode & 0o077:
        path.chmod(0o700)
    return path


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
                if time.monotonic() - start > timeout:
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
        f.write(f"process {os.getpid()}")  # what a waiting process names
        f.flush()
        try:
            yield
        finally:
            f.truncate(0)
            fcntl.flock(f, fcntl.LOCK_UN)
