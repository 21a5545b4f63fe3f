"""A learner's work is never lost: `make test` refuses to run over local changes, and the advice
it gives works in each situation the work can be in.

(`build` never overwriting an edited notebook, `reset` and the guard cell backing modules up are
proved in tests/test_workbook.py on throwaway trees.)
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from helpers import ROOT, copy_checkout


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize("edited", ["minisgl/core.py", "notebooks/01_req_batch_context.ipynb"])
def test_make_test_stops_before_touching_anything_when_you_have_local_work(tmp_path, edited):
    repo = copy_checkout(tmp_path / "repo")
    if not (repo / edited).exists():
        pytest.skip(f"{edited} does not exist yet")
    with open(repo / edited, "a") as f:
        f.write("\n# my own line\n" if edited.endswith(".py") else " ")
    res = subprocess.run(["make", "test", f"PYTHON={sys.executable}"], cwd=repo,
                         capture_output=True, text=True, timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode != 0, f"make test ran over local work:\n{out[-2000:]}"
    assert edited in out and "make reset CH=01" in out, out[-2000:]
    assert not (repo / ".venv").exists(), "make test started setting up before refusing"
    assert (repo / edited).read_text().endswith(("# my own line\n", " ")), "the work was touched"


def test_status_reads_the_manifest_and_needs_no_packages(tmp_path):
    """Before set-up (no nbformat yet) `make test` still recognises the learner's work: `status`
    compares hashes with the manifest and runs without site-packages (`python -S`)."""
    repo = copy_checkout(tmp_path / "repo")

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
    assert code == 1 and "  minisgl/core.py\n  minisgl/extra.py\n`make test`" in out, out


# ----------------------------------------------------------------------------- the advice works


def _git(repo, *args):
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True,
                          timeout=60).stdout


def _status(repo):
    res = subprocess.run([sys.executable, "tools/workbook.py", "status"], cwd=repo,
                         capture_output=True, text=True, check=False, timeout=120)
    return res.returncode, res.stdout + res.stderr


def _advised(out, section):
    """The commands of one section of status's advice ("stash", "committed" or "aside")."""
    starts = {"stash": "  keep your uncommitted work", "committed": "  your committed files",
              "aside": ("  or set it all aside", "  set it aside")}[section]
    lines, inside = [], False
    for line in out.splitlines():
        if line.startswith("  ") and not line.startswith("      "):
            inside = line.startswith(starts)
        elif inside and line.startswith("      "):
            lines.append(line.strip().split("      #")[0].strip())
    assert lines, f"status gave no '{section}' advice:\n{out}"
    return lines


def _follow(repo, commands):
    for cmd in commands:
        if cmd.startswith("make reset"):  # the real make, without setting up a second .venv
            cmd = cmd.replace("make ", f"make -o .venv/.installed VPY={sys.executable} ", 1)
        res = subprocess.run(cmd, shell=True, cwd=repo, capture_output=True, text=True,
                             timeout=300, check=False)
        assert res.returncode == 0, f"the advised `{cmd}` failed:\n{res.stdout}{res.stderr}"


@pytest.fixture
def git_repo(tmp_path):
    if shutil.which("git") is None or shutil.which("make") is None:
        pytest.skip("git and make are needed")
    repo = copy_checkout(tmp_path / "repo")
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "workbook")
    return repo


NOTEBOOK = "notebooks/01_req_batch_context.ipynb"


@pytest.mark.parametrize("situation", ["module edited", "untracked notebook", "notebook only",
                                       "committed on main"])
def test_the_advice_of_a_refused_make_test_works(git_repo, situation):
    repo = git_repo
    if situation == "module edited":
        path, mine = repo / "minisgl" / "core.py", (repo / "minisgl" / "core.py").read_text() + "# mine\n"
    elif situation == "untracked notebook":
        path, mine = repo / "notebooks" / "my_notes.ipynb", "{}"
    else:
        path, mine = repo / NOTEBOOK, (repo / NOTEBOOK).read_text() + " "
        if situation == "committed on main":
            path, mine = repo / "minisgl" / "core.py", (repo / "minisgl" / "core.py").read_text() + "# mine\n"
    path.write_text(mine)
    if situation == "committed on main":
        _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "my work")
    code, out = _status(repo)
    assert code == 1, out
    sections = {"module edited": ["stash", "aside"], "untracked notebook": ["stash", "aside"],
                "notebook only": ["stash", "aside"], "committed on main": ["committed"]}
    for section in sections[situation]:
        work = repo.parent / f"work-{section}"
        shutil.copytree(repo, work, symlinks=True)
        _follow(work, _advised(out, section))
        assert _status(work) == (0, "status: clean\n"), f"after the {section} advice:\n{_status(work)[1]}"
        kept = [work / path.relative_to(repo)]  # where the work is now: stash, backup, history
        if section == "stash":
            _git(work, "stash", "pop", "-q")
        elif section == "committed":
            _git(work, "restore", "minisgl", "notebooks")
        else:
            kept = [*(work / ".workbook-backup").glob(f"*/{path.relative_to(repo)}"),
                    *(work.parent / "my-minisgl-work").glob(path.name)]
        assert any(p.is_file() and p.read_text() == mine for p in kept), (
            f"{situation}, {section}: the work is not where the advice said it would be")


def test_a_scratch_notebook_is_never_run_by_the_test_command(tmp_path, monkeypatch):
    """`check` recommends `notebooks/_name.ipynb` for scratch work and `status` ignores it: the
    test command must not run it (nbmake would, and its cells would rewrite minisgl/)."""
    sys.path.insert(0, str(ROOT / "tools"))
    import test_all

    (tmp_path / "notebooks").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_ch01_x.py").write_text("")
    for name in ("01_a.ipynb", "_scratch.ipynb"):
        (tmp_path / "notebooks" / name).write_text("{}")
    monkeypatch.setattr(test_all, "ROOT", tmp_path)
    for steps in (test_all.steps(), test_all.steps(chapter="01")):
        args = [a for _, cmd in steps for a in cmd]
        assert "notebooks/01_a.ipynb" in args, args
        assert not [a for a in args if "_scratch" in a or a == "notebooks"], args


def test_pytest_says_where_backups_went(tmp_path):
    repo = copy_checkout(tmp_path / "repo")
    (repo / "tests" / "test_zz_backup.py").write_text(
        "import pathlib, sys\n"
        "sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))\n"
        "from tools import workbook as wb\n"
        "def test_backs_up():\n"
        "    wb.backup(wb.ROOT, ['minisgl/core.py'])\n")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/test_zz_backup.py"], cwd=repo, capture_output=True, text=True,
                         timeout=300, check=False, env={**__import__("os").environ,
                                                        "PYTHONPATH": str(repo)})
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "your work was backed up" in out and "minisgl/core.py  ->  .workbook-backup/" in out, out


@pytest.mark.parametrize("args, make", [(["check"], "make check"), (["build"], "make workbook"),
                                        (["reset", "04"], "make reset CH=04"),
                                        (["reset", "4", "--notebook"], "make reset CH=4 NB=1")])
def test_tools_under_a_python_without_the_packages_point_at_the_venv(tmp_path, args, make):
    """The plain `python3` of a fresh machine (`-S`: no site-packages, so no nbformat) gets told
    which Python to use, never "chapters that exist: none" or "delete these notebooks"."""
    repo = copy_checkout(tmp_path / "repo")
    before = {p: p.read_bytes() for p in (repo / "minisgl").rglob("*.py")}
    res = subprocess.run([sys.executable, "-S", "tools/workbook.py", *args], cwd=repo,
                         capture_output=True, text=True, check=False, timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert f"`.venv/bin/python tools/workbook.py {' '.join(args)}`" in out and f"`{make}`" in out, out
    assert "chapters that exist" not in out and "delete" not in out, out
    assert before == {p: p.read_bytes() for p in (repo / "minisgl").rglob("*.py")}
