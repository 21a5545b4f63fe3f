"""Chapter 01: Req / Batch / Context (minisgl/req.py, core.py), minisgl/distributed, minisgl/utils.

References: an independent simulation of a request's lengths written here with plain integers,
plain integer arithmetic (``//``, ``%``, ``math.ceil``) for the helpers, and fakes for the
communicator's plugins. Exercises: 1.1 Req lengths, 1.2 extend_len, 1.3 complete_one,
1.4 Context.forward_batch, 1.5 div_even.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from minisgl import core
from minisgl.core import (Batch, Context, Req, SamplingParams, get_global_ctx, reset_global_ctx,
                          set_global_ctx)
from minisgl.distributed import (DistributedCommunicator, DistributedImpl, DistributedInfo,
                                 TorchDistributedImpl, destroy_distributed, get_tp_info,
                                 reset_tp_info, set_tp_info, try_get_tp_info)
from minisgl.distributed import info as dist_info
from minisgl.utils import Registry, align_ceil, align_down, div_ceil, div_even, torch_dtype


def make_req(n_prompt: int = 6, output_len: int = 5, cached_len: int = 0, uid: int = 0,
             first_token: int = 100) -> Req:
    ids = torch.arange(first_token, first_token + n_prompt, dtype=torch.int32)
    return Req(input_ids=ids, table_idx=uid, cached_len=cached_len, output_len=output_len,
               uid=uid, sampling_params=SamplingParams())


def simulate(n_prompt: int, output_len: int, cached_len: int = 0) -> list[dict]:
    """The lengths before every forward of one request, and once more when it is finished.

    Written independently of minisgl: plain integers, the rule stated in the chapter.
    """
    cached, known, limit = cached_len, n_prompt, n_prompt + output_len
    states = []
    while True:
        states.append(dict(cached_len=cached, device_len=known, max_device_len=limit,
                           extend_len=known - cached, remain_len=limit - known,
                           can_decode=limit - known > 0))
        if limit - known == 0:
            return states
        # one forward computes positions [cached, known); the sampled token is position `known`
        cached, known = known, known + 1


def lengths_of(req: Req) -> dict:
    return dict(cached_len=req.cached_len, device_len=req.device_len,
                max_device_len=req.max_device_len, extend_len=req.extend_len,
                remain_len=req.remain_len, can_decode=req.can_decode)


EXERCISE_OF = {"device_len": "Exercise 1.1 (Req lengths in __post_init__)",
               "max_device_len": "Exercise 1.1 (Req lengths in __post_init__)",
               "extend_len": "Exercise 1.2 (extend_len)",
               "cached_len": "Exercise 1.3 (complete_one)",
               "remain_len": "Exercise 1.1 / 1.3 (remain_len = max_device_len - device_len)",
               "can_decode": "Exercise 1.1 / 1.3 (can_decode = remain_len > 0)"}


@pytest.fixture
def clean_global_ctx():
    """Run a test with no global Context, then put back whatever was there."""
    saved = core._GLOBAL_CTX
    core._GLOBAL_CTX = None
    yield
    core._GLOBAL_CTX = saved


@pytest.fixture
def clean_tp_info():
    saved = dist_info._TP_INFO
    dist_info._TP_INFO = None
    yield
    dist_info._TP_INFO = saved


@pytest.fixture
def saved_plugins():
    saved = list(DistributedCommunicator.plugins)
    yield
    DistributedCommunicator.plugins = saved


# ----------------------------------------------------------------------------- Req


@pytest.mark.parametrize("n_prompt,output_len,cached_len",
                         [(6, 5, 0), (1, 1, 0), (3, 2, 2), (8, 4, 3), (2, 7, 1)])
def test_lengths_across_life_cycle(n_prompt, output_len, cached_len):
    try:  # a valid request: a refusal here comes from the lengths __post_init__ derived
        req = make_req(n_prompt, output_len, cached_len)
    except ValueError as e:
        pytest.fail(f"Exercise 1.1 (Req lengths in __post_init__): a valid request (prompt "
                    f"{n_prompt}, output_len {output_len}, cached_len {cached_len}) was refused, "
                    f"so the lengths set in __post_init__ are wrong: device_len should be "
                    f"{n_prompt} (every known id) and max_device_len {n_prompt + output_len} "
                    f"(prompt + output_len). The error: {e}", pytrace=False)
    expected = simulate(n_prompt, output_len, cached_len)
    what = f"prompt {n_prompt}, output_len {output_len}, cached_len {cached_len}"
    for step, want in enumerate(expected):
        got = lengths_of(req)
        when = "at creation" if step == 0 else f"after {step} forward(s) + complete_one"
        for key, value in want.items():
            assert got[key] == value, (
                f"{EXERCISE_OF[key]}: {what}, {when}: {key} should be {value}, got {got[key]} "
                f"(all lengths: {got})")
        if not want["can_decode"]:
            break
        before = lengths_of(req)
        req.complete_one()  # the Engine calls this right after the forward
        after = lengths_of(req)
        assert (after["cached_len"], after["device_len"]) == (
            before["device_len"], before["device_len"] + 1), (
            f"Exercise 1.3 (complete_one): {what}, {when}: complete_one should make cached_len = "
            f"the old device_len ({before['device_len']}) and device_len one more "
            f"({before['device_len'] + 1}), got cached_len={after['cached_len']}, "
            f"device_len={after['device_len']}")
        token = torch.tensor([7 + step], dtype=torch.int64)  # the token sampled by that forward
        req.append_host(token)
        assert len(req.input_ids) == req.device_len, (
            f"Exercise 1.3 (complete_one): {what}, after complete_one + append_host the host ids "
            f"should hold device_len={req.device_len} tokens, got {len(req.input_ids)}")
    assert len(expected) == output_len + 1, "the reference simulation itself is wrong"
    assert req.input_ids.dtype == torch.int32, "append_host must keep input_ids int32"
    assert req.input_ids[n_prompt:].tolist() == [7 + s for s in range(output_len)], (
        "append_host should append each sampled token in order after the prompt")


def test_prefill_then_first_decode_named_numbers():
    req = make_req(6, 5)
    assert (req.device_len, req.max_device_len) == (6, 11), (
        "Exercise 1.1 (Req lengths in __post_init__): a 6-token prompt with output_len 5 has "
        f"device_len 6 and max_device_len 11, got {req.device_len} and {req.max_device_len}")
    assert req.extend_len == 6, (
        f"Exercise 1.2 (extend_len): the prefill computes all 6 prompt tokens, got {req.extend_len}")
    req.complete_one()
    assert req.cached_len == 6, (
        f"Exercise 1.3 (complete_one): after prefill of 6 tokens cached_len should be 6, got "
        f"{req.cached_len}")
    assert req.device_len == 7, (
        f"Exercise 1.3 (complete_one): the sampled token takes position 6, so device_len should "
        f"be 7, got {req.device_len}")
    assert req.extend_len == 1, (
        f"Exercise 1.2 (extend_len): a decode step computes 1 token, got {req.extend_len}")


def test_repr_and_identity():
    a, b = make_req(uid=1), make_req(uid=1)
    assert a != b and len({a, b}) == 2, "requests compare by identity (dataclass eq=False)"
    assert "cached_len=0" in repr(a) and "device_len=6" in repr(a), repr(a)


@pytest.mark.parametrize("n_prompt,output_len,cached_len,names", [
    (6, 5, 6, ("cached_len=6", "device_len=6")),  # nothing left to compute
    (6, 5, 7, ("cached_len=7", "device_len=6")),
    (6, 5, -1, ("cached_len=-1",)),
    (6, -1, 0, ("device_len=6", "max_device_len=5")),  # negative output_len
    (0, 3, 0, ("cached_len=0", "device_len=0")),  # empty prompt
])
def test_invariant_errors_name_the_lengths(n_prompt, output_len, cached_len, names):
    with pytest.raises(ValueError) as err:
        make_req(n_prompt, output_len, cached_len)
    for name in names:
        assert name in str(err.value), (
            f"Exercise 1.1 (Req lengths in __post_init__): the error for prompt {n_prompt}, "
            f"output_len {output_len}, cached_len {cached_len} should name {name!r}; got: "
            f"{err.value}")


def test_check_invariant_after_tampering():
    req = make_req(6, 5)
    req.cached_len = req.device_len
    with pytest.raises(ValueError, match="cached_len=6"):
        req.check_invariant()


@pytest.mark.parametrize("ids,exc,word", [
    (torch.tensor([1.0, 2.0]), TypeError, "dtype"),
    (torch.tensor([True, False]), TypeError, "dtype"),
    (torch.tensor([[1, 2, 3]], dtype=torch.int32), ValueError, "1-D"),
    ([1, 2, 3], TypeError, "torch.Tensor"),
])
def test_input_ids_checks(ids, exc, word):
    with pytest.raises(exc) as err:
        Req(input_ids=ids, table_idx=0, cached_len=0, output_len=1, uid=3, sampling_params=None)
    assert word in str(err.value) and "uid=3" in str(err.value), (
        f"the error for input_ids={ids!r} should say what is wrong ({word!r}) and name the "
        f"request; got: {err.value}")


def test_int64_ids_are_accepted():
    req = Req(input_ids=torch.tensor([5, 6, 7]), table_idx=0, cached_len=0, output_len=2, uid=0,
              sampling_params=None)
    assert req.device_len == 3, "Exercise 1.1 (Req lengths in __post_init__): device_len = len(ids)"


def test_append_host():
    req = make_req(4, 3)
    req.complete_one()
    req.append_host(torch.tensor([42], dtype=torch.int64))
    assert req.input_ids.tolist() == [100, 101, 102, 103, 42], req.input_ids.tolist()
    assert req.input_ids.dtype == torch.int32, "append_host keeps the dtype of input_ids"
    req.complete_one()
    req.append_host(torch.tensor(43))  # a 0-d tensor is one token too
    assert req.input_ids.tolist()[-1] == 43
    assert len(req.input_ids) == req.device_len == 6


def test_append_host_refuses_to_run_ahead():
    req = make_req(4, 3)
    with pytest.raises(ValueError, match="complete_one"):
        req.append_host(torch.tensor([42]))  # no forward yet: position 4 is not open
    req.complete_one()
    req.append_host(torch.tensor([9]))
    with pytest.raises(ValueError, match="complete_one"):
        req.append_host(torch.tensor([9]))  # twice for one forward
    assert len(req.input_ids) == 5, "a refused append must leave input_ids unchanged"


# ----------------------------------------------------------------------------- Batch


def test_batch_empty_and_phase():
    with pytest.raises(ValueError, match="empty"):
        Batch(reqs=[], phase="decode")
    with pytest.raises(ValueError, match="phase"):
        Batch(reqs=[make_req()], phase="extend")


def test_batch_size_and_padding():
    reqs = [make_req(uid=i) for i in range(3)]
    batch = Batch(reqs=reqs, phase="decode")
    assert batch.size == 3 and batch.is_decode and not batch.is_prefill
    for name in ("input_ids", "positions", "out_loc", "padded_reqs", "attn_metadata"):
        assert getattr(batch, name) is None, f"batch.{name} starts as None (filled later)"
    with pytest.raises(RuntimeError, match="pad_batch"):
        batch.padded_size
    batch.padded_reqs = reqs + [reqs[0]]
    assert batch.padded_size == 4 and batch.size == 3
    assert Batch(reqs=reqs[:1], phase="prefill").is_prefill


# ----------------------------------------------------------------------------- Context


def test_context_page_size():
    with pytest.raises(ValueError, match="page_size"):
        Context(page_size=0)
    assert Context(page_size=4).page_size == 4


def test_forward_batch_sets_and_clears():
    ctx, batch = Context(page_size=1), Batch(reqs=[make_req()], phase="prefill")
    with pytest.raises(RuntimeError) as err:
        ctx.batch
    assert "forward_batch" in str(err.value), (
        f"ctx.batch outside a forward should point at `forward_batch`; got: {err.value}")
    with ctx.forward_batch(batch):
        assert ctx.batch is batch, (
            "Exercise 1.4 (Context.forward_batch): inside the `with`, ctx.batch must be the batch")
    assert ctx._batch is None, (
        "Exercise 1.4 (Context.forward_batch): after the `with`, the batch must be cleared")
    with ctx.forward_batch(batch):  # reusable once cleared
        pass


def test_forward_batch_clears_on_error():
    ctx, batch = Context(page_size=1), Batch(reqs=[make_req()], phase="prefill")
    with pytest.raises(ZeroDivisionError):
        with ctx.forward_batch(batch):
            1 / 0
    assert ctx._batch is None, (
        "Exercise 1.4 (Context.forward_batch): when the body raises, the batch must still be "
        "cleared (try/finally around the yield)")


def test_forward_batch_refuses_nesting():
    ctx = Context(page_size=1)
    outer, inner = (Batch(reqs=[make_req(uid=i)], phase="decode") for i in range(2))
    for nested in (inner, outer):  # refused whatever batch is active, the same one included
        with ctx.forward_batch(outer):
            try:
                with ctx.forward_batch(nested):
                    pass
            except RuntimeError as e:
                err = e
            except AssertionError as e:
                pytest.fail(f"Exercise 1.4 (Context.forward_batch): the nesting check is an "
                            f"assert ({e}); raise a RuntimeError instead (python -O removes "
                            "asserts)", pytrace=False)
            else:
                pytest.fail(f"Exercise 1.4 (Context.forward_batch): a nested forward_batch with "
                            f"{'the same' if nested is outer else 'a different'} batch ran; it "
                            "must raise RuntimeError whenever a batch is active "
                            "(self._batch is not None)", pytrace=False)
            assert ctx._batch is outer, (
                "Exercise 1.4 (Context.forward_batch): the refused nested call cleared the outer "
                "batch: move the nesting check before the `try`, so that the refusal never "
                "reaches the `finally`")
    assert "nest" in str(err) or "already" in str(err), (
        f"Exercise 1.4 (Context.forward_batch): the nesting error should say a batch is already "
        f"active; got: {err}")
    assert ctx._batch is None, "Exercise 1.4 (Context.forward_batch): cleared after the outer `with`"


def test_global_ctx(clean_global_ctx):
    with pytest.raises(RuntimeError, match="global Context"):
        get_global_ctx()
    ctx = Context(page_size=2)
    set_global_ctx(ctx)
    assert get_global_ctx() is ctx
    with pytest.raises(RuntimeError, match="already set"):
        set_global_ctx(Context(page_size=2))
    assert get_global_ctx() is ctx, "a refused set_global_ctx must keep the first context"
    reset_global_ctx()
    with pytest.raises(RuntimeError):
        get_global_ctx()
    set_global_ctx(Context(page_size=1))  # allowed again after a reset


# ----------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize("kwargs,word", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_p=-0.2), "top_p"),
    (dict(top_k=0), "top_k"), (dict(top_k=-2), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
])
def test_sampling_params_validation(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("temperature,top_k,top_p,greedy", [
    (0.0, -1, 1.0, True),   # the default
    (0.7, -1, 1.0, False),
    (0.7, 1, 1.0, True),    # only the top token survives the top-k cut
    (0.0, 50, 1.0, True),
    (0.7, 50, 1.0, False),
    (0.7, -1, 0.9, False),
    (0.0, -1, 0.9, False),  # a top-p cut is asked for: the sampler's general path
    (1.0, 1, 0.5, False),
])
def test_is_greedy_truth_table(temperature, top_k, top_p, greedy):
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    assert p.is_greedy is greedy, (
        f"is_greedy for temperature={temperature}, top_k={top_k}, top_p={top_p} should be {greedy}")


# ----------------------------------------------------------------------------- distributed


def test_distributed_info_validation():
    assert DistributedInfo(0, 1).is_primary() and DistributedInfo(0, 4).is_primary()
    assert not DistributedInfo(3, 4).is_primary()
    for rank, size in [(1, 1), (-1, 2), (0, 0), (4, 4)]:
        with pytest.raises(ValueError, match="rank"):
            DistributedInfo(rank, size)
    with pytest.raises(TypeError):
        DistributedInfo("0", 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        DistributedInfo(0, 1).rank = 1


def test_tp_info(clean_tp_info):
    assert try_get_tp_info() is None
    with pytest.raises(RuntimeError, match="set_tp_info"):
        get_tp_info()
    set_tp_info(1, 2)
    assert get_tp_info() == DistributedInfo(1, 2) and try_get_tp_info() is get_tp_info()
    with pytest.raises(RuntimeError, match="reset_tp_info"):
        set_tp_info(0, 1)
    reset_tp_info()
    assert try_get_tp_info() is None


class RecordingImpl(DistributedImpl):
    def __init__(self, tag: float) -> None:
        self.tag, self.calls = tag, []

    def all_reduce(self, x):
        self.calls.append("all_reduce")
        return x + self.tag

    def all_gather(self, x):
        self.calls.append("all_gather")
        return torch.cat([x, x + self.tag])


def test_communicator_delegates_to_last_plugin(saved_plugins):
    first, last = RecordingImpl(1.0), RecordingImpl(10.0)
    DistributedCommunicator.plugins = [TorchDistributedImpl(), first, last]
    comm, x = DistributedCommunicator(), torch.zeros(2, 3)
    assert torch.equal(comm.all_reduce(x), x + 10.0)
    assert comm.all_gather(x).shape == (4, 3)
    assert last.calls == ["all_reduce", "all_gather"] and first.calls == [], (
        "the communicator must call only the last registered plugin")
    destroy_distributed()
    plugins = DistributedCommunicator.plugins
    assert len(plugins) == 1 and isinstance(plugins[0], TorchDistributedImpl), (
        "destroy_distributed leaves exactly the default torch.distributed plugin")


# ----------------------------------------------------------------------------- utils


def _div_even(a, b, rep=False):
    """div_even's answer, or the ValueError it raised; any other error names Exercise 1.5."""
    try:
        return div_even(a, b, allow_replicate=rep), None
    except ValueError as e:
        return None, e
    except Exception as e:  # noqa: BLE001 (the learner's error, reported with the exercise)
        pytest.fail(f"Exercise 1.5 (div_even): div_even({a}, {b}, allow_replicate={rep}) raised "
                    f"{type(e).__name__}: {e}; raise a ValueError naming both numbers",
                    pytrace=False)


def test_div_even_against_plain_math():
    for a in range(1, 33):
        for b in range(1, 9):
            got, err = _div_even(a, b)
            call = f"div_even({a}, {b})"
            if a % b == 0:
                assert err is None, f"Exercise 1.5 (div_even): {call} should be {a // b}; it raised: {err}"
                assert type(got) is int and got == a // b, (
                    f"Exercise 1.5 (div_even): {call} should be the int {a // b}, got "
                    f"{got!r} (a // b, not a / b: it is used as a size)")
            else:
                assert err is not None, (
                    f"Exercise 1.5 (div_even): {call} returned {got!r}; it should raise a "
                    f"ValueError: {b} does not divide {a}"
                    + (" (and without allow_replicate, more ranks than items is an error too)"
                       if b > a else ""))
                assert str(a) in str(err) and str(b) in str(err), (
                    f"Exercise 1.5 (div_even): the error for {call} should name both numbers; "
                    f"got: {err}")


def test_div_even_replicate():
    for a in range(1, 9):
        for b in range(1, 17):
            if b > a and b % a == 0:
                want = 1  # each rank keeps one whole item, copied on b // a ranks
            elif b <= a and a % b == 0:
                want = a // b
            else:
                want = None
            got, err = _div_even(a, b, True)
            call = f"div_even({a}, {b}, allow_replicate=True)"
            if want is None:
                assert err is not None, (
                    f"Exercise 1.5 (div_even): {call} returned {got!r}; it should raise a "
                    "ValueError: " + (f"{b} ranks cannot share {a} items evenly ({b} % {a} != 0)"
                                      if b > a else f"{b} does not divide {a}"))
                continue
            assert err is None, (
                f"Exercise 1.5 (div_even): {call} should be {want}"
                + (": with more ranks than items each rank keeps one whole item; test the "
                   "replicate case before the divisibility check" if b > a else "")
                + f"; it raised: {err}")
            assert got == want, (
                f"Exercise 1.5 (div_even): {call} should be {want}, got {got}")


def test_div_ceil_and_align():
    for a in range(0, 70):
        for b in range(1, 17):
            assert div_ceil(a, b) == math.ceil(a / b), (a, b)
            assert align_ceil(a, b) == math.ceil(a / b) * b, (a, b)
            assert align_down(a, b) == math.floor(a / b) * b, (a, b)
            assert align_down(a, b) <= a <= align_ceil(a, b)


def test_torch_dtype_restores():
    before = torch.get_default_dtype()
    with torch_dtype(torch.float64):
        assert torch.empty(1).dtype == torch.float64
    with pytest.raises(KeyError):
        with torch_dtype(torch.float16):
            raise KeyError("boom")
    assert torch.get_default_dtype() == before


def test_registry():
    reg: Registry = Registry("widget")

    @reg.register("b")
    def make_b():
        return "b1"

    assert make_b() == "b1", "register(name) returns the decorated object unchanged"
    reg.register("a")(int)
    assert reg["b"] is make_b and reg["a"] is int and "a" in reg and "zz" not in reg
    assert reg.supported_names() == ["a", "b"]
    with pytest.raises(KeyError) as err:
        reg["zz"]
    assert "widget" in str(err.value) and "a, b" in str(err.value), (
        f"the lookup error should name the kind and the supported names; got: {err.value}")
    reg.register("b")(str)  # re-registering replaces (re-running a notebook cell is harmless)
    assert reg["b"] is str and reg.supported_names() == ["a", "b"]
    reg.assert_supported(["a", "b"])
    with pytest.raises(KeyError, match="zz"):
        reg.assert_supported(["a", "zz"])


# ----------------------------------------------------------------------------- quick check


def quick_check() -> None:
    """Fast smoke check of chapter 01's modules (raises on failure; used by later chapters)."""
    req = make_req(6, 5)
    want = simulate(6, 5)
    for step in range(3):
        got = lengths_of(req)
        if got != want[step]:
            raise AssertionError(f"Req lengths after {step} forward(s): {got}, expected "
                                 f"{want[step]} (exercises 1.1-1.3)")
        req.complete_one()
        req.append_host(torch.tensor([1]))
    ctx, batch = Context(page_size=1), Batch(reqs=[req], phase="decode")
    with ctx.forward_batch(batch):
        if ctx.batch is not batch:
            raise AssertionError("Context.forward_batch does not install the batch (exercise 1.4)")
    if ctx._batch is not None:
        raise AssertionError("Context.forward_batch does not clear the batch (exercise 1.4)")
    if div_even(12, 4) != 3 or div_even(2, 4, allow_replicate=True) != 1:
        raise AssertionError("div_even gives wrong results (exercise 1.5)")


def test_quick_check():
    quick_check()


@pytest.mark.parametrize("cached", [0, 3])
def test_complete_one_moves_only_the_two_lengths(cached):
    """complete_one (Exercise 1.3) advances cached_len and device_len; every other field says
    what the request asked for (output_len, max_device_len, its sampling parameters) or holds its
    tokens, and stays as it was."""
    params = SamplingParams(temperature=0.7, max_tokens=4)
    req = Req(input_ids=torch.arange(7, dtype=torch.int32), table_idx=2, cached_len=cached,
              output_len=4, uid=5, sampling_params=params)
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in vars(req).items()
              if k not in ("cached_len", "device_len")}
    req.complete_one()
    changed = [k for k, v in before.items() if not (
        torch.equal(v, getattr(req, k)) if isinstance(v, torch.Tensor) else v == getattr(req, k))]
    assert not changed, (f"Exercise 1.3 (complete_one) changed {changed}: it moves cached_len "
                         "and device_len only")
    assert (req.cached_len, req.device_len) == (7, 8)
