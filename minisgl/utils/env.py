# Chapter 01 (01_req_batch_context.ipynb): the one reader of minisgl's environment variables.
"""``read_env``: every ``MINISGL_*`` variable is read here, with its type and range checked.

A bad value is refused with one message naming the variable, the value and what it accepts, so a
typo never turns into a silent default, a wait without end (``nan`` seconds) or a traceback deep
inside a later chapter. Standard library only: tools may load this file before set-up.
"""

from __future__ import annotations

import math
import os
import pathlib
from typing import Any, Sequence


class EnvVarError(ValueError):
    """A ``MINISGL_*`` environment variable holds a value minisgl cannot use."""


def env_error(name: str, raw: str, problem: str, accepted: str) -> EnvVarError:
    """The one message format: the variable, its value, what is wrong, what it accepts."""
    return EnvVarError(f"{name}={raw!r} {problem}; {name} accepts {accepted}. Set it to such a "
                       f"value, or unset it (`unset {name}`) for the default.")


def _accepted(kind: type, low: Any, high: Any, choices: Sequence[str] | None) -> str:
    if choices is not None:
        return "one of " + ", ".join(repr(c) for c in choices)
    if kind is bool:
        return "1 or 0 (also true/false, yes/no, on/off)"
    if kind is pathlib.Path:
        return "a path"
    what = {int: "a whole number", float: "a finite number"}.get(kind, "text")
    if low is not None and high is not None:
        return f"{what} from {low} to {high}"
    if low is not None:
        return f"{what} of at least {low}"
    if high is not None:
        return f"{what} of at most {high}"
    return what


def read_env(name: str, kind: type = str, default: Any = None, *, low: Any = None,
             high: Any = None, choices: Sequence[str] | None = None) -> Any:
    """``$name`` as ``kind`` (str, int, float, bool or pathlib.Path), or ``default`` when unset or
    empty. Numbers must be finite and within ``[low, high]``; text must be one of ``choices`` when
    given. Anything else raises an ``EnvVarError`` (a ValueError) naming the variable."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip()
    accepted = _accepted(kind, low, high, choices)
    if kind is bool:
        flags = {"1": True, "true": True, "yes": True, "on": True,
                 "0": False, "false": False, "no": False, "off": False}
        if value.lower() not in flags:
            raise env_error(name, raw, "is not a yes/no value", accepted)
        return flags[value.lower()]
    if kind in (int, float):
        try:
            number = int(value) if kind is int else float(value)
        except ValueError:
            raise env_error(name, raw, "is not a number", accepted) from None
        if not math.isfinite(number):
            raise env_error(name, raw, "is not a finite number", accepted)
        if (low is not None and number < low) or (high is not None and number > high):
            raise env_error(name, raw, "is outside the accepted range", accepted)
        return number
    if "\0" in value:
        raise env_error(name, raw, "holds a NUL character", accepted)
    if kind is pathlib.Path:
        try:
            os.fsencode(value)
        except UnicodeError:
            raise env_error(name, raw, "is not a path this system can encode", accepted) from None
        return pathlib.Path(value).expanduser()
    if choices is not None and value not in choices:
        raise env_error(name, raw, "is not an accepted value", accepted)
    return value
