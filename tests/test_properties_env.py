"""Property tests (Hypothesis): every MINISGL_* variable's reader, given any text, returns a value
of its type within its range, or raises one of docs/errors.md's errors naming the variable (never
a wait without end, a silent default or a traceback). The kernel cache path of any kind (missing,
a file, below a file, a folder) gives a private folder or a catalogued error."""

from __future__ import annotations

import math
import os
import pathlib

import pytest
from errors_catalogue import assert_catalogued
from helpers import generated
from hypothesis import HealthCheck, assume, given
from hypothesis import strategies as st

import minisgl.kernel.cache as kcache
from minisgl.utils.env import read_env

SETTINGS = generated(40, [HealthCheck.function_scoped_fixture])

numberish = st.one_of(st.text(max_size=12), st.floats().map(repr), st.integers().map(str),
                      st.sampled_from(["nan", "inf", "-inf", "-1", "1e400", "0", "300", " 5 ",
                                       "1_0", "0x10", "", "   "]))


def _settable(value: str) -> bool:
    """Only what an environment can hold (no NUL, encodable)."""
    try:
        os.fsencode(value)
    except UnicodeError:
        return False
    return "\0" not in value


def _read(monkeypatch, name, value, reader, quoted=None):
    monkeypatch.setenv(name, value)
    try:
        return reader(), None
    except Exception as e:  # noqa: BLE001 - the property: a catalogued error
        quoted = repr(value) if quoted is None else quoted
        assert name in str(e), f"{name}={value!r}: the message does not name the variable: {e}"
        assert quoted in str(e), f"{name}={value!r}: the message does not quote it: {e}"
        assert_catalogued(e)
        return None, e


@SETTINGS
@given(numberish)
def test_lock_timeout_any_text(monkeypatch, value):
    assume(_settable(value))
    got, err = _read(monkeypatch, "MINISGL_KERNEL_LOCK_TIMEOUT", value, kcache.lock_timeout)
    if err is None:
        assert isinstance(got, float) and math.isfinite(got) and 0 <= got <= 86400, got
        if value.strip():
            assert got == float(value.strip())
        else:
            assert got == 300.0


@SETTINGS
@given(numberish, st.sampled_from([(int, 0, 10), (float, 1, None), (int, None, None)]))
def test_read_env_numbers(monkeypatch, value, spec):
    assume(_settable(value))
    kind, low, high = spec
    got, err = _read(monkeypatch, "MINISGL_TEST_NUMBER", value,
                     lambda: read_env("MINISGL_TEST_NUMBER", kind, "dflt", low=low, high=high))
    if err is None and got != "dflt":
        assert type(got) is kind and math.isfinite(got)
        assert (low is None or got >= low) and (high is None or got <= high)


@SETTINGS
@given(st.text(max_size=12))
def test_choice_variables_any_text(monkeypatch, value):
    assume(_settable(value))
    import test_browser

    got, err = _read(monkeypatch, "MINISGL_BROWSER_NOTEBOOKS", value, test_browser._chapters)
    if err is None:
        assert got is None or all(len(c) == 2 and c.isdigit() for c in got), got
    got, err = _read(monkeypatch, "MINISGL_GPU_TEST_DEVICE", value,
                     lambda: read_env("MINISGL_GPU_TEST_DEVICE", str, "cuda",
                                      choices=("cuda", "cpu")))
    if err is None:
        assert got in ("cuda", "cpu")


@SETTINGS
@given(st.sampled_from(["missing", "file", "below-file", "folder", "nested-missing"]),
       st.text(alphabet=st.characters(blacklist_characters="/\0", blacklist_categories=("Cs",)),
               min_size=1, max_size=8))
def test_kernel_cache_path_of_any_kind(monkeypatch, tmp_path_factory, kind, name):
    assume(name not in (".", ".."))
    base = tmp_path_factory.mktemp("kc")
    path = {"missing": base / name, "file": base / name, "below-file": base / "f" / name,
            "folder": base / name, "nested-missing": base / "a" / name}[kind]
    if kind == "file":
        path.write_text("x")
    elif kind == "below-file":
        (base / "f").write_text("x")
    elif kind == "folder":
        path.mkdir()
    got, err = _read(monkeypatch, "MINISGL_KERNEL_CACHE", str(path),
                     lambda: kcache._private_dir(kcache.cache_dir()), quoted=str(path))
    assert (err is None) == (kind in ("missing", "folder", "nested-missing")), (kind, err)
    if err is None:
        assert got.is_dir() and (got.stat().st_mode & 0o077) == 0


def test_kernel_load_names_no_compiler_for_a_cache_problem(monkeypatch, tmp_path, capsys):
    """A cache path that is a file is a cache problem: the one line says so, without the
    compiler advice (which was the wrong fix)."""
    import minisgl.kernel as kernel

    (tmp_path / "cache").write_text("x")
    monkeypatch.setenv("MINISGL_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kernel, "_MODULE", None)
    monkeypatch.setattr(kernel, "_FAILED", None)
    assert kernel.load() is None
    err = capsys.readouterr().err
    assert "is a file, not a folder" in err and "C++ compiler" not in err, err


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_kernel_load_refuses_a_bad_timeout(monkeypatch, tmp_path, value):
    import minisgl.kernel as kernel

    monkeypatch.setenv("MINISGL_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MINISGL_KERNEL_LOCK_TIMEOUT", value)
    monkeypatch.setattr(kernel, "_MODULE", None)
    monkeypatch.setattr(kernel, "_FAILED", None)
    with pytest.raises(ValueError, match="MINISGL_KERNEL_LOCK_TIMEOUT") as info:
        kernel.load()
    assert_catalogued(info.value)
    assert not pathlib.Path(tmp_path / "cache").exists(), "a bad setting touched the disk"
