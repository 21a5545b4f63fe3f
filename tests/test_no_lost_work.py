"""No write loses work: the sequences that used to lose a module, run in real kernels on a copy
of the repository with a learner's workspace in it (`tools/workbook.py workspace`).

The learner's notebooks (workspace/notebooks/) write their own package, workspace/minisgl/; the
solutions write the repository's minisgl/, so the two never share a file. The workbook's
`%%writefile` (tools/nbtools.py) keeps the version a cell replaces in <tree>/.history/ (not the
reference or the stub, which `reset` restores) and refuses a target outside the notebook's tree.
Every kernel of the workbook's .venv gets it at start-up (tools/bootstrap.sh writes the venv's
IPython kernel config, which runs tools/kernel_startup.py); the first cell of a notebook
(`guard`) registers it too. These tests start their kernels the way JupyterLab does: the venv's
`python3` kernel, in the notebook's folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
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
    repo = copy_checkout(tmp_path / "repo", models=True)
    subprocess.run([sys.executable, "tools/workbook.py", "workspace"], cwd=repo, check=True,
                   capture_output=True, timeout=300)
    return repo


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


def kept(tree: Path, rel: str) -> list[str]:
    """The earlier versions of `rel` kept in <tree>/.history/."""
    return sorted(p.read_text() for p in (tree / ".history" / rel).glob("*"))


def test_the_venv_kernels_get_the_workbooks_writefile():
    assert KERNEL_CONFIG.is_file() and "kernel_startup.py" in KERNEL_CONFIG.read_text(), (
        f"{KERNEL_CONFIG} is missing or old: `make setup` writes it (tools/bootstrap.sh)")


def test_a_solution_cell_never_touches_the_learners_package(repo):
    """No guard cell: a learner opens solutions/01 and runs only the cell of core.py. It writes the
    reference package; the learner's workspace/minisgl/core.py is another file."""
    ws = repo / "workspace"
    mine = (ws / CORE).read_text() + "# my own work\n"
    (ws / CORE).write_text(mine)
    with kernel(repo / "solutions") as run:
        run(writefile_cell(repo, "solutions", CORE))
    assert (ws / CORE).read_text() == mine


def test_each_answer_a_learner_replaces_is_kept_once_in_one_folder(repo):
    """A cell run before the first cell, then again after changing the answer: the first run
    replaces the reference (restorable: nothing kept), each later one keeps what it replaces,
    one calm line each, all in one folder per file."""
    ws = repo / "workspace"
    cell = writefile_cell(repo, "notebooks", CORE)
    with kernel(ws / "notebooks") as learner:
        assert "kept" not in learner(cell)
        outs = [learner(cell + f"\n# attempt {n}") for n in (1, 2, 3)]
        assert "kept" not in learner(cell + "\n# attempt 3")  # the same text again
    assert "kept" not in outs[0]  # the stub it replaced: restorable
    assert all(len([ln for ln in out.splitlines() if "kept" in ln]) == 1 for out in outs[1:]), outs
    assert kept(ws, CORE) == sorted([cell.split("\n", 1)[1] + f"\n# attempt {n}\n"
                                     for n in (1, 2)])


def test_an_editors_edit_then_the_learners_cell_keeps_the_edit(repo):
    ws = repo / "workspace"
    learner_cell = writefile_cell(repo, "notebooks", CORE)
    with kernel(ws / "notebooks") as learner:
        learner(learner_cell)
        edited = (ws / CORE).read_text() + "# edited in an editor\n"
        (ws / CORE).write_text(edited)
        out = learner(learner_cell)
    assert "kept in .history/minisgl/core.py/" in out, out
    assert kept(ws, CORE) == [edited]


def test_other_files_and_targets_outside_the_tree(repo, tmp_path):
    ws = repo / "workspace"
    outside = tmp_path / "outside.txt"
    outside.write_text("not the workbook's")
    (ws / "minisgl" / "link.py").symlink_to(outside)
    with kernel(ws / "notebooks") as run:
        out = run("%%writefile scratch.txt\nhello")
        assert out.startswith("Writing scratch.txt") and (ws / "notebooks" / "scratch.txt").exists()
        for target in ("../minisgl/link.py", str(outside), "../../README.md"):
            with pytest.raises(Exception, match="outside this notebook's tree"):
                run(f"%%writefile {target}\nx = 1")
    assert outside.read_text() == "not the workbook's"
    assert (repo / "README.md").read_text().startswith("# minisgl")


def run_all(repo: Path, chapter: str, edit=None) -> nbformat.NotebookNode:
    """Chapter NN with every exercise filled in (the solution's cells), saved in the learner's
    workspace/notebooks/ and run there cell by cell as JupyterLab's Run All would (every cell, tags ignored); `edit`
    changes the notebook first. Raises CellExecutionError at the first failing cell."""
    nb = nbformat.read(next((repo / "solutions").glob(f"{chapter}_*.ipynb")), as_version=4)
    for cell in nb.cells:
        cell.metadata.pop("tags", None)
    if edit:
        edit(nb)
    path = repo / "workspace" / "notebooks" / f"{chapter}_filled_in.ipynb"
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
    broken file aside (kept in .history/) and Run All completes; the learner's rotary cell then writes
    their code again."""
    rotary = repo / "workspace" / "minisgl" / "layers" / "rotary.py"
    broken = rotary.read_text().replace("def ", "def def ", 1)
    rotary.write_text(broken)
    nb = run_all(repo, "02")
    first = "".join(o.get("text", "") for c in nb.cells[:3] if c.cell_type == "code"
                    for o in c.outputs if o.output_type == "stream")
    assert "minisgl/layers/rotary.py did not import" in first, first
    assert kept(repo / "workspace", "minisgl/layers/rotary.py") == [broken]
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
