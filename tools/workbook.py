"""Workbook toolchain: solutions/ is the single source of truth for minisgl/ and notebooks/.

    python tools/workbook.py build        strip solutions/, regenerate minisgl/ and notebooks/
    python tools/workbook.py check        verify the tree (CI); changes nothing
    python tools/workbook.py status       exit 1 if minisgl/ or notebooks/ hold your own work
    python tools/workbook.py reset NN [--notebook]
                                          restore chapter NN's reference files (backs up yours)

The chapter notebooks `solutions/NN_slug.ipynb` write the package with
`%%writefile ../minisgl/<path>.py` cells. Exercise regions inside function bodies look like

        # BEGIN SOLUTION 4.2: write k and v into the pool
        ...solution lines...
        # END SOLUTION

and become `raise NotImplementedError("Exercise 4.2: write k and v into the pool")` in the learner
copy `notebooks/NN_slug.ipynb`. `tools/workbook-manifest.json` records the sha256 of every file
`build` generated, so that `build` never overwrites a learner's own work. Outputs are stripped
and checked by nbstripout (`build` runs it in place, `check` runs `nbstripout --verify`).

This module must import quickly (tools/nbtools.py uses it from notebooks): nbformat and nbstripout
are imported only inside the functions that need them.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import posixpath
import re
import shlex
import shutil
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = "tools/workbook-manifest.json"
BACKUP_DIR = ".workbook-backup"
SKIP_TAG = "skip-execution"
NB_NAME = re.compile(r"^(\d\d)_.+\.ipynb$")
MARKER = re.compile(r"^([ \t]*)#[ \t]*(BEGIN|END) SOLUTION\b(.*)$")
HEADER = re.compile(r"^\s+(\d+)\.(\d+)\s*:\s*(\S.*?)\s*$")


class WorkbookError(Exception):
    """A user-facing error: the CLI prints it and exits with code 2."""


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

    target is relative to the repository root ("minisgl/x/y.py"); "" when invalid.
    """
    first, _, body = source.partition("\n")
    if not first.startswith("%%writefile"):
        return None
    errors, target = [], ""
    try:
        args = shlex.split(first[len("%%writefile"):])
    except ValueError as exc:
        return "", body, [f"cannot parse `{first}`: {exc}"]
    if any(a in ("-a", "--append") for a in args):
        errors.append("`%%writefile -a` (append) is not allowed: write each file from one cell")
    paths = [a for a in args if not a.startswith("-")]
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
    return target, body, errors


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
    writer: dict[str, int] = {}
    for i, cell in enumerate(chap.learner.get("cells", [])):
        src, where = cell_source(cell), f"solutions/{name} cell {i}"
        parsed = parse_writefile(src) if cell.get("cell_type") == "code" else None
        if parsed is None:
            if "BEGIN SOLUTION" in src or "END SOLUTION" in src:
                chap.problems.append(f"{where}: solution markers are allowed only in %%writefile "
                                     "cells")
            chap.has_test_cell |= cell.get("cell_type") == "code" and bool(test_call.search(src))
            continue
        target, body, errors = parsed
        stubbed, bodies, stub_errors = stub(body, nn, where)
        chap.problems += [f"{where}: {e}" for e in errors] + stub_errors
        for eid, text in bodies.items():
            if eid in chap.bodies:
                chap.problems.append(f"{where}: duplicate exercise id {eid} in chapter {nn}")
            chap.bodies[eid] = text
        if target in writer:
            chap.problems.append(f"{where}: {target} is already written by cell {writer[target]}")
        elif target:
            writer[target] = i
            chap.modules[target] = written_content(body)
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
    stubs = {}
    for cell in chap.learner.get("cells", []):
        parsed = parse_writefile(cell_source(cell)) if cell.get("cell_type") == "code" else None
        if parsed and parsed[0]:
            stubs[parsed[0]] = written_content(parsed[1])
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


def load_manifest(root: Path) -> dict[str, str]:
    """The manifest: generated path -> sha256 of what `build` last wrote."""
    path = root / MANIFEST
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def save_manifest(root: Path, manifest: dict[str, str]) -> None:
    """Write the manifest (sorted, stable) if it changed."""
    path = root / MANIFEST
    text = json.dumps(dict(sorted(manifest.items())), indent=2) + "\n"
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


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


def backup(root: Path, rels: list[str]) -> Path:
    """Copy files (paths relative to root) into a new .workbook-backup/<timestamp>/ folder. The
    backup folder holds a `.gitignore` of `*`, so git never offers to commit it."""
    (root / BACKUP_DIR).mkdir(exist_ok=True)
    (root / BACKUP_DIR / ".gitignore").write_text("*\n", encoding="utf-8")
    dest = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=root / BACKUP_DIR))
    for rel in rels:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, dest / rel)
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


def keep_or_discard(rel: str, nn: str) -> str:
    """Advice for a file of chapter NN that holds the learner's work."""
    keep = ("keep it: `git stash push --include-untracked -- minisgl notebooks` (later: `git "
            "stash pop`)")
    if rel.startswith("notebooks/"):
        how = f"move it away, or `python tools/workbook.py reset {nn} --notebook`"
    else:
        how = f"`python tools/workbook.py reset {nn}` (backs up, then restores its modules)"
    return f"  {rel}\n      {keep}\n      discard it: {how}"


def build(root: Path = ROOT) -> int:
    """Strip solutions/, regenerate minisgl/ and notebooks/ without overwriting learner work."""
    for rel in strip_solutions(root):
        print(f"build: stripped outputs from {rel}")
    gen = generate(root)
    if gen.problems:
        print("\n".join(gen.problems), file=sys.stderr)
        print(f"build: {len(gen.problems)} problem(s) in solutions/; nothing generated",
              file=sys.stderr)
        return 1
    manifest = load_manifest(root)
    written = unchanged = removed = 0
    blocked = []
    for rel, data in sorted(gen.files.items()):
        current = read_bytes(root / rel)
        if current == data:
            unchanged += 1
        elif current is not None and sha256(current) != manifest.get(rel):
            blocked.append(rel)
            continue
        else:
            write_file(root / rel, data)
            written += 1
        manifest[rel] = sha256(data)
    for rel in sorted(set(manifest) - set(gen.files)):
        current = read_bytes(root / rel)
        if current is not None and sha256(current) == manifest[rel]:
            (root / rel).unlink()
            removed += 1
        elif current is not None:
            print(f"build: {rel} is no longer generated but holds your changes; left it in place")
        del manifest[rel]
    save_manifest(root, manifest)
    print(f"build: {written} files written, {unchanged} unchanged" +
          (f", {removed} removed" if removed else ""))
    if blocked:
        print(f"build: left {len(blocked)} file(s) alone: they hold your own work (they differ "
              "from what build generated last time and from what it generates now):")
        print("\n".join(keep_or_discard(rel, gen.origin[rel]) for rel in blocked))
        return 1
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
    if load_manifest(root) != {rel: sha256(data) for rel, data in gen.files.items()}:
        problems.append(f"{MANIFEST}: out of date; run `python tools/workbook.py build`")
    for line in notes + problems:
        print(line)
    if problems:
        print(f"check: {len(problems)} problem(s)")
        return 1
    modules = sum(rel.startswith("minisgl/") for rel in gen.files)
    print(f"check: OK ({len(gen.chapters)} notebooks, {modules} modules)")
    return 0


def learner_work(root: Path) -> list[str]:
    """Files under minisgl/ or notebooks/ that `build` did not write: a generated file whose hash
    is not the one recorded in the manifest, or a file no notebook generates. Needs no nbformat,
    so it works on a fresh machine before set-up."""
    manifest = load_manifest(root)
    current = {rel: read_bytes(root / rel) for rel in sorted(manifest)}
    work = [rel for rel, data in current.items()
            if data is not None and sha256(data) != manifest[rel]]
    return work + extra_files(root, manifest)


def module_chapters(root: Path) -> dict[str, str]:
    """Generated path -> chapter NN, read from solutions/ without nbformat (for `status`)."""
    owner = {}
    for nn, path in solution_notebooks(root)[0].items():
        owner[f"notebooks/{path.name}"] = nn
        try:
            cells = read_json(path).get("cells", [])
        except (OSError, ValueError):
            continue
        for cell in cells:
            parsed = parse_writefile(cell_source(cell)) if cell.get("cell_type") == "code" else None
            if parsed and parsed[0]:
                owner[parsed[0]] = nn
    return owner


def git_states(root: Path, rels: list[str]) -> dict[str, str] | None:
    """For each path: "uncommitted" (changed or not in git) or "committed"; None without git."""
    import subprocess

    try:
        out = subprocess.run(["git", "status", "--porcelain", "-z", "--untracked-files=all",
                              "--", *rels], cwd=root, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    dirty = {entry[3:] for entry in out.stdout.decode("utf-8", "replace").split("\0") if entry[3:]}
    return {rel: "uncommitted" if rel in dirty else "committed" for rel in rels}


def status_advice(root: Path, work: list[str]) -> list[str]:
    """Commands that set the learner's work aside, for the situation the files are in: changed
    and not committed (stash them), committed on this branch (a branch keeps them; `reset`
    restores the reference), notebooks (`reset NN --notebook`), files no notebook writes (move)."""
    owner = module_chapters(root)
    states = git_states(root, work)
    chapters: dict[str, bool] = {}  # NN -> a notebook of it is among the work
    extra = []
    for rel in work:
        if rel in owner:
            chapters[owner[rel]] = chapters.get(owner[rel], False) or rel.startswith("notebooks/")
        else:
            extra.append(rel)
    # `make reset` sets up .venv first: the advice works before `make setup` too
    resets = {nn: f"make reset CH={nn}" + (" NB=1" if nb else "") for nn, nb in sorted(chapters.items())}
    moves = {rel: f"mkdir -p ../my-minisgl-work && mv {rel} ../my-minisgl-work/" for rel in extra}
    lines = ["`make test` rewrites minisgl/ and notebooks/, so it stops here. To go on:"]
    uncommitted = [rel for rel in work if states is None or states[rel] == "uncommitted"]
    committed = [rel for rel in work if rel not in uncommitted]
    if states is not None and uncommitted:
        lines += ["  keep your uncommitted work in git's stash:",
                  "      git stash push --include-untracked -- minisgl notebooks"
                  "      # later: git stash pop"]
    if committed:
        lines.append("  your committed files stay in git's history: restore the reference now "
                     "(each file is copied to .workbook-backup/ first), and after the tests "
                     "`git restore minisgl notebooks` brings yours back:")
        owned = sorted({owner[rel] for rel in committed if rel in owner})
        lines += [f"      {resets[nn]}" for nn in owned]
        lines += [f"      {moves[rel]}" for rel in committed if rel in moves]
    if uncommitted:
        lines.append(("  or set it all aside" if states is not None else "  set it aside") +
                     f" (each file is copied to {BACKUP_DIR}/ first, then the reference is "
                     "restored):")
        lines += [f"      {cmd}" for cmd in [*resets.values(), *moves.values()]]
    return lines


def status(root: Path = ROOT) -> int:
    """Exit 1 (with advice) when minisgl/ or notebooks/ hold the learner's own work. (A file that
    is merely out of date, generated from an older solutions/, is `check`'s business.)"""
    work = learner_work(root)
    if not work:
        print("status: clean")
        return 0
    print("status: these files hold your own work (they differ from what "
          "`python tools/workbook.py build` generated):")
    states = git_states(root, work) or {}
    print("\n".join(f"  {rel}" + (f"   ({states[rel]})" if rel in states else "") for rel in work))
    print("\n".join(status_advice(root, work)))
    return 1


def reset(root: Path, chapter: str, notebook: bool = False) -> int:
    """Restore chapter NN's reference modules (and with notebook=True its learner notebook).

    Every file that differs from the reference is first copied to .workbook-backup/<timestamp>/.
    """
    nn = chapter_id(chapter)
    gen = generate(root)
    chap = gen.chapters.get(nn)
    if chap is None:
        have = ", ".join(sorted(gen.chapters)) or "none (solutions/ has no NN_slug.ipynb)"
        raise WorkbookError(f"unknown chapter {chapter!r}; chapters that exist: {have}")
    if chap.problems:
        raise WorkbookError("fix solutions/ first:\n" + "\n".join(chap.problems))
    rels = sorted(rel for rel, o in gen.origin.items()
                  if o == nn and (notebook or rel.startswith("minisgl/")))
    differing = [rel for rel in rels if read_bytes(root / rel) not in (None, gen.files[rel])]
    if differing:
        dest = backup(root, differing)
        for rel in differing:
            print(f"reset: saved your {rel} to {(dest / rel).relative_to(root).as_posix()}")
    manifest = load_manifest(root)
    for rel in rels:
        write_file(root / rel, gen.files[rel])
        manifest[rel] = sha256(gen.files[rel])
    save_manifest(root, manifest)
    what = "modules and notebook" if notebook else "modules"
    print(f"reset: restored chapter {nn}'s reference {what} ({len(rels)} files, "
          f"{len(differing)} backed up)")
    return 0


def need_packages(command: str, args: str, chapter: str | None, notebook: bool) -> None:
    """`build`, `check` and `reset` read notebooks with nbformat and nbstripout: under a Python
    that lacks them (the plain `python3` of a fresh machine), say which Python has them."""
    missing = [name for name in ("nbformat", "nbstripout") if not _importable(name)]
    if missing:
        make = {"build": "make workbook", "check": "make check",
                "reset": f"make reset CH={chapter}" + (" NB=1" if notebook else "")}[command]
        raise WorkbookError(
            f"`{command}` needs the workbook's packages ({', '.join(missing)} missing from "
            f"{sys.executable}). Run it with the workbook's Python, `.venv/bin/python "
            f"tools/workbook.py {args}`, or as `{make}` "
            "(which creates .venv first when it is missing).")


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog="python tools/workbook.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root (default: "
                        "the checkout holding this file)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="strip solutions/, regenerate minisgl/ and notebooks/")
    sub.add_parser("check", help="verify the tree; exit 1 listing every problem")
    sub.add_parser("status", help="exit 1 if minisgl/ or notebooks/ hold your own work")
    p = sub.add_parser("reset", help="restore chapter NN's reference modules (backs yours up)")
    p.add_argument("chapter", help="chapter number, e.g. 04")
    p.add_argument("--notebook", action="store_true", help="also restore notebooks/NN_*.ipynb")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    try:
        if args.command != "status":
            need_packages(args.command, shlex.join(sys.argv[1:] if argv is None else argv),
                          getattr(args, "chapter", None), getattr(args, "notebook", False))
        if args.command == "reset":
            return reset(root, args.chapter, args.notebook)
        return {"build": build, "check": check, "status": status}[args.command](root)
    except WorkbookError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
