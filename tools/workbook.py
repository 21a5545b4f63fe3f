"""Workbook toolchain: solutions/ is the single source of truth for minisgl/ and notebooks/.

    python tools/workbook.py build        strip solutions/, regenerate minisgl/ and notebooks/
    python tools/workbook.py check        verify the tree (CI); changes nothing
    python tools/workbook.py workspace    create workspace/ (the learner's notebooks and package)
    python tools/workbook.py adopt REF    copy the learner's files kept in git into workspace/
    python tools/workbook.py reset NN [--notebook]
                                          put chapter NN's reference into workspace/ (keeps yours)

The chapter notebooks `solutions/NN_slug.ipynb` write the package with
`%%writefile ../minisgl/<path>.py` cells. Exercise regions inside function bodies look like

        # BEGIN SOLUTION 4.2: write k and v into the pool
        ...solution lines...
        # END SOLUTION

and become `raise NotImplementedError("Exercise 4.2: write k and v into the pool")` in the learner
copy `notebooks/NN_slug.ipynb`. minisgl/ and notebooks/ are generated only: the learner works in
workspace/ (git-ignored), which no tool but `workspace`, `adopt` and `reset` writes, and those
keep what they replace in workspace/.history/. Outputs are stripped and checked by nbstripout
(`build` runs it in place, `check` runs `nbstripout --verify`).

This module must import quickly (tools/nbtools.py uses it from notebooks): nbformat and nbstripout
are imported only inside the functions that need them.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import posixpath
import re
import shlex
import shutil
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKSPACE = "workspace"  # the learner's own notebooks and package (git-ignored)
HISTORY = ".history"  # earlier versions of a tree's files, by path (git-ignored)
PACKAGE_ENV = "MINISGL_PACKAGE_TREE"  # the tests import minisgl/ from this folder when set
SKIP_TAG = "skip-execution"
NB_NAME = re.compile(r"^(\d\d)_.+\.ipynb$")
MARKER = re.compile(r"^([ \t]*)#[ \t]*(BEGIN|END) SOLUTION\b(.*)$")
HEADER = re.compile(r"^\s+(\d+)\.(\d+)\s*:\s*(\S.*?)\s*$")
# The first line of a `%%writefile -a` cell: which part of its module the cell writes. A module
# is its first cell's body (part 1) followed by parts 2, 3, ... in order; the marker lines stay in
# the file as plain comments, so the workbook's %%writefile can replace one part in place.
PART = re.compile(r"^(?:#|//) --- part (\d+): (\S.*?) ---[ \t]*$")  # `//` in C++ files
# The most lines a %%writefile cell may write (its first line aside): about a screen, so that a
# cell can be read whole, with the prose that explains it next to it. A longer module is written
# by several cells, one part each.
MAX_CELL_LINES = 120
# The most words of prose a markdown cell may show (tables, fenced code and pictures, and what
# `<details>` blocks fold away, not counted): about a screen of reading before the next cell. A
# measurement log grows one paragraph at a time; its numbers go in a `<details>` block, its idea
# stays in sight.
MAX_PROSE_WORDS = 750
DETAILS = re.compile(r"<details\b[^>]*>.*?</details\s*>", re.DOTALL | re.IGNORECASE)
FENCED = re.compile(r"^[ \t]*```.*?^[ \t]*```", re.DOTALL | re.MULTILINE)
# markdown that a renderer left as typed, in the text of a folded block: code, strong, emphasis,
# and at the start of a line what would have broken a paragraph: a heading, a list's first item,
# a quote, or a table's delimiter row
AS_TYPED = re.compile(r"`|\*\*|__|(?<![\w*])\*[^\s*][^*\n]*\*|(?<!\w)_[^\s_][^_\n]*_(?!\w)"
                      r"|^[ \t]*(?:#{1,6} |[-*+] |1[.)] |>|\|?[ \t]*:?-{3,}[ \t]*\|)",
                      re.MULTILINE)


def prose_words(markdown: str) -> int:
    """Words of ``markdown`` a reader meets as running text: outside ``<details>`` blocks,
    fenced code and table rows."""
    text = FENCED.sub("", DETAILS.sub("", markdown))
    return sum(len(line.split()) for line in text.splitlines()
               if not line.lstrip().startswith("|"))


class _Folds(HTMLParser):
    """Reads a markdown cell rendered as JupyterLab renders it (CommonMark): the elements open
    at each point, and each ``<details>`` block's summary and text."""

    VOID = frozenset({"br", "hr", "img", "input", "wbr", "col", "area", "source", "embed"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.open: list[str] = []
        self.folds: list[list] = []  # per open <details>: [has a <summary>, its text]
        self.errors: list[str] = []

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag in self.VOID:
            return
        if tag == "summary" and self.open[-1:] == ["details"]:
            self.folds[-1][0] = True
        if tag == "details":
            self.folds.append([False, []])
        self.open.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag not in self.open:
            if tag == "details":
                self.errors.append("a `</details>` with no block to close: it is indented 4 "
                                   "spaces or more, or its `<details>` is in another block")
            return
        while (top := self.open.pop()) != tag:  # elements closed by an outer end tag
            if top == "summary":
                self.errors.append("a `<summary>` that never closes: end it on its own line")
            elif top == "details":
                self._fold_ends()
                self.errors.append(f"a `<details>` that ends with the block around it (at "
                                   f"`</{tag}>`): open and close it at one indentation, in one "
                                   "list item or quote")
        if top == "details":
            self._fold_ends()

    def handle_data(self, data: str) -> None:
        if self.folds and not {"code", "pre"} & set(self.open):
            self.folds[-1][1].append(data)

    def _fold_ends(self) -> None:
        has_summary, text = self.folds.pop()
        if not has_summary:
            self.errors.append("a `<details>` block without a `<summary>` right inside it: "
                               "name what it folds")
        if typed := AS_TYPED.search("".join(text)):
            self.errors.append(f"a folded block shows markdown as typed ({typed[0].strip()!r}): "
                               "leave a blank line after the `<summary>...</summary>` line and "
                               "before `</details>`; in a summary, write code as `<code>`")
        if self.folds:
            self.folds[-1][1] += text

    def problems(self, rendered: str) -> list[str]:
        self.feed(rendered)
        self.close()
        if "details" in self.open:
            self.errors.append("a `<details>` that never closes folds away the rest of the cell: "
                               "end it with `</details>` after a blank line")
            for _ in range(self.open.count("details")):
                self._fold_ends()
        return list(dict.fromkeys(self.errors))


def markdown_problems(src: str) -> list[str]:
    """What keeps a markdown cell from reading well, or from rendering as its author meant:
    the cell rendered with markdown-it (CommonMark, as JupyterLab renders it), then read."""
    try:
        from markdown_it import MarkdownIt
    except ImportError:
        raise WorkbookError("check renders the chapters' markdown with markdown-it-py, which is "
                            "not installed here: pip install -e '.[dev]'") from None
    errors = []
    if (words := prose_words(src)) > MAX_PROSE_WORDS:
        errors.append(f"{words} words of prose, more than the {MAX_PROSE_WORDS} a markdown cell "
                      "may show: keep the idea in sight and fold its measurements into "
                      "`<details><summary>Measured: ...</summary>` (a blank line after the "
                      "summary line), or give the next idea a cell of its own")
    md = MarkdownIt("commonmark").enable("table")
    tokens = md.parse(src)
    if any(t.type == "code_block" for t in tokens):
        errors.append("lines indented 4 spaces or more became a code block: indent less, or "
                      "fence code with ```")
    return errors + _Folds().problems(md.renderer.render(tokens, md.options, {}))


class WorkbookError(Exception):
    """A user-facing error: the CLI prints it and exits with code 2."""


# The tools' MINISGL_* variables. They run before set-up, when minisgl.utils' reader (the one the
# package uses) may not import, so they have this small equivalent: the same rules, the same
# kind of message (the variable, its value, what it accepts).
def env_flag(name: str) -> bool:
    """A MINISGL_* switch: unset, "" or "0" is off, "1" is on; anything else is refused."""
    value = os.environ.get(name, "")
    if value not in ("", "0", "1"):
        raise WorkbookError(f"{name}={value!r}: use 1 (on) or 0 (off), or unset it")
    return value == "1"


def env_folder(name: str, must_hold: str) -> Path | None:
    """A MINISGL_* folder: None when unset; refused unless it is a folder holding `must_hold`."""
    value = os.environ.get(name, "")
    if not value:
        return None
    path = Path(value).expanduser()
    if not (path / must_hold).is_dir():
        raise WorkbookError(f"{name}={value!r}: not a folder holding {must_hold}/; give one "
                            f"(for example the workbook's workspace/), or unset it")
    return path.resolve()


@dataclass
class Chapter:
    """What one solutions/NN_slug.ipynb generates."""

    nn: str
    name: str
    modules: dict[str, str] = field(default_factory=dict)  # "minisgl/x.py" -> content
    bodies: dict[str, str] = field(default_factory=dict)  # exercise id -> solution text
    learner: dict = field(default_factory=dict)  # the learner notebook (plain dict)
    has_test_cell: bool = False
    problems: list[str] = field(default_factory=list)


@dataclass
class Generation:
    """Everything `build` would write, keyed by path relative to the root."""

    files: dict[str, bytes] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)  # path -> chapter NN
    chapters: dict[str, Chapter] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- parsing


MODULE_SUFFIXES = (".py", ".cpp", ".h")  # what a %%writefile cell may write into minisgl/


def cell_source(cell: dict) -> str:
    """A cell's source as one string (on disk it may be a list of lines)."""
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def chapter_id(chapter: str | int) -> str:
    """Normalise "4", 4 or "04" to "04"."""
    text = str(chapter).strip()
    if not text.isdigit():
        raise WorkbookError(f"chapter must be a number like 04, not {chapter!r}")
    return f"{int(text):02d}"


def parse_writefile(source: str) -> tuple[str, str, list[str]] | None:
    """Split a `%%writefile` cell into (target, body, errors); None for any other cell.

    target is relative to the repository root ("minisgl/x/y.py"); "" when invalid. Whether the
    cell appends (`-a`) is `is_append(source)`.
    """
    first, _, body = source.partition("\n")
    if not first.startswith("%%writefile"):
        return None
    errors, target = [], ""
    try:
        args = shlex.split(first[len("%%writefile"):])
    except ValueError as exc:
        return "", body, [f"cannot parse `{first}`: {exc}"]
    paths = [a for a in args if not a.startswith("-")]
    flags = [a for a in args if a.startswith("-") and a not in ("-a", "--append")]
    if flags:
        errors.append(f"`{first.strip()}`: unknown option {flags[0]} (only -a is understood)")
    if len(paths) != 1:
        errors.append(f"`{first.strip()}` must name exactly one file")
    else:
        norm = posixpath.normpath(paths[0])
        if paths[0].startswith("../minisgl/") and norm.startswith("../minisgl/") and (
            norm.endswith(MODULE_SUFFIXES)
        ):
            target = norm[3:]
        else:
            errors.append(f"`{paths[0]}`: the target must be a .py, .cpp or .h file under "
                          "../minisgl/")
    if is_append(source) and not PART.match(body.partition("\n")[0]):
        errors.append("a `%%writefile -a` cell's first line must be a part marker, "
                      "`# --- part N: title ---` (`// --- part N: title ---` in C++)")
    return target, body, errors


def is_append(source: str) -> bool:
    """Whether a `%%writefile` cell appends a part to its module (`-a`)."""
    first = source.partition("\n")[0]
    try:
        return any(a in ("-a", "--append") for a in shlex.split(first[len("%%writefile"):]))
    except ValueError:
        return False


def split_parts(text: str) -> tuple[str, dict[int, str]]:
    """A module's text as (part 1, {N: part N}) from its part marker lines."""
    head, parts, current = [], {}, None
    for line in text.splitlines(keepends=True):
        m = PART.match(line.rstrip("\r\n"))
        if m:
            current = int(m[1])
            parts[current] = ""
        if current is None:
            head.append(line)
        else:
            parts[current] += line
    return "".join(head), parts


def join_parts(head: str, parts: dict[int, str]) -> str:
    """The inverse of split_parts: part 1, then the other parts in their order."""
    return head + "".join(parts[n] for n in sorted(parts))


def written_content(body: str) -> str:
    """What `%%writefile` writes for a cell body (IPython ends a non-empty cell with a newline)."""
    return body if not body or body.endswith("\n") else body + "\n"


def stub(body: str, nn: str, where: str) -> tuple[str, dict[str, str], list[str]]:
    """Replace each exercise region of a `%%writefile` body by a NotImplementedError stub.

    Returns (stubbed body, {exercise id: solution text}, errors). Line numbers in errors count
    the `%%writefile` line as line 1.
    """
    out, bodies, errors = [], {}, []
    region = None  # [exercise id, task, indent, line number, solution lines]
    for no, line in enumerate(body.splitlines(keepends=True), start=2):
        at = f"{where} line {no}"
        m = MARKER.match(line.rstrip("\r\n"))
        if not m:
            if "BEGIN SOLUTION" in line or "END SOLUTION" in line:
                errors.append(f"{at}: a marker must be a comment line of its own")
            (region[4] if region else out).append(line)
            continue
        indent, kind, rest = m.groups()
        if kind == "END":
            if region is None:
                errors.append(f"{at}: END SOLUTION without BEGIN SOLUTION")
                continue
            eid, task, ind, _, lines = region
            msg = json.dumps(f"Exercise {eid}: {task}", ensure_ascii=False)
            newline = "\n" if line.endswith("\n") else ""
            out.append(f"{ind}raise NotImplementedError({msg}){newline}")
            bodies[eid] = "".join(lines)
            region = None
            continue
        if region is not None:
            errors.append(f"{at}: nested BEGIN SOLUTION inside exercise {region[0]} "
                          f"(line {region[3]}); close it with END SOLUTION first")
            continue
        head = HEADER.match(rest)
        if not indent:
            errors.append(f"{at}: BEGIN SOLUTION at column 0; put regions inside a function body")
        if not head:
            errors.append(f"{at}: missing exercise id or task; write `# BEGIN SOLUTION N.M: task`")
            eid, task = "?", ""
        else:
            eid, task = f"{head[1]}.{head[2]}", head[3]
            if int(head[1]) != int(nn):
                errors.append(f"{at}: exercise {eid} in chapter {nn}; number it {int(nn)}.M")
            if eid in bodies:
                errors.append(f"{at}: duplicate exercise id {eid}")
        region = [eid, task, indent, no, []]
    if region is not None:
        errors.append(f"{where} line {region[3]}: BEGIN SOLUTION {region[0]} has no END SOLUTION")
    return "".join(out), bodies, errors


def parse_chapter(nn: str, name: str, nb: dict) -> Chapter:
    """Parse a solution notebook (any dict in nbformat 4 shape) into what it generates."""
    chap = Chapter(nn, name, learner=json.loads(json.dumps(nb)))
    test_call = re.compile(r"run_chapter_tests\(\s*[\"']" + nn + r"[\"']")
    writer: dict[str, int] = {}  # module -> the cell that starts it
    parts: dict[str, int] = {}  # module -> parts written so far
    last = ""  # the module the latest %%writefile cell wrote
    for i, cell in enumerate(chap.learner.get("cells", [])):
        src, where = cell_source(cell), f"solutions/{name} cell {i}"
        parsed = parse_writefile(src) if cell.get("cell_type") == "code" else None
        if parsed is None:
            if cell.get("cell_type") == "markdown":
                chap.problems += [f"{where}: {e}" for e in markdown_problems(src)]
            if "BEGIN SOLUTION" in src or "END SOLUTION" in src:
                chap.problems.append(f"{where}: solution markers are allowed only in %%writefile "
                                     "cells")
            chap.has_test_cell |= cell.get("cell_type") == "code" and bool(test_call.search(src))
            continue
        target, body, errors = parsed
        if (lines := len(body.splitlines())) > MAX_CELL_LINES:
            errors.append(f"{lines} lines for {target}, more than the "
                          f"{MAX_CELL_LINES} a cell may write: end the cell at a place where the "
                          "code changes subject and write the rest with a `%%writefile -a` cell "
                          "whose first line is a part marker (`# --- part N: title ---`, `//` in "
                          "C++), with the prose about that rest between the two cells")
        stubbed, bodies, stub_errors = stub(body, nn, where)
        chap.problems += [f"{where}: {e}" for e in errors] + stub_errors
        for eid, text in bodies.items():
            if eid in chap.bodies:
                chap.problems.append(f"{where}: duplicate exercise id {eid} in chapter {nn}")
            chap.bodies[eid] = text
        if target and is_append(src):
            marker = PART.match(body.partition("\n")[0])
            if target not in writer:
                chap.problems.append(f"{where}: `%%writefile -a` before the cell that starts "
                                     f"{target}; write its part 1 with `%%writefile` first")
            elif last != target:
                chap.problems.append(f"{where}: a part of {target} after {last}'s cell; the parts "
                                     f"of a module follow its first cell (cell {writer[target]})")
            elif marker and int(marker[1]) != parts[target] + 1:
                chap.problems.append(f"{where}: part {marker[1]} of {target}; the next part is "
                                     f"{parts[target] + 1}")
            else:
                parts[target] += 1
                chap.modules[target] += written_content(body)
        elif target in writer:
            chap.problems.append(f"{where}: {target} is already written by cell {writer[target]}")
        elif target:
            writer[target], parts[target] = i, 1
            chap.modules[target] = written_content(body)
        last = target or last
        first, sep, _ = src.partition("\n")
        cell["source"] = first + sep + stubbed
        tags = cell.setdefault("metadata", {}).setdefault("tags", [])
        if SKIP_TAG not in tags:
            tags.append(SKIP_TAG)
    return chap


def chapter_versions(root: Path, nn: str) -> dict[str, tuple[str, str]]:
    """The modules solutions/NN_*.ipynb writes: path -> (reference text, learner stub text).
    Reads the notebook as plain JSON (no nbformat): notebooks' kernels call this."""
    path = solution_notebooks(root)[0].get(nn)
    if path is None:
        return {}
    chap = parse_chapter(nn, path.name, read_json(path))
    stubs: dict[str, str] = {}
    for cell in chap.learner.get("cells", []):
        parsed = parse_writefile(cell_source(cell)) if cell.get("cell_type") == "code" else None
        if parsed and parsed[0]:
            before = stubs.get(parsed[0], "") if is_append(cell_source(cell)) else ""
            stubs[parsed[0]] = before + written_content(parsed[1])
    return {rel: (text, stubs.get(rel, text)) for rel, text in chap.modules.items()}


def read_json(path: Path) -> dict:
    """Read a notebook as a plain dict (fast; no validation)."""
    return json.loads(path.read_text(encoding="utf-8"))


def solution_notebooks(root: Path) -> tuple[dict[str, Path], list[str]]:
    """Map chapter NN -> solutions/NN_slug.ipynb; names starting with '_' are ignored."""
    found, problems = {}, []
    for path in sorted((root / "solutions").glob("*.ipynb")):
        m = NB_NAME.match(path.name)
        if path.name.startswith("_"):
            continue
        if not m:
            problems.append(f"solutions/{path.name}: name it NN_slug.ipynb (or start it with '_')")
        elif m[1] in found:
            problems.append(f"solutions/{path.name}: chapter {m[1]} already is {found[m[1]].name}")
        else:
            found[m[1]] = path
    return found, problems


# ----------------------------------------------------------------------------- notebooks I/O


def load_notebook(path: Path):
    """Read a notebook with nbformat, without outputs or execution counts (nbstripout, in memory;
    the file itself is stripped by `build`), so that a learner copy never carries any."""
    import nbformat
    from nbstripout import strip_output

    return strip_output(nbformat.read(path, as_version=4), keep_output=False, keep_count=False,
                        keep_id=True)


def nbstripout(*args: str) -> tuple[int, str]:
    """Run nbstripout's own command line (always keeping cell ids) in this process, where
    nbformat is already imported (a fresh interpreter spends seconds importing it); return its
    exit status and its error messages. What it prints to stdout is dropped."""
    from nbstripout import main

    err, saved = io.StringIO(), (sys.argv, sys.stdin, sys.stdout)
    sys.argv, sys.stdin = ["nbstripout", "--keep-id", *args], None
    sys.stdout = types.SimpleNamespace(buffer=io.BytesIO())  # main() writes to stdout.buffer only
    try:
        with contextlib.redirect_stderr(err):
            main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except Exception as exc:  # noqa: BLE001 - e.g. valid JSON that is not a notebook
        code = 1
        err.write(f"{type(exc).__name__}: {exc}")
    finally:
        sys.argv, sys.stdin, sys.stdout = saved
    return code, err.getvalue().strip()


def nb_bytes(nb: dict) -> bytes:
    """Serialise a notebook exactly as `build` writes it (nbformat v4, trailing newline)."""
    import nbformat

    text = nbformat.writes(nbformat.from_dict(nb), version=4)
    return (text if text.endswith("\n") else text + "\n").encode("utf-8")


def generate(root: Path) -> Generation:
    """Compute every generated file from solutions/ without writing anything."""
    sols, problems = solution_notebooks(root)
    gen = Generation(problems=problems)
    for nn, path in sols.items():
        try:
            nb = load_notebook(path)
        except ImportError:
            raise
        except Exception as exc:  # noqa: BLE001 - any unreadable notebook is a reportable problem
            gen.problems.append(f"solutions/{path.name}: cannot read notebook: {exc}")
            continue
        chap = gen.chapters[nn] = parse_chapter(nn, path.name, nb)
        gen.problems += chap.problems
        for rel, content in chap.modules.items():
            if rel in gen.origin:
                other = gen.chapters[gen.origin[rel]].name
                gen.problems.append(f"{rel}: written by solutions/{other} and solutions/"
                                    f"{path.name}; write each module from exactly one notebook")
                continue
            gen.files[rel], gen.origin[rel] = content.encode("utf-8"), nn
        rel = f"notebooks/{path.name}"
        gen.files[rel], gen.origin[rel] = nb_bytes(chap.learner), nn
    return gen


# ----------------------------------------------------------------------------- files


def sha256(data: bytes) -> str:
    """Hex sha256 of some bytes."""
    return hashlib.sha256(data).hexdigest()


def read_bytes(path: Path) -> bytes | None:
    """File content, or None when missing."""
    return path.read_bytes() if path.is_file() else None


def extra_files(root: Path, generated) -> list[str]:
    """Files under minisgl/ (*.py, *.cpp) and notebooks/ (*.ipynb) not among `generated`.

    Hidden folders, __pycache__ and notebooks whose name starts with '_' are ignored.
    """
    found = [p.relative_to(root).as_posix() for p in (root / "minisgl").rglob("*")
             if p.suffix in MODULE_SUFFIXES and p.is_file()
             and not any(d.startswith(".") or d == "__pycache__" for d in p.relative_to(root).parts)]
    found += [f"notebooks/{p.name}" for p in (root / "notebooks").glob("*.ipynb")
              if not p.name.startswith("_")]
    return sorted(set(found) - set(generated))


def read_text(path: Path) -> str:
    """A file's text (UTF-8), or a WorkbookError that names the file and the fix."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise WorkbookError(f"{path}: not UTF-8 text; restore it (`git checkout -- {path}` for a "
                            "tracked file) or move it away") from None


def write_text(path: Path, text: str) -> None:
    """Write text (UTF-8), creating parent folders."""
    write_file(path, text.encode("utf-8"))


def keep_history(tree: Path, path: Path, data: str | bytes) -> Path | None:
    """Keep `data`, a version of `path` (inside `tree`) about to be replaced, as
    <tree>/.history/<path>/<time>-<hash><suffix>. A version already kept is not copied again
    (returns None then). The history folder ignores itself in git."""
    data = data.encode("utf-8") if isinstance(data, str) else data
    rel = path.resolve().relative_to(tree.resolve())
    folder = tree / HISTORY / rel
    digest = sha256(data)[:10]
    if any(folder.glob(f"*-{digest}{path.suffix}")):
        return None
    write_text(tree / HISTORY / ".gitignore", "*\n")
    dest = folder / f"{time.strftime('%Y%m%d-%H%M%S')}-{digest}{path.suffix}"
    write_file(dest, data)
    return dest


def write_file(path: Path, data: bytes) -> None:
    """Write bytes, creating parent folders."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def strip_solutions(root: Path) -> list[str]:
    """Strip outputs from solutions/*.ipynb in place with nbstripout; return the paths it changed
    (a notebook it cannot read is left for `generate` to report)."""
    paths = list(solution_notebooks(root)[0].values())
    before = {path: path.read_bytes() for path in paths}
    nbstripout(*map(str, paths))
    return [f"solutions/{path.name}" for path in paths if path.read_bytes() != before[path]]


# ----------------------------------------------------------------------------- commands


def build(root: Path = ROOT) -> int:
    """Strip solutions/, regenerate minisgl/ and notebooks/ (generated only: nothing of a
    learner's lives there, their work is in workspace/). Deletes nothing; `check` names files
    that no notebook writes any more."""
    for rel in strip_solutions(root):
        print(f"build: stripped outputs from {rel}")
    gen = generate(root)
    if gen.problems:
        print("\n".join(gen.problems), file=sys.stderr)
        print(f"build: {len(gen.problems)} problem(s) in solutions/; nothing generated",
              file=sys.stderr)
        return 1
    written = 0
    for rel, data in sorted(gen.files.items()):
        if read_bytes(root / rel) != data:
            write_file(root / rel, data)
            written += 1
    print(f"build: {written} files written, {len(gen.files) - written} unchanged")
    return 0


def notebook_problems(root: Path, gen: Generation) -> list[str]:
    """Notebooks nbstripout would change (outputs, counts, volatile metadata); solution text or
    missing tags in learner copies."""
    rels = [f"{folder}/{path.name}" for folder in ("solutions", "notebooks")
            for path in sorted((root / folder).glob("*.ipynb")) if not path.name.startswith("_")]
    problems = []
    for rel in rels:
        code, err = nbstripout("--verify", str(root / rel))
        if code and err:
            problems.append(f"{rel}: not a notebook nbstripout can read ({err})")
            continue
        if code:
            problems.append(f"{rel}: holds outputs or execution counts (`nbstripout --verify` "
                            "fails); run `python tools/workbook.py build` (it strips them)")
        if rel.startswith("notebooks/"):
            cells = read_json(root / rel).get("cells", [])
            chap = next((c for c in gen.chapters.values() if f"notebooks/{c.name}" == rel), None)
            problems += learner_problems(rel, cells, chap.bodies if chap else {})
    return problems


def learner_problems(rel: str, cells: list[dict], bodies: dict[str, str]) -> list[str]:
    """Solution text and missing `skip-execution` tags in one learner notebook's cells."""
    problems = []
    for i, cell in enumerate(cells):
        src, where = cell_source(cell), f"{rel} cell {i}"
        if "BEGIN SOLUTION" in src or "END SOLUTION" in src:
            problems.append(f"{where}: contains a solution marker; run `python tools/workbook.py "
                            "build` (if this is your own work, see README 'Your work')")
        for eid, body in bodies.items():
            if body.strip() and body in src:
                problems.append(f"{where}: contains the solution of exercise {eid} verbatim; "
                                "regenerate it with `python tools/workbook.py build`")
        tags = cell.get("metadata", {}).get("tags", [])
        is_writefile = cell.get("cell_type") == "code" and src.startswith("%%writefile")
        if is_writefile and SKIP_TAG not in tags:
            problems.append(f"{where}: %%writefile cell lacks the `{SKIP_TAG}` tag; run "
                            "`python tools/workbook.py build`")
    return problems


def check(root: Path = ROOT) -> int:
    """Report every problem in the tree (one per line); exit status 1 if any. Changes nothing."""
    gen = generate(root)
    problems, notes = list(gen.problems), []
    for nn, chap in sorted(gen.chapters.items()):
        if not chap.has_test_cell:
            problems.append(f"solutions/{chap.name}: no test cell; add a code cell calling "
                            f'`run_chapter_tests("{nn}")`')
    for rel, data in sorted(gen.files.items()):
        current = read_bytes(root / rel)
        if current is None:
            problems.append(f"{rel}: missing; run `python tools/workbook.py build`")
        elif current != data:
            problems.append(f"{rel}: differs from what solutions/ generates; run `python "
                            "tools/workbook.py build` (if this is your own work, see README "
                            "'Your work')")
    for rel in extra_files(root, gen.files):
        if rel.startswith("notebooks/"):
            problems.append(f"{rel}: not generated from solutions/; delete it, or start its name "
                            "with '_' for a scratch notebook")
        elif gen.chapters:
            problems.append(f"{rel}: written by no notebook; add a %%writefile cell for it in "
                            "solutions/ or delete it")
    if not gen.chapters:
        notes.append("check: note: no chapter notebooks in solutions/; skipped the "
                     "'written by no notebook' rule for minisgl/")
    problems += notebook_problems(root, gen)
    for line in notes + problems:
        print(line)
    if problems:
        print(f"check: {len(problems)} problem(s)")
        return 1
    modules = sum(rel.startswith("minisgl/") for rel in gen.files)
    print(f"check: OK ({len(gen.chapters)} notebooks, {modules} modules)")
    return 0


# ----------------------------------------------------------------------------- the workspace
#
# The learner works in workspace/ (git-ignored): workspace/notebooks/ holds their copies of the
# chapters, whose `../minisgl/` is workspace/minisgl/, their own package. No tool writes there
# except `workspace` (it adds files that are missing, never replaces one), `adopt` and `reset`
# (each keeps what it replaces in workspace/.history/ first).


def learner_copy(data: bytes) -> bytes:
    """A learner notebook as the workspace holds it: its %%writefile cells without the
    `skip-execution` tag, so that any way of running it (JupyterLab, nbclient, nbconvert,
    papermill) writes the learner's cells, stubs included, as JupyterLab does."""
    nb = json.loads(data.decode("utf-8"))
    for cell in nb.get("cells", []):
        tags = cell.get("metadata", {}).get("tags")
        if isinstance(tags, list) and SKIP_TAG in tags:
            tags.remove(SKIP_TAG)
            if not tags:
                del cell["metadata"]["tags"]
    return (json.dumps(nb, indent=1, ensure_ascii=False) + "\n").encode("utf-8")


def git_blob(root: Path, ref: str, rel: str) -> bytes | None:
    """The bytes of `rel` at git `ref`, or None (not there, or no git)."""
    import subprocess

    try:
        out = subprocess.run(["git", "show", f"{ref}:{rel}"], cwd=root, capture_output=True,
                             timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def _put(root: Path, rel: str, data: bytes, why: str) -> str:
    """Write `data` at workspace/<rel>, keeping a different version there in .history/."""
    ws = root / WORKSPACE
    dest = ws / rel
    old = read_bytes(dest)
    if old == data:
        return f"  {WORKSPACE}/{rel}: already holds it"
    kept = None
    if old is not None:
        kept = keep_history(ws, dest, old)
    write_file(dest, data)
    return f"  {WORKSPACE}/{rel}: {why}" + (f" (its previous version: {kept.relative_to(root)})"
                                           if kept else "")


def workspace(root: Path = ROOT) -> int:
    """Create workspace/ or add what it lacks: the learner copies of the chapters and the
    reference package, for files that are missing there (never replacing one). Work a learner
    left in the tracked minisgl/ or notebooks/ (the earlier layout: a file that differs both from
    what `build` generates and from git's HEAD) is moved in: copied into workspace/, then the
    tracked file is regenerated."""
    gen = generate(root)
    if gen.problems:
        raise WorkbookError(f"{gen.problems[0]} (`python tools/workbook.py check` lists every "
                            "problem); restore it with `git checkout -- solutions/`")
    ws = root / WORKSPACE
    created = not ws.exists()
    added, moved = 0, []
    for rel, data in sorted(gen.files.items()):
        current = read_bytes(root / rel)
        if current is not None and current != data and current != git_blob(root, "HEAD", rel):
            copy = learner_copy(current) if rel.endswith(".ipynb") else current
            moved.append(_put(root, rel, copy, f"your work, moved from {rel}"))
            if read_bytes(ws / rel) == copy:  # safely there: regenerate the tracked file
                write_file(root / rel, data)
        if not (ws / rel).exists():
            write_file(ws / rel, learner_copy(data) if rel.endswith(".ipynb") else data)
            added += 1
    scratch = [f"notebooks/{p.name}" for p in (root / "notebooks").glob("_*.ipynb")]
    for rel in extra_files(root, gen.files) + scratch:
        if not (ws / rel).exists():  # a scratch notebook or a module of the learner's own
            moved.append(_put(root, rel, (root / rel).read_bytes(), f"your file, copied from {rel}"))
    write_text(ws / ".gitignore", "*\n")
    models = ws / "models"  # the notebooks read ../models/: the repository's prepared weights
    if not models.exists() and not models.is_symlink():
        models.symlink_to(Path("..") / "models", target_is_directory=True)
    print(f"workspace: {'created' if created else 'up to date:'} {WORKSPACE}/"
          + (f" ({added} files added)" if added else "")
          + f". Your notebooks are in {WORKSPACE}/notebooks/ (`make lab` opens them).")
    if moved:
        print("workspace: your work from the earlier layout is in your workspace now:")
        print("\n".join(moved))
    return 0


def adopt(root: Path, ref: str) -> int:
    """Copy the learner's files kept in git (a stash such as stash@{0}, a branch or a commit)
    under minisgl/ and notebooks/ into workspace/: every file that `ref` changed or added against
    its base (a stash's parent, or the merge base with HEAD), a stash's untracked files
    included. What it replaces in workspace/ is kept in workspace/.history/."""
    import subprocess

    def git(*args: str, ok: bool = False) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                                 timeout=60)
        except (OSError, subprocess.SubprocessError) as exc:
            raise WorkbookError(f"git {' '.join(args)}: {exc}") from None
        if out.returncode != 0:
            if ok:
                return None
            raise WorkbookError(f"`git {' '.join(args)}` failed ({out.stderr.strip()}); name a "
                                "stash (`git stash list`), a branch or a commit")
        return out.stdout.strip()

    commit = git("rev-parse", "--verify", "--end-of-options", f"{ref}^{{commit}}")
    is_stash = commit in (git("stash", "list", "--format=%H", ok=True) or "").split()
    base = git("rev-parse", f"{commit}^1") if is_stash else git("merge-base", commit, "HEAD")
    untracked = git("rev-parse", "--verify", "-q", f"{commit}^3", ok=True) if is_stash else None
    if not (root / WORKSPACE).exists():
        workspace(root)
    lines = []
    changed = git("diff", "--name-only", "--no-renames", "--diff-filter=AM", base, commit, "--",
                  "minisgl", "notebooks")
    sources = [(commit, rel) for rel in changed.splitlines() if rel]
    if untracked:
        listed = git("ls-tree", "-r", "--name-only", untracked, "--", "minisgl", "notebooks")
        sources += [(untracked, rel) for rel in listed.splitlines() if rel]
    for tree, rel in sources:
        data = git_blob(root, tree, rel)
        if data is not None:
            copy = learner_copy(data) if rel.endswith(".ipynb") and not rel.startswith(
                "notebooks/_") else data
            lines.append(_put(root, rel, copy, f"your version from {ref}"))
    print(f"adopt: {len(lines)} file(s) from {ref}" + (":" if lines else "; nothing to copy"))
    if lines:
        print("\n".join(lines))
    return 0


def reset(root: Path, chapter: str, notebook: bool = False) -> int:
    """Put chapter NN's reference modules (and with notebook=True its learner notebook) into
    workspace/, keeping every file it replaces in workspace/.history/ first."""
    nn = chapter_id(chapter)
    gen = generate(root)
    chap = gen.chapters.get(nn)
    if chap is None:
        unreadable = [p for p in gen.problems if p.startswith(f"solutions/{nn}_")]
        if unreadable:
            raise WorkbookError(f"{unreadable[0]}; restore it (`git checkout -- solutions/`)")
        have = ", ".join(sorted(gen.chapters)) or "none (solutions/ has no NN_slug.ipynb)"
        raise WorkbookError(f"unknown chapter {chapter!r}; chapters that exist: {have}")
    if chap.problems:
        raise WorkbookError(f"fix solutions/ first: {chap.problems[0]}")
    rels = sorted(rel for rel, o in gen.origin.items()
                  if o == nn and (notebook or rel.startswith("minisgl/")))
    lines = [_put(root, rel, learner_copy(gen.files[rel]) if rel.endswith(".ipynb")
                  else gen.files[rel], "the reference") for rel in rels]
    changed = [line for line in lines if not line.endswith("already holds it")]
    if changed:
        print("\n".join(changed))
    print(f"reset: chapter {nn}'s {'modules and notebook' if notebook else 'modules'} in "
          f"{WORKSPACE}/ are the reference now" + (f"; what they replaced is in "
                                                   f"{WORKSPACE}/{HISTORY}/" if changed else ""))
    return 0


def need_packages(command: str, args: str) -> None:
    """The commands read notebooks with nbformat and nbstripout: under a Python that lacks them
    (the plain `python3` of a fresh machine), say which Python has them."""
    missing = [name for name in ("nbformat", "nbstripout") if not _importable(name)]
    if missing:
        raise WorkbookError(
            f"`{command}` needs the workbook's packages ({', '.join(missing)} missing from "
            f"{sys.executable}). Run it with the workbook's Python, `.venv/bin/python "
            f"tools/workbook.py {args}`, or through make (`make setup` creates .venv).")


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def file_error(exc: BaseException) -> str:
    """One line for a file-system failure: which file, what is wrong, what to do."""
    import errno

    name = getattr(exc, "filename", None) or getattr(exc, "filename2", None) or "a file"
    if isinstance(exc, PermissionError):
        return (f"{name}: not writable (read-only, or owned by another user); make it writable "
                f"(`chmod u+w {name}`) or work in a copy you own")
    if isinstance(exc, IsADirectoryError):
        return f"{name}: a folder stands where a file belongs; move that folder away"
    if isinstance(exc, NotADirectoryError):
        return f"{name}: a file stands where a folder belongs; move that file away"
    if isinstance(exc, FileNotFoundError):
        return f"{name}: missing; restore it (`git checkout -- {name}` for a tracked file)"
    if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
        return f"{name}: the disk is full; free some space, then run the command again"
    if isinstance(exc, UnicodeError):
        return (f"{name}: not UTF-8 text ({exc.reason if hasattr(exc, 'reason') else exc}); "
                "restore it (`git checkout -- FILE` for a tracked file) or move it away")
    if isinstance(exc, json.JSONDecodeError):
        return (f"a notebook is not valid JSON ({exc.msg} at line {exc.lineno}); restore it with "
                "`git checkout -- FILE` or move it away")
    return f"{name}: {exc.strerror or exc}" if isinstance(exc, OSError) else str(exc)


def check_root(root: Path) -> Path:
    """`--root` must be a workbook checkout: a folder holding solutions/ and tools/."""
    if not root.exists():
        raise WorkbookError(f"--root {root}: no such folder; give the workbook's folder (the one "
                            "holding solutions/ and tools/)")
    if not root.is_dir():
        raise WorkbookError(f"--root {root}: a file, not a folder; give the workbook's folder")
    if not (root / "solutions").is_dir() or not (root / "tools").is_dir():
        raise WorkbookError(f"--root {root}: not a workbook (no solutions/ and tools/ in it); "
                            "run from the workbook's folder or give it with --root")
    return root


COMMANDS = {
    "build": "strip solutions/, regenerate minisgl/ and notebooks/",
    "check": "verify the tree; exit 1 listing every problem",
    "workspace": "create workspace/ (your notebooks and package) or add what it lacks",
    "adopt": "copy your files kept in git (a stash, a branch, a commit) into workspace/",
    "reset": "put chapter NN's reference modules into workspace/ (keeps yours in .history/)",
}


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog="python tools/workbook.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root (default: "
                        "the checkout holding this file)")
    sub = parser.add_subparsers(dest="command", required=True)
    parsers = {name: sub.add_parser(name, help=text) for name, text in COMMANDS.items()}
    parsers["adopt"].add_argument("ref", help="a stash (stash@{0}), a branch or a commit")
    parsers["reset"].add_argument("chapter", help="chapter number, e.g. 04")
    parsers["reset"].add_argument("--notebook", action="store_true",
                                  help="also workspace/notebooks/NN_*.ipynb")
    args = parser.parse_args(argv)
    try:
        root = check_root(args.root.resolve())
        need_packages(args.command, shlex.join(sys.argv[1:] if argv is None else argv))
        if args.command == "reset":
            return reset(root, args.chapter, args.notebook)
        if args.command == "adopt":
            return adopt(root, args.ref)
        return {"build": build, "check": check, "workspace": workspace}[args.command](root)
    except WorkbookError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (OSError, UnicodeError, ValueError) as exc:
        print(f"error: {file_error(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
