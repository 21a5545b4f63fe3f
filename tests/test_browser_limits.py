"""The browser test's time limit and its failure message, without a browser.

tests/test_browser.py stretches its per-notebook limit by the machine's load, and when a notebook
still runs out of time it says what the kernel was doing. Here stand-in "kernels" (plain Python
processes) compute, sleep, or wait for a file lock another process holds, and the message must
tell the three apart.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import test_browser as tb

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")

HOLD_LOCK = """
import fcntl, sys, time
f = open(sys.argv[1], "a+")
fcntl.flock(f, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(120)
"""
# what minisgl/kernel/build.py does while another process builds: poll a non-blocking flock
POLL_LOCK = """
import fcntl, sys, time
f = open(sys.argv[1], "a+")
print("waiting", flush=True)
while True:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        break
    except BlockingIOError:
        time.sleep(0.5)
"""
SPIN = "print('spinning', flush=True)\nwhile True:\n    pass\n"
SLEEP = "import time\nprint('sleeping', flush=True)\ntime.sleep(120)\n"


class FakeLab:
    def __init__(self, pid: int):
        self.pid = pid

    def kernels(self) -> dict[int, list[str]]:
        return {self.pid: ["python", "-m", "ipykernel_launcher"]}


@pytest.fixture
def spawn():
    procs = []

    def start(code: str, *args: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                                text=True)
        procs.append(proc)
        proc.stdout.readline()  # started (and holding the lock, for HOLD_LOCK)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_the_limit_stretches_with_the_load_within_bounds(monkeypatch):
    monkeypatch.setattr(tb.os, "getloadavg", lambda: (1.0, 0.0, 0.0))
    monkeypatch.setattr(tb.os, "cpu_count", lambda: 2)
    assert tb.load_stretch() == 1.0
    monkeypatch.setattr(tb.os, "getloadavg", lambda: (5.0, 0.0, 0.0))
    assert tb.load_stretch() == 2.5
    monkeypatch.setattr(tb.os, "getloadavg", lambda: (50.0, 0.0, 0.0))
    assert tb.load_stretch() == tb.MAX_STRETCH


def test_a_computing_kernel_is_called_computing(spawn):
    kernel = spawn(SPIN)
    time.sleep(0.5)
    text = tb.kernel_activity(FakeLab(kernel.pid), "busy", sample_s=2.0)
    assert "was computing" in text and "not stuck" in text, text


def test_a_kernel_waiting_for_a_lock_names_the_lock_and_its_holder(spawn, tmp_path):
    lock = tmp_path / "build.lock"
    holder = spawn(HOLD_LOCK, str(lock))
    kernel = spawn(POLL_LOCK, str(lock))
    text = tb.kernel_activity(FakeLab(kernel.pid), "busy", sample_s=2.0)
    assert "was waiting" in text and "for a lock" in text, text
    assert str(lock) in text and f"locked by process {holder.pid}" in text, text


def test_a_sleeping_kernel_is_waiting_but_not_for_a_lock(spawn):
    kernel = spawn(SLEEP)
    text = tb.kernel_activity(FakeLab(kernel.pid), "busy", sample_s=1.0)
    assert "was waiting" in text and "other than a file lock" in text, text


def test_an_idle_kernel_is_called_idle(spawn):
    kernel = spawn(SLEEP)
    text = tb.kernel_activity(FakeLab(kernel.pid), "idle", sample_s=0.5)
    assert "was idle" in text, text
