"""Tests for tools/workbook.py and tools/nbtools.py, each on a fake repository under tmp_path."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tools import nbtools
from tools import workbook as wb

SETUP = ("import sys, pathlib; sys.path.insert(0, str(pathlib.Path.cwd().parent))\n"
         "from tools.nbtools import guard, reload_minisgl, run_chapter_tests\n"
         'guard("{nn}")')
INIT = '%%writefile ../minisgl/__init__.py\n"""minisgl (chapter 00)."""'
NORM = ("%%writefile ../minisgl/layers/norm.py\n# minisgl/layers/norm.py (chapter 01)\n"
        "def norm(x):\n    return x\n")
OPS = '''%%writefile ../minisgl/ops.py
# minisgl/ops.py (chapter 01)
def add(a, b):
    """Add two numbers."""
    # BEGIN SOLUTION 1.1: return the sum of a and b
    total = a + b
    return total
    # END SOLUTION


class Scaler:
    def __init__(self, k):
        self.k = k

    def scale(self, x):
        """Multiply x by k."""
        # BEGIN SOLUTION 1.2: multiply x by "k"
        return x * self.k
        # END SOLUTION
'''
OPS_STUB = '''# minisgl/ops.py (chapter 01)
def add(a, b):
    """Add two numbers."""
    raise NotImplementedError("Exercise 1.1: return the sum of a and b")


class Scaler:
    def __init__(self, k):
        self.k = k

    def scale(self, x):
        """Multiply x by k."""
        raise NotImplementedError("Exercise 1.2: multiply x by \\"k\\"")
'''


def make_nb(nn: str, *cells: str, test: bool = True) -> nbformat.NotebookNode:
    """A chapter notebook: setup cell, the given cells (code; '## ' starts markdown), test cell."""
    body = [new_code_cell(SETUP.format(nn=nn))]
    body += [new_markdown_cell(c) if c.startswith("## ") else new_code_cell(c) for c in cells]
    if test:
        body.append(new_code_cell(f'run_chapter_tests("{nn}")'))
    for i, cell in enumerate(body):
        cell["id"] = f"c{nn}-{i}"
    return new_notebook(cells=body)


def save(path: Path, nb) -> None:
    """Write a notebook the way build does."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(wb.nb_bytes(nb))


def load(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def cli(root: Path, capsys, *args: str) -> tuple[int, str]:
    """Run the CLI on the fake repository; return (exit code, stdout + stderr)."""
    code = wb.main(["--root", str(root), *args])
    out = capsys.readouterr()
    return code, out.out + out.err


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _minisgl_modules() -> dict:
    return {k: v for k, v in sys.modules.items() if k == "minisgl" or k.startswith("minisgl.")}


@pytest.fixture(autouse=True)
def _one_minisgl_per_process():
    """guard() imports a tree's modules in this process (to find one that does not import), and
    reload_minisgl() forgets them: afterwards the process's minisgl is put back as it was, so a
    test file run after this one in the same process sees one package, not a temporary tree's
    modules mixed with its own (chapter 05's tests then found the tp info unset)."""
    saved, path = _minisgl_modules(), list(sys.path)
    yield
    for name in _minisgl_modules():
        del sys.modules[name]
    sys.modules.update(saved)
    sys.path[:] = path


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "minisgl").mkdir(parents=True)
    (root / "tools").mkdir()  # a workbook: solutions/ and tools/
    (root / "minisgl" / "__init__.py").write_text('"""placeholder"""\n')
    save(root / "solutions" / "00_intro.ipynb", make_nb("00", "## Intro", INIT))
    save(root / "solutions" / "01_ops.ipynb", make_nb("01", "## Ops", OPS, NORM))
    return root


@pytest.fixture
def built(repo: Path, capsys) -> Path:
    # the placeholder differs from chapter 00's module: move it away like a maintainer would
    (repo / "minisgl" / "__init__.py").unlink()
    assert cli(repo, capsys, "build")[0] == 0
    return repo


def edit_learner_nb(root: Path, text: str = "# my own work\n") -> Path:
    path = root / "notebooks" / "01_ops.ipynb"
    nb = load(path)
    nb.cells[2].source = nb.cells[2].source + text
    save(path, nb)
    return path


# ----------------------------------------------------------------------------- stubs


def test_stub_replaces_regions_keeping_signature_and_docstring():
    body = OPS.split("\n", 1)[1]
    stubbed, bodies, errors = wb.stub(body, "01", "solutions/01_ops.ipynb cell 2")
    assert errors == []
    assert stubbed == OPS_STUB
    assert bodies == {"1.1": "    total = a + b\n    return total\n",
                      "1.2": "        return x * self.k\n"}


def test_stubbed_module_compiles_imports_and_raises(built: Path, tmp_path: Path):
    cell = load(built / "notebooks" / "01_ops.ipynb").cells[2]
    module = tmp_path / "stubbed_ops.py"
    module.write_text(cell.source.split("\n", 1)[1])
    spec = importlib.util.spec_from_file_location("stubbed_ops", module)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(NotImplementedError, match="Exercise 1.1: return the sum of a and b"):
        mod.add(1, 2)
    with pytest.raises(NotImplementedError, match='Exercise 1.2: multiply x by "k"'):
        mod.Scaler(2).scale(3)
    assert mod.add.__doc__ == "Add two numbers."


# ----------------------------------------------------------------------------- build


def test_build_writes_modules_and_learner_notebooks(built: Path):
    assert (built / "minisgl" / "ops.py").read_text() == OPS.split("\n", 1)[1]
    assert (built / "minisgl" / "__init__.py").read_text() == '"""minisgl (chapter 00)."""\n'
    assert (built / "minisgl" / "layers" / "norm.py").read_text() == NORM.split("\n", 1)[1]
    sol, nb = load(built / "solutions" / "01_ops.ipynb"), load(built / "notebooks" / "01_ops.ipynb")
    assert [c.id for c in nb.cells] == [c.id for c in sol.cells]
    assert nb.cells[2].source == "%%writefile ../minisgl/ops.py\n" + OPS_STUB
    for cell in nb.cells:
        is_writefile = cell.source.startswith("%%writefile")
        assert ("skip-execution" in cell.metadata.get("tags", [])) == is_writefile
        assert "SOLUTION" not in cell.source and "total = a + b" not in cell.source
        assert cell.get("outputs", []) == [] and cell.get("execution_count") is None


def test_build_strips_solutions_keeps_tags_and_is_idempotent(built: Path, capsys):
    path = built / "solutions" / "01_ops.ipynb"
    nb = load(path)
    nb.cells[0].outputs = [new_output("stream", text="hi\n")]
    nb.cells[0].execution_count = 7
    nb.cells[0].metadata["tags"] = ["keep-me"]
    save(path, nb)
    code, out = cli(built, capsys, "build")
    assert code == 0 and "stripped" in out
    cell = load(path).cells[0]
    assert cell.outputs == [] and cell.execution_count is None and cell.metadata.tags == ["keep-me"]
    assert cell.id == "c01-0", "stripping must keep the cell ids (the learner copies share them)"
    before = snapshot(built)
    code, out = cli(built, capsys, "build")
    assert code == 0 and "build: 0 files written" in out
    assert snapshot(built) == before


def test_build_rewrites_generated_files_and_deletes_nothing(built: Path, capsys):
    """minisgl/ and notebooks/ are generated only (the learner's work is in workspace/): build
    rewrites whatever differs, and leaves a file no notebook writes any more for `check`."""
    (built / "minisgl" / "ops.py").write_text("# hand edit\n")
    sol = built / "solutions" / "01_ops.ipynb"
    nb = load(sol)
    nb.cells[2].source = nb.cells[2].source.replace("../minisgl/ops.py", "../minisgl/ops2.py")
    save(sol, nb)
    code, out = cli(built, capsys, "build")
    assert code == 0 and "2 files written" in out, out
    assert (built / "minisgl" / "ops2.py").read_text() == OPS.split("\n", 1)[1]
    assert (built / "minisgl" / "ops.py").read_text() == "# hand edit\n"
    code, out = cli(built, capsys, "check")
    assert code == 1 and "minisgl/ops.py: written by no notebook" in out, out


def test_build_writes_over_an_unknown_existing_file(repo: Path, capsys):
    code, out = cli(repo, capsys, "build")
    assert code == 0, out
    assert (repo / "minisgl" / "__init__.py").read_text() == '"""minisgl (chapter 00)."""\n'


PART2 = """%%writefile -a ../minisgl/ops.py
# --- part 2: more ops ---
def sub(a, b):
    # BEGIN SOLUTION 1.3: a minus b
    return a - b
    # END SOLUTION
"""


def test_a_module_written_by_several_cells(repo: Path, capsys):
    """A first cell, then a part cell (`-a` with a part marker) after prose: the module is their
    bodies in order; the learner copy stubs each part's exercises."""
    save(repo / "solutions" / "01_ops.ipynb", make_nb("01", OPS, "## Prose between", PART2))
    (repo / "minisgl" / "__init__.py").unlink()
    code, out = cli(repo, capsys, "build")
    assert code == 0, out
    assert (repo / "minisgl" / "ops.py").read_text() == OPS.split("\n", 1)[1] + PART2.split(
        "\n", 1)[1]
    learner = load(repo / "notebooks" / "01_ops.ipynb")
    assert 'raise NotImplementedError("Exercise 1.3: a minus b")' in learner.cells[3].source
    assert "skip-execution" in learner.cells[3].metadata["tags"]
    assert wb.chapter_versions(repo, "01")["minisgl/ops.py"][1] == OPS_STUB + (
        "# --- part 2: more ops ---\ndef sub(a, b):\n"
        '    raise NotImplementedError("Exercise 1.3: a minus b")\n')


@pytest.mark.parametrize("cells, expected", [
    ([PART2, OPS], "before the cell that starts minisgl/ops.py"),
    ([OPS, NORM, PART2], "a part of minisgl/ops.py after minisgl/layers/norm.py's cell"),
    ([OPS, PART2.replace("part 2", "part 3")], "part 3 of minisgl/ops.py; the next part is 2"),
    ([OPS, PART2.replace("# --- part 2: more ops ---\n", "")], "first line must be a part marker"),
    ([OPS, PART2.replace("-a", "-x")], "unknown option -x"),
], ids=["part-first", "other-module-between", "part-skipped", "no-marker", "unknown-flag"])
def test_check_reports_misplaced_parts(tmp_path: Path, capsys, cells, expected):
    save(tmp_path / "solutions" / "01_ops.ipynb", make_nb("01", *cells))
    (tmp_path / "tools").mkdir()
    code, out = cli(tmp_path, capsys, "check")
    assert code == 1 and expected in out, out


def test_writefile_replaces_one_part_in_place(tmp_path: Path):
    """Re-running any one cell of a module alone gives the module Run All gives."""
    head, part2 = OPS.split("\n", 1)[1], PART2.split("\n", 1)[1]
    whole = head + part2
    assert nbtools.new_text(None, head, False) == head
    assert nbtools.new_text(head, part2, True) == whole
    assert nbtools.new_text(whole, part2.replace("a - b", "b - a"), True) == whole.replace(
        "a - b", "b - a")
    assert nbtools.new_text(whole, head.replace("a + b", "b + a"), False) == whole.replace(
        "a + b", "b + a")
    assert nbtools.new_text("x = 1\n", "y = 2\n", True) == "x = 1\ny = 2\n"  # IPython's -a


# ----------------------------------------------------------------------------- check


def test_check_passes_on_clean_tree(built: Path, capsys):
    code, out = cli(built, capsys, "check")
    assert code == 0 and "check: OK (2 notebooks, 3 modules)" in out


def test_check_passes_on_empty_tree(tmp_path: Path, capsys):
    (tmp_path / "minisgl").mkdir()
    (tmp_path / "tools").mkdir()
    (tmp_path / "minisgl" / "__init__.py").write_text("")
    (tmp_path / "solutions").mkdir()
    code, out = cli(tmp_path, capsys, "check")
    assert code == 0 and "check: OK (0 notebooks, 0 modules)" in out and "note" in out


def _nb_edit(rel: str, fn):
    def mutate(root: Path):
        nb = load(root / rel)
        fn(nb)
        save(root / rel, nb)
    return mutate


def _set(cell_attr: str, value):
    return lambda nb: nb.cells[0].__setitem__(cell_attr, value)


def _append(rel: str, text: str):
    return lambda root: (root / rel).write_text((root / rel).read_text() + text)


def _solution_text(nb):
    nb.cells[2].source = nb.cells[2].source.replace(
        '    raise NotImplementedError("Exercise 1.1: return the sum of a and b")\n',
        "    total = a + b\n    return total\n")


CHECK_FAILURES = {
    "drift-minisgl": (_append("minisgl/ops.py", "# mine\n"),
                      "minisgl/ops.py: differs from what solutions/ generates"),
    "drift-notebook": (edit_learner_nb, "notebooks/01_ops.ipynb: differs"),
    "missing-file": (lambda r: (r / "minisgl/layers/norm.py").unlink(),
                     "minisgl/layers/norm.py: missing; run `python tools/workbook.py build`"),
    "outputs": (_nb_edit("solutions/01_ops.ipynb",
                         _set("outputs", [new_output("stream", text="x")])),
                "solutions/01_ops.ipynb: holds outputs or execution counts"),
    "execution-count": (_nb_edit("notebooks/01_ops.ipynb", _set("execution_count", 3)),
                        "notebooks/01_ops.ipynb: holds outputs or execution counts"),
    "widget-state": (_nb_edit("solutions/01_ops.ipynb",
                              lambda nb: nb.metadata.__setitem__("widgets", {"state": {}})),
                     "solutions/01_ops.ipynb: holds outputs or execution counts"),
    "not-a-notebook": (lambda r: (r / "notebooks/01_ops.ipynb").write_text("{"),
                       "notebooks/01_ops.ipynb: not a notebook nbstripout can read"),
    "solution-text": (_nb_edit("notebooks/01_ops.ipynb", _solution_text),
                      "notebooks/01_ops.ipynb cell 2: contains the solution of exercise 1.1"),
    "solution-marker": (lambda r: edit_learner_nb(r, "    # END SOLUTION\n"),
                        "notebooks/01_ops.ipynb cell 2: contains a solution marker"),
    "skip-tag": (_nb_edit("notebooks/01_ops.ipynb", lambda nb: nb.cells[2].metadata.pop("tags")),
                 "notebooks/01_ops.ipynb cell 2: %%writefile cell lacks the `skip-execution` tag"),
    "written-by-none": (lambda r: (r / "minisgl/extra.py").write_text(""),
                        "minisgl/extra.py: written by no notebook"),
    "extra-notebook": (lambda r: shutil.copy(r / "notebooks/01_ops.ipynb", r / "notebooks/x.ipynb"),
                       "notebooks/x.ipynb: not generated from solutions/"),
}


@pytest.mark.parametrize("kind", sorted(CHECK_FAILURES))
def test_check_reports_each_failure_without_modifying(built: Path, capsys, kind: str):
    mutate, expected = CHECK_FAILURES[kind]
    mutate(built)
    before = snapshot(built)
    code, out = cli(built, capsys, "check")
    assert code == 1 and expected in out, out
    assert snapshot(built) == before


def test_check_drift_mentions_learner_work(built: Path, capsys):
    _append("minisgl/ops.py", "# mine\n")(built)
    assert "README 'Your work'" in cli(built, capsys, "check")[1]


def wf(*lines: str) -> str:
    """A `%%writefile ../minisgl/ops.py` cell with the given lines."""
    return "%%writefile ../minisgl/ops.py\n" + "".join(f"{line}\n" for line in lines)


BEGIN, END = "    # BEGIN SOLUTION 1.1: t", "    # END SOLUTION"
SOLUTION_FAILURES = {
    "missing-test-cell": (["## Ops", OPS], False,
                          'no test cell; add a code cell calling `run_chapter_tests("01")`'),
    "outside-minisgl": (["%%writefile ../other/x.py\nx = 1\n"], True, "under ../minisgl/"),
    "not-py": (["%%writefile ../minisgl/x.txt\nx = 1\n"], True, "must be a .py, .cpp or .h file"),
    "same-file-twice": ([OPS, OPS.replace("1.1", "1.3").replace("1.2", "1.4")], True,
                        "cell 2: minisgl/ops.py is already written by cell 1"),
    "begin-without-end": ([wf("def f():", BEGIN, "    return 1")], True,
                          "cell 1 line 3: BEGIN SOLUTION 1.1 has no END SOLUTION"),
    "nested-begin": ([wf("def f():", BEGIN, "    # BEGIN SOLUTION 1.2: u", END)], True,
                     "cell 1 line 4: nested BEGIN SOLUTION inside exercise 1.1"),
    "end-without-begin": ([wf("def f():", "    return 1", END)], True,
                          "cell 1 line 4: END SOLUTION without BEGIN SOLUTION"),
    "column-0": ([wf("# BEGIN SOLUTION 1.1: t", "x = 1", "# END SOLUTION")], True,
                 "cell 1 line 2: BEGIN SOLUTION at column 0"),
    "missing-id": ([wf("def f():", "    # BEGIN SOLUTION: t", END)], True,
                   "cell 1 line 3: missing exercise id or task"),
    "missing-task": ([wf("def f():", "    # BEGIN SOLUTION 1.1:", END)], True,
                     "cell 1 line 3: missing exercise id or task"),
    "duplicate-id": ([OPS, OPS.replace("ops.py", "ops2.py").replace("1.2", "1.5")], True,
                     "duplicate exercise id 1.1"),
    "duplicate-id-in-cell": ([wf("def f():", BEGIN, END, "def g():", BEGIN, END)], True,
                             "cell 1 line 6: duplicate exercise id 1.1"),
    "wrong-chapter": ([OPS.replace("1.2", "4.2")], True,
                      "cell 1 line 17: exercise 4.2 in chapter 01"),
    "marker-outside-writefile": (["def f():\n" + BEGIN + "\n" + END], True,
                                 "cell 1: solution markers are allowed only in %%writefile"),
    "marker-not-own-line": ([wf("x = 1  # END SOLUTION")], True,
                            "cell 1 line 2: a marker must be a comment line of its own"),
    "prose-too-long": (["## Ops\n" + "word " * wb.MAX_PROSE_WORDS], True,
                       (f"cell 1: {wb.MAX_PROSE_WORDS + 2} words of prose, more than the "
                        f"{wb.MAX_PROSE_WORDS} a markdown cell may show")),
    "details-unclosed": (["## Ops\n<details><summary>Measured</summary>\n\n`x` grew."], True,
                         "cell 1: a `<details>` that never closes"),
    "details-without-summary": (["## Ops\n<details>\n\nx grew\n\n</details>"], True,
                                "cell 1: a `<details>` block without a `<summary>`"),
    "summary-unclosed": (["## Ops\n<details>\n<summary>Answer\n\nx grew.\n\n</details>"], True,
                         "cell 1: a `<summary>` that never closes"),
    "details-closed-by-its-list": (
        ["## Ops\n1. Why?\n   <details><summary>Answer</summary>\n\nx grew.\n\n</details>"],
        True, "cell 1: a `<details>` that ends with the block around it"),
    "details-close-indented": (
        ["## Ops\n<details><summary>A</summary>\n\nx grew.\n\n        </details>"],
        True, "cell 1: lines indented 4 spaces or more became a code block"),
    "details-stray-close": (["## Ops\nx grew.\n\n</details>"], True,
                            "cell 1: a `</details>` with no block to close"),
    "indented-code-block": (["## Ops\n<details><summary>A</summary>\n\n    x **grew**.\n\n</details>"],
                            True, "cell 1: lines indented 4 spaces or more became a code block"),
    "details-markdown-as-typed": (
        ["## Ops\n1. Why?\n   <details><summary>Answer</summary>Because\n   `x` grew.</details>"],
        True, "cell 1: a folded block shows markdown as typed ('`')"),
    "details-markdown-in-summary": (
        ["## Ops\n<details><summary>Measured: `bench.py`</summary>\n\n12 ms\n\n</details>"],
        True, "cell 1: a folded block shows markdown as typed ('`')"),
    "details-emphasis-as-typed": (
        ["## Ops\n<details><summary>Answer</summary>Only the *new* row.</details>"],
        True, "cell 1: a folded block shows markdown as typed ('*new*')"),
    "details-table-as-typed": (
        ["## Ops\n<details>\n<summary>Measured</summary>\n| n | ms |\n|---|---|\n| 1 | 2 |\n</details>"],
        True, "cell 1: a folded block shows markdown as typed"),
    "cell-too-long": ([wf(*[f"x{i} = {i}" for i in range(wb.MAX_CELL_LINES + 1)])], True,
                      (f"cell 1: {wb.MAX_CELL_LINES + 1} lines for minisgl/ops.py, more than the "
                       f"{wb.MAX_CELL_LINES} a cell may write")),
}


@pytest.mark.parametrize("kind", sorted(SOLUTION_FAILURES))
def test_check_reports_solution_problems(tmp_path: Path, capsys, kind: str):
    cells, test, expected = SOLUTION_FAILURES[kind]
    (tmp_path / "tools").mkdir()
    save(tmp_path / "solutions" / "01_ops.ipynb", make_nb("01", *cells, test=test))
    code, out = cli(tmp_path, capsys, "check")
    assert code == 1 and expected in out, out
    if kind != "missing-test-cell":  # grammar errors stop build before it writes anything
        assert "solutions/01_ops.ipynb cell" in out
        assert cli(tmp_path, capsys, "build")[0] == 1
        assert not (tmp_path / "minisgl").exists() and not (tmp_path / "notebooks").exists()


def test_a_cell_of_max_cell_lines_is_accepted(tmp_path: Path, capsys):
    (tmp_path / "tools").mkdir()
    cells = [wf(*[f"x{i} = {i}" for i in range(wb.MAX_CELL_LINES)])]
    save(tmp_path / "solutions" / "01_ops.ipynb", make_nb("01", *cells, test=True))
    assert cli(tmp_path, capsys, "build")[0] == 0
    code, out = cli(tmp_path, capsys, "check")
    assert code == 0, out


def test_a_markdown_cell_at_the_prose_limit_is_accepted(tmp_path: Path, capsys):
    """Only running text counts: what `<details>` folds, tables, fenced pictures and an answer
    of plain words on the summary's line are free."""
    (tmp_path / "tools").mkdir()
    text = "## " + "word " * (wb.MAX_PROSE_WORDS - 1)  # "##" is a word too
    folded = "<details><summary>Measured</summary>\n\n" + "`w` " * 900 + "\n\n</details>"
    table = "| a | b |\n|---|---|\n" + "| many words in a row | here |\n" * 200
    fenced = "```\n" + "x ─► y\n" * 200 + "```"
    answer = "<details><summary>Answer</summary>Three: the\n   prefill and two steps.</details>"
    cell = f"{text}\n\n{folded}\n\n{table}\n\n{fenced}\n\n{answer}"
    assert wb.prose_words(cell) == wb.MAX_PROSE_WORDS
    save(tmp_path / "solutions" / "01_ops.ipynb", make_nb("01", cell, OPS, test=True))
    assert cli(tmp_path, capsys, "build")[0] == 0
    code, out = cli(tmp_path, capsys, "check")
    assert code == 0, out


def _rendered_details(markdown: str) -> list[str]:
    """The folded blocks of ``markdown`` as mistune renders them: nbconvert's renderer, not the
    one `check` uses (markdown-it), so the two are checked against each other."""
    import mistune

    html = mistune.create_markdown(escape=False, plugins=["table"])(markdown)
    return re.findall(r"<details>.*?</details>", html, re.DOTALL)


def test_every_folded_block_in_the_chapters_renders_its_markdown():
    """A second renderer (mistune, nbconvert's; JupyterLab's follows the same CommonMark rules
    for HTML blocks) must leave no backtick or emphasis star as typed inside any `<details>`
    block of the chapters."""
    seen = 0
    for path in sorted((REPO / "solutions").glob("*.ipynb")):
        for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
            if cell.cell_type != "markdown" or "<details>" not in cell.source:
                continue
            for block in _rendered_details(cell.source):
                seen += 1
                text = re.sub(r"<code>.*?</code>", "", block, flags=re.DOTALL)
                assert "`" not in text and not re.search(r"(?<![\w*])\*[^\s*]", text), (
                    f"{path.name} cell {i}: a folded block shows markdown as typed: {block[:300]}")
    assert seen >= 30  # the checkpoint answers and chapter 07's measurements


@pytest.mark.parametrize("block, flagged", [
    ("<details><summary>A</summary>Plain words\n   on two lines.</details>", False),
    ("<details><summary>A</summary>See `x`\n   here.</details>", True),
    ("<details><summary>A</summary>Only *after* it.</details>", True),
    ("<details><summary>A</summary>**Bold** it.</details>", True),
    ("<details><summary>A</summary>\n   See `x` on the next line.\n   </details>", True),
    ("<details><summary>A</summary>\n\n   See `x` and *after*.\n\n   </details>", False),
])
def test_the_rule_for_folded_blocks_agrees_with_a_renderer(block: str, flagged: bool):
    """`check` flags a block exactly when a second renderer (mistune) shows markdown as typed,
    and finds nothing at all wrong with the ones it renders well."""
    cell = "1. Why?\n   " + block
    problems = wb.markdown_problems(cell)
    if flagged:
        problems = [p for p in problems if "as typed" in p]
    shown = _rendered_details(cell)
    assert len(shown) == 1
    text = re.sub(r"<code>.*?</code>", "", shown[0], flags=re.DOTALL)
    as_typed = "`" in text or "*" in text
    assert bool(problems) == flagged == as_typed, (problems, shown)


def test_check_reports_module_written_by_two_notebooks(built: Path, capsys):
    save(built / "solutions" / "02_more.ipynb", make_nb("02", NORM))
    code, out = cli(built, capsys, "check")
    assert code == 1
    assert ("minisgl/layers/norm.py: written by solutions/01_ops.ipynb and "
            "solutions/02_more.ipynb") in out


# ----------------------------------------------------------------------------- reset


def test_reset_keeps_the_learners_files_and_restores_the_reference(built: Path, capsys):
    assert cli(built, capsys, "workspace")[0] == 0
    ws = built / wb.WORKSPACE
    ops = ws / "minisgl" / "ops.py"
    mine = b"# my own ops\n\x00\xff"  # not even UTF-8: kept byte for byte
    ops.write_bytes(mine)
    notebook = ws / "notebooks" / "01_ops.ipynb"
    learner_nb = notebook.read_bytes()
    code, out = cli(built, capsys, "reset", "1")
    assert code == 0, out
    [kept] = list((ws / wb.HISTORY / "minisgl" / "ops.py").glob("*.py"))
    assert kept.read_bytes() == mine and str(kept.relative_to(built)) in out, out
    assert ops.read_text() == OPS.split("\n", 1)[1]
    assert notebook.read_bytes() == learner_nb  # untouched without --notebook
    notebook.write_text("{}")
    code, out = cli(built, capsys, "reset", "01", "--notebook")
    assert code == 0 and notebook.read_bytes() == wb.learner_copy(
        (built / "notebooks" / "01_ops.ipynb").read_bytes())
    assert [p.read_text() for p in (ws / wb.HISTORY / "notebooks" / "01_ops.ipynb").glob("*")] == ["{}"]
    assert cli(built, capsys, "check")[0] == 0


def test_reset_unknown_chapter(built: Path, capsys):
    code, out = cli(built, capsys, "reset", "07")
    assert code == 2 and "unknown chapter '07'; chapters that exist: 00, 01" in out


# ----------------------------------------------------------------------------- nbtools


def test_write_module_keeps_every_earlier_version_once(built: Path):
    tree = built / wb.WORKSPACE
    ops = tree / "minisgl" / "ops.py"
    ops.parent.mkdir(parents=True)
    for before in (OPS.split("\n", 1)[1], OPS_STUB):  # the reference or the stub: `reset` has them
        ops.write_text(before)
        assert nbtools.write_module(ops, "# v1\n", tree=tree, root=built) is None
    kept = nbtools.write_module(ops, "# v2\n", tree=tree, root=built)  # v1: the learner's
    assert kept is not None and kept.read_text() == "# v1\n" and kept.parent == (
        tree / wb.HISTORY / "minisgl" / "ops.py")
    ops.write_text("# v1\n")
    assert nbtools.write_module(ops, "# v3\n", tree=tree, root=built) is None  # kept already
    assert nbtools.write_module(ops, "# v3\n", tree=tree, root=built) is None  # same text
    assert sorted(p.read_text() for p in kept.parent.iterdir()) == ["# v1\n"]
    new = tree / "minisgl" / "new.py"  # a file that did not exist: nothing to keep
    assert nbtools.write_module(new, "x = 1\n", tree=tree, root=built) is None and new.exists()


def test_write_module_refuses_a_target_outside_the_tree(built: Path, tmp_path: Path):
    tree = built / wb.WORKSPACE
    (tree / "minisgl").mkdir(parents=True)
    outside = tmp_path / "elsewhere.py"
    outside.write_text("# not the workbook's\n")
    (tree / "minisgl" / "link.py").symlink_to(outside)
    (tree / "minisgl" / "folder").symlink_to(tmp_path, target_is_directory=True)
    for target in (tree / "minisgl" / "link.py", tree / "minisgl" / "folder" / "elsewhere.py",
                   tree / ".." / "README.md", outside):
        with pytest.raises(wb.WorkbookError, match="outside this notebook's tree"):
            nbtools.write_module(target, "x = 1\n", tree=tree, root=built)
    assert outside.read_text() == "# not the workbook's\n"
    with pytest.raises(wb.WorkbookError, match="is a folder"):
        nbtools.write_module(tree / "minisgl", "x = 1\n", tree=tree, root=built)


def test_guard_sets_aside_a_module_that_does_not_compile(built: Path, capsys):
    assert cli(built, capsys, "workspace")[0] == 0
    tree = built / wb.WORKSPACE
    ops = tree / "minisgl" / "ops.py"
    ops.write_text("def add(a, b:\n")
    shutil.rmtree(tree / "minisgl" / "layers")
    nbtools.guard("01", root=built, cwd=tree / "notebooks")
    out = capsys.readouterr().out
    assert "guard: minisgl/ops.py did not import (SyntaxError" in out, out
    [saved] = list((tree / wb.HISTORY / "minisgl" / "ops.py").glob("*.py"))
    assert saved.read_text() == "def add(a, b:\n"
    assert ops.read_text() == OPS_STUB  # from the learner's copy: the stub, until the cell runs
    assert (tree / "minisgl" / "layers").is_dir()
    ref = built / "minisgl" / "ops.py"
    ref.write_text("def add(a, b:\n")
    nbtools.guard("01", root=built, cwd=built / "solutions")
    assert ref.read_text() == OPS.split("\n", 1)[1]  # from solutions/: the reference
    capsys.readouterr()
    nbtools.guard("01", root=built, cwd=tree / "notebooks")  # nothing broken: nothing set aside
    assert "did not import" not in capsys.readouterr().out
    nbtools.guard("05", root=built, cwd=tree / "notebooks")  # no notebook: a note, no exception
    assert "nothing to do" in capsys.readouterr().out


def test_reload_minisgl_forgets_only_minisgl_modules(monkeypatch):
    saved = {k: v for k, v in sys.modules.items() if k == "minisgl" or k.startswith("minisgl.")}
    try:
        monkeypatch.setitem(sys.modules, "minisgl", object())
        monkeypatch.setitem(sys.modules, "minisgl.ops", object())
        monkeypatch.setitem(sys.modules, "minisglx", object())
        assert nbtools.reload_minisgl() is None
        assert "minisgl" not in sys.modules and "minisgl.ops" not in sys.modules
        assert "minisglx" in sys.modules
    finally:
        sys.modules.update(saved)


def test_run_chapter_tests(tmp_path: Path, capsys):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_ch03_ok.py").write_text("def test_ok():\n    assert True\n")
    (tmp_path / "tests" / "test_ch04_bad.py").write_text(
        "def test_bad():\n    raise NotImplementedError('Exercise 4.1: do it')\n")
    nbtools.run_chapter_tests("03", "-p", "no:cacheprovider", root=tmp_path)
    assert "chapter 03: all tests passed" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="chapter 04's tests failed"):
        nbtools.run_chapter_tests("4", "-p", "no:cacheprovider", root=tmp_path)
    assert "Exercise 4.1: do it" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match=r"tests/test_ch05_\*\.py"):
        nbtools.run_chapter_tests("05", root=tmp_path)


def test_a_crash_in_the_tests_is_named_as_one(tmp_path: Path, capsys):
    """A test that kills Python (a segfault in compiled code, an abort) ends pytest without a
    failure report: the message names the signal and the test that was running, not 'read the
    first failure above'."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_ch07_crash.py").write_text(
        "import faulthandler, os, signal\n\n"
        "def test_fine():\n    assert True\n\n"
        "def test_a_kernel_that_crashes():\n    faulthandler._sigsegv()\n")
    (tmp_path / "tests" / "test_ch06_abort.py").write_text(
        "import os, signal\n\ndef test_aborts():\n    os.kill(os.getpid(), signal.SIGABRT)\n")
    with pytest.raises(AssertionError) as err:
        nbtools.run_chapter_tests("07", root=tmp_path)
    msg = str(err.value)
    assert "SIGSEGV" in msg and "`test_a_kernel_that_crashes` (test_ch07_crash.py)" in msg, msg
    assert "read the first failure above" not in msg, msg
    with pytest.raises(AssertionError, match="SIGABRT while `test_aborts`"):
        nbtools.run_chapter_tests("06", root=tmp_path)
    assert "Fatal Python error" in capsys.readouterr().out  # the traceback the message cites
    killed = nbtools.crashed(9, "")
    assert "SIGKILL" in killed and "ran out of memory" in killed and "above" not in killed
    assert "killed by signal 77. That is a crash" in nbtools.crashed(77, "")


def test_cli_script_runs(built: Path):
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "workbook.py"), "--root",
                           str(built), "check"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "check: OK" in proc.stdout


def test_an_error_inside_exercise_code_is_named_by_the_cell(monkeypatch):
    """guard() installs an IPython handler: an error raised inside an exercise's code whose
    message names no exercise gets a note naming it (the innermost exercise function on the
    traceback, by qualified name); an error raised by a check cell's own code is named by the
    exercise the cell checks at that line; an error already naming one, or raised by a cell
    that checks no exercise, is shown as it is."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    saved = shell.custom_exceptions, shell.CustomTB
    monkeypatch.setattr(shell, "_minisgl_chapters", (REPO, ["01", "02"]), raising=False)
    shell.set_custom_exc((Exception,), nbtools._note_the_exercise)
    monkeypatch.syspath_prepend(str(REPO))
    try:
        def error_of(src: str) -> BaseException:
            result = shell.run_cell(src, store_history=False)
            assert result.error_in_exec is not None, src
            return result.error_in_exec

        def notes(err: BaseException) -> str:
            return " ".join(getattr(err, "__notes__", []))

        # a shape error raised inside rms_norm's body (Exercise 2.6)
        err = error_of("import torch\nfrom minisgl.layers.norm import rms_norm\n"
                       "rms_norm(torch.randn(3, 4), torch.randn(5), 1e-6)")
        assert "Exercise 2.6" in notes(err) and "minisgl/layers/norm.py, in rms_norm" in notes(err)
        # raised in a helper (the context) called from a method holding Exercise 2.5's region
        err = error_of("from minisgl.core import reset_global_ctx\n"
                       "from minisgl.distributed import reset_tp_info, set_tp_info\n"
                       "from minisgl.layers.embedding import ParallelLMHead\n"
                       "reset_global_ctx(); reset_tp_info(); set_tp_info(0, 1)\n"
                       "head = ParallelLMHead(10, 4)\nreset_tp_info()\n"
                       "head.load_state_dict({'weight': torch.randn(10, 4)})\n"
                       "head.forward(torch.randn(2, 4))")
        assert "Exercise 2.5" in notes(err) and "ParallelLMHead.forward" in notes(err), notes(err)
        # a check cell's own code fails on what an exercise returned: the exercise it checks
        # next from the failing line is named (else the last one before it)
        err = error_of("values = {'eps': 1e-6}\nfor k, v in values.items():\n    print(v.shape)\n"
                       "assert all(hasattr(v, 'shape') for v in values.values()), "
                       "'Exercise 2.1: not tensors'\nassert True, 'Exercise 2.2: later'")
        assert "Exercise 2.1" in notes(err) and "line 3" in notes(err), notes(err)
        err = error_of("assert True, 'Exercise 1.3: done'\n[].pop()")
        assert "Exercise 1.3" in notes(err), notes(err)
        # the cell's own error in a cell that checks no exercise, and one that already names
        # an exercise: no note
        assert not notes(error_of("raise ValueError('mine')"))
        assert not notes(error_of("raise RuntimeError('Exercise 1.4: already named')"))
        assert nbtools.exercise_of_error(ValueError("no traceback"), ["02"], REPO) is None
    finally:
        shell.custom_exceptions, shell.CustomTB = saved
