"""A wrong learner module must be caught, with a message naming the exercise: first by the check
cells right after its build cell in the notebook (the second half of this file), then by its
chapter's tests (the first half).

For each chapter 00-06 this file takes a plausible bug a learner would really write (not a stub),
applies it as an exact text replacement to the module in a temporary copy of the repository, runs
that chapter's tests there (``pytest -x``: the run stops at the first failure, as a learner sees
it) and checks that the first failure's message names the exercise ("Exercise N.M").

Mechanics:
- the copy holds the files of ``git ls-files -co --exclude-standard`` plus a symlink to the real
  ``models/`` folder (git-ignored, ~600 MB);
- the subprocess runs from the copy root with ``PYTHONPATH`` = the copy root. The venv installs
  ``minisgl`` editable (pointing at this checkout), but setuptools' editable finder is *appended*
  to ``sys.meta_path``, after the normal path finder, so the copy's package wins; a small pytest
  plugin written into the copy records where every ``minisgl`` module was imported from, and each
  run asserts that all of them come from the copy;
- the first failure's message is read from the JUnit XML report (the exception message the
  learner sees, without the test's source lines, which also quote "Exercise ..." strings).

A bug the chapter's tests do not (yet) catch, or catch without naming the exercise, is listed
with ``gap=`` (why) and runs as a strict xfail: it turns into a failure as soon as the chapter's
tests improve, so that the ``gap=`` is removed.

When the reference code of an exercise changes, the exact text a mutation replaces may disappear:
the test then fails saying that the mutation no longer applies and must be updated here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
RUN_TIMEOUT_S = 240  # a chapter's tests take < 60 s; generous for a shared, busy 2-core machine
pytestmark = pytest.mark.slow  # a chapter's tests per mutation: not in the quick tier

# Written into the copy's root (on PYTHONPATH) and loaded with `-p`: records, at the end of the
# session, the file of every imported minisgl module.
ORIGIN_PLUGIN = '''
import json, os, sys


def pytest_sessionfinish(session, exitstatus):
    mods = {name: getattr(mod, "__file__", None) for name, mod in list(sys.modules.items())
            if name == "minisgl" or name.startswith("minisgl.")}
    with open(os.environ["WRONG_MODULES_ORIGIN"], "w") as f:
        json.dump(mods, f)
'''


@dataclasses.dataclass(frozen=True)
class Mutation:
    chapter: str  # "04"
    exercise: str  # "4.1"
    module: str  # path of the module, relative to the repository root
    bug: str  # what the learner got wrong, in words
    edits: tuple  # ((old, new), ...): exact text replacements, each `old` occurs exactly once
    gap: str = ""  # non-empty: the chapter's tests do not name the exercise yet (strict xfail)

    @property
    def id(self) -> str:
        return f"ch{self.chapter}-ex{self.exercise}-{self.bug.split(':')[0]}"


_CAUSAL_MASK = ('    scores = scores.masked_fill(future, float("-inf"))  # exp(-inf) = 0: no '
                'weight on the future\n')
_TOP_K = ("    if top_k is not None:\n"
          "        sorted_p = sorted_p.masked_fill(rank >= top_k[:, None], 0.0)\n")
_TOP_P = ("    if top_p is not None:\n"
          "        kept = sorted_p / sorted_p.sum(-1, keepdim=True)\n"
          "        mass_before = kept.cumsum(-1) - kept  # mass of the likelier tokens\n"
          "        sorted_p = sorted_p.masked_fill((mass_before >= top_p[:, None]) & (rank > 0), "
          "0.0)\n")

MUTATIONS = [
    Mutation("00", "0.2", "minisgl/step0/layers.py",
             "no-causal-mask: attention forgets to mask the future",
             ((_CAUSAL_MASK, ""),)),
    Mutation("01", "1.3", "minisgl/req.py",
             "lines-swapped: complete_one advances device_len before copying it to cached_len",
             (('        self.cached_len = self.device_len\n        self.device_len += 1\n',
               '        self.device_len += 1\n        self.cached_len = self.device_len\n'),)),
    Mutation("01", "1.3", "minisgl/req.py",
             "no-device_len-advance: complete_one forgets `device_len += 1`",
             (('        self.cached_len = self.device_len\n        self.device_len += 1\n',
               '        self.cached_len = self.device_len\n'),)),
    Mutation("02", "2.8", "minisgl/layers/rotary.py",
             "rope-sin-sign: the rotation uses +sin / -sin the wrong way round",
             (('o1 = torch.addcmul(x1 * cos, x2, sin, value=-1)  # x1 * cos - x2 * sin',
               'o1 = torch.addcmul(x1 * cos, x2, sin)  # x1 * cos + x2 * sin'),
              ('o2 = torch.addcmul(x2 * cos, x1, sin)  # x2 * cos + x1 * sin',
               'o2 = torch.addcmul(x2 * cos, x1, sin, value=-1)  # x2 * cos - x1 * sin'))),
    Mutation("03", "3.4", "minisgl/models/weight.py",
             "merge-in-file-order: q/k/v (gate/up) are concatenated in checkpoint order (k, q, v)",
             (('torch.cat([parts[i] for i in range(expected)], dim=0)',
               'torch.cat(list(parts.values()), dim=0)'),)),
    Mutation("04", "4.1", "minisgl/kvcache/mha_pool.py",
             "k-into-v-buffer: store_kv copies k into the v buffer (copy-paste)",
             (('self._v_buffer[layer_id].view(shape).index_copy_(0, index, v.view(shape))',
               'self._v_buffer[layer_id].view(shape).index_copy_(0, index, k.view(shape))'),)),
    Mutation("05", "5.1", "minisgl/attention/mask.py",
             "top-left-causal: the mask forgets the cached prefix (query i sees keys 0..i)",
             (('    query_pos = cached_lens[:, None, None] + i  # [Bp, Qmax, 1]\n',
               '    query_pos = i  # [1, Qmax, 1]\n'),)),
    Mutation("06", "6.1", "minisgl/engine/sample.py",
             "top-k-off-by-one: the top-k cut keeps k + 1 tokens (rank > k)",
             (('sorted_p = sorted_p.masked_fill(rank >= top_k[:, None], 0.0)',
               'sorted_p = sorted_p.masked_fill(rank > top_k[:, None], 0.0)'),)),
    Mutation("06", "6.1", "minisgl/engine/sample.py",
             "top-p-before-top-k: the top-p cut runs before the top-k cut",
             ((_TOP_K + _TOP_P, _TOP_P + _TOP_K),)),
]


# ----------------------------------------------------------------------------- the copy


@pytest.fixture(scope="module")
def repo_files() -> list[str]:
    """The repository's files as git sees them (tracked and untracked, ignored ones left out)."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                             capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        pytest.fail(f"`git ls-files` failed in {ROOT} ({e}); this test copies the repository's "
                    "files with git", pytrace=False)
    files = [f for f in out.decode().split("\0") if f and (ROOT / f).is_file()]
    assert files, "git ls-files listed no files"
    if not (ROOT / "models").is_dir():
        pytest.fail(f"{ROOT / 'models'} is missing: run `make models`", pytrace=False)
    return files


def make_copy(dest: pathlib.Path, files: list[str]) -> pathlib.Path:
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / rel, target)
    (dest / "models").symlink_to(ROOT / "models", target_is_directory=True)
    (dest / "_wrong_modules_origin.py").write_text(ORIGIN_PLUGIN)
    return dest


def apply(copy: pathlib.Path, mutation: Mutation) -> None:
    path = copy / mutation.module
    text = path.read_text()
    for old, new in mutation.edits:
        if text.count(old) != 1:
            pytest.fail(
                f"the mutation {mutation.id!r} no longer applies: {mutation.module} contains the "
                f"text it replaces {text.count(old)} time(s), expected exactly once. The code of "
                f"Exercise {mutation.exercise} changed; update MUTATIONS in "
                f"tests/test_wrong_modules.py to the new code.\nText looked for:\n{old}",
                pytrace=False)
        text = text.replace(old, new)
    path.write_text(text)


@dataclasses.dataclass
class Run:
    returncode: int
    output: str
    seconds: float
    failures: list  # [(test id, kind, message)] in report order
    origins: dict  # minisgl module name -> file it was imported from


def run_chapter(copy: pathlib.Path, chapter: str) -> Run:
    """Run the copy's tests/test_chNN_*.py with -x, from the copy root, on the copy's minisgl."""
    test_files = sorted((copy / "tests").glob(f"test_ch{chapter}_*.py"))
    assert len(test_files) == 1, f"expected one tests/test_ch{chapter}_*.py, got {test_files}"
    report, origin = copy.parent / f"junit-{chapter}.xml", copy.parent / f"origin-{chapter}.json"
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "PYTEST_ADDOPTS",
                        "PYTEST_PLUGINS")}
    env.update(PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1", WRONG_MODULES_ORIGIN=str(origin))
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
           "-p", "_wrong_modules_origin", f"--junitxml={report}",
           str(test_files[0].relative_to(copy))]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, check=False, cwd=copy, env=env, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"chapter {chapter}'s tests did not finish within {RUN_TIMEOUT_S} s in the "
                    f"copy {copy}:\n{(e.stdout or b'')[-3000:]!r}", pytrace=False)
    seconds = time.perf_counter() - start
    output = proc.stdout + proc.stderr
    failures = []
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            for kind in ("failure", "error"):
                for node in case.findall(kind):
                    failures.append((f"{case.get('classname')}::{case.get('name')}", kind,
                                     node.get("message") or ""))
    origins = json.loads(origin.read_text()) if origin.exists() else {}
    return Run(proc.returncode, output, seconds, failures, origins)


def assert_imported_from_copy(run: Run, copy: pathlib.Path, module: str | None = None) -> None:
    assert run.origins, (
        "the origin plugin recorded no minisgl module: the chapter's tests did not import minisgl, "
        f"or the plugin did not run.\n{run.output[-3000:]}")
    outside = {name: f for name, f in run.origins.items()
               if f is not None and not pathlib.Path(f).resolve().is_relative_to(copy.resolve())}
    assert not outside, (
        f"these minisgl modules were imported from outside the copy {copy} (the editable install "
        f"won over PYTHONPATH?): {outside}")
    if module is not None:
        name = module.removesuffix(".py").replace("/", ".")
        assert name in run.origins, (
            f"the chapter's tests never imported {name}, the mutated module; imported: "
            f"{sorted(run.origins)}")


# ----------------------------------------------------------------------------- the tests


def test_unmutated_copy_passes_chapter_01(repo_files, tmp_path):
    """The copy mechanism itself is sound: the untouched copy passes, on the copy's own modules."""
    copy = make_copy(tmp_path / "repo", repo_files)
    run = run_chapter(copy, "01")
    print(f"unmutated chapter 01: exit {run.returncode} in {run.seconds:.1f} s")
    assert run.returncode == 0, (
        f"the unmutated copy fails tests/test_ch01_core.py (exit {run.returncode}): the copy "
        f"mechanism is broken, so the wrong-module tests below would prove nothing.\n"
        f"{run.output[-4000:]}")
    assert not run.failures, run.failures
    assert_imported_from_copy(run, copy, "minisgl/core.py")


class NotCaught(AssertionError):
    """The chapter's tests miss the bug or do not name the exercise (the only failure a known
    gap's strict xfail accepts; a broken set-up fails for real)."""


def _param(m: Mutation):
    marks = [pytest.mark.xfail(strict=True, raises=NotCaught, reason=(
        f"chapter {m.chapter}'s tests do not name Exercise {m.exercise} for this bug yet: "
        f"{m.gap}. Remove `gap=` once they do."))] if m.gap else []
    return pytest.param(m, id=m.id, marks=marks)


@pytest.mark.parametrize("mutation", [_param(m) for m in MUTATIONS])
def test_wrong_module_is_caught_and_named(mutation, repo_files, tmp_path):
    copy = make_copy(tmp_path / "repo", repo_files)
    apply(copy, mutation)
    run = run_chapter(copy, mutation.chapter)
    first = run.failures[0] if run.failures else None
    print(f"chapter {mutation.chapter}, {mutation.bug}: exit {run.returncode} in "
          f"{run.seconds:.1f} s; first failure: {first}")
    assert_imported_from_copy(run, copy, mutation.module)
    if run.returncode == 0:
        raise NotCaught(
            f"chapter {mutation.chapter}'s tests PASS on a wrong Exercise {mutation.exercise} "
            f"({mutation.bug}, in {mutation.module}): the chapter's tests must catch this bug.\n"
            f"{run.output[-2000:]}")
    assert run.returncode == 1 and first is not None, (
        f"chapter {mutation.chapter}'s tests did not fail on a test (exit {run.returncode}, "
        f"failures {run.failures}): a usage or collection error?\n{run.output[-3000:]}")
    assert len(run.failures) == 1, f"-x should stop at the first failure: {run.failures}"
    test_id, kind, message = first
    if f"Exercise {mutation.exercise}" not in message:
        raise NotCaught(
            f"chapter {mutation.chapter}: with a wrong Exercise {mutation.exercise} "
            f"({mutation.bug}) the first failure, {test_id} ({kind}), does not name the "
            f"exercise; the learner sees:\n{message[:2000]}")


# ----------------------------------------------------------------------------- the notebooks' checks
#
# The chapter tests come last; the check cells right after a build cell are what a learner sees
# first. tests/wrong_cells/chNN.py lists, for every exercise of chapter NN, at least two plausible
# wrong versions; tests/wrong_cells_runner.py runs the solution notebook in one IPython shell (as
# Run All would) and, for each wrong version, the build cell with the mistake and the cells after
# it up to the last one that mentions the exercise. The first cell that fails must be a cell that
# checks that exercise, and its message must name it.

CELL_CHAPTERS = ["00", "01", "02", "03", "04", "05", "06"]
CELLS_TIMEOUT_S = 1500  # one notebook run plus the re-runs of each case's cells, on a busy machine
EXERCISE_MARKER = re.compile(r"#\s*BEGIN SOLUTION\s+(\d+\.\d+)\b")


# The wrong versions: tests/wrong_cells/chNN.py (text edits, written with the checks in view) and
# the blind sets tests/wrong_cells/blind_*/chNN.json, written by people who had read only the
# chapter's prose and its module cells (never its checks, its tests or these files). A blind
# entry replaces a whole exercise region: {"exercise", "class", "description", "wrong_region"}.
# WRONG_CELLS_SETS=listed,blind_a (comma-separated) runs only those sets (default: all).
BLIND_SETS = sorted(p.name for p in (ROOT / "tests" / "wrong_cells").glob("blind_*") if p.is_dir())


def solution_regions(chapter: str) -> dict[str, str]:
    """Exercise number -> the text strictly between its markers in chapter NN's solution."""
    nb = json.loads(next((ROOT / "solutions").glob(f"{chapter}_*.ipynb")).read_text())
    regions, current = {}, None
    for cell in nb["cells"]:
        if cell["cell_type"] != "code" or not "".join(cell["source"]).startswith("%%writefile"):
            continue
        for line in "".join(cell["source"]).splitlines(keepends=True):
            m = EXERCISE_MARKER.search(line)
            if m:
                current, regions[m[1]] = m[1], ""
            elif "# END SOLUTION" in line:
                current = None
            elif current:
                regions[current] += line
    return regions


def load_cases(chapter: str, sets: list[str] | None = None) -> list[dict]:
    if sets is None:
        chosen = os.environ.get("WRONG_CELLS_SETS")
        sets = chosen.split(",") if chosen else ["listed", *BLIND_SETS]
    cases = []
    path = ROOT / "tests" / "wrong_cells" / f"ch{chapter}.py"
    if "listed" in sets:
        if not path.exists():
            pytest.fail(f"{path.relative_to(ROOT)} is missing: list there at least three plausible "
                        f"wrong versions of each exercise of chapter {chapter}", pytrace=False)
        spec = importlib.util.spec_from_file_location(f"wrong_cells_ch{chapter}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for n, (exercise, module_path, bug, edits) in enumerate(module.CASES):
            cases.append({"id": f"{exercise}#{n} {bug.split(':')[0]}", "exercise": exercise,
                          "module": module_path, "bug": bug, "edits": [list(e) for e in edits]})
    blind = [s for s in sets if s.startswith("blind_")]
    if blind:
        exercises, regions = chapter_exercises(chapter), solution_regions(chapter)
    for name in blind:
        path = ROOT / "tests" / "wrong_cells" / name / f"ch{chapter}.json"
        for n, entry in enumerate(json.loads(path.read_text()) if path.exists() else []):
            ex = entry["exercise"]
            label = re.sub(r"[^\w ,.+-]", "", entry["class"])[:60]
            cases.append({"id": f"{ex}#{name}-{n} {label}", "exercise": ex, "set": name,
                          "module": exercises.get(ex, "?"), "bug": entry["description"],
                          "edits": [[regions.get(ex, "<no such exercise>"),
                                     _reindent(entry["wrong_region"], regions.get(ex, ""))]]})
    return cases


def _reindent(wrong: str, like: str) -> str:
    """``wrong`` shifted to the indentation of the region it replaces (a blind set written when
    the region sat in a function may now replace one inside a method)."""
    def indent(text: str) -> int:
        first = next((ln for ln in text.splitlines() if ln.strip()), "")
        return len(first) - len(first.lstrip())

    shift = indent(like) - indent(wrong)
    if shift <= 0:
        return wrong
    return "".join(" " * shift + ln if ln.strip() else ln for ln in wrong.splitlines(True))


def chapter_exercises(chapter: str) -> dict[str, str]:
    """Exercise number -> module, from the markers of the modules chapter NN's notebook writes."""
    nb = json.loads(next((ROOT / "solutions").glob(f"{chapter}_*.ipynb")).read_text())
    found = {}
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        first = src.split("\n", 1)[0].split()
        if cell["cell_type"] == "code" and first[:1] == ["%%writefile"]:
            for ex in EXERCISE_MARKER.findall(src):
                found[ex] = first[-1].removeprefix("../")
    return found


@pytest.mark.parametrize("chapter", CELL_CHAPTERS, ids=[f"ch{c}" for c in CELL_CHAPTERS])
def test_notebook_checks_catch_wrong_exercises(chapter, repo_files, tmp_path):
    cases = load_cases(chapter)
    exercises = chapter_exercises(chapter)
    counts = {ex: sum(c["exercise"] == ex for c in cases) for ex in exercises}
    too_few = {ex: n for ex, n in counts.items() if n < 3}
    assert os.environ.get("WRONG_CELLS_SETS") or not too_few, (
        f"tests/wrong_cells/: every exercise needs at least three wrong versions; "
        f"these have fewer: {too_few}")
    unknown = sorted({c["exercise"] for c in cases} - set(exercises))
    assert not unknown, f"tests/wrong_cells/ch{chapter}.py names exercises that do not exist: {unknown}"
    for c in cases:
        assert c["module"] == exercises[c["exercise"]], (
            f"case {c['id']}: Exercise {c['exercise']} lives in {exercises[c['exercise']]}, "
            f"not {c['module']}")

    copy = make_copy(tmp_path / "repo", repo_files)
    shutil.copyfile(ROOT / "tests" / "wrong_cells_runner.py", copy / "_wrong_cells_runner.py")
    notebook = next((copy / "solutions").glob(f"{chapter}_*.ipynb"))
    plan, result = tmp_path / "plan.json", tmp_path / "result.json"
    plan.write_text(json.dumps({"notebook": str(notebook), "cases": cases}))
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH")}
    env.update(PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1", MPLBACKEND="agg",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               MINISGL_SKIP_CHAPTER_TESTS="1")
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, str(copy / "_wrong_cells_runner.py"), str(plan),
                               str(result)], cwd=copy / "solutions", env=env, capture_output=True,
                              text=True, timeout=CELLS_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"chapter {chapter}'s notebook with its wrong versions did not finish within "
                    f"{CELLS_TIMEOUT_S} s:\n{(e.stdout or b'')[-3000:]!r}", pytrace=False)
    print(f"chapter {chapter}: {len(cases)} wrong versions in {time.perf_counter() - start:.0f} s")
    RATES_FILE = os.environ.get("WRONG_CELLS_RATES")  # where to append caught-and-named rates
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and result.exists(), (
        f"the runner failed (exit {proc.returncode}):\n{output[-4000:]}")
    report = json.loads(result.read_text())
    slowest = sorted(((r.get("seconds", 0), cid) for cid, r in report["results"].items()),
                     reverse=True)[:3]
    print(f"chapter {chapter}: the slowest wrong versions (each runs its build cell and the cells "
          f"after it, up to the last that names its exercise): "
          + ", ".join(f"{cid} {sec:.0f} s" for sec, cid in slowest))
    problems, missed = [], set()
    if report["baseline_error"]:
        problems.append(f"the reference notebook itself failed: {report['baseline_error']}")
    for c in cases:
        r = report["results"].get(c["id"])
        ex = f"Exercise {c['exercise']}"
        if r is None:
            missed.add(c['id'])
            problems.append(f"{c['id']}: never ran (the notebook stopped before its build cell)")
        elif "problem" in r:
            missed.add(c['id'])
            problems.append(f"{c['id']}: {r['problem']}")
        elif r["failed_cell"] is None:
            missed.add(c['id'])
            problems.append(f"{c['id']} ({c['bug']}): every check cell after the build cell of "
                            f"{c['module']} PASSES this wrong {ex}")
        elif not r["cell_mentions"] or ex not in r["error"]:
            missed.add(c['id'])
            problems.append(f"{c['id']} ({c['bug']}): the first failing cell, {r['failed_cell']}, "
                            f"does not name {ex}; the learner sees: {r['error'][:1500]}")
    if RATES_FILE:
        by_set: dict[str, list[int]] = {}
        for c in cases:
            tally = by_set.setdefault(c.get("set", "listed"), [0, 0])
            tally[0] += c["id"] not in missed
            tally[1] += 1
        with open(RATES_FILE, "a") as f:
            for name, (ok, total) in sorted(by_set.items()):
                f.write(f"ch{chapter} {name}: {ok}/{total} caught and named\n")
    assert not problems, (f"chapter {chapter}'s check cells miss wrong exercises:\n- "
                          + "\n- ".join(problems))
