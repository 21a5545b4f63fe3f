"""Run every check the workbook has, in order, and say how long each step took.

Called by `make test` (and so by CI) after set-up. Steps:
1. `tools/workbook.py check`: generated files in sync, notebooks stripped, markers well formed;
2. `pytest tests/`: every chapter's tests, the toolchain's tests, the bad-input catalogue, the
   milestone script, and every solution notebook run twice in a row in one kernel
   (tests/test_notebooks.py; one after another, since they all write the same minisgl/ files);
3. the learner notebooks under nbmake (their %%writefile cells are tagged skip-execution, so
   they run against the reference package).
Every step runs even when an earlier one failed; the exit code is non-zero if any failed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
NB_TIMEOUT = "600"  # seconds per cell


def steps() -> list[tuple[str, list[str]]]:
    nb_args = ["-p", "no:cacheprovider", "--nbmake", f"--nbmake-timeout={NB_TIMEOUT}", "-q"]
    return [
        ("workbook check", [PY, "tools/workbook.py", "check"]),
        ("pytest tests/", [PY, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider"]),
        ("learner notebooks", [PY, "-m", "pytest", *nb_args, "notebooks"]),
    ]


def main() -> int:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONDONTWRITEBYTECODE="1")
    results = []
    t_all = time.perf_counter()
    for name, cmd in steps():
        print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        # the notebooks' own test cells would re-run tests/test_chNN_*.py, which step 2 ran
        step_env = dict(env, MINISGL_SKIP_CHAPTER_TESTS="1") if name == "learner notebooks" \
            else env
        code = subprocess.run(cmd, cwd=ROOT, env=step_env).returncode
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
