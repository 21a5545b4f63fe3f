"""Helpers the workbook notebooks import (see tools/workbook.py for the workbook's layout).

First cell of every chapter notebook (the same in solutions/, notebooks/ and workspace/notebooks/;
`tools` is importable from the workbook's .venv wherever the notebook is):

    import sys, pathlib; sys.path.insert(0, str(pathlib.Path.cwd().parent))
    from tools.nbtools import guard, reload_minisgl, run_chapter_tests
    guard("04")

and its last code cell runs `run_chapter_tests("04")`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from . import workbook as wb


def repo_root() -> Path:
    """The repository root (the folder holding tools/)."""
    return wb.ROOT


# ----------------------------------------------------------------------------- %%writefile
#
# The notebooks write the package with `%%writefile ../minisgl/...` cells. A notebook writes into
# its own tree, the parent of its folder: the learner's copies in workspace/notebooks/ write
# workspace/minisgl/ (the learner's own package, git-ignored), the complete chapters in
# solutions/ write the tracked minisgl/ (the reference). The workbook's %%writefile (registered
# by `guard`, the first cell, and by every kernel of the workbook's .venv: tools/kernel_startup.py)
# adds two things to IPython's:
# - it keeps the version a cell replaces in <tree>/.history/<path>/ (one calm line says so), so
#   every earlier version of a module is still there, grouped by file (the reference and the
#   stub are not copied: `make reset` restores them);
# - `%%writefile -a` with a part marker (`# --- part N: title ---`) replaces part N of a module
#   written by several cells, so any one cell can be re-run alone.
# It refuses a target outside the notebook's tree (a symbolic link included): nothing a cell
# writes can land in the tracked files of the repository from a learner's notebook.


def notebook_tree(cwd: Path | None = None) -> Path:
    """The tree a notebook's cells write into: the parent of the notebook's folder."""
    return (Path(cwd) if cwd else Path.cwd()).resolve().parent


def new_text(old: str | None, text: str, append: bool) -> str:
    """What a module holds after a `%%writefile` (`append`: `-a`) of `text` over `old`.

    Part 1 (a plain `%%writefile`) keeps the parts after it; part N replaces part N."""
    if append:
        marker = wb.PART.match(text.partition("\n")[0])
        if not marker:
            return (old or "") + text  # IPython's -a
        head, parts = wb.split_parts(old or "")
        parts[int(marker[1])] = text
        return wb.join_parts(head, parts)
    if old and not wb.split_parts(text)[1]:
        return wb.join_parts(text, wb.split_parts(old)[1])
    return text


@functools.lru_cache(maxsize=1)
def _generated_hashes(root: Path) -> frozenset[str]:
    """sha256 of every module text the chapters generate (reference and stub, whole modules and
    each part): a file holding one of these loses nothing when replaced (`reset` restores it)."""
    found = set()
    for nn in wb.solution_notebooks(root)[0]:
        for pair in wb.chapter_versions(root, nn).values():
            for text in pair:
                head, parts = wb.split_parts(text)
                found |= {wb.sha256(t.encode("utf-8")) for t in (text, head, *parts.values())}
    return frozenset(found)


def write_module(path: Path, text: str, *, append: bool = False, tree: Path | None = None,
                 root: Path | None = None) -> Path | None:
    """Write a cell's text to `path` (inside `tree`), keeping the version it replaces in
    <tree>/.history/. Returns the kept copy's path, or None (nothing new to keep)."""
    tree = (Path(tree) if tree else notebook_tree()).resolve()
    target = Path(os.path.abspath(path)).resolve()  # through any symbolic link
    if not target.is_relative_to(tree):
        raise wb.WorkbookError(
            f"%%writefile {path}: that file ({target}) is outside this notebook's tree ({tree}); "
            "a notebook's cells write only inside it. Write to a path under "
            f"{tree.name}/ instead.")
    if target.is_dir():
        raise wb.WorkbookError(f"%%writefile {path}: {target} is a folder; give a file name")
    old = wb.read_text(target) if target.exists() else None
    data = new_text(old, text, append)
    keep = old not in (None, data) and wb.sha256(old.encode("utf-8")) not in _generated_hashes(
        Path(root) if root else repo_root())
    kept = wb.keep_history(tree, target, old) if keep else None
    wb.write_text(target, data)
    return kept


def _writefile(line: str, cell: str):
    """The workbook's `%%writefile`: IPython's, keeping what it replaces and writing parts."""
    try:
        args = shlex.split(line)
    except ValueError as exc:
        print(f"%%writefile {line}: {exc}")
        return
    paths = [a for a in args if not a.startswith("-")]
    flags = set(args) - set(paths)
    if len(paths) != 1 or flags - {"-a", "--append"}:
        print(f"%%writefile {line}: give one file name, optionally after -a")
        return
    target = Path(os.path.expanduser(paths[0]))
    exists = target.exists()
    try:
        kept = write_module(target, cell if cell.endswith("\n") or not cell else cell + "\n",
                            append=bool(flags))
    except wb.WorkbookError as exc:
        from IPython.core.error import UsageError

        raise UsageError(str(exc)) from None
    print(("Appending to " if flags else "Overwriting " if exists else "Writing ") + paths[0])
    if kept is not None:
        print(f"(the version it replaced is kept in {kept.relative_to(notebook_tree())})")


def register_writefile() -> bool:
    """Make `%%writefile` in this IPython kernel the workbook's (idempotent); False outside
    IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    if shell is None:
        return False
    shell.register_magic_function(_writefile, magic_kind="cell", magic_name="writefile")
    return True


# ----------------------------------------------------------------------------- the first cell


def _module_name(rel: str) -> str:
    return rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _first_broken(root: Path, rels: list[str]) -> tuple[str | None, str]:
    """The first of `rels` (or a module they import) that does not import, with its error."""
    import traceback

    package = (root / "minisgl").resolve()
    for rel in rels:
        try:
            compile((root / rel).read_text(encoding="utf-8"), str(root / rel), "exec")
        except (SyntaxError, ValueError, UnicodeDecodeError) as exc:
            return rel, f"{type(exc).__name__}: {exc}"
    reload_minisgl()
    spec = importlib.util.find_spec("minisgl")
    if spec is None or not spec.origin or not Path(spec.origin).resolve().is_relative_to(package):
        return None, ""  # `import minisgl` would not read this tree: only the syntax is checked
    try:
        for rel in rels:
            try:
                importlib.import_module(_module_name(rel))
            except Exception as exc:  # noqa: BLE001 - whatever a broken module raises
                frames = [Path(f.filename).resolve() for f in traceback.extract_tb(exc.__traceback__)]
                if isinstance(exc, SyntaxError) and exc.filename:
                    frames.append(Path(exc.filename).resolve())
                inside = [f for f in frames if f.is_relative_to(package)]
                culprit = inside[-1].relative_to(root.resolve()).as_posix() if inside else rel
                return culprit, f"{type(exc).__name__}: {exc}"
    finally:
        reload_minisgl()
    return None, ""


def _set_aside_broken(tree: Path, versions: dict[str, str], root: Path) -> None:
    """A module of this chapter that an earlier run left unimportable would stop Run All at the
    first check cell that imports its package, before the cell that rewrites it. Put this
    notebook's own version (the stub, or the reference) in its place, keeping the broken one in
    .history/; the notebook's cell for it writes the learner's code again when Run All reaches
    it."""
    rels = [rel for rel in versions if rel.endswith(".py") and (tree / rel).is_file()]
    for _ in range(len(rels) + 1):
        culprit, error = _first_broken(tree, rels)
        if culprit is None:
            return
        if culprit not in versions:
            print(f"guard: {culprit} does not import ({error}). This chapter does not write it: "
                  "fix it in the chapter that does, or restore the reference with `make reset "
                  "CH=NN` (it keeps yours in .history/ first).")
            return
        kept = write_module(tree / culprit, versions[culprit], tree=tree, root=root)
        print(f"guard: {culprit} did not import ({error}); this notebook's version of it is in "
              f"its place until your cell for it runs (yours is kept in "
              f"{kept.relative_to(tree) if kept else '.history/'}).")


def guard(chapter: str, *, root: Path | None = None, cwd: Path | None = None) -> None:
    """The first cell of every chapter notebook: the workbook's %%writefile, the package folders
    this chapter writes, and no module of this chapter left unimportable by an earlier run.

    Where the notebook runs decides what its cells write: solutions/ writes the reference in the
    repository's minisgl/, workspace/notebooks/ writes the learner's package workspace/minisgl/.
    The generated learner copies in notebooks/ run only under the workbook's tests
    (MINISGL_WORKBOOK_TEST=1): a learner opening one is sent to their workspace copy."""
    cwd = (Path(cwd) if cwd else Path.cwd()).resolve()
    nn = wb.chapter_id(chapter)
    root, tree = (Path(root) if root else repo_root()).resolve(), notebook_tree(cwd)
    if cwd == root / "notebooks" and not wb.env_flag(TEST_ENV):
        name = next((p.name for p in (root / "notebooks").glob(f"{nn}_*.ipynb")), f"{nn}_*.ipynb")
        raise wb.WorkbookError(
            f"this is notebooks/{name}, the generated copy the tests run; your own copy is "
            f"workspace/notebooks/{name}. Run `make lab` (it creates workspace/ the first time) "
            "and open it there: its cells write your package, workspace/minisgl/.")
    register_writefile()
    _install_exercise_notes(nn, root)
    from_solutions = cwd.name == "solutions"
    versions = {rel: pair[0] if from_solutions else pair[1]
                for rel, pair in wb.chapter_versions(root, nn).items()}
    if not versions:
        print(f"guard: chapter {nn} writes no modules (no solutions/{nn}_*.ipynb); nothing to do")
        return
    for rel in versions:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
    _set_aside_broken(tree, versions, root)
    if tree != root:
        check_earlier_chapters(nn, root)
        print(f"guard: this notebook's cells write your package, {tree.name}/minisgl/; each "
              f"version a cell replaces is kept in {tree.name}/.history/.")


def earlier_chapters(nn: str, root: Path) -> list[str]:
    """The chapters whose modules chapter NN uses: those its tests `require(...)` (every
    chapter before it for the Engine and the milestone), in order."""
    files = sorted((root / "tests").glob(f"test_ch{nn}_*.py"))
    text = files[0].read_text(encoding="utf-8") if files else ""
    if re.search(r"require\(\*", text):  # require(*EARLIER...): all chapters 01.. before NN
        return [f"{n:02d}" for n in range(1, int(nn))
                if any((root / "tests").glob(f"test_ch{n:02d}_*.py"))]
    found = re.search(r"require\(([^)]*)\)", text)
    return re.findall(r"\d\d", found[1]) if found else []


def _regions_by_function(reference: str) -> dict[str, list[str]]:
    """Qualified function name ('ParallelLMHead.forward') -> the exercise numbers whose regions
    its body holds, in a module's reference text."""
    import ast

    lines, found = reference.splitlines(), {}

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                ids = [m[1] for line in lines[child.lineno - 1:child.end_lineno]
                       if (m := wb.MARKER.match(line)) and m[2] == "BEGIN"
                       and (m := re.search(r"(\d+\.\d+)", m[3]))]
                if ids:
                    found[name] = list(dict.fromkeys(ids))
                visit(child, f"{name}.<locals>.")

    visit(ast.parse(reference), "")
    return found


@functools.lru_cache(maxsize=32)
def _exercise_functions(root: Path, chapters: tuple[str, ...]) -> dict[str, dict[str, list[str]]]:
    """Module path ('minisgl/layers/norm.py') -> its functions that hold exercise regions, over
    the given chapters' reference modules (a module written by two chapters: both merged)."""
    table: dict[str, dict[str, list[str]]] = {}
    for nn in chapters:
        for rel, (reference, _) in wb.chapter_versions(root, nn).items():
            if rel.endswith(".py"):
                table.setdefault(rel, {}).update(_regions_by_function(reference))
    return table


def exercise_of_error(exc: BaseException, chapters: list[str], root: Path
                      ) -> tuple[str, str] | None:
    """('Exercise N.M', 'minisgl/x.py, in Class.method') for an error raised inside the learner's
    code: the innermost frame, in a module of the given chapters, whose function holds an
    exercise region in the reference; None when no such frame is on the traceback."""
    import traceback

    table = _exercise_functions(root.resolve(), tuple(chapters))
    for frame, _ in reversed(list(traceback.walk_tb(exc.__traceback__))):
        parts = Path(frame.f_code.co_filename).parts
        if "minisgl" not in parts:
            continue
        rel = "/".join(parts[len(parts) - parts[::-1].index("minisgl") - 1:])
        functions = table.get(rel, {})
        code = frame.f_code
        name = getattr(code, "co_qualname", code.co_name)  # Python 3.10: the bare name
        ids = functions.get(name) or next(
            (v for k, v in functions.items() if k.rsplit(".", 1)[-1] == name), None)
        if ids:
            return "Exercise " + " / ".join(ids), f"{rel}, in {name}"
    return None


def _exercise_of_crash(exc: BaseException, nn: str, root: Path) -> str | None:
    """'Exercise N.M' for an error raised inside the learner's code of chapter NN."""
    found = exercise_of_error(exc, [nn], root)
    return found[0] if found else None


NAMED = re.compile(r"Exercise \d+\.\d+")


def exercise_checked_near(exc: BaseException, cells: dict) -> tuple[str, int] | None:
    """('Exercise N.M', line) for an error raised by a check cell's own code (the innermost
    frame that is a cell's, among `cells`, IPython's cell file names): the exercise the cell
    checks next from the failing line (its first "Exercise N.M" at or after the line, else the
    last one before it); None when that cell names no exercise."""
    import linecache
    import traceback

    where = [(f.f_code.co_filename, line) for f, line in traceback.walk_tb(exc.__traceback__)
             if f.f_code.co_filename in cells]
    if not where:
        return None
    name, line = where[-1]
    lines = linecache.getlines(name)
    for text in lines[line - 1:]:
        if m := NAMED.search(text):
            return m[0], line
    before = [m[0] for text in lines[:line - 1] if (m := NAMED.search(text))]
    return (before[-1], line) if before else None


def _note_the_exercise(shell, etype, value, tb, tb_offset=None):
    """IPython's handler for an error a cell raises (installed by guard). An error whose
    message names no exercise gets a note naming one, shown under the error, then the usual
    traceback: raised inside the learner's exercise code, the exercise whose code raised it;
    raised by a check cell's own code (it could not use what an exercise returned), the
    exercise that cell checks at that line."""
    try:
        told = str(value) + " ".join(getattr(value, "__notes__", []))
        chapters = getattr(shell, "_minisgl_chapters", None)
        if chapters and not NAMED.search(told):
            found = exercise_of_error(value, chapters[1], chapters[0])
            near = None if found else exercise_checked_near(
                value, getattr(shell.compile, "_filename_map", {}))
            if found:
                value.add_note(f"{found[0]}: this error was raised inside your code for "
                               f"{found[0]} ({found[1]}); look there first, then run its "
                               "cell again")
            elif near:
                value.add_note(f"{near[0]}: this error was raised by the check itself (line "
                               f"{near[1]} of the cell), where it checks {near[0]}: most likely "
                               f"what your code for {near[0]} returned is not of the kind the "
                               "check expects (its type, shape or keys); look there first")
    finally:
        shell.showtraceback((etype, value, tb), tb_offset=tb_offset, running_compiled_code=True)


def _install_exercise_notes(nn: str, root: Path) -> None:
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:
        return
    chapters = [c for c in sorted(wb.solution_notebooks(root)[0]) if c <= nn]
    shell._minisgl_chapters = (root, chapters)
    shell.set_custom_exc((Exception,), _note_the_exercise)


class EarlierChapterError(Exception):
    """An earlier chapter's module, which this chapter uses, fails that chapter's checks."""


def check_earlier_chapters(nn: str, root: Path) -> None:
    """Run the quick checks (tests/test_chMM_*.py's quick_check) of the chapters chapter NN
    uses, on this notebook's package; stop at the first that fails, naming its exercise."""
    tests = str(root / "tests")
    added = tests not in sys.path
    if added:
        sys.path.append(tests)
    try:
        import prereq

        for mm in earlier_chapters(nn, root):
            try:
                prereq._load_test_module(mm).quick_check()
            except Exception as exc:  # noqa: BLE001 - any failure means that chapter is broken
                found = re.search(r"Exercise \d+\.\d+", str(exc))
                where = found[0] if found else _exercise_of_crash(exc, mm, root) or (
                    f"chapter {mm}'s exercises")
                name = next((p.name for p in (root / "notebooks").glob(f"{mm}_*.ipynb")), mm)
                raise EarlierChapterError(
                    f"this chapter uses chapter {mm}'s modules, and they fail chapter {mm}'s own "
                    f"checks: {type(exc).__name__}: {exc}\nLook at {where} in notebooks/{name} of "
                    f"your workspace, run its cell again, then this cell; or go on with the "
                    f"reference for now: `make reset CH={mm}` (it keeps your version in "
                    ".history/).") from None
            finally:
                reload_minisgl()
    finally:
        if added:
            sys.path.remove(tests)


def reload_minisgl() -> None:
    """Forget every imported minisgl module so the next import sees the files just written."""
    for name in [n for n in sys.modules if n == "minisgl" or n.startswith("minisgl.")]:
        del sys.modules[name]
    importlib.invalidate_caches()


SKIP_ENV = "MINISGL_SKIP_CHAPTER_TESTS"
TEST_ENV = "MINISGL_WORKBOOK_TEST"  # set by the workbook's own test runs
CHAPTER_TESTS_TIMEOUT_S = 1800


def run_tests(*args: str, root: Path | None = None, cwd: Path | None = None,
              failure: str = "the tests failed: read the first failure above") -> str:
    """Run `pytest -q -p no:cacheprovider ARGS` in the repository on this notebook's package
    (workspace/minisgl/ from the learner's copy), print its output, and raise AssertionError
    with `failure` when a test fails. Returns the output."""
    root = Path(root) if root else repo_root()
    tree = notebook_tree(cwd)
    env = dict(os.environ)
    if tree != root.resolve():
        env[wb.PACKAGE_ENV] = str(tree)  # tests/conftest.py puts this tree's minisgl/ first
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, check=False,
                              timeout=CHAPTER_TESTS_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the tests ran past {CHAPTER_TESTS_TIMEOUT_S} s and were stopped: a "
                             "loop in your code may never end; run them in a terminal to see "
                             f"where (`.venv/bin/python -m pytest -x {' '.join(args)}`)") from exc
    print(proc.stdout, end="" if proc.stdout.endswith("\n") else "\n")
    if proc.returncode < 0:  # killed by a signal: no test failed, the process itself died
        raise AssertionError(crashed(-proc.returncode, proc.stdout))
    if proc.returncode != 0:
        raise AssertionError(failure)
    return proc.stdout


def crashed(signum: int, output: str) -> str:
    """What to say when pytest was killed by signal `signum`: which signal, the test that was
    running (from the traceback Python's faulthandler prints), and where to look."""
    import signal

    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    # faulthandler prints the test's frames innermost first: the first test_* function named
    tests = re.findall(r'File "([^"]+)", line \d+ in (test_\w+)', output)
    where = (f" while `{tests[0][1]}` ({Path(tests[0][0]).name}) was running" if tests else "")
    trace = ("The traceback above, under 'Fatal Python error', shows the call that crashed."
             if "Fatal Python error" in output else "No traceback was printed: a SIGKILL "
             "usually means the system ran out of memory and stopped the process.")
    return (f"the tests did not finish: Python was killed by {name}{where}. That is a crash, "
            "not a failed check: compiled code read or wrote memory it does not own (in "
            f"chapter 07, an index past an array in a C++ kernel), or memory ran out. {trace}")


def run_chapter_tests(chapter: str, *extra_args: str, root: Path | None = None,
                      cwd: Path | None = None) -> None:
    """Run tests/test_chNN_*.py with pytest on this notebook's package (workspace/minisgl/ from
    the learner's copy) and print its output; AssertionError if any fail."""
    root = Path(root) if root else repo_root()
    nn = wb.chapter_id(chapter)
    pattern = f"tests/test_ch{nn}_*.py"
    files = sorted(p.relative_to(root).as_posix() for p in (root / "tests").glob(pattern[6:]))
    if not files:
        raise FileNotFoundError(f"no test file matches {pattern} in {root}")
    if wb.env_flag(SKIP_ENV):  # the full test suite runs these files itself
        print(f"chapter {nn}: tests not re-run here ({SKIP_ENV}=1: `make test` runs "
              f"{', '.join(files)} in its own step)")
        return
    run_tests("-x", *files, *extra_args, root=root, cwd=cwd,
              failure=f"chapter {nn}'s tests failed: read the first failure above; it names the "
                      "exercise to fix")
    print(f"chapter {nn}: all tests passed")
