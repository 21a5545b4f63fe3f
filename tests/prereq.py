"""Check that earlier chapters' modules work before testing a later chapter.

A chapter's tests build on the modules of the chapters before it. When one of those is broken
(a stub left in, a bug), the failure would surface deep inside the later chapter's code. Instead,
each later test file calls ``require("01", "02")`` first; it runs those chapters' own
``quick_check()`` and, when one fails, stops with "chapter 02's module fails its own checks —
fix it first".
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

TESTS = pathlib.Path(__file__).resolve().parent
_PASSED: set[str] = set()


def _load_test_module(chapter: str):
    files = sorted(TESTS.glob(f"test_ch{chapter}_*.py"))
    if not files:
        raise FileNotFoundError(f"no tests/test_ch{chapter}_*.py")
    spec = importlib.util.spec_from_file_location(f"_prereq_ch{chapter}", files[0])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and friends look their module up here
    spec.loader.exec_module(module)
    return module


def require(*chapters: str) -> None:
    """Run the quick checks of earlier chapters; fail with a clear message if one is broken."""
    for chapter in chapters:
        if chapter in _PASSED:
            continue
        try:
            _load_test_module(chapter).quick_check()
        except NotImplementedError as e:
            pytest.fail(
                f"chapter {chapter}'s module is not finished ({e}); finish chapter {chapter} first "
                f"(or restore the reference with `python tools/workbook.py reset {chapter}`).",
                pytrace=False,
            )
        except Exception as e:  # noqa: BLE001 - any failure means the earlier chapter is broken
            pytest.fail(
                f"chapter {chapter}'s module fails its own checks — fix it first: "
                f"{type(e).__name__}: {e}\n(run `python -m pytest tests/test_ch{chapter}_*.py` to "
                f"see details, or `python tools/workbook.py reset {chapter}` to restore the "
                f"reference)",
                pytrace=False,
            )
        _PASSED.add(chapter)
