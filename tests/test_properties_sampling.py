"""Property tests (Hypothesis): SamplingParams over their whole types, at construction and after
a change, where the sampler uses them. Every input gives a valid run that matches plain torch, or
one of docs/errors.md's errors."""

from __future__ import annotations

import math

import pytest
import torch
from errors_catalogue import assert_catalogued
from helpers import generated
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

from minisgl.core import Batch, Req, SamplingParams
from minisgl.engine.sample import Sampler

V = 50  # vocabulary of the sampler under test
SETTINGS = generated(60, [HealthCheck.too_slow])

anything = st.one_of(st.none(), st.booleans(), st.text(max_size=5), st.lists(st.integers(),
                                                                             max_size=2))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10, 10),
                   st.sampled_from([0, 0.0, -0.0, 1, 1.0, 1e-300, 1e300, -1, 2]), anything)
ints = st.one_of(st.integers(-3, 3 * V), st.sampled_from([0, -1, 1, V, V + 1, 10**30, -10**30]),
                 st.floats(allow_nan=True), anything)
bools = st.one_of(st.booleans(), anything, st.integers(-1, 2))
FIELDS = {"temperature": floats, "top_k": ints, "top_p": floats, "ignore_eos": bools,
          "max_tokens": ints}
params = st.fixed_dictionaries({}, optional=FIELDS)


def _req(sp, uid=0):
    return Req(input_ids=torch.arange(1, 5, dtype=torch.int32), table_idx=uid, cached_len=0,
               output_len=4, uid=uid, sampling_params=sp)


def _check_sample(sp: SamplingParams) -> None:
    """Sample one row; the token must be one the plain-torch reference allows."""
    sampler = Sampler(torch.device("cpu"), V)
    try:
        args = sampler.prepare(Batch(reqs=[_req(sp)], phase="prefill"))
    except Exception as e:  # noqa: BLE001 - the property: a catalogued error
        assert_catalogued(e)
        assert sp.top_k > V, f"prepare refused valid params {sp}: {e}"
        return
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(0))
    token = int(sampler.sample(logits, args)[0])
    order = logits[0].argsort(descending=True).tolist()
    if sp.is_greedy:
        assert token == order[0], f"{sp}: greedy should pick {order[0]}, got {token}"
        return
    k = V if sp.top_k == -1 else min(sp.top_k, V)
    assert token in order[:k], f"{sp}: token {token} is outside the top-{k}"
    probs = torch.softmax(logits[0].double() / max(sp.temperature, 1e-6), -1)[order[:k]]
    probs = probs / probs.sum()
    before = (probs.cumsum(0) - probs).tolist()  # mass of the likelier kept tokens
    rank = order.index(token)
    assert rank == 0 or before[rank] < sp.top_p + 1e-5, f"{sp}: token {token} is outside top-p"


@SETTINGS
@given(params)
def test_constructed_params_are_valid_or_refused(kw):
    try:
        sp = SamplingParams(**kw)
    except Exception as e:  # noqa: BLE001
        assert isinstance(e, (TypeError, ValueError)), f"{kw}: {type(e).__name__}: {e}"
        assert_catalogued(e)
        return
    assert math.isfinite(sp.temperature) and sp.temperature >= 0 and 0 < sp.top_p <= 1
    assert sp.top_k == -1 or sp.top_k >= 1
    _check_sample(sp)


@SETTINGS
@given(st.sampled_from(sorted(FIELDS)).flatmap(lambda f: st.tuples(st.just(f), FIELDS[f])))
def test_params_changed_after_construction_are_checked_where_used(change):
    """``sp.top_k = 0`` after construction: refused at Sampler.prepare with the constructor's
    rule and message, never sampled unchecked."""
    field, value = change
    sp = SamplingParams(temperature=0.8, top_k=10, top_p=0.9)
    setattr(sp, field, value)
    try:
        SamplingParams(**{**vars(sp)})
        ctor_error = None
    except Exception as e:  # noqa: BLE001
        ctor_error = e
    sampler = Sampler(torch.device("cpu"), V)
    if ctor_error is not None:
        with pytest.raises(type(ctor_error)) as info:
            sampler.prepare(Batch(reqs=[_req(sp)], phase="prefill"))
        assert_catalogued(info.value)
        assert str(ctor_error).split(": ", 1)[1] in str(info.value), (
            f"prepare's message differs from the constructor's: {info.value} / {ctor_error}")
        return
    _check_sample(sp)
