"""Run the workbook's checks and say how long each part took.

    python tools/test_all.py               everything (`make test`, what CI runs)
    python tools/test_all.py --chapter 04  one chapter (`make test CH=04`)
    python tools/test_all.py --quick       the quick tier (`make test-quick`)
    add --jobs 1 to run the parts one after another (default: one part per CPU, at most 2)

Everything, after set-up:
1. `tools/workbook.py check`: generated files in sync, notebooks stripped, markers well formed;
2. `pytest tests/`: every chapter's tests, the toolchain's tests, the bad-input catalogue, the
   milestone script, the wrong modules, the browser test, and every solution notebook run twice
   in a row in one kernel (tests/test_notebooks.py, in a copy of the checkout);
3. the learner notebooks `notebooks/NN_*.ipynb` under nbmake (their %%writefile cells are tagged
   skip-execution, so they run against the reference package and write nothing); a scratch
   notebook (`notebooks/_*.ipynb`) is never run, nor a learner copy whose code cells are its
   solution's (chapter 07, which has no exercises: step 2 runs the same cells).
Steps 2 and 3 are cut into parts (one pytest process each: a chapter's wrong versions, a
solution notebook, a learner notebook, a group of test files) that run two at a time, the
longest first, each lane pinned to its own CPUs (half of them each): two torch processes on
the same cores run 2-4x slower than one after the other. Two at a time is safe because no part
writes into the checkout: the tests that write work in copies of it, and the kernels' build
cache takes a lock. Each part's output is
printed whole when it ends, so two parts never interleave their lines.
`--chapter NN` runs step 1, then only chapter NN's tests, its wrong modules, its notebooks (twice
in one kernel, and in the browser) and its learner notebook.
`--quick` runs step 1, then step 2 without the tests marked `slow` or `browser` (pyproject.toml),
in the same groups of test files.
Every part runs even when another failed; the exit code is non-zero if any failed. A part that
runs past its limit is stopped (with everything it started) and reported as failed.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from workbook import read_json  # tools/, this file's folder

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
NB_TIMEOUT = "600"  # seconds per cell
# the files whose tests are parametrized by chapter ("04_kv_pool_and_page_table", "ch04-ex4.1-...")
PER_CHAPTER = ["tests/test_notebooks.py", "tests/test_wrong_modules.py", "tests/test_browser.py"]
CELL_CHAPTERS = ["00", "01", "02", "03", "04", "05", "06"]  # tests/test_wrong_modules.py's


PART_LIMIT_S = 3600  # one part's limit: far above the slowest part (~10 min) on a busy machine


def _files(pattern: str) -> list[str]:
    return sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob(pattern))


def _same_code(learner: Path, solution: Path) -> bool:
    """Whether a learner copy's code cells are its solution's, source for source (a chapter
    without exercises): nbmake would run what tests/test_notebooks.py runs already."""
    def code(path: Path) -> list[str] | None:
        try:
            cells = read_json(path)["cells"]
        except (OSError, ValueError, KeyError):
            return None
        return ["".join(c["source"]) for c in cells if c.get("cell_type") == "code"]

    mine = code(learner)
    return mine is not None and mine == code(solution)


@dataclass
class Part:
    name: str
    cmd: list[str]
    weight: float = 20.0  # rough seconds (WEIGHTS): the longest parts start first
    env: dict = field(default_factory=dict)


# seconds of the slower parts, measured in one `make test` on an idle 2-core AMD EPYC (Zen 3),
# each lane pinned to one core (23 min in all): the longest start first, so that the two lanes
# end together
WEIGHTS = {"wrong versions ch06": 511, "tests, group 1": 428, "browser, solutions": 315,
           "tests, group 4": 280, "browser, the rest": 252, "wrong modules": 118,
           "solution notebook 07": 92, "wrong versions ch03": 85, "wrong versions ch05": 80,
           "wrong versions ch02": 80, "wrong versions ch04": 53, "tests, group 2": 46,
           "solution notebook 05": 42, "solution notebook 06": 39, "wrong versions ch00": 37,
           "solution notebook 03": 34, "tests, group 3": 34, "learner notebook 05": 33,
           "wrong versions ch01": 30, "solution notebook 00": 26, "learner notebook 03": 24,
           "learner notebook 06": 23,
           # the quick tier (`--quick`), measured the same way (168 s in all, group 4 first)
           "quick tests, group 4": 151, "quick tests, group 1": 62, "quick tests, group 2": 30,
           "quick tests, group 3": 17}
# the test files that are neither per-chapter parts nor notebooks, in groups of similar size
GROUPS = [["tests/test_ch07_*.py", "tests/test_tp.py"],
          ["tests/test_ch06_*.py", "tests/test_ch05_*.py", "tests/test_gpu.py",
           "tests/test_fi_metadata.py"],
          ["tests/test_ch0[0-4]_*.py"],
          ["tests/test_*.py"]]  # the rest


def _groups(taken: set[str]) -> list[tuple[int, list[str]]]:
    """(number, files) of each non-empty group of GROUPS; a file goes to the first group that
    matches it, and the files in `taken` to none."""
    out = []
    for i, patterns in enumerate(GROUPS, 1):
        files = [f for p in patterns for f in _files(p) if f not in taken]
        taken = taken | set(files)
        if files:
            out.append((i, files))
    return out


def parts(quick: bool = False, chapter: str | None = None) -> list[Part]:
    pytest = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=5"]
    learner = [*pytest, "--nbmake", f"--nbmake-timeout={NB_TIMEOUT}"]
    # the notebooks' own test cells would re-run tests/test_chNN_*.py, which the tests run
    skip_tests = {"MINISGL_SKIP_CHAPTER_TESTS": "1"}
    if quick:  # the test-file groups, without the slow and browser tests
        return [Part(f"quick tests, group {i}", [*pytest, *files, "-m", "not slow and not browser"],
                     WEIGHTS.get(f"quick tests, group {i}", 20.0))
                for i, files in _groups(set())]
    if chapter:
        tests = _files(f"tests/test_ch{chapter}_*.py")
        if not tests:
            raise SystemExit(f"no tests/test_ch{chapter}_*.py: is {chapter} a chapter?")
        selected = [*tests, *PER_CHAPTER, "-k", f"ch{chapter} or {chapter}_"]
        return [Part(f"chapter {chapter} tests", [*pytest, *selected]),
                Part("learner notebook", [*learner, *_files(f"notebooks/{chapter}_*.ipynb")],
                     env=skip_tests)]
    out: list[Part] = []
    for c in CELL_CHAPTERS:
        out.append(Part(f"wrong versions ch{c}", [*pytest, "tests/test_wrong_modules.py", "-k",
                                                  f"notebook_checks and ch{c}"]))
    out.append(Part("wrong modules", [*pytest, "tests/test_wrong_modules.py", "-k",
                                      "not notebook_checks"]))
    # the browser test in two parts (one JupyterLab each): the slowest file of all
    out.append(Part("browser, solutions", [*pytest, "tests/test_browser.py", "-k",
                                           "solution_notebook"]))
    out.append(Part("browser, the rest", [*pytest, "tests/test_browser.py", "-k",
                                          "not solution_notebook"]))
    for nb in _files("solutions/[0-9][0-9]_*.ipynb"):
        stem = Path(nb).stem
        out.append(Part(f"solution notebook {stem[:2]}",
                        [*pytest, "tests/test_notebooks.py", "-k", stem]))
    for nb in _files("notebooks/[0-9][0-9]_*.ipynb"):
        if _same_code(ROOT / nb, ROOT / "solutions" / Path(nb).name):
            continue  # no exercises (chapter 07): the solution notebook's run is this one's
        out.append(Part(f"learner notebook {Path(nb).name[:2]}", [*learner, nb], env=skip_tests))
    out += [Part(f"tests, group {i}", [*pytest, *files])
            for i, files in _groups({*PER_CHAPTER, "tests/test_wrong_modules.py"})]
    for part in out:
        part.weight = WEIGHTS.get(part.name, part.weight)
    return out


def _pin(cpus: set[int] | None):
    """What the child runs before the part: pin it (and all it starts) to `cpus`."""
    return None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))


def _session_members(sid: int) -> list[int]:
    """The processes of session `sid` (a compiler that ninja put in a group of its own is one)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # after the name: state, ppid, pgrp, session
            found.append(int(stat.parent.name))
    return found


def _stop(proc: subprocess.Popen) -> None:
    """Stop a part and everything it started: it leads its own session and process group."""
    for pid in [proc.pid, *_session_members(proc.pid)]:
        try:
            if pid == proc.pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def lanes(jobs: int) -> list[set[int] | None]:
    """The CPUs of each lane: this process's CPUs cut into `jobs` disjoint sets, so that two
    parts never share a core (None for every lane where the OS cannot pin, or cores are fewer
    than lanes). Two torch processes that each spin 2 threads on the same 2 cores run 2-4x
    slower than one after the other; pinned, each one's torch and Engine see one core."""
    if not hasattr(os, "sched_getaffinity"):
        return [None] * jobs
    cpus = sorted(os.sched_getaffinity(0))
    if jobs < 2 or len(cpus) < jobs:
        return [None] * jobs
    return [set(cpus[i::jobs]) for i in range(jobs)]


def run_parts(todo: list[Part], jobs: int, env: dict, logs: Path) -> list[tuple[str, int, float]]:
    """Run the parts, `jobs` at a time, longest first, each lane on its own CPUs (`lanes`);
    print each part's output when it ends."""
    pending = sorted(todo, key=lambda p: -p.weight)
    free = lanes(jobs)
    running: dict[subprocess.Popen, tuple[Part, float, Path, set[int] | None]] = {}
    results = []
    try:
        while pending or running:
            while pending and free:
                part, cpus = pending.pop(0), free.pop(0)
                log = logs / f"{len(results) + len(running):02d}.log"
                with open(log, "wb") as out:
                    proc = subprocess.Popen(part.cmd, cwd=ROOT, env={**env, **part.env},
                                            stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True,
                                            preexec_fn=_pin(cpus))  # noqa: PLW1509 (one thread)
                running[proc] = (part, time.perf_counter(), log, cpus)
                print(f"--- started  {part.name}"
                      + (f" (CPUs {','.join(map(str, sorted(cpus)))})" if cpus else ""), flush=True)
            time.sleep(0.5)
            for proc in [p for p in running if p.poll() is not None
                         or time.perf_counter() - running[p][1] > PART_LIMIT_S]:
                part, t0, log, cpus = running.pop(proc)
                free.append(cpus)
                code, note = proc.poll(), ""
                if code is None:
                    _stop(proc)
                    code, note = 124, (f"\n(stopped: {part.name} ran past its {PART_LIMIT_S} s "
                                       f"limit; run it alone to see where it hangs:\n  "
                                       f"{' '.join(part.cmd[1:])})\n")
                if code == 5 and "pytest" in part.cmd:  # nothing collected (e.g. no notebooks)
                    code, note = 0, f"({part.name}: nothing to run yet)\n"
                secs = time.perf_counter() - t0
                print(f"\n=== {part.name} ({secs:.0f} s, {'ok' if code == 0 else 'FAILED'}): "
                      f"{' '.join(part.cmd[1:])}", flush=True)
                sys.stdout.write(log.read_text(errors="replace") + note)
                sys.stdout.flush()
                results.append((part.name, code, secs))
    finally:  # interrupted: stop what still runs
        for proc in running:
            _stop(proc)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="leave out slow and browser tests")
    parser.add_argument("--chapter", type=lambda s: f"{int(s):02d}", help="one chapter, e.g. 04")
    usable = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
              else os.cpu_count() or 1)  # the CPUs this process may use, not the machine's
    parser.add_argument("--jobs", type=int, default=max(1, min(2, usable)),
                        help="parts run at once (default: the CPUs this process may use, at most 2)")
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error("--jobs must be 1 or more")
    # MINISGL_WORKBOOK_TEST=1: the generated learner copies in notebooks/ run (a learner opening
    # one is sent to their workspace/ copy instead; see tools/nbtools.py's guard)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONDONTWRITEBYTECODE="1",
               MINISGL_WORKBOOK_TEST="1")
    env.pop("MINISGL_PACKAGE_TREE", None)  # the tests check the reference package
    t_all = time.perf_counter()
    print("=== workbook check", flush=True)
    t0 = time.perf_counter()
    code = subprocess.run([PY, "tools/workbook.py", "check"], cwd=ROOT, env=env,
                          check=False).returncode
    results = [("workbook check", code, time.perf_counter() - t0)]
    todo = parts(args.quick, args.chapter)
    print(f"=== {len(todo)} parts, {min(args.jobs, len(todo))} at a time", flush=True)
    with tempfile.TemporaryDirectory(prefix="minisgl-test-") as logs:
        results += run_parts(todo, args.jobs, env, Path(logs))
    print("\n=== summary")
    for name, code, secs in results:
        print(f"  {'ok  ' if code == 0 else 'FAIL'}  {name:<24} {secs:7.1f} s")
    failed = [name for name, code, _ in results if code != 0]
    print(f"  total {time.perf_counter() - t_all:.1f} s"
          + (f"; failed: {', '.join(failed)}" if failed else "; all passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
