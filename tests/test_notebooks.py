"""Every solution notebook runs top to bottom, twice in a row in one kernel.

A learner re-runs cells all the time: rewriting modules, rebuilding the Engine, re-running the
chapter's tests. Running each chapter twice in one kernel proves that works (and replaces a
plain single nbmake run of solutions/). Learner copies are run separately by `make test`
(nbmake, with their %%writefile cells skipped) and in the browser test.
"""

from __future__ import annotations

import os

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from helpers import ROOT

SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
CELL_TIMEOUT = 600
pytestmark = pytest.mark.slow  # minutes per notebook: not in the quick tier


def _run_twice(path):
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", MPLBACKEND="agg")
    n_cells = len(nb.cells)
    with client.setup_kernel(env=env):
        for run in (1, 2):
            if run == 2:  # the test cell ran for real in run 1; pytest runs the tests anyway
                nb.cells.append(nbformat.v4.new_code_cell(
                    "import os; os.environ['MINISGL_SKIP_CHAPTER_TESTS'] = '1'"))
                client.execute_cell(nb.cells[-1], len(nb.cells) - 1)
            for index, cell in enumerate(nb.cells[:n_cells]):
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
def test_solution_notebook_runs_twice_in_one_kernel(path):
    _run_twice(path)
