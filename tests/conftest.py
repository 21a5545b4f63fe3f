"""Shared pytest set-up: offline hub, the repo root on sys.path, and stub messages.

- Every test runs with ``HF_HUB_OFFLINE=1``: weights come only from ``models/``.
- A learner's unfinished exercise raises ``NotImplementedError("Exercise N.M: task")``; such a
  failure is reported as one clear line naming the exercise instead of a long traceback.
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = pathlib.Path(__file__).resolve().parent.parent
TESTS = pathlib.Path(__file__).resolve().parent
for p in (str(ROOT), str(TESTS)):
    if p not in sys.path:
        sys.path.insert(0, p)


def _exercise_message(exc: BaseException) -> str | None:
    """The 'Exercise N.M: task' text of a learner's stub, if this failure comes from one."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, NotImplementedError) and str(exc).startswith("Exercise "):
            return str(exc)
        exc = exc.__cause__ or exc.__context__
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is None or report.passed:
        return
    msg = _exercise_message(call.excinfo.value)
    if msg:
        exercise, _, task = msg.partition(": ")
        report.longrepr = (
            f"{exercise} is not done yet ({task}).\n"
            f"Fill it in (the notebook's exercise cell), re-run that %%writefile cell, then re-run "
            f"the chapter's tests. The reference is in solutions/."
        )



# ----------------------------------------------------------------------------- no network
_LOOPBACK = ("127.", "::1", "localhost")


def _guarded_connect(original):
    def connect(self, address):
        host = address[0] if isinstance(address, tuple) else address
        if isinstance(host, str) and (host.startswith(_LOOPBACK) or host.startswith("/")):
            return original(self, address)
        if not isinstance(address, tuple):  # unix sockets and the like
            return original(self, address)
        raise RuntimeError(f"a test tried to reach the network ({address!r}); the workbook runs "
                           "offline: weights come from models/ (run `make models`)")

    return connect


@pytest.fixture(autouse=True, scope="session")
def _no_network():
    """Fail any test that opens a connection to a non-loopback address (e.g. a hub download)."""
    import socket

    original = socket.socket.connect
    socket.socket.connect = _guarded_connect(original)
    yield
    socket.socket.connect = original


@pytest.fixture
def clean_globals():
    """minisgl's process-wide state reset before and after a test: the global Context, the tp
    info and the communicator's plugin stack (modules using it: ``pytestmark =
    pytest.mark.usefixtures("clean_globals")``)."""
    from minisgl.core import reset_global_ctx
    from minisgl.distributed import DistributedCommunicator, reset_tp_info

    reset_tp_info()
    reset_global_ctx()
    plugins = DistributedCommunicator.plugins
    yield
    reset_tp_info()
    reset_global_ctx()
    DistributedCommunicator.plugins = plugins
