"""Every solution notebook runs top to bottom, twice in a row in one kernel.

A learner re-runs cells all the time: rewriting modules, rebuilding the Engine, re-running the
chapter's tests. Running each chapter twice in one kernel proves that works (and replaces a
plain single nbmake run of solutions/). Learner copies are run separately by `make test`
(nbmake, with their %%writefile cells skipped) and in the browser test.

Each notebook runs in a copy of the checkout (tests/helpers.py's copy_checkout), so the modules
its %%writefile cells rewrite are the copy's: the other tests, which `make test` runs at the
same time, read the checkout's minisgl/ and never see a file half written. The chapter's tests
are not run from the notebook's test cell (MINISGL_SKIP_CHAPTER_TESTS=1): pytest runs them
anyway, and run_chapter_tests itself is tested in tests/test_workbook.py.
"""

from __future__ import annotations

import os

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from helpers import ROOT, copy_checkout

SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
CELL_TIMEOUT = 600
pytestmark = pytest.mark.slow  # minutes per notebook: not in the quick tier


@pytest.fixture(scope="module")
def checkout_copy(tmp_path_factory):
    return copy_checkout(tmp_path_factory.mktemp("repo"), models=True)


def _run_twice(path):
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "MINISGL_PACKAGE_TREE")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               MPLBACKEND="agg", MINISGL_SKIP_CHAPTER_TESTS="1",
               PYTHONPATH=str(path.parent.parent))  # the copy's package, not the checkout's
    with client.setup_kernel(env=env):
        for run in (1, 2):
            for index, cell in enumerate(nb.cells):
                if cell.cell_type != "code":
                    continue
                try:
                    client.execute_cell(cell, index)
                except CellExecutionError as e:
                    head = "\n".join(str(e).splitlines()[-12:])
                    raise AssertionError(f"{path.name}, run {run} of 2, cell {index}:\n"
                                         f"{''.join(cell.source)[:300]}\n---\n{head}") from None


@pytest.mark.skipif(not SOLUTIONS, reason="no solution notebooks yet")
@pytest.mark.parametrize("path", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_solution_notebook_runs_twice_in_one_kernel(path, checkout_copy):
    _run_twice(checkout_copy / path.relative_to(ROOT))
