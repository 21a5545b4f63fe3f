"""Run the workbook's checks, in order, and say how long each step took.

    python tools/test_all.py               everything (`make test`, what CI runs)
    python tools/test_all.py --chapter 04  one chapter (`make test CH=04`)
    python tools/test_all.py --quick       the quick tier (`make test-quick`)

Everything, after set-up:
1. `tools/workbook.py check`: generated files in sync, notebooks stripped, markers well formed;
2. `pytest tests/`: every chapter's tests, the toolchain's tests, the bad-input catalogue, the
   milestone script, the wrong modules, the browser test, and every solution notebook run twice
   in a row in one kernel (tests/test_notebooks.py; one after another, since they all write the
   same minisgl/ files);
3. the learner notebooks `notebooks/NN_*.ipynb` under nbmake (their %%writefile cells are tagged
   skip-execution, so they run against the reference package); a scratch notebook
   (`notebooks/_*.ipynb`) is never run.
`--chapter NN` runs step 1, then in step 2 only chapter NN's tests, its wrong modules, its
notebooks (twice in one kernel, and in the browser), and in step 3 only its learner notebook.
`--quick` runs step 1, then step 2 without the tests marked `slow` or `browser` (pyproject.toml).
Every step runs even when an earlier one failed; the exit code is non-zero if any failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
NB_TIMEOUT = "600"  # seconds per cell
# the files whose tests are parametrized by chapter ("04_kv_pool_and_page_table", "ch04-ex4.1-...")
PER_CHAPTER = ["tests/test_notebooks.py", "tests/test_wrong_modules.py", "tests/test_browser.py"]


def _files(pattern: str) -> list[str]:
    return sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob(pattern))


def steps(quick: bool = False, chapter: str | None = None) -> list[tuple[str, list[str]]]:
    pytest = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    learner = [*pytest, "--nbmake", f"--nbmake-timeout={NB_TIMEOUT}"]
    check = ("workbook check", [PY, "tools/workbook.py", "check"])
    if quick:
        return [check, ("pytest tests/ (quick)", [*pytest, "tests", "-m", "not slow and not browser"])]
    if chapter:
        tests = _files(f"tests/test_ch{chapter}_*.py")
        if not tests:
            raise SystemExit(f"no tests/test_ch{chapter}_*.py: is {chapter} a chapter?")
        selected = [*tests, *PER_CHAPTER, "-k", f"ch{chapter} or {chapter}_"]
        return [check, (f"chapter {chapter} tests", [*pytest, *selected]),
                ("learner notebooks", [*learner, *_files(f"notebooks/{chapter}_*.ipynb")])]
    return [check, ("pytest tests/", [*pytest, "tests"]),
            ("learner notebooks", [*learner, *_files("notebooks/[0-9][0-9]_*.ipynb")])]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="leave out slow and browser tests")
    parser.add_argument("--chapter", type=lambda s: f"{int(s):02d}", help="one chapter, e.g. 04")
    args = parser.parse_args()
    # MINISGL_WORKBOOK_TEST=1: the generated learner copies in notebooks/ run (a learner opening
    # one is sent to their workspace/ copy instead; see tools/nbtools.py's guard)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONDONTWRITEBYTECODE="1",
               MINISGL_WORKBOOK_TEST="1")
    env.pop("MINISGL_PACKAGE_TREE", None)  # the tests check the reference package
    results = []
    t_all = time.perf_counter()
    for name, cmd in steps(args.quick, args.chapter):
        print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        # the notebooks' own test cells would re-run tests/test_chNN_*.py, which step 2 ran
        step_env = dict(env, MINISGL_SKIP_CHAPTER_TESTS="1") if name == "learner notebooks" \
            else env
        code = subprocess.run(cmd, cwd=ROOT, env=step_env, check=False).returncode
        if code == 5 and "pytest" in cmd:  # pytest: nothing collected (e.g. no notebooks yet)
            print(f"({name}: nothing to run yet)")
            code = 0
        results.append((name, code, time.perf_counter() - t0))
    print("\n=== summary")
    for name, code, secs in results:
        print(f"  {'ok  ' if code == 0 else 'FAIL'}  {name:<20} {secs:7.1f} s")
    failed = [name for name, code, _ in results if code != 0]
    print(f"  total {time.perf_counter() - t_all:.1f} s"
          + (f"; failed: {', '.join(failed)}" if failed else "; all passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
