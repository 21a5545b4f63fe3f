"""Helpers the workbook notebooks import (see tools/workbook.py for the workbook's layout).

First cell of every chapter notebook:

    import sys, pathlib; sys.path.insert(0, str(pathlib.Path.cwd().parent))
    from tools.nbtools import guard, reload_minisgl, run_chapter_tests
    guard("04")

and its last code cell runs `run_chapter_tests("04")`.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

from . import workbook as wb


def repo_root() -> Path:
    """The repository root (the folder holding tools/)."""
    return wb.ROOT


def _chapter_notebook(root: Path, folder: str, nn: str) -> Path | None:
    """solutions/NN_*.ipynb or notebooks/NN_*.ipynb, if there is one."""
    found = sorted((root / folder).glob(f"{nn}_*.ipynb"))
    return found[0] if found else None


def _targets(nb_path: Path) -> dict[str, str]:
    """The files a notebook's %%writefile cells write: root-relative path -> content."""
    modules = {}
    for cell in wb.read_json(nb_path).get("cells", []):
        parsed = wb.parse_writefile(wb.cell_source(cell))
        if cell.get("cell_type") == "code" and parsed and parsed[0]:
            modules[parsed[0]] = wb.written_content(parsed[1])
    return modules


def guard(chapter: str, *, root: Path | None = None) -> None:
    """Protect the learner's modules before a chapter notebook's %%writefile cells run.

    From solutions/: every minisgl/ file this chapter writes that differs from the reference is
    copied to .workbook-backup/<timestamp>/ first. From notebooks/: only a reminder. Either way,
    the package folders the chapter writes are created.
    """
    root = Path(root) if root else repo_root()
    nn = wb.chapter_id(chapter)
    solution = _chapter_notebook(root, "solutions", nn)
    from_solutions = Path.cwd().name == "solutions"
    source = solution if from_solutions else _chapter_notebook(root, "notebooks", nn) or solution
    if source is None:
        print(f"guard: no notebook for chapter {nn} in solutions/ or notebooks/; nothing to check")
        return
    modules = _targets(source)
    for rel in modules:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
    if not from_solutions:
        print("guard: this notebook's %%writefile cells write your own code into ../minisgl/; "
              f"`git diff minisgl/` shows your changes, `python tools/workbook.py reset {nn}` "
              "restores the reference (backing yours up).")
        return
    differing = [rel for rel, text in modules.items()
                 if (root / rel).is_file() and (root / rel).read_bytes() != text.encode("utf-8")]
    if differing:
        dest = wb.backup(root, differing)
        for rel in differing:
            saved = (dest / rel).relative_to(root).as_posix()
            print(f"guard: your version of {rel} differs from the reference; saved a copy to "
                  f"{saved} before this notebook overwrites it.")


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
