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
for p in (str(ROOT), str(TESTS)):
    if p not in sys.path:
        sys.path.insert(0, p)


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



# Every tool that backs a file up says where it went: notebooks run by the tests write minisgl/
# with the workbook's %%writefile, which copies a module holding the learner's work to
# .workbook-backup/ first; this lists, at the end of the run, what was saved during it.
BACKUPS = ROOT / ".workbook-backup"
_backups_before: set[str] = set()


def pytest_sessionstart(session):
    _backups_before.update(p.name for p in BACKUPS.glob("*") if p.is_dir())


def pytest_terminal_summary(terminalreporter):
    new = sorted(p for p in BACKUPS.glob("*") if p.is_dir() and p.name not in _backups_before)
    if not new:
        return
    terminalreporter.section("your work was backed up")
    for folder in new:
        for f in sorted(q for q in folder.rglob("*") if q.is_file()):
            terminalreporter.write_line(f"  {f.relative_to(folder).as_posix()}  ->  "
                                        f"{f.relative_to(ROOT).as_posix()}")
    terminalreporter.write_line("These files held work of your own that a notebook run by the "
                                "tests replaced; copy back what you want to keep.")


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
