"""Map an exception (or a command line's exit) to its row of docs/errors.md.

The property tests (tests/test_properties_*.py) accept an outcome only when it is a valid run or
one of the catalogue's errors: ``row_for`` finds the row whose exception type matches and whose
value-free fragments (those without ``=`` or digits, e.g. ``is not a finite number``) all appear
in the message, and fails the test, quoting the message, when no row fits.
"""

from __future__ import annotations

import re

from helpers import ROOT


def _rows() -> dict[str, tuple[str, list[str]]]:
    rows = {}
    for line in (ROOT / "docs" / "errors.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("id", "---") or set(cells[0]) <= {"-"}:
            continue
        rows[cells[0]] = (cells[2], re.findall(r"`([^`]+)`", cells[3]))
    return rows


ROWS = _rows()


def _generic(fragment: str) -> bool:
    return not re.search(r"[=\d'/]", fragment) and fragment not in ("the key", "the task")


def row_for(kind: str | BaseException, message: str | None = None) -> str:
    """The id of the errors.md row for this exception (or ``"exit status N"`` and its stderr)."""
    if isinstance(kind, BaseException):
        message = str(kind) if message is None else message
        names = {c.__name__ for c in type(kind).__mro__}
    else:
        names = {kind}
    best, best_hits = None, -1
    for rid, (exc, fragments) in ROWS.items():
        if exc not in names:
            continue
        generic = [f for f in fragments if _generic(f)]
        if generic and not all(f in message for f in generic):
            continue
        hits = sum(f in message for f in fragments)
        if not generic and hits == 0:
            continue
        if hits > best_hits:
            best, best_hits = rid, hits
    assert best is not None, (f"no docs/errors.md row fits this error ({sorted(names)[0]}): "
                              f"{message}")
    return best


def assert_catalogued(err: BaseException) -> str:
    """``err`` is one of the catalogue's errors, with no traceback text in its message."""
    rid = row_for(err)
    assert "Traceback" not in str(err), f"{rid}: a traceback inside the message: {err}"
    return rid
