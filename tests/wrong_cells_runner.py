"""Run a solution notebook with wrong versions of its exercises (used by test_wrong_modules.py).

    python wrong_cells_runner.py PLAN.json RESULT.json      (cwd: solutions/ of a repo copy)

The notebook runs top to bottom in one IPython shell, as Run All would. At a build cell (a
`%%writefile` cell) that has cases, each case runs the cell with its text edits applied, then
the code cells after it, up to the last one that mentions the case's exercise ("Exercise N.M"),
and records the first cell that raises. Then the reference cell runs and the notebook goes on.
Cells tagged skip-execution and the `run_chapter_tests` cells are skipped; the run stops after
the last cell any case needs.
"""

from __future__ import annotations

import json
import signal
import sys
import time
import traceback

CELL_TIMEOUT_S = 300


class CellTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise CellTimeout(f"the cell ran longer than {CELL_TIMEOUT_S} s")


def main(plan_path: str, result_path: str) -> int:
    from IPython.core.interactiveshell import InteractiveShell

    plan = json.load(open(plan_path))
    nb = json.load(open(plan["notebook"]))
    cells = []  # (notebook index, source) of the code cells that run
    for index, cell in enumerate(nb["cells"]):
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        tags = cell.get("metadata", {}).get("tags", [])
        if cell["cell_type"] != "code" or "skip-execution" in tags or "run_chapter_tests(" in src:
            continue
        cells.append((index, src))

    shell = InteractiveShell.instance()
    signal.signal(signal.SIGALRM, _alarm)

    def run(src: str):
        signal.alarm(CELL_TIMEOUT_S)
        try:
            r = shell.run_cell(src, store_history=False)
        finally:
            signal.alarm(0)
        return r.error_before_exec or r.error_in_exec

    def describe(err: BaseException) -> str:
        return "".join(traceback.format_exception_only(type(err), err)).strip()

    by_target = {}  # build cell's target -> positions in `cells` (a module may have several)
    for pos, (_, src) in enumerate(cells):
        first = src.split("\n", 1)[0].split()
        if first[:1] == ["%%writefile"] and len(first) >= 2:
            target = first[-1]
            rel = target[3:] if target.startswith("../") else target
            by_target.setdefault(rel, []).append(pos)
    results = {}
    todo = {}  # position of the build cell -> cases
    for case in plan["cases"]:
        if case["module"] not in by_target:
            results[case["id"]] = {"problem": f"no %%writefile cell writes {case['module']}"}
            continue
        old = case["edits"][0][0] if case["edits"] else ""
        where = [p for p in by_target[case["module"]] if old in cells[p][1]]
        todo.setdefault(where[0] if where else by_target[case["module"]][0], []).append(case)

    def last_mention(pos: int, exercise: str) -> int | None:
        found = None
        for p in range(pos + 1, len(cells)):
            if f"Exercise {exercise}" in cells[p][1]:
                found = p
        return found

    stop = max([last_mention(p, c["exercise"]) or p for p, cs in todo.items() for c in cs],
               default=-1)
    baseline_error = None
    for pos in range(stop + 1):
        index, src = cells[pos]
        for case in todo.get(pos, []):
            mutated, problem = src, None
            for old, new in case["edits"]:
                if mutated.count(old) != 1:
                    problem = (f"the edit's text occurs {mutated.count(old)} time(s) in the build "
                               f"cell of {case['module']}, expected once:\n{old}")
                    break
                mutated = mutated.replace(old, new)
            end = last_mention(pos, case["exercise"])
            if problem is None and end is None:
                problem = (f"no code cell after the build cell of {case['module']} mentions "
                           f"'Exercise {case['exercise']}'")
            if problem:
                results[case["id"]] = {"problem": problem}
                continue
            outcome, began = {"failed_cell": None}, time.perf_counter()
            for p in range(pos, end + 1):
                err = run(mutated if p == pos else cells[p][1])
                if err is not None:
                    outcome = {"failed_cell": cells[p][0], "error": describe(err),
                               "cell_mentions": f"Exercise {case['exercise']}" in cells[p][1],
                               "build_cell": index}
                    break
            outcome["seconds"] = round(time.perf_counter() - began, 2)
            results[case["id"]] = outcome
            print(f"[wrong cells] {case['id']}: {outcome}", flush=True)
        err = run(src)
        if err is not None:
            baseline_error = {"cell": index, "error": describe(err)}
            break
    json.dump({"results": results, "baseline_error": baseline_error}, open(result_path, "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
