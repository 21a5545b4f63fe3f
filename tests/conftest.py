"""Shared pytest set-up: offline hub, the repo root on sys.path, and stub messages.

- Every test runs with ``HF_HUB_OFFLINE=1``: weights come only from ``models/``. The network
  itself is closed by pytest-socket (``--allow-hosts`` in pyproject.toml: loopback only); a test
  it stops gets a note saying why.
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
# The package under test: the repository's minisgl/ (the reference), or the learner's own when a
# notebook of workspace/ runs its chapter's tests (tools/nbtools.py sets MINISGL_PACKAGE_TREE).
sys.path.insert(0, str(ROOT))
from tools.workbook import env_folder  # noqa: E402 - the tools' reader of MINISGL_* variables

PACKAGE_TREE = env_folder("MINISGL_PACKAGE_TREE", "minisgl") or ROOT.resolve()
for p in (str(ROOT), str(TESTS), str(PACKAGE_TREE)):
    if p in sys.path:
        sys.path.remove(p)
    sys.path.insert(0, p)
if PACKAGE_TREE != ROOT:  # subprocesses of the tests (the milestone script...) import it too
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(PACKAGE_TREE), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
os.environ.setdefault("MINISGL_WORKBOOK_TEST", "1")


def _chain(exc: BaseException | None):
    """An exception and its causes / contexts."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _exercise_message(exc: BaseException) -> str | None:
    """The 'Exercise N.M: task' text of a learner's stub, if this failure comes from one."""
    return next((str(e) for e in _chain(exc)
                 if isinstance(e, NotImplementedError) and str(e).startswith("Exercise ")), None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is None or report.passed:
        return
    if any(type(e).__name__ == "SocketConnectBlockedError" for e in _chain(call.excinfo.value)):
        report.sections.append(("why the network is closed", (
            "The tests run offline (pytest-socket allows loopback only): weights come from "
            "models/ (run `make models`), and nothing may download at test time.")))
    msg = _exercise_message(call.excinfo.value)
    if msg:
        exercise, _, task = msg.partition(": ")
        report.longrepr = (
            f"{exercise} is not done yet ({task}).\n"
            f"Fill it in (the notebook's exercise cell), re-run that %%writefile cell, then re-run "
            f"the chapter's tests. The reference is in solutions/."
        )



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
