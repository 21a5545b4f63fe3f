# Chapter 01 (01_req_batch_context.ipynb): SamplingParams, how one request picks its tokens.
"""A request's sampling options, checked where the user sets them and again where they are used.

``check_sampling_params`` holds the rules; the constructor runs it, and the sampler (chapter 06)
runs it on every batch, so a field changed after construction cannot slip through.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any


def is_count(value: Any) -> bool:
    """A whole number given as an integer (bool is an int in Python, but never a count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)




def _is_real(value: Any) -> bool:
    """A real number (int or float, numpy's included), not a bool or a string."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_sampling_params(params: "SamplingParams", where: str = "SamplingParams") -> None:
    """The rules for every field, in one place: the constructor runs them, and so does the sampler
    (``Sampler.prepare``) on every batch, so a field changed after construction
    (``sp.top_k = 0``) is refused with the same message. ``where`` starts the message."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"{where}={params!r} is not a SamplingParams; pass "
                        "SamplingParams(temperature=..., top_k=..., top_p=...), or None for greedy.")
    for name, example in (("temperature", "0.7 (0 for greedy)"), ("top_p", "0.9 (1.0 keeps "
                                                                      "every token)")):
        value = getattr(params, name)
        if not _is_real(value):
            raise TypeError(f"{where}: {name}={value!r} is not a number; pass a float "
                            f"such as {name}={example}.")
        if not math.isfinite(value):
            raise ValueError(f"{where}: {name}={value!r} is not a finite number; pass "
                             f"a float such as {name}={example}.")
    for name, example in (("top_k", "40 (-1 for no top-k cut)"), ("max_tokens", "64")):
        value = getattr(params, name)
        if not is_count(value):
            raise TypeError(f"{where}: {name}={value!r} is not an integer; pass a whole "
                            f"number such as {name}={example}.")
    if not isinstance(params.ignore_eos, bool):
        raise TypeError(f"{where}: ignore_eos={params.ignore_eos!r} is not a bool; use True or "
                        "False.")
    if params.temperature < 0:
        raise ValueError(f"{where}: temperature={params.temperature} is negative; "
                         "use 0 for greedy decoding or a positive value to sample.")
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"{where}: top_p={params.top_p} is outside (0, 1]; use 1.0 to "
                         "keep every token, or e.g. 0.9 to keep the smallest set holding 90%.")
    if params.top_k == 0 or params.top_k < -1:
        raise ValueError(f"{where}: top_k={params.top_k} is invalid; use -1 for no "
                         "top-k cut, 1 for greedy, or k >= 1 to keep the k likeliest tokens.")
    if params.max_tokens < 1:
        raise ValueError(f"{where}: max_tokens={params.max_tokens} must be at least 1.")


@dataclass
class SamplingParams:
    """How to pick the next token of one request.

    ``temperature <= 0`` or ``top_k == 1`` means greedy; ``top_k == -1`` means no top-k cut;
    ``top_p == 1.0`` means no top-p cut.
    """

    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    ignore_eos: bool = False
    max_tokens: int = 1024

    def __post_init__(self) -> None:
        check_sampling_params(self)

    @property
    def is_greedy(self) -> bool:
        return (self.temperature <= 0.0 or self.top_k == 1) and self.top_p == 1.0
