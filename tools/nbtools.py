"""Helpers the workbook notebooks import (see tools/workbook.py for the workbook's layout).

First cell of every chapter notebook:

    import sys, pathlib; sys.path.insert(0, str(pathlib.Path.cwd().parent))
    from tools.nbtools import guard, reload_minisgl, run_chapter_tests
    guard("04")

and its last code cell runs `run_chapter_tests("04")`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
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
# The notebooks write the package with `%%writefile ../minisgl/...` cells. The workbook's own
# %%writefile (registered by `guard`, the first cell, and by every kernel of the workbook's
# .venv: see tools/kernel_startup.py) replaces IPython's for files under minisgl/: before it
# overwrites a file, it copies it to .workbook-backup/ unless the file holds nothing this cell
# could lose: the same text, the reference (`reset` restores it), the exercise stub, or what this
# kernel itself wrote there last. Everything else (an edit made in an editor, another notebook's
# version, the learner's cell run from notebooks/ before a solution cell) is work: backed up.

_WRITTEN: dict[str, str] = {}  # minisgl/ path -> sha256 of what this kernel last wrote there


def _known_versions(root: Path, rel: str) -> set[str]:
    """sha256 of the reference and the stub of `rel`, from the chapter that writes it."""
    for nn in wb.solution_notebooks(root)[0]:
        versions = wb.chapter_versions(root, nn)
        if rel in versions:
            return {wb.sha256(text.encode("utf-8")) for text in versions[rel]}
    return set()


def write_module(path: Path, text: str, *, root: Path | None = None) -> Path | None:
    """Write `text` to `path` (under minisgl/), first backing up what the file held when that is
    work this kernel did not write. Returns the backup copy's path, or None."""
    root = Path(root) if root else repo_root()
    rel = path.resolve().relative_to(root.resolve()).as_posix()
    data = text.encode("utf-8")
    saved = None
    old = path.read_bytes() if path.is_file() else None
    if old is not None and old != data:
        digest = wb.sha256(old)
        if digest != _WRITTEN.get(rel) and digest not in _known_versions(root, rel):
            saved = wb.backup(root, [rel]) / rel
            print(f"writefile: {rel} held work this cell did not write (an editor's, another "
                  f"notebook's, or an earlier version); saved it to "
                  f"{saved.relative_to(root).as_posix()} before replacing it.")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    _WRITTEN[rel] = wb.sha256(data)
    return saved


def _writefile(line: str, cell: str):
    """The workbook's `%%writefile`: IPython's, plus a backup for files under minisgl/."""
    from IPython import get_ipython
    from IPython.core.magics.osm import OSMagics

    shell = get_ipython()
    try:
        args = shlex.split(line)
    except ValueError:
        args = []
    target = Path(os.path.expanduser(args[0])) if len(args) == 1 else None
    package = (repo_root() / "minisgl").resolve()
    if target is None or not target.resolve().is_relative_to(package):
        return OSMagics(shell).writefile(line, cell)  # anything else: IPython's own
    print(("Overwriting " if target.exists() else "Writing ") + args[0])
    write_module(target, cell)


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


def _set_aside_broken(root: Path, versions: dict[str, str], nn: str) -> None:
    """A module of this chapter that an earlier run left unimportable would stop Run All at the
    first check cell that imports its package, before the cell that rewrites it. Back it up and
    put this notebook's own version (the stub, or the reference from solutions/) in its place;
    that cell writes the learner's version when Run All reaches it."""
    rels = [rel for rel in versions if rel.endswith(".py") and (root / rel).is_file()]
    for _ in range(len(rels) + 1):
        culprit, error = _first_broken(root, rels)
        if culprit is None:
            return
        if culprit not in versions:
            print(f"guard: {culprit} does not import ({error}). It is not written by this "
                  "chapter: fix it in the chapter that writes it, or restore the reference with "
                  "`python tools/workbook.py reset NN` (it backs yours up first).")
            return
        saved = wb.backup(root, [culprit]) / culprit
        (root / culprit).write_text(versions[culprit], encoding="utf-8")
        _WRITTEN[culprit] = wb.sha256(versions[culprit].encode("utf-8"))
        print(f"guard: {culprit} did not import ({error}), which would stop every cell that "
              f"imports its package before this notebook's cell for it runs. Saved it to "
              f"{saved.relative_to(root).as_posix()} and put this notebook's version of it in "
              "its place; your cell for it writes your code again when you run it.")


def guard(chapter: str, *, root: Path | None = None) -> None:
    """The first cell of every chapter notebook: the workbook's %%writefile (which backs up work
    before replacing it), the package folders this chapter writes, and no module of this chapter
    left unimportable by an earlier run."""
    root = Path(root) if root else repo_root()
    nn = wb.chapter_id(chapter)
    register_writefile()
    from_solutions = Path.cwd().name == "solutions"
    versions = {rel: pair[0] if from_solutions else pair[1]
                for rel, pair in wb.chapter_versions(root, nn).items()}
    if not versions:
        print(f"guard: chapter {nn} writes no modules (no solutions/{nn}_*.ipynb); nothing to do")
        return
    for rel in versions:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
    _set_aside_broken(root, versions, nn)
    if not from_solutions:
        print("guard: this notebook's %%writefile cells write your own code into ../minisgl/ "
              "(a file holding other work is copied to .workbook-backup/ first); `git diff "
              f"minisgl/` shows your changes, `python tools/workbook.py reset {nn}` restores the "
              "reference.")


def reload_minisgl() -> None:
    """Forget every imported minisgl module so the next import sees the files just written."""
    for name in [n for n in sys.modules if n == "minisgl" or n.startswith("minisgl.")]:
        del sys.modules[name]
    importlib.invalidate_caches()


SKIP_ENV = "MINISGL_SKIP_CHAPTER_TESTS"


def run_chapter_tests(chapter: str, *extra_args: str, root: Path | None = None) -> None:
    """Run tests/test_chNN_*.py with pytest and print its output; AssertionError if any fail."""
    root = Path(root) if root else repo_root()
    nn = wb.chapter_id(chapter)
    pattern = f"tests/test_ch{nn}_*.py"
    files = sorted(p.relative_to(root).as_posix() for p in (root / "tests").glob(pattern[6:]))
    if not files:
        raise FileNotFoundError(f"no test file matches {pattern} in {root}")
    if os.environ.get(SKIP_ENV) == "1":  # the full test suite runs these files itself
        print(f"chapter {nn}: tests not re-run here ({SKIP_ENV}=1: `make test` runs "
              f"{', '.join(files)} in its own step)")
        return
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", *files, *extra_args]
    proc = subprocess.run(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, check=False)
    print(proc.stdout, end="" if proc.stdout.endswith("\n") else "\n")
    if proc.returncode != 0:
        raise AssertionError(f"chapter {nn}'s tests failed: read the first failure above; "
                             "it names the exercise to fix")
    print(f"chapter {nn}: all tests passed")
