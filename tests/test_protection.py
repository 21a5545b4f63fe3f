"""A learner's work is never lost: `make test` refuses to run over local changes.

(`build` never overwriting an edited notebook, `reset` and the guard cell backing modules up are
proved in tests/test_workbook.py on throwaway trees.)
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from helpers import ROOT


def _copy_checkout(dst):
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.splitlines()
    for rel in files:
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    return dst


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize("edited", ["minisgl/core.py", "notebooks/01_req_batch_context.ipynb"])
def test_make_test_stops_before_touching_anything_when_you_have_local_work(tmp_path, edited):
    repo = _copy_checkout(tmp_path / "repo")
    if not (repo / edited).exists():
        pytest.skip(f"{edited} does not exist yet")
    with open(repo / edited, "a") as f:
        f.write("\n# my own line\n" if edited.endswith(".py") else " ")
    res = subprocess.run(["make", "test", f"PYTHON={sys.executable}"], cwd=repo,
                         capture_output=True, text=True, timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode != 0, f"make test ran over local work:\n{out[-2000:]}"
    assert edited in out and "git stash" in out, out[-2000:]
    assert not (repo / ".venv").exists(), "make test started setting up before refusing"
    assert (repo / edited).read_text().endswith(("# my own line\n", " ")), "the work was touched"


def test_status_reads_the_manifest_and_needs_no_packages(tmp_path):
    """Before set-up (no nbformat yet) `make test` still recognises the learner's work: `status`
    compares hashes with the manifest and runs without site-packages (`python -S`)."""
    repo = _copy_checkout(tmp_path / "repo")

    def status():
        res = subprocess.run([sys.executable, "-S", "tools/workbook.py", "status"], cwd=repo,
                             capture_output=True, text=True, check=False)
        return res.returncode, res.stdout + res.stderr

    assert status() == (0, "status: clean\n"), "a clean checkout shows no work"
    with open(repo / "minisgl" / "core.py", "a") as f:
        f.write("# mine\n")
    (repo / "notebooks" / "_scratch.ipynb").write_text("{}")  # ignored: starts with _
    (repo / "minisgl" / "extra.py").write_text("# my own module\n")
    code, out = status()
    assert code == 1 and "  minisgl/core.py\n  minisgl/extra.py\nTo proceed" in out, out
