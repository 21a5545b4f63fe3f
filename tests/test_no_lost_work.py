"""No write into minisgl/ loses work: the sequences that used to lose a module, run in real
kernels on a copy of the repository.

The workbook's `%%writefile` (tools/nbtools.py) backs up a file under minisgl/ before replacing
it, unless the file holds the same text, the reference, the exercise stub, or what this kernel
wrote there last. Every kernel of the workbook's .venv gets it at start-up (tools/bootstrap.sh
writes the venv's IPython kernel config, which runs tools/kernel_startup.py); the first cell of a
notebook (`guard`) registers it too. These tests start their kernels the way JupyterLab does: the
venv's `python3` kernel, in solutions/ or notebooks/ of the copy.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from helpers import copy_checkout

pytestmark = pytest.mark.slow  # kernels and a chapter's Run All: not in the quick tier
KERNEL_CONFIG = Path(sys.prefix) / "etc" / "ipython" / "ipython_kernel_config.py"
CORE = "minisgl/core.py"
# the copy's tools and minisgl, not this checkout's; no chapter tests inside the notebooks
KERNEL_ENV = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
              "MPLBACKEND": "agg", "MINISGL_SKIP_CHAPTER_TESTS": "1"}


@pytest.fixture
def repo(tmp_path) -> Path:
    return copy_checkout(tmp_path / "repo", models=True)


@contextlib.contextmanager
def kernel(cwd: Path):
    """A kernel of this venv started in `cwd`; yields run(source) -> its printed text."""
    nb = nbformat.v4.new_notebook()
    client = NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(cwd)}})
    with client.setup_kernel(env=KERNEL_ENV):
        def run(source: str) -> str:
            cell = nbformat.v4.new_code_cell(source)
            nb.cells.append(cell)
            client.execute_cell(cell, len(nb.cells) - 1)
            return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
        yield run


def writefile_cell(repo: Path, folder: str, rel: str) -> str:
    """The %%writefile cell of `rel` in the chapter-01 notebook of solutions/ or notebooks/."""
    nb = json.loads(next((repo / folder).glob("01_*.ipynb")).read_text())
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if src.startswith(f"%%writefile ../{rel}\n"):
            return src
    raise AssertionError(f"no %%writefile cell for {rel} in {folder}/01_*.ipynb")


def backups(repo: Path, rel: str) -> list[str]:
    return sorted(p.read_text() for p in (repo / ".workbook-backup").glob(f"*/{rel}"))


def test_the_venv_kernels_get_the_workbooks_writefile():
    assert KERNEL_CONFIG.is_file() and "kernel_startup.py" in KERNEL_CONFIG.read_text(), (
        f"{KERNEL_CONFIG} is missing or old: `make setup` writes it (tools/bootstrap.sh)")


def test_a_solution_cell_run_alone_backs_up_the_learners_module(repo):
    """No guard cell: a learner opens solutions/01 and runs only the cell of core.py."""
    mine = (repo / CORE).read_text() + "# my own work\n"
    (repo / CORE).write_text(mine)
    with kernel(repo / "solutions") as run:
        out = run(writefile_cell(repo, "solutions", CORE))
    assert "saved it to .workbook-backup/" in out, out
    assert backups(repo, CORE) == [mine]
    assert (repo / CORE).read_text() != mine  # the reference replaced it, a copy was kept


def test_guard_then_learner_write_then_solution_rerun_keeps_the_learners_version(repo):
    learner_cell = writefile_cell(repo, "notebooks", CORE) + "\n# my own work"
    with kernel(repo / "solutions") as solution:
        solution('import sys, pathlib; sys.path.insert(0, str(pathlib.Path.cwd().parent))\n'
                 'from tools.nbtools import guard\nguard("01")')
        reference_cell = writefile_cell(repo, "solutions", CORE)
        assert "saved it" not in solution(reference_cell)  # the reference over the reference
        with kernel(repo / "notebooks") as learner:
            assert "saved it" not in learner(learner_cell)  # the learner's over the reference
        mine = (repo / CORE).read_text()
        assert mine.endswith("# my own work\n")
        out = solution(reference_cell)  # the solution's cell again, in its own kernel
    assert "saved it to .workbook-backup/" in out, out
    assert backups(repo, CORE) == [mine]


def test_an_editors_edit_then_the_learners_cell_keeps_the_edit(repo):
    learner_cell = writefile_cell(repo, "notebooks", CORE)
    with kernel(repo / "notebooks") as learner:
        assert "saved it" not in learner(learner_cell)  # stub over the reference: nothing to keep
        assert "saved it" not in learner(learner_cell)  # its own earlier write: nothing to keep
        edited = (repo / CORE).read_text() + "# edited in an editor\n"
        (repo / CORE).write_text(edited)
        out = learner(learner_cell)
    assert "saved it to .workbook-backup/" in out, out
    assert backups(repo, CORE) == [edited]


def test_other_files_get_ipythons_writefile(repo):
    with kernel(repo / "notebooks") as run:
        out = run("%%writefile scratch.txt\nhello")
    assert out.startswith("Writing scratch.txt") and (repo / "notebooks" / "scratch.txt").exists()
    assert not (repo / ".workbook-backup").exists()


def run_all(repo: Path, chapter: str, edit=None) -> nbformat.NotebookNode:
    """Chapter NN with every exercise filled in (the solution's cells), saved in notebooks/ and
    run there cell by cell as JupyterLab's Run All would (every cell, tags ignored); `edit`
    changes the notebook first. Raises CellExecutionError at the first failing cell."""
    nb = nbformat.read(next((repo / "solutions").glob(f"{chapter}_*.ipynb")), as_version=4)
    for cell in nb.cells:
        cell.metadata.pop("tags", None)
    if edit:
        edit(nb)
    path = repo / "notebooks" / f"{chapter}_filled_in.ipynb"
    nbformat.write(nb, path)
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    with client.setup_kernel(env=KERNEL_ENV):
        for index, cell in enumerate(nb.cells):
            if cell.cell_type == "code":
                client.execute_cell(cell, index)
    return nb


def test_run_all_gets_past_a_module_an_earlier_run_broke(repo):
    """Chapter 02 while an earlier run left layers/rotary.py with a syntax error: the check cells
    before the rotary cell import minisgl.layers, which imports rotary. The first cell sets the
    broken file aside (backed up) and Run All completes; the learner's rotary cell then writes
    their code again."""
    rotary = repo / "minisgl" / "layers" / "rotary.py"
    broken = rotary.read_text().replace("def ", "def def ", 1)
    rotary.write_text(broken)
    nb = run_all(repo, "02")
    first = "".join(o.get("text", "") for c in nb.cells[:3] if c.cell_type == "code"
                    for o in c.outputs if o.output_type == "stream")
    assert "minisgl/layers/rotary.py did not import" in first, first
    assert backups(repo, "minisgl/layers/rotary.py") == [broken]
    assert "def def" not in rotary.read_text()


def test_run_all_completes_with_the_optional_exercise_left_as_its_stub(repo):
    """Chapter 05 with every exercise filled in except the optional 5.4, left as the learner
    copy has it: its checks skip with a message and Run All completes."""
    learner = json.loads(next((repo / "notebooks").glob("05_*.ipynb")).read_text())
    stubs = {"".join(c["source"]).split("\n", 1)[0]: "".join(c["source"])
             for c in learner["cells"] if "Exercise 5.4" in "".join(c["source"])
             and "".join(c["source"]).startswith("%%writefile")}
    assert stubs, "no %%writefile cell of the learner's chapter 05 holds the stub of Exercise 5.4"

    def leave_54_as_stub(nb):
        for cell in nb.cells:
            first = cell.source.split("\n", 1)[0]
            if cell.cell_type == "code" and first in stubs:
                cell.source = stubs[first]

    nb = run_all(repo, "05", leave_54_as_stub)
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                      for o in c.outputs if o.output_type == "stream")
    assert "skip" in printed.lower() and "5.4" in printed, printed[-3000:]
