"""The learner's work is theirs by construction: it lives in workspace/ (git-ignored), which no
tool writes except `workspace` (adds what is missing), `adopt` and `reset` (each keeps what it
replaces in workspace/.history/). The tracked minisgl/ and notebooks/ are generated only, so the
test command never has to refuse, and a learner with work in the earlier layout (their files in
the tracked minisgl/ and notebooks/) moves over without losing any of it.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import ROOT, copy_checkout

sys.path.insert(0, str(ROOT))
from tools import workbook as wb  # noqa: E402

PY = sys.executable
CORE = "minisgl/core.py"
NB01 = "notebooks/01_req_batch_context.ipynb"


def tool(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run([PY, "tools/workbook.py", *args], cwd=repo, capture_output=True,
                         text=True, timeout=300, check=False)
    if check:
        assert res.returncode == 0, res.stdout + res.stderr
    return res


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.email=l@example.com", "-c", "user.name=learner",
                           *args], cwd=repo, capture_output=True, text=True, check=True,
                          timeout=60).stdout


@pytest.fixture
def repo(tmp_path):
    """A checkout of the workbook under git, as a learner's clone is."""
    repo = copy_checkout(tmp_path / "repo", models=True)
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "the workbook")
    return repo


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def cells(data: bytes) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(data)["cells"]]


def test_workspace_holds_the_learner_copies_and_the_reference(repo):
    tool(repo, "workspace")
    ws = repo / "workspace"
    gen = wb.generate(repo)
    for rel, data in gen.files.items():
        have = (ws / rel).read_bytes()
        if rel.endswith(".ipynb"):
            assert cells(have) == cells(data), f"{rel}: the workspace copy's cells differ"
            tags = [c.get("metadata", {}).get("tags", []) for c in json.loads(have)["cells"]]
            assert not any(wb.SKIP_TAG in t for t in tags), (
                f"{rel}: the workspace copy keeps skip-execution, so a headless run would skip "
                "the learner's cells")
        else:
            assert have == data, f"workspace/{rel} is not the reference"
    assert "workspace" not in git(repo, "status", "--porcelain", "--untracked-files=all")


def test_workspace_never_replaces_a_file_and_adds_what_is_missing(repo):
    tool(repo, "workspace")
    ws = repo / "workspace"
    (ws / CORE).write_text("# my core\n")
    (ws / "minisgl" / "kvcache" / "base.py").unlink()
    out = tool(repo, "workspace").stdout
    assert (ws / CORE).read_text() == "# my core\n"
    assert (ws / "minisgl" / "kvcache" / "base.py").read_bytes() == (
        repo / "minisgl" / "kvcache" / "base.py").read_bytes()
    assert "1 files added" in out, out


@pytest.mark.slow  # runs a chapter notebook
def test_no_tool_of_the_test_command_writes_the_workspace(repo):
    """build, check, and a solution notebook run as the tests run it, leave workspace/ alone."""
    tool(repo, "workspace")
    ws = repo / "workspace"
    (ws / CORE).write_text("# my core\n")
    before = snapshot(ws)
    tool(repo, "build")
    tool(repo, "check")
    env = {**os.environ, "MINISGL_WORKBOOK_TEST": "1", "MINISGL_SKIP_CHAPTER_TESTS": "1"}
    env.pop("MINISGL_PACKAGE_TREE", None)
    res = subprocess.run([PY, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
                          "--ExecutePreprocessor.timeout=300",
                          "--output", str(repo.parent / "out.ipynb"),
                          "solutions/01_req_batch_context.ipynb"], cwd=repo, env=env,
                         capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    assert snapshot(ws) == before


def _old_layout_work(repo: Path) -> dict[str, bytes]:
    """Work as the earlier layout held it: a module and a notebook changed in place, a scratch
    notebook and a module of the learner's own, untracked."""
    with open(repo / CORE, "a") as f:
        f.write("\n# my own line\n")
    nb = json.loads((repo / NB01).read_text())
    nb["cells"][3]["source"] = "my notes on chapter 01\n"
    (repo / NB01).write_text(json.dumps(nb, indent=1) + "\n")
    (repo / "notebooks" / "_scratch.ipynb").write_text(json.dumps(
        {"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    (repo / "minisgl" / "mine.py").write_text("# my helper\n")
    return {rel: (repo / rel).read_bytes() for rel in
            (CORE, NB01, "notebooks/_scratch.ipynb", "minisgl/mine.py")}


def _kept(repo: Path, work: dict[str, bytes]) -> None:
    ws = repo / "workspace"
    for rel, data in work.items():
        have = (ws / rel).read_bytes()
        if rel.endswith(".ipynb"):
            assert cells(have) == cells(data), f"{rel}: the learner's cells were not kept"
        else:
            assert have == data, f"{rel}: the learner's module was not kept"


def test_readme_move_over_with_uncommitted_work_keeps_all_of_it(repo):
    """The README's steps for work in the earlier layout: stash it, pull, `make adopt`."""
    readme = (ROOT / "README.md").read_text()
    for step in ("git stash push --include-untracked -- minisgl notebooks", "git pull",
                 "make adopt REF='stash@{0}'"):
        assert step in readme, f"README no longer gives the step `{step}`"
    work = _old_layout_work(repo)
    git(repo, "stash", "push", "--include-untracked", "--", "minisgl", "notebooks")
    assert not (repo / "minisgl" / "mine.py").exists()
    tool(repo, "adopt", "stash@{0}")  # `make adopt` runs this, after `git pull`
    _kept(repo, work)
    assert git(repo, "status", "--porcelain") == "", "adopt changed tracked files"


def test_move_over_from_a_branch_keeps_all_of_it(repo):
    work = _old_layout_work(repo)
    git(repo, "checkout", "-qb", "my-work")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "my work")
    git(repo, "checkout", "-q", "-")
    tool(repo, "adopt", "my-work")
    _kept(repo, work)


def test_work_left_in_the_tracked_files_moves_into_the_workspace(repo):
    """No stash: the first `make lab` (or any make command) finds the work in place, copies it
    into workspace/ and only then regenerates the tracked file."""
    work = _old_layout_work(repo)
    out = tool(repo, "workspace").stdout
    _kept(repo, work)
    assert "your work, moved from minisgl/core.py" in out, out
    assert (repo / CORE).read_bytes() == git(repo, "show", f"HEAD:{CORE}").encode()


def test_adopt_over_existing_work_keeps_the_replaced_version(repo):
    tool(repo, "workspace")
    (repo / "workspace" / CORE).write_text("# what I had in the workspace\n")
    work = _old_layout_work(repo)
    git(repo, "stash", "push", "--include-untracked", "--", "minisgl", "notebooks")
    out = tool(repo, "adopt", "stash@{0}").stdout
    _kept(repo, work)
    kept = list((repo / "workspace" / ".history" / CORE).glob("*.py"))
    assert [p.read_text() for p in kept] == ["# what I had in the workspace\n"], out


def test_reset_keeps_the_learners_modules_and_restores_the_reference(repo):
    tool(repo, "workspace")
    ws = repo / "workspace"
    (ws / CORE).write_text("# attempt 1\n")
    out = tool(repo, "reset", "01").stdout
    assert (ws / CORE).read_bytes() == (repo / CORE).read_bytes()
    [kept] = (ws / ".history" / CORE).glob("*.py")
    assert kept.read_text() == "# attempt 1\n" and str(kept.relative_to(repo)) in out, out
    (ws / NB01).write_text("{}")
    tool(repo, "reset", "01", "--notebook")
    assert cells((ws / NB01).read_bytes()) == cells((repo / NB01).read_bytes())
    assert [p.read_text() for p in (ws / ".history" / NB01).glob("*")] == ["{}"]


@pytest.mark.parametrize("ref", ["no-such-branch", "HEAD~99", "stash@{9}", "-"])
def test_adopt_of_something_that_is_not_there_says_what_to_name(repo, ref):
    res = tool(repo, "adopt", ref, check=False)
    assert res.returncode == 2 and "name a stash" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_the_generated_copy_sends_the_learner_to_their_workspace(repo):
    """Opening notebooks/NN (generated, run by the tests) outside the tests: the first cell says
    where the learner's copy is, and nothing is written."""
    before = snapshot(repo / "minisgl")
    env = {k: v for k, v in os.environ.items() if k != "MINISGL_WORKBOOK_TEST"}
    code = ("import os; os.chdir('notebooks'); import sys; sys.path.insert(0, '..')\n"
            "from tools.nbtools import guard\nguard('01')\n")
    res = subprocess.run([PY, "-c", code], cwd=repo, env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert res.returncode != 0 and f"workspace/{NB01}" in res.stderr, res.stderr[-2000:]
    assert snapshot(repo / "minisgl") == before


HEADLESS = [pytest.param(nb.name, marks=[] if nb.name.startswith("04") else pytest.mark.slow)
            for nb in sorted((ROOT / "notebooks").glob("0[0-6]_*.ipynb"))]


@pytest.mark.parametrize("name", HEADLESS)
def test_a_headless_run_of_a_learner_copy_never_passes_with_stubs(repo, name):
    """nbclient (as nbconvert and papermill use it) runs the workspace copy's %%writefile cells:
    the first stub stops the run with one of this chapter's exercises, never a pass."""
    tool(repo, "workspace")
    env = {k: v for k, v in os.environ.items() if k not in ("MINISGL_WORKBOOK_TEST",
                                                            "MINISGL_PACKAGE_TREE")}
    env["MINISGL_SKIP_CHAPTER_TESTS"] = "1"
    res = subprocess.run([PY, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
                          "--ExecutePreprocessor.timeout=300",
                          "--output", str(repo.parent / "out.ipynb"), name],
                         cwd=repo / "workspace" / "notebooks", env=env, capture_output=True,
                         text=True, timeout=900, check=False)
    assert res.returncode != 0, f"a headless run of {name}, full of stubs, passed"
    assert f"Exercise {int(name[:2])}." in res.stderr, res.stderr[-3000:]
    written = "".join(p.read_text() for p in (repo / "workspace" / "minisgl").rglob("*.py"))
    assert f'NotImplementedError("Exercise {int(name[:2])}.' in written, (
        "the run did not write the learner's cells")


# ----------------------------------------------------------------------------- file errors


def _one_line_error(res: subprocess.CompletedProcess, *words: str) -> None:
    err = res.stderr.strip()
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for word in words:
        assert word in err, err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes read-only files anyway")
def test_read_only_file_is_one_line(repo):
    tool(repo, "workspace")
    target = repo / "workspace" / CORE
    target.chmod(stat.S_IREAD)
    _one_line_error(tool(repo, "reset", "01", check=False), "core.py", "chmod")


def test_folder_in_place_of_a_file_is_one_line(repo):
    tool(repo, "workspace")
    (repo / "workspace" / CORE).unlink()
    (repo / "workspace" / CORE).mkdir()
    _one_line_error(tool(repo, "reset", "01", check=False), "core.py", "folder")


def test_non_utf8_solution_is_one_line(repo):
    (repo / "solutions" / "01_req_batch_context.ipynb").write_bytes(b"\xff\xfe{}")
    res = tool(repo, "check", check=False)
    assert "Traceback" not in res.stderr + res.stdout and res.returncode != 0, res.stderr


def test_corrupt_notebook_is_one_line(repo):
    tool(repo, "workspace")
    (repo / "solutions" / "01_req_batch_context.ipynb").write_text("{not json")
    res = tool(repo, "reset", "01", check=False)
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
    assert "01_req_batch_context.ipynb" in res.stdout + res.stderr, res.stdout + res.stderr


@pytest.mark.parametrize("root", ["missing", "a-file", "empty-folder"])
def test_a_root_that_is_not_a_workbook_is_one_line(tmp_path, root):
    path = tmp_path / root
    if root == "a-file":
        path.write_text("x")
    elif root == "empty-folder":
        path.mkdir()
    res = subprocess.run([PY, str(ROOT / "tools" / "workbook.py"), "--root", str(path), "check"],
                         capture_output=True, text=True, timeout=120, check=False)
    _one_line_error(res, str(path))


# ----------------------------------------------------------------------------- the test command


def test_a_scratch_notebook_is_never_run_by_the_test_command(tmp_path, monkeypatch):
    """A scratch notebook in notebooks/ (`_name.ipynb`) is never run: nbmake would run it."""
    sys.path.insert(0, str(ROOT / "tools"))
    import test_all

    for folder in ("notebooks", "solutions", "tests"):
        (tmp_path / folder).mkdir()
    (tmp_path / "tests" / "test_ch01_x.py").write_text("")
    for name in ("01_a.ipynb", "_scratch.ipynb"):
        (tmp_path / "notebooks" / name).write_text("{}")
        (tmp_path / "solutions" / name).write_text("{}")
    # a learner copy with its solution's code cells (no exercises) is run once, as the solution
    same = json.dumps({"cells": [{"cell_type": "code", "source": ["print(1)"]}]})
    (tmp_path / "notebooks" / "02_b.ipynb").write_text(same)
    (tmp_path / "solutions" / "02_b.ipynb").write_text(same)
    monkeypatch.setattr(test_all, "ROOT", tmp_path)
    assert "notebooks/02_b.ipynb" not in [a for part in test_all.parts() for a in part.cmd]
    for parts in (test_all.parts(), test_all.parts(chapter="01")):
        args = [a for part in parts for a in part.cmd]
        assert "notebooks/01_a.ipynb" in args, args
        assert not [a for a in args if "_scratch" in a or a in ("notebooks", "solutions")], args


def test_the_test_command_runs_every_test_file_once(tmp_path, monkeypatch):
    """`make test` cuts the suite into parts run two at a time: every tests/test_*.py file is in
    exactly one part, or is one of the per-chapter files cut by -k, whose cuts cover it."""
    sys.path.insert(0, str(ROOT / "tools"))
    import test_all

    files = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("test_*.py"))
    cmds = [part.cmd for part in test_all.parts()]
    named = [a for cmd in cmds for a in cmd if a.startswith("tests/")]
    whole = [f for f in files if f not in test_all.PER_CHAPTER and f != "tests/test_wrong_modules.py"]
    assert sorted(f for f in named if f in whole) == whole, (
        "a test file is in no part, or in two: fix GROUPS in tools/test_all.py")
    wrong = [" ".join(c) for c in cmds if "tests/test_wrong_modules.py" in c]
    assert any("not notebook_checks" in w for w in wrong)
    for ch in test_all.CELL_CHAPTERS:
        assert sum(f"notebook_checks and ch{ch}" in w for w in wrong) == 1, ch
    from test_wrong_modules import CELL_CHAPTERS
    assert test_all.CELL_CHAPTERS == CELL_CHAPTERS
    browser = sorted(" ".join(c[c.index("tests/test_browser.py"):]) for c in cmds
                     if "tests/test_browser.py" in c)
    assert browser == ["tests/test_browser.py -k not solution_notebook",
                       "tests/test_browser.py -k solution_notebook"], browser
    sols = sorted(p.stem for p in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
    assert sorted(c[-1] for c in cmds if "tests/test_notebooks.py" in c) == sols


def test_the_test_command_stops_a_part_past_its_limit(tmp_path, monkeypatch, capsys):
    """A part that hangs is stopped at its limit, with what it started, and reported failed;
    the other parts still run and their output is printed whole."""
    sys.path.insert(0, str(ROOT / "tools"))
    import test_all

    monkeypatch.setattr(test_all, "PART_LIMIT_S", 3)
    marker = tmp_path / "child.pid"
    script = ("import os, subprocess, sys, time; "  # the child in a process group of its own
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
              "preexec_fn=os.setpgrp); "
              f"open({str(marker)!r}, 'w').write(str(p.pid)); time.sleep(600)")
    hang = [PY, "-c", script]
    quick = [PY, "-c", "print('part two says hello')"]
    t0 = time.monotonic()
    results = test_all.run_parts([test_all.Part("hangs", hang, 10), test_all.Part("two", quick)],
                                 2, dict(os.environ), tmp_path)
    assert time.monotonic() - t0 < 30
    assert sorted((n, c) for n, c, _ in results) == [("hangs", 124), ("two", 0)]
    out = capsys.readouterr().out
    assert "part two says hello" in out and "ran past its 3 s limit" in out, out
    child = int(marker.read_text())
    for _ in range(50):
        try:  # gone, or a zombie waiting for init to reap it
            if Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the hanging part's child {child} survived")


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="pinning needs an OS that can pin and 2 CPUs")
def test_the_test_command_gives_each_lane_its_own_cpus(tmp_path, capsys):
    """Two parts at a time never share a core (sharing made each 2-4x slower), and each part
    and what it starts sees only its lane's CPUs: torch's default thread count follows."""
    sys.path.insert(0, str(ROOT / "tools"))
    import test_all

    script = ("import os, subprocess, sys, time; time.sleep(1); "
              "print('cpus', sorted(os.sched_getaffinity(0)), subprocess.run([sys.executable, "
              "'-c', 'import os; print(sorted(os.sched_getaffinity(0)))'], capture_output=True, "
              "text=True).stdout.strip())")
    show = [PY, "-c", script]
    results = test_all.run_parts([test_all.Part(f"p{i}", show) for i in range(3)], 2,
                                 dict(os.environ), tmp_path)
    assert [c for _, c, _ in results] == [0, 0, 0]
    seen = [line.split(" ", 1)[1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("cpus ")]
    assert len(seen) == 3
    mine = sorted(os.sched_getaffinity(0))
    sets = []
    for line in seen:
        own, child = line.split("] ")
        own = {int(c) for c in own.strip("[").split(", ")}
        assert child.strip("[]").split(", ") == [str(c) for c in sorted(own)], (
            f"a part's child left its lane: {line}")
        sets.append(own)
    assert sets[0].isdisjoint(sets[1]) and sets[0] | sets[1] == set(mine), (
        f"the two lanes should split this machine's CPUs {mine}: {sets}")
    assert sets[2] in sets[:2], "the third part should take the lane the first one freed"


@pytest.mark.parametrize("args", [["check"], ["build"], ["reset", "04"], ["workspace"]])
def test_tools_under_a_python_without_the_packages_point_at_the_venv(tmp_path, args):
    """The plain `python3` of a fresh machine (`-S`: no site-packages, so no nbformat) gets told
    which Python to use, and nothing is written."""
    repo = copy_checkout(tmp_path / "repo")
    before = snapshot(repo)
    res = subprocess.run([PY, "-S", "tools/workbook.py", *args], cwd=repo,
                         capture_output=True, text=True, check=False, timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == 2, out
    assert f"`.venv/bin/python tools/workbook.py {' '.join(args)}`" in out, out
    assert snapshot(repo) == before


def first_cell(ws: Path, nn: str) -> subprocess.CompletedProcess:
    """A learner's chapter-NN first cell, run in workspace/notebooks/ as its kernel would."""
    code = ("import sys, pathlib; sys.path.insert(0, str(pathlib.Path.cwd().parent))\n"
            f"from tools.nbtools import guard\nguard({nn!r})\n")
    env = {k: v for k, v in os.environ.items() if k != "MINISGL_PACKAGE_TREE"}
    return subprocess.run([PY, "-c", code], cwd=ws / "notebooks", env=env, capture_output=True,
                          text=True, timeout=300, check=False)


def test_the_first_cell_checks_the_earlier_chapters_it_uses(repo):
    """A wrong 4.3 (batch_row_map by batch position) in the learner's package: chapter 05's first
    cell names Exercise 4.3 before any chapter 05 check can blame a correct 5.3."""
    tool(repo, "workspace")
    ws = repo / "workspace"
    table = ws / "minisgl" / "kvcache" / "page_table.py"
    text = table.read_text()
    right = "rows = torch.tensor([r.table_idx for r in reqs], dtype=torch.int64)"
    assert right in text
    table.write_text(text.replace(right, "rows = torch.arange(len(reqs), dtype=torch.int64)"))
    res = first_cell(ws, "05")
    assert res.returncode != 0 and "Exercise 4.3" in res.stderr, res.stderr[-3000:]
    assert "make reset CH=04" in res.stderr, res.stderr[-3000:]
    table.write_text(text)
    res = first_cell(ws, "05")
    assert res.returncode == 0, res.stderr[-3000:]


def test_a_crash_inside_an_earlier_chapters_exercise_is_named(repo):
    """The earlier chapter's quick check does not name the exercise when the learner's code
    raises: the first cell names it from the function the error came from."""
    tool(repo, "workspace")
    ws = repo / "workspace"
    pool = ws / "minisgl" / "kvcache" / "mha_pool.py"
    text = pool.read_text()
    marker = "# BEGIN SOLUTION 4.1"
    at = text.index(marker)
    indent = text[text.rindex("\n", 0, at) + 1:at]
    pool.write_text(text[:at] + "raise KeyError('oops')\n" + indent + text[at:])
    res = first_cell(ws, "05")
    assert res.returncode != 0 and "Exercise 4.1" in res.stderr, res.stderr[-3000:]
