"""Chapter 07 (d): the fused C++ kernels, a second implementation chosen once per Engine.

References: the learner's code each kernel replaces (the ops of chapters 02 and 05 as they run
in a default Engine), dense causal attention in float64 (chapter 05's harness), a float64
matmul, and Hugging Face's logits and tokens through whole Engines (``test_ch06_engine.py`` runs
its HF comparisons in both configurations). Also: ``bind`` hands each op its implementation and
nothing else changes; a default Engine imports and compiles nothing; the build survives a killed
builder, a truncated or corrupt library, a busy lock and a missing compiler.
"""

from __future__ import annotations

import fcntl
import itertools
import math
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from helpers import generated as helpers_generated
from helpers import model_path, require_kernels

import minisgl
from minisgl import kernel
from minisgl.kernel import build as kbuild

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE_TREE = pathlib.Path(minisgl.__file__).resolve().parent.parent  # the package under test
pytestmark = pytest.mark.usefixtures("clean_globals")


@pytest.fixture
def kmod():
    return require_kernels()


def run_script(code: str, timeout: int = 300, **env_extra) -> subprocess.CompletedProcess:
    """``python -c code`` in a fresh process, on the package under test: a crash or a hang there
    fails one test, not the whole session."""
    env = {**os.environ, "PYTHONPATH": str(PACKAGE_TREE), **env_extra}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=timeout, check=False)


def strided_rows(t: int, width: int, offset: int = 3, g: torch.Generator | None = None,
                 seed: int = 0) -> torch.Tensor:
    """``[t, width]`` rows that are a view into wider rows (like q inside the fused qkv), or
    contiguous rows when ``offset`` is 0; from ``g``, else from a generator seeded ``seed``."""
    g = g if g is not None else torch.Generator().manual_seed(seed)
    if offset == 0:
        return torch.randn(t, width, generator=g)
    return torch.randn(t, width + offset + 4, generator=g)[:, offset: offset + width]


def rmsnorm64(a: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float64, the reference for the kernels' float32."""
    a = a.double()
    return a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def silu_and_mul64(gate_up: torch.Tensor) -> torch.Tensor:
    h = gate_up.shape[-1] // 2
    return F.silu(gate_up[:, :h].double()) * gate_up[:, h:].double()


def generated(n: int):
    """Hypothesis settings for ``n`` examples (helpers.generated), every health check off: a
    kernel's first call may build it."""
    from hypothesis import HealthCheck

    return helpers_generated(n, list(HealthCheck))


class Threads:
    """``torch.set_num_threads(n)`` for a block (the kernels' workers follow it)."""

    def __init__(self, n: int) -> None:
        self.n, self.old = n, torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.n)

    def __exit__(self, *exc) -> None:
        torch.set_num_threads(self.old)


# ----------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("t", [1, 4, 300])  # 300 rows: split_rows splits them over threads
def test_fused_add_rmsnorm_equals_the_learner_code(kmod, t):
    from minisgl.layers import RMSNormFused, build_ops

    mine = RMSNormFused(576, 1e-5)
    with build_ops(kernel.op_impls()):  # an op keeps the implementation it was built with
        fused = RMSNormFused(576, 1e-5)
    mine.weight = fused.weight = torch.randn(576, generator=torch.Generator().manual_seed(1))
    assert fused._kernel is kernel.add_rmsnorm and mine._kernel is None
    x, res = strided_rows(t, 576, seed=2), torch.randn(t, 576)
    for residual in (None, res):
        r_ref = None if residual is None else residual.clone()
        r_got = None if residual is None else residual.clone()
        y_ref, r_ref = mine.forward(x, r_ref)
        y, r_got = fused.forward(x, r_got)
        torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r_got, r_ref, atol=0, rtol=0)  # the add itself is exact
        if residual is None:
            assert r_got is x, "the first call's input becomes the residual stream"


@pytest.mark.parametrize("t", [1, 4, 300])
def test_silu_and_mul_equals_the_learner_code(kmod, t):
    from minisgl.layers import silu_and_mul

    x = strided_rows(t, 2 * 1536, seed=3) * 4
    torch.testing.assert_close(kernel.silu_and_mul(x), silu_and_mul(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [True, False], ids=["q-and-k-adjacent", "separate"])
@pytest.mark.parametrize("t", [1, 5, 300])
def test_rope_equals_the_learner_code(kmod, fused, t):
    from minisgl.layers import build_ops, get_rope

    rope = get_rope(64, 64, 4096, 10000.0)
    with build_ops(kernel.op_impls()):
        fused_rope = get_rope(64, 64, 4096, 10000.0)
    assert fused_rope is not rope and fused_rope._kernel is kernel.rope
    hq, hkv, d = 9, 3, 64
    positions = torch.randint(0, 4096, (t,), generator=torch.Generator().manual_seed(4)).int()
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=torch.Generator().manual_seed(5))

    def run(forward):
        buf = qkv.clone()
        if fused:  # views of one fused tensor: rotated in one pass
            q, k, _ = buf.split([hq * d, hkv * d, hkv * d], dim=-1)
        else:
            q, k = buf[:, : hq * d].clone(), buf[:, hq * d: (hq + hkv) * d].clone()
        q, k = forward(positions, q, k)
        return torch.cat([q, k], dim=1), buf[:, (hq + hkv) * d:]

    qk_ref, v_ref = run(rope.forward)
    qk, v = run(fused_rope.forward)
    torch.testing.assert_close(qk, qk_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(v, v_ref), "rope must not touch v, which follows k in the fused qkv"


# vocabularies: below one vector, a whole vector, a tail after whole vectors, SmolLM2's 49152
@pytest.mark.parametrize("v", [1, 5, 16, 17, 1000, 49152])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("kind", ["random", "ties", "nan", "inf", "all-inf", "strided"])
def test_greedy_argmax_equals_torch_argmax(kmod, v, rows, kind):
    """The Sampler's greedy kernel gives ``torch.argmax``'s index in every row: the first one
    on a tie (equal values in different lanes, or a later value equal to an earlier one), the
    first NaN where a row has one, index 0 in a row of -inf, and rows that are strided views."""
    g = torch.Generator().manual_seed(v * 31 + rows)
    x = torch.randn(rows, v, generator=g)
    if kind == "ties":  # few distinct values: the maximum occurs many times
        x = torch.randint(-2, 3, (rows, v), generator=g).float()
    elif kind == "nan":
        x[:, (v * 2) // 3] = float("nan")
        x[0, v // 3] = float("nan")
    elif kind == "inf":
        x[:, v - 1] = float("inf")
        x[-1, 0] = float("inf")
    elif kind == "all-inf":
        x = torch.full((rows, v), float("-inf"))
    elif kind == "strided":
        x = torch.randn(rows, v + 9, generator=g)[:, 4: 4 + v]
    got, want = kmod.argmax_rows(x), torch.argmax(x, dim=-1)
    assert got.dtype == torch.int64 and torch.equal(got, want), (
        f"argmax_rows of {rows}x{v} ({kind}) gave {got.tolist()[:8]}, torch.argmax "
        f"{want.tolist()[:8]}")


def test_greedy_argmax_looks_at_every_column(kmod):
    """The largest logit at each column in turn, one row per column (the rest random, below
    it): every index must come back. A loop that skipped a vector where a row is cut between
    threads, at the end of the whole vectors or in the tail, gets some index wrong here, where
    random rows rarely put the maximum there."""
    g = torch.Generator().manual_seed(5)
    for v in (1, 5, 16, 17, 31, 32, 33, 47, 48, 63, 64, 100, 1000, 1031):
        x = torch.randn(v, v, generator=g)
        x[torch.arange(v), torch.arange(v)] = 10.0
        got = kmod.argmax_rows(x)
        bad = (got != torch.arange(v)).nonzero().flatten().tolist()
        assert not bad, f"{v} columns: the maximum at column {bad[:5]} was not found"
    v = 49152  # SmolLM2's vocabulary: the columns around the cut, the first and the last
    cols = torch.tensor([*range(64), *range(v // 2 - 64, v // 2 + 64), *range(v - 64, v)])
    x = torch.randn(len(cols), v, generator=g)
    x[torch.arange(len(cols)), cols] = 10.0
    got = kmod.argmax_rows(x)
    bad = cols[got != cols].tolist()
    assert not bad, f"{v} columns: the maximum at column {bad[:5]} was not found"


def test_greedy_argmax_on_generated_rows(kmod):
    """Hypothesis: rows drawn from a few values (ties everywhere) with infinities and NaNs."""
    from hypothesis import given
    from hypothesis import strategies as st

    value = st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, float("inf"), float("-inf"),
                             float("nan"), 1e-30, -3e38])

    # up to 200 columns: rows of two vectors or more are cut in halves (two tasks), and a tie
    # or a NaN may fall on either side of the cut
    @generated(300)
    @given(st.integers(1, 200).flatmap(lambda n: st.lists(st.lists(value, min_size=n, max_size=n),
                                                          min_size=1, max_size=4)))
    def check(rows):
        x = torch.tensor(rows, dtype=torch.float32)
        assert torch.equal(kmod.argmax_rows(x), torch.argmax(x, dim=-1)), rows

    check()


@pytest.mark.parametrize("lengths", [[7, 7, 7], [7, 2, 20, 11], [1]], ids=["equal", "ragged",
                                                                           "one-token"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("n_dummy", [0, 2])
def test_cpp_backend_decode_equals_dense_attention(kmod, lengths, hq, hkv, n_dummy):
    """Through chapter 05's harness with backend "cpp": scattered pages of 4 slots, GQA, ragged
    lengths and padding dummies; every real row equals float64 dense causal attention, the
    kernel ran once per layer, and K/V went into the pool through ``store_kv`` only."""
    from test_ch05_attention import NUM_LAYERS, make_env, run_and_compare

    env = make_env(hq, hkv, 32, ps=4, seed=len(lengths) + hq + n_dummy, backend="cpp")
    reqs = [env.add_req(n - 1, n) for n in lengths]
    batch = env.make_batch(reqs, "decode", n_dummy=n_dummy)
    calls = {"decode_attention": 0, "store_kv": 0}
    real_attn, real_store = env.backend._module, env.pool.store_kv

    class Spy:
        def decode_attention(self, *args):
            calls["decode_attention"] += 1
            return real_attn.decode_attention(*args)

    def store_spy(*args):
        calls["store_kv"] += 1
        return real_store(*args)

    env.backend._module, env.pool.store_kv = Spy(), store_spy
    run_and_compare(env, batch, what=f"the 'cpp' backend's decode kernel, lengths {lengths}, "
                                     f"Hq={hq}, Hkv={hkv}, {n_dummy} dummies")
    assert calls == {"decode_attention": NUM_LAYERS, "store_kv": NUM_LAYERS}, (
        f"each layer should store through the pool, then call the kernel once: {calls}")


def test_cpp_backend_prefill_is_chapter_05s(kmod):
    """A prefill (with a cached prefix) through backend "cpp" is the TorchBackend's code."""
    from test_ch05_attention import make_env, run_and_compare

    env = make_env(8, 2, 16, ps=4, seed=3, backend="cpp")
    reqs = [env.add_req(0, 9), env.add_req(4, 11)]
    run_and_compare(env, env.make_batch(reqs, "prefill"), what="the 'cpp' backend's prefill")


# rows: 1 to 7 (one weight row at a time, in 2 to 4 streams, 8 to 14 partial sums, the rows left
# over by the streams in one), and from 8 rows x transposed, in 1 or 2 vectors, full or not (8
# rows in an AVX-512 build: one 8-float vector, the half-width instantiation); (N, K): whole
# tiles and 16-float chunks, short last tiles (N % 4, N % 12, N % 6, and so N % S), K below one
# vector, K with whole blocks of 2 to 8 vectors, then single vectors, then a K % 16 tail (1077 =
# 1024 + 48 + 5: add_tail_columns), and SmolLM2's gate_up and LM-head-like widths
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 16])
@pytest.mark.parametrize("n,k", [(3072, 576), (577, 33), (6, 15), (1, 7), (37, 1077)])
def test_linear_equals_a_float64_matmul(kmod, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k + 5, generator=g)[:, 2: 2 + k]  # rows inside wider rows
    w = torch.randn(n, k + 3, generator=g)[:, :k]  # weight rows with a stride > k
    b = torch.randn(n, generator=g)
    ref = x.double() @ w.double().T
    for bias, want in [(None, ref), (b, ref + b.double())]:
        y = kernel.small_batch_linear(x, w, bias)
        assert y.shape == (m, n) and y.dtype == torch.float32
        err = (y.double() - want).abs().max().item()
        assert err < 1e-4 * (1 + want.abs().max().item()), (
            f"linear({m}x{k} @ {n}x{k}, bias={bias is not None}) is {err:.2e} off float64")


@pytest.mark.parametrize("threads", [2, 3])
def test_work_split_over_threads_gives_the_same_bits(kmod, threads):
    """``split_rows`` (csrc/common.h) shares a call's chunks among the kernels' own threads;
    every output row or tile is computed by the same code whichever thread runs it, so the
    results must equal one thread's bit for bit (a chunk lost or done twice would not)."""
    g = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(4, 576, generator=g), torch.randn(3077, 576, generator=g), None
    x1, x8 = torch.randn(1, 576, generator=g), torch.randn(8, 576, generator=g)  # each path
    x16 = torch.randn(16, 576, generator=g)
    rows, weight = strided_rows(301, 576, seed=6), torch.randn(576, generator=g)
    gate_up = torch.randn(299, 2 * 96, generator=g)

    def run():
        return [kmod.linear(x1, w, b), kmod.linear(x, w, b), kmod.linear(x8, w, b),
                kmod.linear(x16, w, b),
                kmod.rmsnorm(rows, weight, 1e-5),
                kmod.silu_and_mul(gate_up)]

    with Threads(1):
        want = run()
    with Threads(threads):
        for _ in range(3):
            # memory a lost chunk would leave behind holds NaN, not an earlier run's results
            poison = [torch.full_like(ref, float("nan")) for ref in want]
            del poison
            for got, ref in zip(run(), want):
                assert torch.equal(got, ref), f"{threads} threads changed a kernel's result"


THREADS_SCRIPT = r"""
import os, signal, sys, threading, time
import torch
from minisgl import kernel
mod = kernel.load()
torch.set_num_threads(2)
x, w = torch.randn(3, 576), torch.randn(3072, 576)
want = x.double() @ w.double().T
def ok(y):
    return (y.double() - want).abs().max().item() < 1e-3
assert ok(mod.linear(x, w, None))  # the workers exist now
pid = os.fork()  # a child has none of its parent's threads: it must not wait for them
if pid == 0:
    os._exit(0 if ok(mod.linear(x, w, None)) else 3)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, f"the forked child failed: {status}"
# the calls keep their results while another busy thread competes for the cores, and after
# the workers fell asleep (a pause longer than their spin)
stop = threading.Event()
busy = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)])
busy.start()
try:
    for _ in range(200):
        assert ok(mod.linear(x, w, None))
finally:
    stop.set(); busy.join()
time.sleep(0.05)
assert ok(mod.linear(x, w, None))
torch.set_num_threads(3); assert ok(mod.linear(x, w, None))  # a new thread count: new workers
torch.set_num_threads(1); assert ok(mod.linear(x, w, None))
print("threads ok")
"""


def test_kernel_threads_survive_a_fork_a_busy_machine_and_sleep(kmod):
    """The kernels' threads (``Workers``, csrc/common.h) after a fork, beside a busy thread,
    after sleeping, and when the thread count changes: every call completes (within the
    timeout: a lost wake-up or a wait for a thread a fork left behind would hang) and is right."""
    out = run_script(THREADS_SCRIPT)
    assert out.returncode == 0 and "threads ok" in out.stdout, out.stderr[-3000:]



def in_buffer(kmod, *shapes, gap=16):
    """Float32 tensors of ``shapes`` inside one ``weight_buffer`` (the memory the workers may
    read ahead), ``gap`` floats apart, the last one ending where the buffer ends, filled with
    random values; and the buffer."""
    g = torch.Generator().manual_seed(sum(n * m for n, m in shapes))
    sizes = [n * m + gap for n, m in shapes[:-1]] + [shapes[-1][0] * shapes[-1][1]]
    buf = kmod.weight_buffer(sum(sizes) * 4)
    flat, out, at = buf.view(torch.float32), [], 0
    for (n, m), size in zip(shapes, sizes):
        t = flat[at:at + n * m].view(n, m)
        t.copy_(torch.randn(n, m, generator=g))
        out.append(t)
        at += size
    return out, buf


def test_read_ahead_follows_the_order_of_the_calls(kmod):
    """After a call with weight w, the workers read the weights that followed w the last time,
    in that order, up to the budget (``set_read_ahead``), stopping when the chain comes back to
    w, or at the first weight outside a ``weight_buffer`` (they load what they read ahead, and
    only such a buffer cannot be unmapped while they read). The plan is what they read: a
    wrong order, a lost span, a budget ignored or memory of any kind read shows here. The
    results do not depend on it, bit for bit."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 96, generator=g)
    (a, wide, c), buf = in_buffer(kmod, (40, 96), (30, 100), (24, 96))  # c ends the buffer
    b = wide[:, 2:98]  # a view: rows 100 floats apart
    plain = torch.randn(8, 96, generator=g)  # ordinary memory: never read ahead
    span = {id(w): (w.data_ptr(), ((w.shape[0] - 1) * w.stride(0) + w.shape[1]) * 4)
            for w in (a, b, c)}
    old = kmod.set_read_ahead(1 << 30)
    try:
        first = [kmod.linear(x, w, None) for w in (a, b, c)]
        assert kmod.read_ahead_plan(c) == [], "c was never followed by anything: nothing to read"
        again = [kmod.linear(x, w, None) for w in (a, b, c)]
        assert kmod.read_ahead_plan(a) == [span[id(b)], span[id(c)]], (
            "after a, the workers must read b then c (each from its first byte to its last)")
        assert kmod.read_ahead_plan(c) == [span[id(a)], span[id(b)]]
        kmod.set_read_ahead(span[id(b)][1] + 100)
        assert kmod.read_ahead_plan(a) == [span[id(b)], (span[id(c)][0], 100)], (
            "the budget bounds the bytes read ahead, the last span cut short")
        assert kmod.set_read_ahead(0) == span[id(b)][1] + 100
        assert kmod.read_ahead_plan(a) == [], "budget 0: nothing is read ahead"
        kmod.set_read_ahead(1 << 30)
        off = [kmod.linear(x, w, None) for w in (a, b, plain, c)]
        assert kmod.read_ahead_plan(a) == [span[id(b)]], (
            "b was followed by a tensor outside any weight_buffer: the plan must stop there")
        assert kmod.read_ahead_plan(plain) == [span[id(c)], span[id(a)], span[id(b)]]
        for y0, y1, y2 in zip(first, again, off[:2] + off[3:]):
            assert torch.equal(y0, y1) and torch.equal(y0, y2), "read-ahead changed a result"
        with pytest.raises(RuntimeError, match="read-ahead budget must be >= 0 bytes, got -1"):
            kmod.set_read_ahead(-1)
    finally:
        kmod.set_read_ahead(old)
    del a, b, c, wide, buf
    assert kmod.read_ahead_plan(plain) == [], "a freed buffer's weights must leave every plan"


def kv_spans(slots, lens, k_cache, v_cache, most=32):
    """The (address, bytes) spans of the rows a decode attention read, computed here: each
    request's slots up to its length, cut into runs of consecutive slots (slot s + 1 right after
    slot s), the first ``most`` runs in request order, each run's keys and then its values."""
    row = k_cache.shape[1] * k_cache.element_size()
    runs = []
    for b, n in enumerate(lens):
        s, j = [int(v) for v in slots[b][:n]], 0
        while j < n:
            e = j + 1
            while e < n and s[e] == s[e - 1] + 1:
                e += 1
            runs.append((s[j], e - j))
            j = e
    return [(cache.data_ptr() + first * row, count * row)
            for first, count in runs[:most] for cache in (k_cache, v_cache)]


def forget_kv_notes(kmod):
    """Forget which attention's rows followed which matmul: other tests' weights, freed since,
    may have had the addresses of this test's."""
    kmod.forget_kv_rows()


def test_after_a_matmul_the_workers_prefetch_the_rows_the_next_attention_read(kmod):
    """A decode attention notes the weight of the matmul that ran just before it (a layer's qkv
    projection): that matmul's plan then names the attention's caches, at the slots of the
    latest decode attention, as runs of consecutive slots, at most 32, in request order, each
    run's keys and then its values. Hypothesis draws the slots: runs broken by gaps, by a step
    back, by a slot repeated, and padding past each length that continues the last run (never
    read: a plan that runs to the padded width makes that run longer). Checked against the runs
    computed here."""
    from hypothesis import given
    from hypothesis import strategies as st

    D, hq, hkv = 8, 4, 2
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(1, 16, generator=g), torch.randn(8, 16, generator=g)
    piece = st.tuples(st.integers(0, 120), st.integers(1, 6))  # (first slot, slots in a row)
    forget_kv_notes(kmod)

    @generated(200)
    @given(st.lists(st.lists(piece, min_size=1, max_size=6), min_size=1, max_size=12),
           st.integers(0, 3))
    def check(reqs, pad):
        rows = [[s for first, n in pieces for s in range(first, first + n)] for pieces in reqs]
        lens, L = [len(r) for r in rows], max(len(r) for r in rows) + pad
        slots = [r + [r[-1] + 1 + i for i in range(L - len(r))] for r in rows]
        S = max(max(r) for r in slots) + 1
        k_cache, v_cache = (torch.randn(S, hkv * D, generator=g) for _ in range(2))
        q = torch.randn(len(rows), hq * D, generator=g)
        kmod.linear(x, w, None)
        kmod.decode_attention(q, k_cache, v_cache, torch.tensor(slots).reshape(-1),
                              torch.tensor(lens), L, D)
        want = kv_spans(slots, lens, k_cache, v_cache)
        got = kmod.kv_read_ahead_plan(w)
        assert got == want, (f"after the matmul before an attention over {len(rows)} requests "
                             f"(lengths {lens}), the workers would prefetch {len(got) // 2} runs "
                             f"{got[:4]}..., not the {len(want) // 2} runs {want[:4]}... of "
                             "slots that attention read")

    check()


def test_each_layers_matmul_plans_its_own_caches_at_the_latest_slots(kmod):
    """Two layers: the matmul before each attention plans that attention's caches, both at the
    slots of the latest decode attention (a step's layers share them); a matmul that was never
    followed by an attention plans nothing. Off, every plan is empty, the notes are still made,
    and the results are the same bits either way."""
    D, hq, hkv, S = 16, 4, 2, 64
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 32, generator=g)
    a, b, c = (torch.randn(8, 32, generator=g) for _ in range(3))
    caches = [[torch.randn(S, hkv * D, generator=g) for _ in range(2)] for _ in range(2)]
    q = torch.randn(2, hq * D, generator=g)

    def step(slots, lens):
        out = [kmod.linear(x, c, None)]
        for w, (k, v) in zip((a, b), caches):
            out.append(kmod.linear(x, w, None))
            out.append(kmod.decode_attention(q, k, v, torch.tensor(slots).reshape(-1),
                                             torch.tensor(lens), len(slots[0]), D))
        return out

    forget_kv_notes(kmod)
    try:
        step([[3, 4, 5, 9], [20, 21, 22, 23]], [4, 3])  # notes to be replaced by the next
        s2, l2 = [[40, 41, 42, 43, 44], [7, 6, 5, 50, 51]], [5, 5]
        second = step(s2, l2)
        for w, (k, v), name in ((a, *caches[:1], "a"), (b, *caches[1:], "b")):
            assert kmod.kv_read_ahead_plan(w) == kv_spans(s2, l2, k, v), (
                f"after {name}, the workers must prefetch the caches of the attention that "
                "followed it, at the latest attention's slots")
        assert kmod.kv_read_ahead_plan(c) == [], "c was never followed by an attention"
        assert kmod.set_kv_read_ahead(False) is True
        assert kmod.kv_read_ahead_plan(a) == [] and kmod.kv_read_ahead_plan(b) == [], (
            "off: the workers prefetch nothing")
        off = step(s2, l2)
        for y_on, y_off in zip(second, off):
            assert torch.equal(y_on, y_off), "prefetching the attention's rows changed a result"
        s3, l3 = [[60, 61, 62, 63, 0], [1, 2, 3, 4, 5]], [4, 5]
        step(s3, l3)
        assert kmod.set_kv_read_ahead(True) is False
        assert kmod.kv_read_ahead_plan(a) == kv_spans(s3, l3, *caches[0]), (
            "off, the attentions' notes are still made: on again, the plans are the latest")
    finally:
        kmod.set_kv_read_ahead(True)


def test_the_kernel_ab_benchmark_gives_each_build_its_own_weight_buffer(kmod):
    """``benchmarks/bench_kernel_ab.py`` swaps two builds of the library under one Engine. A
    library reads ahead only inside a buffer it mapped itself, so each build must run on its own
    copy of the weights (``own_weights``, which places them with ``place_weights`` and the
    build's ``weight_buffer``): with one buffer for both, the other build ran without its
    read-ahead, and an A-A comparison (one source, two builds) measured 0.973x."""
    import types

    from benchmarks.bench_kernel_ab import own_weights

    class Model:  # a state dict of its attributes, as the ops of chapter 02 have
        def __init__(self, **tensors):
            vars(self).update(tensors)

        def state_dict(self):
            return dict(vars(self))

    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(64, 96, generator=g), torch.randn(33, 96, generator=g)
    model = Model(a=a, ids=torch.arange(5), b=b)  # ids: not a float32 weight, never copied
    buf, copies = own_weights(model, kmod)
    assert set(copies) == {"a", "b"} and model.a is copies["a"] and model.b is copies["b"], (
        "the model must hold the build's copies")
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    for key, t in (("a", a), ("b", b)):
        c = copies[key]
        assert torch.equal(c, t) and c.is_contiguous(), f"{key}: not an equal contiguous copy"
        assert c.data_ptr() % 64 == 0, f"{key}: its copy does not start a cache line"
        assert lo <= c.data_ptr() and c.data_ptr() + c.numel() * 4 <= hi, (
            f"{key}: its copy is not inside the buffer the build mapped")
    x = torch.randn(1, 96, generator=g)
    for w in (copies["a"], copies["b"], copies["a"]):
        kmod.linear(x, w, None)
    assert kmod.read_ahead_plan(copies["a"]) == [(copies["b"].data_ptr(), b.numel() * 4)], (
        "the build must read ahead in its own copy")
    for w in (a, b, a):
        kmod.linear(x, w, None)
    assert kmod.read_ahead_plan(a) == [], "the originals are not in a buffer: no read-ahead"
    older = types.SimpleNamespace()  # a build from before weight_buffer reads ahead anywhere
    none, same = own_weights(model, older)
    assert none is None and same["a"] is model.a and set(same) == {"a", "b"}


def test_weight_buffer_is_zeroed_aligned_and_says_when_it_cannot_be_had(kmod):
    """``weight_buffer(nbytes)``: zeroed bytes that start on a 2 MB boundary; 0 bytes is a
    buffer too; a negative size is refused by name, and memory the OS will not map is a
    MemoryError (through ``weights.weight_buffer``) that names the ways out."""
    from minisgl.kernel import weights as kweights

    for n in (0, 1, 3 << 20, (2 << 20) + 7):
        buf = kmod.weight_buffer(n)
        assert buf.dtype == torch.uint8 and buf.shape == (n,), (n, buf.dtype, buf.shape)
        assert buf.data_ptr() % (2 << 20) == 0, f"{n} bytes: not on a 2 MB boundary"
        assert int(buf.count_nonzero()) == 0, f"{n} bytes: not zeroed"
        buf.fill_(7)  # writable, every byte
        assert int(buf.sum()) == 7 * n
    with pytest.raises(RuntimeError, match="weight_buffer needs 0 or more bytes, got -1"):
        kmod.weight_buffer(-1)
    with pytest.raises(MemoryError, match="cpu_kernels=False"):
        kweights.weight_buffer(1 << 50)  # a petabyte: no OS maps that


def test_weight_buffer_without_the_kernels_names_the_way_out(monkeypatch):
    """``weights.weight_buffer`` needs the C++ library (which maps the buffer and knows when it
    is freed): without it, a RuntimeError that says why and names ``cpu_kernels=False``."""
    from minisgl import kernel
    from minisgl.kernel import weights as kweights

    monkeypatch.setattr(kernel, "load", lambda: None)
    monkeypatch.setattr(kernel, "unavailable_reason", lambda: "no compiler here")
    with pytest.raises(RuntimeError, match=r"no compiler here.*cpu_kernels=False"):
        kweights.weight_buffer(64)


FREE_WHILE_READING = r"""
import sys, time, torch
from minisgl import kernel
mod = kernel.load()
torch.set_num_threads(THREADS)
mod.set_read_ahead(8 << 20)
g = torch.Generator().manual_seed(0)
x = torch.randn(1, 256, generator=g)
a = torch.randn(1024, 256, generator=g)  # 8 chunks: the workers take part, then read ahead
want = x.double() @ a.double().T
for i in range(ROUNDS):
    buf = mod.weight_buffer(8 << 20)  # 8 MB: a read ahead of it takes a worker ~0.5 ms
    w = buf.view(torch.float32).view(-1, 256)
    w.fill_(1.0)
    mod.linear(x, a, None); mod.linear(x, w, None)
    y = mod.linear(x, a, None)  # the workers now read w ...
    assert mod.read_ahead_plan(a) == [(w.data_ptr(), 8 << 20)], "a's plan must name all of w"
    del w, buf  # ... and it is freed: the free must wait for them
    assert mod.read_ahead_plan(a) == [], f"round {i}: a's plan still names the freed buffer"
    assert (y.double() - want).abs().max().item() < 1e-3
print("freed while reading ok")
"""


@pytest.mark.parametrize("threads", [2, 3])
def test_freeing_a_weight_buffer_while_the_workers_read_it_is_safe(kmod, threads):
    """The workers load what they read ahead, and a load of unmapped memory kills the process.
    A weight buffer freed right after a call (the workers then reading it) must wait for them:
    the deleter counts the free (``g_frees``) and waits until no worker reads (``g_reading``),
    and a worker counts itself before it looks at the count. 400 rounds, each freeing a buffer
    the workers were reading; a free that did not wait, or a worker that looked first, crashes
    here with SIGSEGV."""
    code = FREE_WHILE_READING.replace("THREADS", str(threads)).replace("ROUNDS", "400")
    out = run_script(code)
    assert out.returncode == 0 and "freed while reading ok" in out.stdout, (
        f"exit status {out.returncode} (-11: a worker read a buffer already unmapped): "
        f"{out.stderr[-3000:]}")


def test_the_workers_read_ahead_with_loads(kmod):
    """What a worker reads ahead of the weights it loads, one byte per cache line
    (``wait_for_call``, ``csrc/common.h`` part 5): a prefetch is a hint the core may drop, and on
    a Zen 2 it gained 0-1% of the batch-1 step where loads gain 3%. The attention's rows it reads
    ahead first (``attention.h`` part 4) it only prefetches: the pool is the Engine's, and a load
    of a pool freed meanwhile would kill the process, where a hint never faults. The results are
    the same either way, so read the worker's code in the cached library: it must load bytes,
    and prefetch with ``prefetcht0`` in one block of at most 16 lines (the rows' loop)."""
    import re

    dis = cached_kernels_disassembly()
    bodies = {**functions(dis, "Workers::Workers(int)::{lambda()#1}"),  # wait_for_call inlined
              **functions(dis, "Workers::loop"),                          # here,
              **functions(dis, "Workers::wait_for_call")}                 # or not at all
    code = [ins for body in bodies.values() for _, ins in body]
    assert code, "the workers' thread function is not in the library: renamed?"
    prefetches = [i for i in code if i.startswith("prefetch")]
    assert prefetches and len(prefetches) <= 16 and all(
        i.startswith("prefetcht0 ") for i in prefetches), (
        f"the workers' code prefetches {len(prefetches)} times ({sorted(set(prefetches))[:3]}): "
        "only the attention's rows are prefetched, one block of 16 lines at most; the weights "
        "are loaded (one volatile byte per 64-byte line)")
    loads = [i for i in code if re.match(r"movz?b\w*\s+-?(0x[0-9a-f]+)?\(%r", i)]
    assert len(loads) >= 8, (f"{len(loads)} byte loads in the workers' code: the read-ahead loop "
                             "should load a byte of each of 16 lines per check")


FORK_WHILE_READING = r"""
import os, sys, time, torch
from minisgl import kernel
mod = kernel.load()
torch.set_num_threads(2)
mod.set_read_ahead(256 << 20)
x = torch.randn(1, 1024)
buf = mod.weight_buffer(260 << 20)
flat = buf.view(torch.float32)
a, w = flat[:1024 * 1024].view(1024, 1024), flat[1024 * 1024:].view(-1, 1024)
a.fill_(0.5); w.fill_(0.25)
mod.linear(x, a, None); mod.linear(x, w, None)
hung = 0
for _ in range(5):
    mod.linear(x, a, None)  # a worker now reads 256 MB of w for ~10 ms ...
    pid = os.fork()         # ... and the child is made meanwhile
    if pid == 0:  # the child: no workers, none of them reading; freeing must not wait
        del a, w, flat, buf
        os._exit(0)
    for _ in range(200):  # 20 s
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        hung += 1
print("fork hung", hung)
"""


def test_a_forked_child_frees_its_weight_buffer_without_waiting(kmod):
    """A child forked while a worker reads ahead inherits the count of reading workers
    (``g_reading``) but none of the threads: the fork handler must reset it, or the child's
    first free of a weight buffer waits forever for a reader that does not exist there."""
    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    out = run_script(FORK_WHILE_READING)
    assert out.returncode == 0 and "fork hung 0" in out.stdout, (
        f"a child's free of its weight buffer hung (killed after 20 s): {out.stdout[-500:]} "
        f"{out.stderr[-3000:]}")


READ_FREED_SCRIPT = r"""
import mmap, sys, time, torch
from minisgl import kernel
mod = kernel.load()
torch.set_num_threads(2)
mod.set_read_ahead(64 << 20)
x, a = torch.randn(1, 576), torch.randn(2048, 576)
buf = mmap.mmap(-1, 4096 * 576 * 4)  # a weight in memory this script unmaps itself
w = torch.frombuffer(buf, dtype=torch.float32).view(4096, 576)
w.normal_()
mod.linear(x, a, None); mod.linear(x, w, None); mod.linear(x, a, None)
addr = w.data_ptr()
assert mod.read_ahead_plan(a) == [], "w is not in a weight_buffer: no plan may name it"
del w
buf.close()  # munmap: w's addresses are no longer mapped
for rng in open("/proc/self/maps").read().splitlines():
    lo, hi = (int(v, 16) for v in rng.split()[0].split("-"))
    assert not lo <= addr < hi, "the freed weight is still mapped: the test would prove nothing"
want = x.double() @ a.double().T
for _ in range(50):  # a worker that read w now would kill the process
    y = mod.linear(x, a, None)
    time.sleep(0.002)
assert (y.double() - want).abs().max().item() < 1e-3
print("read ahead ok")
"""


def test_reading_ahead_freed_memory_is_harmless(kmod):
    """Memory that is not a weight buffer (a test's tensor, a model loaded by other means) is
    never read ahead: here it is unmapped after the calls, and the calls go on; a worker that
    loaded from it would kill the process with SIGSEGV."""
    if not pathlib.Path("/proc/self/maps").exists():
        pytest.skip("needs /proc/self/maps to know the memory is unmapped")
    out = run_script(READ_FREED_SCRIPT)
    assert out.returncode == 0 and "read ahead ok" in out.stdout, (
        f"exit status {out.returncode}: {out.stderr[-3000:]}")


STOPPED_READER = r"""
import time, torch
from minisgl import kernel
mod = kernel.load()
def mapped(addr):
    for line in open("/proc/self/maps"):
        lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
        if lo <= addr < hi:
            return True
    return False
def free_one():
    buf = mod.weight_buffer(4 << 20)
    buf.view(torch.float32).fill_(1.0)
    addr = buf.data_ptr()
    t0 = time.monotonic()
    del buf
    return time.monotonic() - t0, mapped(addr)
print("limit was", mod.set_free_wait(0.3))
assert mod.count_readers(1) == 1  # as if a worker had stopped in the middle of reading ahead
print("stopped reader: waited %.3f s, still mapped %s" % free_one(), flush=True)
assert mod.count_readers(-1) == 0  # it is gone
print("no reader: waited %.3f s, still mapped %s" % free_one(), flush=True)
"""


def test_a_free_waits_for_a_stopped_reader_only_so_long_and_keeps_its_memory(kmod):
    """A weight buffer's free waits until no worker reads ahead in it (``before_free``). A
    worker leaves within 16 lines once it runs, but one the OS keeps stopped could make that
    wait last: after ``set_free_wait`` seconds (5 by default) the free gives up waiting, keeps
    the memory mapped (so the stopped reader's next load cannot fault) and says so on stderr.
    Here a reader is counted that never leaves (``count_readers``): the free must return after
    the limit, not hang, leave the pages mapped and name what happened; with no reader, the
    free unmaps at once."""
    import re

    if not pathlib.Path("/proc/self/maps").exists():
        pytest.skip("needs /proc/self/maps to see what is mapped")
    out = run_script(STOPPED_READER, timeout=60)
    assert out.returncode == 0, f"exit status {out.returncode}: {out.stderr[-3000:]}"
    assert "limit was 5.0" in out.stdout, f"the default limit should be 5 s: {out.stdout}"
    m = re.search(r"stopped reader: waited ([0-9.]+) s, still mapped (\w+)", out.stdout)
    assert m, out.stdout
    assert 0.3 <= float(m.group(1)) < 3, (
        f"with a reader that never leaves, the free waited {m.group(1)} s: it must wait the "
        "limit (0.3 s here, set_free_wait) and then return")
    assert m.group(2) == "True", ("the free gave up waiting and unmapped the buffer anyway: a "
                                  "reader still in it would then crash the process")
    assert "stays mapped" in out.stderr and "0.3 s" in out.stderr and "(4 MB)" in out.stderr, (
        f"giving up must say so on stderr, with the limit and the buffer's size (4 MB): "
        f"{out.stderr[-1000:]!r}")
    m = re.search(r"no reader: waited ([0-9.]+) s, still mapped (\w+)", out.stdout)
    assert m and float(m.group(1)) < 0.3 and m.group(2) == "False", (
        f"with no reader the free must unmap at once: {out.stdout}")
    old = kmod.set_free_wait(0.0)  # both ends of 0 to 3600 s are allowed
    assert kmod.set_free_wait(3600.0) == 0.0 and kmod.set_free_wait(old) == 3600.0
    for bad in (-1.0, 3600.5):
        with pytest.raises(RuntimeError, match="0 to 3600 seconds"):
            kmod.set_free_wait(bad)
    assert kmod.set_free_wait(old) == old, "a refused limit must leave the old one"
    assert kmod.count_readers(0) == 0
    with pytest.raises(RuntimeError, match="fewer than 0 readers"):
        kmod.count_readers(-1)
    with pytest.raises(RuntimeError, match=r"more than 2\^20 readers"):
        kmod.count_readers((1 << 20) + 1)
    assert kmod.count_readers(0) == 0, "a refused count_readers must leave the count as it was"


@pytest.mark.parametrize("threads", [2, 3])
def test_the_caller_takes_chunks_from_the_back_and_the_workers_from_the_front(kmod, threads):
    """``Workers::run`` (csrc/common.h): the workers take a call's chunks from the front, the
    caller from the back, each chunk exactly once. The front is what a worker read ahead
    into its own cache; a caller that took chunks from there (or a shared counter) would still
    give the right results, only slower, so the order itself is checked here."""
    with Threads(threads):
        for n, chunk in [(10, 1), (37, 4), (3, 1), (640, 64), (12, 12)]:
            count = -(-n // chunk)
            for attempt in range(12):  # on a busy machine a worker may be slow to wake, or the
                us = min(300 << attempt, 20000)  # caller paused: each try has longer chunks
                caller, others = kmod.split_order(n, chunk, us)
                if (others and caller) or count == 1:
                    break
            assert sorted(caller + others) == list(range(count)), (
                f"{n} items in chunks of {chunk}: every chunk exactly once, got the caller's "
                f"{caller} and the workers' {others}")
            assert caller == list(range(count - 1, count - 1 - len(caller), -1)), (
                f"the caller takes chunks from the back, one after another: got {caller} of "
                f"{count}")
            assert sorted(others) == list(range(len(others))), (
                f"the workers take chunks from the front: got {others} of {count}")
            if count > 1:
                assert others and caller, (
                    f"{count} chunks of up to 20 ms each: both the caller and a worker should "
                    f"have taken some (caller {caller}, workers {others})")
            if threads == 2:
                assert others == sorted(others), f"one worker goes front to back: {others}"
        # many chunks that take no time: the threads take them as fast as they can, so a take
        # that is not one atomic step (a load, then a store) loses or repeats chunks here
        for _ in range(10):
            caller, others = kmod.split_order(20000, 1, 0)
            assert sorted(caller + others) == list(range(20000)), (
                f"20000 chunks taken at full speed: {len(caller) + len(others)} taken, "
                f"{len(set(caller + others))} distinct; a chunk lost or taken twice")
            assert caller == list(range(19999, 19999 - len(caller), -1))
        assert kmod.split_order(0, 3, 0) == [[], []], "nothing to split: no chunk taken"
        for bad in [(5, 0, 0), (-1, 1, 0), (5, 1, -1), (5, 1, 10**7)]:
            with pytest.raises(RuntimeError, match="split_order needs n >= 0 items"):
                kmod.split_order(*bad)


BUDGET_SCRIPT = r"""
from minisgl import kernel
print(kernel.load().set_read_ahead(0))
"""


def test_the_read_ahead_budget_is_one_cores_l2(kmod):
    """What a worker reads ahead by default is what one core's L2 holds (sysfs names it; 512 KiB
    where it does not): more spills into the shared last-level cache and pushes out what the
    caller needs next (chapter 07, part 4 of linear.h). Read in a fresh process, before any
    test has changed it."""
    want = 512 << 10
    for index in sorted(pathlib.Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level, size = (index / "level").read_text().strip(), (index / "size").read_text()
        except OSError:
            continue
        if level == "2" and size.strip().endswith("K"):
            want = int(size.strip()[:-1]) << 10
            break
    out = run_script(BUDGET_SCRIPT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.split()[-1]) == want, (
        f"the default read-ahead budget is {out.stdout.strip()} bytes; one core's L2 is {want}")


def test_the_prefetch_distance_never_changes_a_result(kmod):
    """Part 1's loop prefetches `ahead` floats ahead with one of two hints (both tuned per row
    count in part 5): a hint to the memory system, so every hint and distance gives the same
    bits, on every loop of 1 to 7 rows (and 70: more than part 2 takes, four rows at a time),
    with K a whole number of vectors and not, and a distance far past the end of the weight is
    harmless."""
    g = torch.Generator().manual_seed(7)
    old = {m: (kmod.prefetch_ahead(m), kmod.prefetch_locality(m)) for m in range(2, 8)}
    choices = [(loc, d) for loc in (0, 1) for d in (0, 64, 256, 4096, 1 << 28)]
    try:
        for m in (*range(1, 8), 70):
            for k in (40, 576, 1030):
                x, w = torch.randn(m, k, generator=g), torch.randn(300, k, generator=g)
                outs = []
                for loc, d in choices:
                    if m >= 2:
                        kmod.set_prefetch_ahead(min(m, 4) if m > 7 else m, d, loc)
                    outs.append(kmod.linear(x, w, None))
                for (loc, d), y in zip(choices, outs):
                    assert torch.equal(y, outs[0]), (
                        f"linear.h part 1: {m} rows, K={k}: prefetching {d} floats ahead with "
                        f"locality {loc} changed the result (max diff "
                        f"{(y - outs[0]).abs().max().item():.3g}); the hint and distance may only "
                        "move a __builtin_prefetch, never a load")
                err = (outs[0].double() - x.double() @ w.double().T).abs().max().item()
                assert err < 1e-3, f"linear.h part 1: {m} rows, K={k}: off by {err:.3g}"
    finally:
        for m, (d, loc) in old.items():
            kmod.set_prefetch_ahead(m, d, max(loc, 0))


TUNING_SCRIPT = r"""
import json, torch
from minisgl import kernel
mod = kernel.load()
g = torch.Generator().manual_seed(0)
w = torch.randn(1024, 1024, generator=g)
untouched = all(mod.prefetch_ahead(r) == -1 and mod.prefetch_locality(r) == -1
                and all(b == 0 for *_, b in mod.prefetch_tuning(r)) for r in range(2, 8))
for m in (1, 8, 16, 70):  # no 2-7-row call: nothing to tune, nothing timed
    mod.linear(torch.randn(m, 1024, generator=g), w, None)
others_after_1_8_16_70 = [[b for *_, b in mod.prefetch_tuning(r)] for r in range(2, 8)]
w2 = torch.randn(300, 1024, generator=g)  # two weights of different sizes, called in turn
x = torch.randn(ROWS, 1024, generator=g)
first = [mod.linear(x, w, None), mod.linear(x, w2, None)]
calls, same = 2, True
while mod.prefetch_ahead(ROWS) < 0 and calls < 40000:
    same = same and torch.equal(mod.linear(x, (w, w2)[calls % 2], None), first[calls % 2])
    calls += 1
accounts = mod.prefetch_tuning(ROWS)
for _ in range(20):  # chosen: later calls time nothing
    mod.linear(x, w, None)
ran = mod.last_prefetch()  # what the loop ran with: the choice
print(json.dumps({"untouched": untouched, "before": others_after_1_8_16_70, "calls": calls,
                  "same": same, "accounts": accounts,
                  "chosen": [mod.prefetch_locality(ROWS), mod.prefetch_ahead(ROWS)],
                  "after": mod.prefetch_tuning(ROWS), "tune_bytes": mod.prefetch_tune_bytes(),
                  "ran": ran,
                  "others": {r: mod.prefetch_ahead(r) for r in range(2, 8) if r != ROWS}}))
"""


@pytest.mark.parametrize("rows", [2, 3, 7])
def test_the_prefetch_distance_is_tuned_in_the_calls(kmod, rows):
    """A fresh process has no hint or distance (-1) and empty accounts; calls of 1, 8, 16 or 70
    rows touch none. Calls of `rows` rows (two weights of different sizes, in turn) take the
    candidates (hint, distance) in turn, each weight its own rounds; the choice comes at the
    start of a round, every candidate's account covering the same bytes, and is the candidate
    with the least time in its account; later calls time nothing. Other row counts are
    untouched, and no call's result changes on the way."""
    import json

    out = run_script(TUNING_SCRIPT.replace("ROWS", str(rows)))
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["untouched"], "linear.h part 5: a fresh process must start with no hint or " \
                           "distance (-1) and empty accounts for every row count"
    assert all(b == 0 for acc in r["before"] for b in acc), (
        f"linear.h part 5: calls of 1, 8, 16 and 70 rows timed something for the 2-7-row loop: "
        f"{r['before']}; only 2-7-row calls tune")
    assert r["same"], f"linear.h part 1: a result changed while {rows} rows were tuning"
    acc = r["accounts"]
    assert min(r["chosen"]) >= 0, (f"linear.h part 5: {r['calls']} calls of {rows} rows chose "
                                   f"no hint and distance: {r['chosen']}, {acc}")
    cands = [[loc, d] for loc, d, _, _ in acc]
    assert len({tuple(c) for c in cands}) == len(cands) >= 4 and r["chosen"] in cands, (
        f"linear.h part 5: the kept (locality, floats) {r['chosen']} must be one of the "
        f"candidates, each once: {cands}")
    assert {loc for loc, _ in cands} == {0, 1}, (
        f"linear.h part 5: the candidates must try both hints (0: prefetchnta, 1: prefetcht2): "
        f"{cands}")
    assert all(math.isfinite(t) and t > 0 for *_, t, _ in acc), (
        f"linear.h part 5: every candidate needs a real time in its account: {acc}")
    sizes = {b for *_, b in acc}
    assert len(sizes) == 1 and sizes.pop() > 0, (
        f"linear.h part 5: the candidates were timed over different bytes {[b for *_, b in acc]}:"
        " choose only at the start of a round, when each has had the same calls")
    assert (r["calls"] - 1) % (2 * len(acc)) == 0, (
        f"linear.h part 5: chose after {r['calls'] - 1} timed calls of two weights, not whole "
        f"rounds of {len(acc)} candidates each")
    both = (1024 + 300) * 1024 * 4  # the two weights' bytes
    assert acc[0][3] == both, (f"linear.h part 5: the accounts cover {acc[0][3]} bytes; the two "
                               f"weights have {both} (bytes, not floats, of each weight)")
    rounds, want = (r["calls"] - 1) // (2 * len(acc)), max(2, math.ceil(r["tune_bytes"] / both))
    assert rounds == want, (
        f"linear.h part 5: chose after {rounds} rounds; the first round start with two rounds "
        f"behind and rounds x {both} bytes >= {r['tune_bytes']} is round {want}")
    best = list(min(acc, key=lambda a: a[2])[:2])
    assert r["chosen"] == best, (f"linear.h part 5: kept (locality, floats) {r['chosen']}, but "
                                 f"the least time was {best}'s: {acc}")
    assert r["after"] == acc, ("linear.h part 5: calls after the choice still went to the "
                               "accounts")
    assert r["ran"] == r["chosen"], (
        f"linear.h part 6: the loop ran with (locality, floats) {r['ran']} after "
        f"{r['chosen']} was chosen: linear must call linear_rows<Loc> for the chosen hint")
    assert all(v == -1 for v in r["others"].values()), (
        f"linear.h part 5: tuning {rows} rows chose distances for other row counts: "
        f"{r['others']}")


def test_a_set_prefetch_distance_is_kept_and_minus_one_tunes_again(kmod):
    """``set_prefetch_ahead(rows, d, locality)`` fixes a distance and hint (calls then time
    nothing, and the loop runs with them: ``last_prefetch``); -1 empties the accounts and tunes
    again; a row count outside 2-7, a distance below
    -1 or a hint the loop is not built with is refused with a message that says what is
    allowed."""
    w, x = torch.randn(256, 64), torch.randn(3, 64)
    old = (kmod.prefetch_ahead(3), max(kmod.prefetch_locality(3), 0))
    try:
        rounds = 2 * len(kmod.prefetch_tuning(3))  # calls for two rounds of the candidates
        kmod.set_prefetch_ahead(3, -1)
        for _ in range(rounds):  # tuning: two rounds in the accounts
            kmod.linear(x, w, None)
        assert sum(b for *_, b in kmod.prefetch_tuning(3)) > 0, (
            "linear.h part 5: while tuning, two rounds of 3-row calls timed nothing")
        for loc in (1, 0):
            kmod.set_prefetch_ahead(3, 128, loc)
            before = kmod.prefetch_tuning(3)
            kmod.linear(x, w, None)
            assert (kmod.prefetch_ahead(3), kmod.prefetch_locality(3)) == (128, loc), (
                f"linear.h part 6: a set distance and hint (128, {loc}) were not kept")
            assert tuple(kmod.last_prefetch()) == (loc, 128), (
                f"linear.h part 6: set to (locality {loc}, 128 floats), the 3-row loop ran with "
                f"{kmod.last_prefetch()}: linear must call linear_rows<Loc> for the set hint")
            old4 = (kmod.prefetch_ahead(4), max(kmod.prefetch_locality(4), 0))
            try:  # more rows than part 2 takes go 4 at a time, with the 4-row choice
                kmod.set_prefetch_ahead(4, 256, loc)
                kmod.linear(torch.randn(70, 64), w, None)
                assert tuple(kmod.last_prefetch()) == (loc, 256), (
                    f"linear.h part 1: 70 rows, 4 at a time, ran with {kmod.last_prefetch()}, "
                    f"not the 4-row choice (locality {loc}, 256 floats)")
            finally:
                kmod.set_prefetch_ahead(4, *old4)
            assert kmod.prefetch_tuning(3) == before, (
                "linear.h part 6: with a set distance, calls still went to the accounts")
        assert kmod.set_prefetch_ahead(3, -1) == 128
        assert kmod.prefetch_ahead(3) == -1 and kmod.prefetch_locality(3) == -1 and all(
            s == 0 and b == 0 for *_, s, b in kmod.prefetch_tuning(3)), (
            "linear.h part 6: -1 must empty the accounts and tune again")
        for _ in range(rounds):
            kmod.linear(x, w, None)
        assert sum(b for *_, b in kmod.prefetch_tuning(3)) > 0, (
            "linear.h part 5: after -1, two rounds of 3-row calls timed nothing")
        for bad in (1, 8, 0, -3):
            with pytest.raises(RuntimeError, match="tuned for 2 to 7 rows"):
                kmod.prefetch_ahead(bad)
            with pytest.raises(RuntimeError, match="tuned for 2 to 7 rows"):
                kmod.prefetch_tuning(bad)
            with pytest.raises(RuntimeError, match="tuned for 2 to 7 rows"):
                kmod.prefetch_locality(bad)
        with pytest.raises(RuntimeError, match="must be >= 0 floats"):
            kmod.set_prefetch_ahead(3, -2)
        for bad in (2, 3, -1):
            with pytest.raises(RuntimeError, match=r"locality must be 0 \(non-temporal"):
                kmod.set_prefetch_ahead(3, 128, bad)
        assert kmod.prefetch_ahead(3) == -1, "linear.h part 6: a refused call changed the distance"
    finally:
        kmod.set_prefetch_ahead(3, *old)


def test_the_build_targets_this_cpus_widest_vectors(kmod):
    """-march=native: AVX-512 where the CPU has it, else AVX2 with FMA, NEON on aarch64; the
    module says which (``vector_isa``, printed in the benchmarks' headers)."""
    import platform

    isa, lanes = kmod.vector_isa(), kmod.vector_lanes()
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        flags = set(pathlib.Path("/proc/cpuinfo").read_text().split()) if pathlib.Path(
            "/proc/cpuinfo").exists() else set()
        if not flags:
            pytest.skip("no /proc/cpuinfo to compare with")
        want = ("AVX-512", 16) if "avx512f" in flags else (
            ("AVX2+FMA", 8) if {"avx2", "fma"} <= flags else None)
        if want is None:
            pytest.skip("an x86 CPU without AVX2")
        assert (isa, lanes) == want, f"built for {isa} ({lanes} floats), the CPU has {want[0]}"
    elif machine in ("aarch64", "arm64"):
        assert (isa, lanes) == ("NEON", 4)


def test_kernel_isa_setting_is_checked(monkeypatch):
    from minisgl.utils.env import EnvVarError

    monkeypatch.setenv("MINISGL_KERNEL_ISA", "avx1024")
    with pytest.raises(EnvVarError, match="MINISGL_KERNEL_ISA='avx1024'.*one of 'native'"):
        kernel.build_flags()
    monkeypatch.setenv("MINISGL_KERNEL_ISA", "no-avx512")
    assert "-mno-avx512f" in kernel.build_flags()


def test_linear_reads_each_calls_own_x(kmod):
    """Each thread keeps its transposed copy of x (``thread_xt``) from call to call, so every
    call must copy again, on every thread that takes a chunk: here x changes in place between
    calls (same tensor, same address, same shape), the weight stays, the thread count changes
    under a kept copy, and some calls come after a pause long enough for the workers to sleep
    (they then join late, after the caller's copy). A copy keyed on x's address or shape, one
    flag for all threads, or a worker that skips its copy gives the last call's answer."""
    g = torch.Generator().manual_seed(7)
    for m, k in [(8, 576), (16, 577), (16, 1536), (32, 64)]:
        w = torch.randn(12000, k, generator=g)  # calls long enough for a late worker to join
        x = torch.randn(m, k, generator=g)
        for threads in (2, 1, 3, 2):
            for i in range(6):
                if i % 2:
                    time.sleep(0.003)  # past the workers' 1 ms of spinning: they sleep
                x.copy_(torch.randn(m, k, generator=g))
                want = x.double() @ w.double().T
                with Threads(threads):
                    y = kmod.linear(x, w, None)
                err = (y.double() - want).abs().max().item()
                assert err < 1e-4 * (1 + want.abs().max().item()), (
                    f"linear({m}x{k}) with {threads} threads, x changed in place since the last "
                    f"call: off float64 by {err:.1e} (a thread used an old copy of x?)")


def test_small_batch_linear_hands_a_prefill_to_mkl(kmod, monkeypatch):
    calls = []
    monkeypatch.setattr(kernel, "_MODULE", type("Spy", (), {
        "linear": staticmethod(lambda *a: calls.append(a[0].shape[0]) or kmod.linear(*a))})())
    w = torch.randn(96, 64)
    for rows in (1, kernel.LINEAR_MAX_ROWS, kernel.LINEAR_MAX_ROWS + 1, 300):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(kernel.small_batch_linear(x, w), F.linear(x, w))
    assert calls == [1, kernel.LINEAR_MAX_ROWS], f"rows sent to the kernel: {calls}"


@pytest.mark.slow
@pytest.mark.parametrize("flags,lanes", [(["-O3"], 4), (["-O3", "-mavx2", "-mfma"], 8)],
                         ids=["4-lanes", "8-lanes"])
def test_linear_with_narrower_vectors(kmod, flags, lanes):
    """``linear``'s and decode attention's vectors follow the compiler's target: 16 floats with
    AVX-512, 8 with AVX2, 4 otherwise (SSE, an ARM laptop's NEON). Build the narrower ones here
    and check them too."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the flags below are x86 ones")
    try:
        mod = kbuild.load_or_build(flags)
    except (RuntimeError, OSError) as e:  # a compiler without these flags: nothing to check
        pytest.skip(f"cannot build with {flags}: {e}")
    assert mod.vector_lanes() == lanes, f"{flags} should give {lanes}-float vectors"
    g = torch.Generator().manual_seed(lanes)
    for m, n, k in [(1, 577, 33), (1, 70, 1077), (2, 40, 37), (3, 21, 1077), (4, 96, 64),
                    (4, 11, 83), (7, 6, 15), (9, 13, 37), (16, 130, 576)]:
        x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n)
        want = x.double() @ w.double().T + b.double()
        err = (mod.linear(x, w, b).double() - want).abs().max().item()
        assert err < 1e-4 * (1 + want.abs().max().item()), (
            f"{lanes}-lane linear({m}x{k} @ {n}x{k}) is {err:.2e} off float64")
    check_decode_attention(mod)


def functions(disassembly: str, function: str) -> dict[str, list[tuple[int, str]]]:
    """Every function whose name contains `function`, from `objdump -d -C` output: {name:
    [(address, 'mnemonic operands'), ...]}."""
    import re

    funcs: dict[str, list[tuple[int, str]]] = {}
    name = None
    for line in disassembly.splitlines():
        if (m := re.match(r"^[0-9a-f]+ <(.*)>:$", line)):
            name = m.group(1) if function in m.group(1) else None
            if name:
                funcs[name] = []
        elif name and (m := re.match(r"^\s*([0-9a-f]+):\s+(\S.*)$", line)):
            funcs[name].append((int(m.group(1), 16), m.group(2).strip()))
    return funcs


def cached_kernels_disassembly() -> str:
    """`objdump -d -C` of the library `kmod` was loaded from, as the cache keeps it (skips where
    that cannot be read: not x86, no objdump)."""
    import platform
    import shutil

    from minisgl import kernel
    from minisgl.kernel import build as kbuild

    if platform.machine().lower() not in ("x86_64", "amd64") or not shutil.which("objdump"):
        pytest.skip("reads x86 code with objdump (binutils)")
    key = kbuild.build_key(kbuild.source_bytes(), kernel.build_flags())
    lib = kbuild.cache_dir() / key / f"minisgl_cpu_kernels_{key}.so"
    assert lib.exists(), f"{lib}: the library kmod was loaded from should be cached there"
    return subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", str(lib)],
                          capture_output=True, text=True, timeout=120, check=True).stdout


def inner_loops(disassembly: str, function: str) -> dict[str, list[tuple[int, list[str]]]]:
    """The innermost loops (a backward jump and what it jumps over, with no other backward jump
    in between) that hold 4 multiply-adds or more, of every function whose name contains
    `function`, from `objdump -d -C` output: {name: [(address of the loop's first instruction,
    loop), ...]}, each loop a list of 'mnemonic operands' lines. (A jump from code laid out
    after a loop back into the code before it spans the loop's end: not a loop of its own.)"""
    import re

    found = {}
    for fname, insns in functions(disassembly, function).items():
        loops = [(int(m.group(1), 16), addr) for addr, ins in insns
                 if (m := re.match(r"j\w+\s+([0-9a-f]+)\b", ins)) and int(m.group(1), 16) <= addr]
        inner = [lp for lp in loops if not any(o != lp and lp[0] <= o[1] <= lp[1] for o in loops)]
        bodies = [(lo, [ins for addr, ins in insns if lo <= addr <= hi]) for lo, hi in inner]
        found[fname] = [(lo, b) for lo, b in bodies
                        if sum(bool(re.match(r"v?(fn?madd\w*ps|mulps)\b", i)) for i in b) >= 4]
    return found


@pytest.mark.slow
def test_the_many_rows_loop_keeps_its_sums_in_registers(tmp_path):
    """From 8 rows `linear` is limited by arithmetic, and its loop is fast only while its 12
    running sums stay in vector registers: 16 of them with SSE and AVX2, 32 with AVX-512. A
    copy through a local array once made GCC keep them on the stack in the AVX2 build only (a
    store after every FMA: 16 rows took 4.3x as long), unseen on an AVX-512 machine. So compile
    the kernels for 4, 8 and 16-float vectors (object files only: no CPU here needs to run
    them) and read every `linear_rows_t<L, MV, TR>`'s inner loop: no vector register may go to
    or come from the stack there. The same holds for the loop of 1 to 7 rows,
    `linear_few_rows<MM, S, U, Loc, L>`: MM x S x U sums, up to 14 of AVX2's 16 registers; and
    that loop reads each vector once a pass (check_few_rows_loads), in the vectors its L names
    (check_few_rows_width: 8 floats from 2 rows on in the AVX-512 build). In both, the addresses
    and counters stay in general registers (check_pointers_in_registers)."""
    import platform
    import shutil
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    from minisgl.kernel.cache import SOURCE

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the flags below are x86 ones")
    cxx, objdump = shutil.which("g++") or shutil.which("c++"), shutil.which("objdump")
    if not cxx or not objdump:
        pytest.skip("needs a C++ compiler and objdump (binutils)")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    common = [cxx, "-c", str(SOURCE), "-std=c++17", "-fPIC", "-O3", "-w",
              f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_EXTENSION_NAME=check",
              "-DTORCH_API_INCLUDE_EXTENSION_H", f"-I{sysconfig.get_paths()['include']}",
              *(f"-I{p}" for p in include_paths())]
    targets = {4: [], 8: ["-mavx2", "-mfma"], 16: ["-march=x86-64-v4"]}
    for flags in targets.values():  # an older compiler may not know a flag: nothing to check
        probe = subprocess.run([cxx, *flags, "-x", "c++", "-c", "-", "-o", os.devnull],
                               input="int f() { return 0; }\n", capture_output=True, text=True,
                               timeout=60, check=False)
        if probe.returncode != 0:
            pytest.skip(f"{cxx} does not accept {flags}: {probe.stderr.strip()[-200:]}")
    procs = {lanes: subprocess.Popen([*common, *flags, "-o", str(tmp_path / f"{lanes}.o")],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for lanes, flags in targets.items()}
    try:
        outs = {lanes: proc.communicate(timeout=900)[0] for lanes, proc in procs.items()}
    except subprocess.TimeoutExpired:
        pytest.fail("compiling the kernels took over 15 minutes, 3 builds at once: is the "
                    "machine swapping? Run this test alone (-k many_rows_loop) to see")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for lanes, out in outs.items():  # the flags work, so a failure is in the source
        assert procs[lanes].returncode == 0, f"{targets[lanes]} build failed: {out[-2000:]}"
    for lanes in targets:
        obj = str(tmp_path / f"{lanes}.o")
        dis = subprocess.run([objdump, "-d", "--no-show-raw-insn", "-C", obj],
                             capture_output=True, text=True, check=True).stdout
        # the loop is in linear_rows_t<L, MV, TR>, or in linear_tile_t<L, MV, TR> where the
        # compiler did not inline that into it
        rows, tiles = inner_loops(dis, "linear_rows_t<"), inner_loops(dis, "linear_tile_t<")
        few = inner_loops(dis, "linear_few_rows<")
        for found, fn in ((rows, "linear_rows_t"), (few, "linear_few_rows")):
            assert found, (f"no {fn}<...> in the {lanes}-float build: it must stay a function "
                           "of its own (__attribute__((noinline)), linear.h) for this check")
        for name in [*rows, *few]:
            args = name[name.index("<"):name.index(">") + 1]
            loops = {**rows, **tiles} if name in rows else few
            bodies = [b for n, bs in loops.items() if args in n for _, b in bs]
            sums = math.prod(int(a) for a in args.strip("<>").split(",")[:3])  # MM x S x U
            if name in few and sums < 4:  # a leftover instance: under 4 FMAs a pass, not read
                continue
            assert bodies, f"{lanes}-float build: no multiply-add loop found in {name}"
            for body in bodies:
                spills = [i for i in body if "(%rsp)" in i or "(%rbp)" in i if "mm" in i]
                assert not spills, (
                    f"{lanes}-float build: the inner loop of {name} moves vectors to or from the "
                    f"stack ({len(spills)} of its {len(body)} instructions, e.g. {spills[0]!r}): "
                    "its running sums no longer fit in registers. Keep 12 sums a tile at most "
                    "(linear_rows_many) and 14 in the few-rows loop (rows x streams x sums, "
                    "linear_rows), load each x vector on its own (load_vec), and index the sums "
                    "by constants only.")
                check_pointers_in_registers(name, lanes, body)
            if name in few:
                check_few_rows_loads(name, lanes, bodies)
                check_few_rows_width(name, lanes, bodies)
        if lanes == 16:  # the AVX-512 build has both widths: one row at 16, more at 8
            widths = {int(n[n.index("<") + 1:n.index(">")].split(",")[0]):
                      int(n[n.index("<") + 1:n.index(">")].split(",")[4]) for n in few}
            assert widths.get(1) == 16 and widths.get(4) == 8, (
                f"16-float build: linear_few_rows takes {widths} (rows: floats a vector); "
                "1 row must keep 16-float vectors, 2 to 7 rows take 8 (linear.h part 1, Width)")


def check_pointers_in_registers(name: str, lanes: int, body: list[str]) -> None:
    """A matmul loop keeps its addresses and counters in general registers: it neither reads
    nor writes the stack with them, nor parks them in vector registers (vmovq between an %xmm
    and a general register). x86-64 has 16 general registers, and each weight row a loop reads
    at once takes one for its pointer: with 12 weight rows a tile (linear_rows_t<16, 1, 12>),
    GCC 12 moved 3 pointers in and out of vector registers on every k, and the 16-row loop ran
    at 0.77x the core's FMA peak in L2 on a Zen 4 (with 8 weight rows a tile: 0.93x)."""
    import re

    gpr = r"%(r(?!ip)[a-z0-9]+|e[a-z]{2})\b"
    parked = [i for i in body if re.match(r"v?mov[dq]\s", i) and "mm" in i and re.search(gpr, i)]
    stack = [i for i in body if ("(%rsp)" in i or "(%rbp)" in i) and not i.startswith("lea")]
    bad = parked + stack
    assert not bad, (
        f"{lanes}-float build: the inner loop of {name} keeps addresses or counters outside the "
        f"general registers ({len(bad)} of its {len(body)} instructions, e.g. {bad[0]!r}): a "
        "loop reading more weight rows at once than x86-64's 16 general registers can point "
        "to. Take fewer weight rows a tile (linear_rows_many: 8 with one vector a column) or "
        "fewer streams (linear_rows).")


def memory_reads(body: list[str]) -> int:
    """How many instructions of a loop read memory: a load, or an operation that takes one of
    its operands from memory (AT&T syntax: a source operand in parentheses). Prefetches,
    address arithmetic (lea) and jumps (whose target objdump names with its arguments) read
    nothing."""
    import re

    count = 0
    for ins in body:
        mnemonic, _, ops = ins.partition(" ")
        if mnemonic.startswith(("prefetch", "lea", "nop", "j", "call")) or "(" not in ops:
            continue
        operands = re.findall(r"[^,(]*(?:\([^)]*\))?[^,]*", ops.strip())
        operands = [o for o in operands if o.strip()]
        count += any("(" in o for o in operands[:-1])
    return count


def check_few_rows_width(name: str, lanes: int, bodies: list[list[str]]) -> None:
    """`linear_few_rows<MM, S, U, Loc, L>` multiplies in vectors of L floats: every FMA of its
    inner loop on the registers of that width (%zmm: 16, %ymm: 8, %xmm: 4), none wider or
    narrower. A loop declared for 8 floats whose loads or sums were still typed for 16 would
    not compile; this reads what the compiler made of the width it was given."""
    import re

    width = int(name[name.index("<") + 1:name.index(">")].split(",")[4])
    reg = {16: "zmm", 8: "ymm", 4: "xmm"}[width]
    for body in bodies:
        fmas = [i for i in body if re.match(r"v?(fn?madd\w*ps|mulps)\b", i)]
        wrong = [i for i in fmas if f"%{reg}" not in i or
                 any(f"%{r}" in i for r in ("zmm", "ymm", "xmm") if r != reg)]
        assert not wrong, (f"{lanes}-float build: {name} declares {width}-float vectors, but its "
                           f"loop multiplies in other registers: {wrong[:2]}")


def check_few_rows_loads(name: str, lanes: int, bodies: list[list[str]]) -> None:
    """`linear_few_rows<MM, S, U, Loc, L>` loads each vector of x once a pass and each stream's
    weight vector once: U * (S + MM) reads for MM * S * U multiply-adds, where the registers
    hold them (32 with AVX-512, 16 otherwise). Rows of x that the sums and the weight vector
    leave no register for are read from L1 by every stream. GCC 12, left to itself, read the
    weight vectors again inside the FMAs of the AVX-512 build (21 reads for 12 FMAs at 4 rows).
    SSE (the 4-float build) multiplies in place: a product takes one of its 16 registers for a
    copy. And the loop prefetches with the hint its Loc names (0: prefetchnta, 1: prefetcht2),
    from 2 rows on; one row prefetches nothing."""
    import re

    mm, s, u, loc, _ = (int(a) for a in name[name.index("<") + 1:name.index(">")].split(","))
    for body in bodies:
        hints = {i.split()[0] for i in body if i.startswith("prefetch")}
        want = set() if mm == 1 else {("prefetchnta", "prefetcht2")[loc]}
        assert hints == want, (
            f"{lanes}-float build: the inner loop of {name} prefetches with {sorted(hints)}, not "
            f"{sorted(want)}: __builtin_prefetch's locality must be the template's Loc (0: "
            "non-temporal, 1: into L2), and one row of x prefetches nothing")
    regs = {16: 32, 8: 16}.get(lanes, 15)
    in_regs = max(0, min(mm, regs - mm * s * u - 1))
    allowed = u * (s + in_regs + (mm - in_regs) * s)  # per pass of mm * s * u products
    for body in bodies:
        products = sum(bool(re.match(r"v?(fn?madd\w*ps|mulps)\b", i)) for i in body)
        reads = memory_reads(body)
        assert reads * mm * s * u <= allowed * products, (
            f"{lanes}-float build: the inner loop of {name} reads memory {reads} times for "
            f"{products} multiply-adds; at most {allowed} per {mm * s * u} (each x vector and "
            f"weight vector once a pass, {mm - in_regs} rows of x from L1): are the vectors of x "
            "and the weight held with in_register (common.h) after they are loaded?")


def test_the_matmul_loops_start_a_line_of_code(kmod):
    """The kernels are built with ``-falign-loops=64`` (``kernel.build_flags``), so each inner
    multiply-add loop of ``linear`` starts a 64-byte line of code: its speed must not hang on
    where an edit elsewhere in the library happens to put it. Built without it, a 16-row
    matmul's loop moved 16 bytes, with the same instructions, and the decode step at batch 16
    took 5% longer on a Zen 2."""
    dis = cached_kernels_disassembly()
    loops = {**inner_loops(dis, "linear_rows_t<"), **inner_loops(dis, "linear_few_rows<")}
    starts = {name: [lo for lo, _ in found] for name, found in loops.items() if found}
    assert len(starts) >= 4, f"too few of linear's loops found to check: {list(starts)}"
    for name, found in starts.items():
        for lo in found:
            assert lo % 64 == 0, (
                f"{name}: a multiply-add loop starts at {lo:#x}, {lo % 64} bytes into a line of "
                f"code: is -falign-loops=64 still in kernel.build_flags()?")


def test_bad_input_gets_a_clear_error(kmod):
    m = kmod
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="float32"):
        m.rmsnorm(x.double(), torch.ones(8, dtype=torch.float64), 1e-6)
    with pytest.raises(RuntimeError, match="weight must be"):
        m.rmsnorm(x, torch.ones(9), 1e-6)
    with pytest.raises(RuntimeError, match="contiguous along its last dim"):
        m.silu_and_mul(torch.randn(8, 2).t())
    for dtype in (torch.int64, torch.int32):  # the batch's positions are int32
        with pytest.raises(RuntimeError, match="position 99 is outside the rope table"):
            m.rope_inplace(torch.tensor([5, 99], dtype=dtype), torch.randn(2, 8),
                           torch.randn(10, 8), 8)
    with pytest.raises(RuntimeError, match="int32 or int64"):
        m.rope_inplace(torch.tensor([5.0, 9.0]), torch.randn(2, 8), torch.randn(10, 8), 8)
    k_cache = torch.zeros(16, 8)
    q = torch.randn(1, 16)
    with pytest.raises(RuntimeError, match="kv slot 40 is outside the pool"):
        m.decode_attention(q, k_cache, k_cache.clone(), torch.tensor([40, 1]),
                           torch.tensor([2]), 2, 8)
    with pytest.raises(RuntimeError, match="seq_len 3 must be in 1..2"):
        m.decode_attention(q, k_cache, k_cache.clone(), torch.tensor([0, 1]),
                           torch.tensor([3]), 2, 8)
    for bad_q in (torch.randn(1, 2, 16)[:, :, :8], torch.randn(1, 4, 4),  # strided, wrong D
                  torch.randn(1, 8, 2).transpose(1, 2)):
        with pytest.raises(RuntimeError, match=r"a 3-D q must be \[B, Hq, head_dim=8\]"):
            m.decode_attention(bad_q, k_cache, k_cache.clone(), torch.tensor([0, 1]),
                               torch.tensor([2]), 2, 8)
    with pytest.raises(RuntimeError, match="positions has 2 entries, x2 has 3 rows"):
        m.rope_inplace(torch.tensor([1, 2]), torch.randn(2, 8), torch.randn(10, 8), 8,
                       torch.randn(3, 8))
    with pytest.raises(RuntimeError, match="x2's last dim \\(6\\)"):
        m.rope_inplace(torch.tensor([1, 2]), torch.randn(2, 8), torch.randn(10, 8), 8,
                       torch.randn(2, 6))
    with pytest.raises(RuntimeError, match="logits must be float32"):
        m.argmax_rows(torch.randn(2, 8).double())
    with pytest.raises(RuntimeError, match="input-major weight"):
        m.linear(x, torch.randn(8, 3).t(), None)  # [3, 8] stored input-major
    with pytest.raises(RuntimeError, match=r"the weight must be \[out_features, 8\]"):
        m.linear(x, torch.randn(3, 9), None)
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32 CPU vector of 3"):
        m.linear(x, torch.randn(3, 8), torch.randn(4))


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("t", [1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_store_kv_kernel_equals_the_pools_code(kmod, page_size, t, dtype):
    """A pool built with the kernels' set stores through ``store_kv`` (C++), one built without
    through chapter 04's code: the same slots change, to the same bits, for strided k and v
    (views of a fused qkv row), and every other slot of every layer keeps its value."""
    from minisgl.distributed import set_tp_info
    from minisgl.kvcache import create_kvcache_pool
    from minisgl.layers import build_ops

    set_tp_info(0, 1)

    class Cfg:
        num_kv_heads, num_layers, head_dim = 2, 3, 8

    g = torch.Generator().manual_seed(t + page_size)
    mine = create_kvcache_pool(Cfg, 24, page_size, torch.float32, "cpu")
    with build_ops(kernel.op_impls()):
        fused = create_kvcache_pool(Cfg, 24, page_size, torch.float32, "cpu")
    assert fused._kernel is kernel.store_kv and mine._kernel is None
    start = torch.randn(mine._kv_buffer.shape, generator=g)
    mine._kv_buffer.copy_(start)
    fused._kv_buffer.copy_(start)
    for layer in (0, 2):
        qkv = torch.randn(t, 5 * 16, generator=g)
        k, v = qkv[:, 32:48], qkv[:, 48:64]  # rows 80 floats apart, as in a fused projection
        out_loc = torch.randperm(mine.num_slots, generator=g)[:t].to(dtype)
        mine.store_kv(k, v, out_loc, layer)
        fused.store_kv(k, v, out_loc, layer)
    assert torch.equal(mine._kv_buffer, fused._kv_buffer)
    assert not torch.equal(fused._kv_buffer, start)
    with pytest.raises(RuntimeError, match=r"out_loc\[1\] = 99 is outside the pool"):
        two = torch.randn(2, 80, generator=g)
        fused.store_kv(two[:, 32:48], two[:, 48:64], torch.tensor([0, 99], dtype=dtype), 1)
    with pytest.raises(RuntimeError, match=r"k and v must be \[T, Hkv \* D\] = \[T, 16\]"):
        fused.store_kv(qkv[:, :24], qkv[:, 24:48], out_loc, 1)
    with pytest.raises(RuntimeError, match=f"int64 CPU vector of {t} slots"):
        fused.store_kv(k, v, out_loc[:0], 1)
    assert torch.equal(mine._kv_buffer, fused._kv_buffer), "a refused store wrote something"


# ----------------------------------------------------------------------------- generated inputs
# The grids above list chosen cases; here Hypothesis draws the rest of each input class against
# float64 references written in plain torch: every row count from 1 to 70 through `linear`'s
# paths (and the boundaries between them), widths ending in every tail of a vector, strided
# views, 1 to 3 threads; for the small ops any width and position; for attention the page size,
# head size, GQA group, ragged lengths and padding dummies.
def _width(vectors: int, tails: int = 16):
    """Widths of 1 to ``vectors`` whole 16-float vectors plus any tail: every remainder a
    vectorised loop can leave is as likely as any other (and a width of 0 never comes)."""
    from hypothesis import strategies as st

    return st.builds(lambda q, r: q * 16 + r, st.integers(0, vectors),
                     st.integers(0, tails - 1)).filter(lambda w: w > 0)


def test_linear_on_every_remainder(kmod):
    """Every combination of the classes a tiled, vectorised loop can get wrong: each row count
    from 1 to 16 (and some beyond), output features ending in each remainder of a 12-row tile
    (and so of 4 and 6), K ending in each remainder of a 16-float vector after 0, 1, 4 or 67
    whole vectors (67: several chunks per thread), with and without bias, x contiguous or
    strided, one thread or two."""
    g = torch.Generator().manual_seed(0)
    failures = []
    for m in [*range(1, 17), 17, 33, 64, 70]:
        for rn in range(1, 13):
            for rk in range(16):
                case = m + rn + rk
                k = 16 * (0, 1, 4, 67)[case % 4] + rk
                if k == 0:
                    k = 16 * 67
                n = 24 + rn
                x = strided_rows(m, k, case % 3, g)
                w = torch.randn(n, k, generator=g)
                b = torch.randn(n, generator=g) if case % 2 else None
                want = x.double() @ w.double().T + (b.double() if b is not None else 0)
                with Threads(1 + case % 2):
                    y = kmod.linear(x, w, b)
                err = (y.double() - want).abs().max().item()
                if err > 1e-4 * (1 + want.abs().max().item()):
                    failures.append(f"{m}x{k} @ {n}x{k} bias={b is not None}: {err:.1e}")
    assert not failures, (f"linear is off float64 in {len(failures)} cases, e.g. "
                          + "; ".join(failures[:6]))


def test_small_ops_on_every_remainder(kmod):
    """rmsnorm, add + rmsnorm and silu * up on widths ending in each remainder of a 16-float
    vector (after 0, 1 and 36 whole vectors), 1, 5 or 16 rows, strided or not, 1 or 2 threads
    (16 rows of 576 and more: several chunks, on both threads)."""
    g = torch.Generator().manual_seed(1)
    failures = []
    for h in [*range(1, 33), *range(576, 592)]:
        for t, off, threads in [(1, 0, 1), (5, 2, 2), (16, 1, 2)]:
            x, r = strided_rows(t, h, off, g), strided_rows(t, h, 1, g)
            w = torch.randn(h, generator=g)
            gu = strided_rows(t, 2 * h, off, g)
            s = x + r
            with Threads(threads):
                got = [kmod.rmsnorm(x, w, 1e-5), kmod.fused_add_rmsnorm(x, r, w, 1e-5),
                       kmod.silu_and_mul(gu)]
            wants = [rmsnorm64(x, w, 1e-5), rmsnorm64(s, w, 1e-5), silu_and_mul64(gu)]
            for name, y, want in zip(["rmsnorm", "fused_add_rmsnorm", "silu_and_mul"], got,
                                     wants):
                if (y.double() - want).abs().max() > 2e-5 * (1 + want.abs().max()):
                    failures.append(f"{name}, {t} rows of {h}")
            if not torch.equal(r, s):
                failures.append(f"fused_add_rmsnorm's residual, {t} rows of {h}")
    assert not failures, f"{len(failures)} cases off float64, e.g. " + "; ".join(failures[:6])


def test_linear_on_generated_shapes(kmod):
    from hypothesis import given
    from hypothesis import strategies as st

    # every row count of a decode batch (1-16) equally likely, a few beyond (the C++ function
    # takes any M; a build with narrower vectors uses those paths for 9-16 rows); output
    # features in whole tiles of 12 plus any remainder; K as in _width, or a model's width
    @generated(400)
    @given(m=st.sampled_from([*range(1, 17), 17, 24, 31, 32, 33, 48, 64, 65, 70]),
           n=st.one_of(st.builds(lambda q, r: 12 * q + r, st.integers(0, 10),
                                 st.integers(1, 12)), st.sampled_from([577, 960])),
           k=st.one_of(_width(20), st.sampled_from([576, 1077, 1536])),
           x_off=st.integers(0, 3), w_extra=st.integers(0, 3), bias=st.booleans(),
           threads=st.integers(1, 3), seed=st.integers(0, 2**16))
    def check(m, n, k, x_off, w_extra, bias, threads, seed):
        g = torch.Generator().manual_seed(seed)
        x = strided_rows(m, k, x_off, g)
        w = torch.randn(n, k + w_extra, generator=g)[:, :k]
        b = torch.randn(n, generator=g) if bias else None
        want = x.double() @ w.double().T + (b.double() if bias else 0)
        with Threads(threads):
            y = kmod.linear(x, w, b)
        assert y.shape == (m, n) and y.is_contiguous(), f"linear gave {tuple(y.shape)}"
        err = (y.double() - want).abs()
        bad = err > 1e-4 * (1 + want.abs().max().item())
        assert not bad.any(), (
            f"linear({m}x{k} @ {n}x{k}, bias={bias}, x {'strided' if x_off else 'contiguous'},"
            f" {threads} threads): {int(bad.sum())} of {m * n} outputs off float64, first at "
            f"(row, feature) {tuple(bad.nonzero()[0].tolist())}, max error {err.max():.2e}")

    check()


def test_norms_and_silu_on_generated_rows(kmod):
    from hypothesis import given
    from hypothesis import strategies as st

    @generated(400)
    @given(t=st.integers(1, 40), h=st.one_of(_width(12), st.sampled_from([576, 896])),
           x_off=st.integers(0, 3), r_off=st.integers(0, 3),
           eps=st.sampled_from([1e-6, 1e-5, 0.5]), scale=st.sampled_from([1e-3, 1.0, 40.0]),
           threads=st.integers(1, 3), seed=st.integers(0, 2**16))
    def check(t, h, x_off, r_off, eps, scale, threads, seed):
        g = torch.Generator().manual_seed(seed)
        x, r = strided_rows(t, h, x_off, g) * scale, strided_rows(t, h, r_off, g) * scale
        w = torch.randn(h, generator=g)
        s = x + r  # the residual stream after the add, in float32
        gu = strided_rows(t, 2 * h, x_off, g) * 4
        with Threads(threads):
            y_plain = kmod.rmsnorm(x, w, eps)
            y_fused = kmod.fused_add_rmsnorm(x, r, w, eps)
            y_silu = kmod.silu_and_mul(gu)
        what = f"{t} rows of {h} (x {'strided' if x_off else 'contiguous'}, {threads} threads)"
        for name, got, want in [("rmsnorm", y_plain, rmsnorm64(x, w, eps)),
                                ("fused_add_rmsnorm", y_fused, rmsnorm64(s, w, eps)),
                                ("silu_and_mul", y_silu, silu_and_mul64(gu))]:
            err = (got.double() - want).abs().max().item()
            assert got.shape == want.shape and err < 2e-5 * (1 + want.abs().max().item()), (
                f"{name} on {what} is {err:.2e} off float64")
        assert torch.equal(r, s), f"fused_add_rmsnorm must leave x + residual in residual: {what}"

    check()


def test_rope_on_generated_heads(kmod):
    from hypothesis import given
    from hypothesis import strategies as st

    @generated(150)
    @given(d=st.sampled_from([2, 4, 8, 16, 24, 32, 64, 80, 128]), hq=st.integers(1, 6),
           hkv=st.integers(1, 3), t=st.integers(1, 20), max_pos=st.integers(1, 64),
           wide=st.booleans(), layout=st.sampled_from(["fused", "separate", "q-only"]),
           threads=st.integers(1, 3), seed=st.integers(0, 2**16))
    def check(d, hq, hkv, t, max_pos, wide, layout, threads, seed):
        g = torch.Generator().manual_seed(seed)
        inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv
        cos_sin = torch.cat([ang.cos(), ang.sin()], dim=-1).float()  # [max_pos, d]
        pos = torch.randint(0, max_pos, (t,), generator=g)
        pos = pos if wide else pos.int()
        qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
        if layout == "fused":
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        else:
            q, k, v = (qkv[:, : hq * d].clone(), qkv[:, hq * d: (hq + hkv) * d].clone(),
                       qkv[:, (hq + hkv) * d:])
        q0, k0, v0 = q.clone(), k.clone(), v.clone()

        def rot64(a, heads):
            a = a.double().view(t, heads, d)
            c = cos_sin[pos.long(), : d // 2].double()[:, None]
            s = cos_sin[pos.long(), d // 2:].double()[:, None]
            a1, a2 = a[..., : d // 2], a[..., d // 2:]
            return torch.cat([a1 * c - a2 * s, a2 * c + a1 * s], dim=-1).view(t, heads * d)

        with Threads(threads):
            kmod.rope_inplace(pos, q, cos_sin, d, None if layout == "q-only" else k)
        what = f"rope: {t} rows, Hq={hq}, Hkv={hkv}, head_size {d}, {layout}, {threads} threads"
        for name, got, want in [("q", q, rot64(q0, hq)),
                                ("k", k, k0.double() if layout == "q-only" else rot64(k0, hkv))]:
            err = (got.double() - want).abs().max().item()
            assert err < 1e-5 * (1 + want.abs().max().item()), f"{what}: {name} {err:.2e} off"
        assert torch.equal(v, v0), f"{what}: v changed"

    check()


def test_store_kv_on_generated_slots(kmod):
    from hypothesis import given
    from hypothesis import strategies as st

    @generated(120)
    @given(hkv=st.integers(1, 4), d=st.sampled_from([1, 3, 8, 16, 64]),
           slots=st.integers(1, 40), data=st.data(), wide=st.booleans(),
           layout=st.sampled_from(["contiguous", "fused", "apart"]), seed=st.integers(0, 2**16))
    def check(hkv, d, slots, data, wide, layout, seed):
        g = torch.Generator().manual_seed(seed)
        t = data.draw(st.integers(1, slots))
        k_cache, v_cache = torch.randn(slots, hkv, d, generator=g), torch.randn(slots, hkv, d)
        row = hkv * d
        if layout == "fused":  # views of a fused projection's rows: one stride for both
            qkv = torch.randn(t, 4 * row, generator=g)
            k, v = qkv[:, row: 2 * row], qkv[:, 2 * row: 3 * row]
        elif layout == "apart":  # k and v strided differently: each must use its own stride
            k = torch.randn(t, 3 * row, generator=g)[:, row: 2 * row]
            v = torch.randn(t, row, generator=g)
        else:
            k, v = torch.randn(t, row, generator=g), torch.randn(t, row, generator=g)
        out_loc = torch.randperm(slots, generator=g)[:t]
        out_loc = out_loc if wide else out_loc.int()
        want_k, want_v = k_cache.clone(), v_cache.clone()
        want_k.view(slots, row)[out_loc.long()] = k
        want_v.view(slots, row)[out_loc.long()] = v
        kmod.store_kv(k_cache, v_cache, k, v, out_loc)
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v), (
            f"store_kv of {t} rows (Hkv={hkv}, D={d}) into {slots} slots "
            f"({'int64' if wide else 'int32'} out_loc, k and v {layout}: strides "
            f"{k.stride(0)} and {v.stride(0)})")

    check()


def test_cpp_backend_decode_on_generated_batches(kmod):
    """Through chapter 05's harness, as the grid above: float64 dense attention per request."""
    from hypothesis import given
    from hypothesis import strategies as st
    from test_ch05_attention import make_env, run_and_compare

    # head sizes: below a vector, whole vectors, a vector plus a tail, blocks of 4 vectors
    # with and without single vectors and a tail after them
    @generated(80)
    @given(lengths=st.lists(st.integers(1, 44), min_size=1, max_size=5),
           heads=st.sampled_from([(1, 1), (2, 1), (3, 3), (4, 2), (6, 2), (8, 1), (9, 3)]),
           d=st.sampled_from([1, 4, 16, 24, 40, 64, 80, 100, 128]),
           ps=st.sampled_from([1, 2, 3, 4, 16]),
           n_dummy=st.integers(0, 1), threads=st.integers(1, 3), seed=st.integers(0, 2**16))
    def check(lengths, heads, d, ps, n_dummy, threads, seed):
        from minisgl.core import reset_global_ctx
        from minisgl.distributed import reset_tp_info

        (hq, hkv) = heads
        reset_tp_info()  # each example builds its own environment
        reset_global_ctx()
        env = make_env(hq, hkv, d, ps=ps, seed=seed, backend="cpp")
        batch = env.make_batch([env.add_req(n - 1, n) for n in lengths], "decode",
                               n_dummy=n_dummy)
        with Threads(threads):
            run_and_compare(env, batch, what=f"the 'cpp' backend's decode kernel, lengths "
                            f"{lengths}, Hq={hq}, Hkv={hkv}, head_dim {d}, page size {ps}, "
                            f"{n_dummy} dummies, {threads} threads")

    check()


@pytest.mark.parametrize("wide", [True, False], ids=["int64", "int32"])
def test_every_index_check_holds_at_its_boundary(kmod, wide):
    """Each index a kernel reads through is checked on both sides of its range: the first and
    the last valid index are taken, one before the first and one past the last are refused with
    the message, and a refused call writes nothing (a check off by one reads or writes one row
    past a table, which no result comparison sees)."""
    idx = torch.int64 if wide else torch.int32
    m = kmod
    P, S, D = 10, 16, 8  # rope table rows, pool slots, head_dim (one kv head)

    def refused(op, args, message, untouched=()):
        before = [t.clone() for t in untouched]
        try:
            op(*args)
        except RuntimeError as e:
            assert message in str(e), f"{op.__name__} refused with {e}, expected {message!r}"
        else:
            pytest.fail(f"{op.__name__} took an index outside its range; its check must "
                        f"refuse it with {message!r} (is a bound off by one?)")
        for t, b in zip(untouched, before):
            assert torch.equal(t, b), f"{op.__name__} wrote before refusing ({message!r})"

    cos_sin = torch.randn(P, D)
    for ok in ([0], [P - 1], [0, P - 1]):
        m.rope_inplace(torch.tensor(ok, dtype=idx), torch.randn(len(ok), D), cos_sin, D)
    for bad in (-1, P, P + 1):
        x = torch.randn(2, D)
        refused(m.rope_inplace, (torch.tensor([0, bad], dtype=idx), x, cos_sin, D),
                f"position {bad} is outside the rope table ({P} positions)", [x])

    k_cache, v_cache = torch.randn(S, D), torch.randn(S, D)
    q, L = torch.randn(1, D), 2
    for ok in ([0, S - 1], [S - 1, 0]):
        m.decode_attention(q, k_cache, v_cache, torch.tensor(ok), torch.tensor([2]), L, D)
    for bad in (-1, S, S + 1):
        for slots in ([bad, 0], [0, bad]):
            refused(m.decode_attention,
                    (q, k_cache, v_cache, torch.tensor(slots), torch.tensor([2]), L, D),
                    f"kv slot {bad} is outside the pool ({S} slots)")
    # slots past a request's seq_len are not read, so they are not checked either
    m.decode_attention(q, k_cache, v_cache, torch.tensor([3, S + 5]), torch.tensor([1]), L, D)
    for n in (1, L):
        m.decode_attention(q, k_cache, v_cache, torch.tensor([0, 1]), torch.tensor([n]), L, D)
    for n in (0, -1, L + 1):
        refused(m.decode_attention,
                (q, k_cache, v_cache, torch.tensor([0, 1]), torch.tensor([n]), L, D),
                f"seq_len {n} must be in 1..{L}")

    for shape in ((S, 1, D), (S // 4, 4, 1, D)):  # token-major, and pages of 4 slots
        caches = torch.randn(shape), torch.randn(shape)
        for ok in ([0], [S - 1], [S - 1, 0]):
            k, v = torch.randn(len(ok), D), torch.randn(len(ok), D)
            m.store_kv(*caches, k, v, torch.tensor(ok, dtype=idx))
            assert torch.equal(caches[0].view(S, D)[ok], k), f"store_kv into slots {ok}"
        for bad in (-1, S, S + 1):
            refused(m.store_kv, (*caches, torch.randn(3, D), torch.randn(3, D),
                                 torch.tensor([0, 1, bad], dtype=idx)),
                    f"out_loc[2] = {bad} is outside the pool ({S} slots); nothing was written",
                    caches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.int64])
@pytest.mark.parametrize("shape", [(7,), (3, 40), (1, 1), (2, 3, 17)])
def test_the_wrappers_equal_torch_on_every_input_they_accept(kmod, dtype, shape):
    """``minisgl.kernel``'s Python wrappers send what the C++ takes to it and everything else to
    torch: whatever the route, the answer is torch's, for every dtype and rank."""
    g = torch.Generator().manual_seed(len(shape) * 7 + shape[-1])
    logits = (torch.randn(shape, generator=g) * 4).to(dtype)
    got, want = kernel.argmax(logits), torch.argmax(logits, dim=-1)
    assert torch.equal(got, want), (
        f"minisgl.kernel.argmax on {dtype} logits of shape {list(shape)} gave {got.tolist()}, "
        f"torch.argmax {want.tolist()}")
    if dtype == torch.float32 and len(shape) >= 2:
        w = torch.randn(5, shape[-1], generator=g)
        for rows in (1, kernel.LINEAR_MAX_ROWS, kernel.LINEAR_MAX_ROWS + 1):
            x = torch.randn(rows, shape[-1], generator=g)
            torch.testing.assert_close(kernel.small_batch_linear(x, w), F.linear(x, w),
                                       atol=1e-4, rtol=1e-4)
        x = torch.randn(*shape, generator=g)  # 3-D: a prefill's [B, T, K]
        torch.testing.assert_close(kernel.small_batch_linear(x, w), F.linear(x, w),
                                   atol=1e-4, rtol=1e-4)


def attention64(q, k_cache, v_cache, slots, lens, D):
    """Decode attention in float64, request by request: the reference for ``decode_attention``
    (q ``[B, Hq * D]``, each request's keys at ``slots[b, :lens[b]]``)."""
    hkv = k_cache.shape[1] // D
    G = q.shape[1] // D // hkv
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, n in enumerate(lens):
        kb = k_cache[slots[b, :n]].double().view(n, hkv, D)
        vb = v_cache[slots[b, :n]].double().view(n, hkv, D)
        p = torch.softmax(torch.einsum("hgd,nhd->hgn", q[b].double().view(hkv, G, D), kb)
                          / D ** 0.5, dim=-1)
        out[b] = torch.einsum("hgn,nhd->hgd", p, vb).reshape(-1)
    return out


def check_decode_attention(mod):
    """``decode_attention`` against float64 over a grid: head sizes that are whole vectors of
    every build (64, 128) and not (8, 24: the key-by-key path where D % lanes != 0), GQA groups
    of 1 to 4 query heads, 1 to 5 requests, and key counts around every multiple of the vector
    (a block of keys' scores is one vector: its lanes must land on their own keys), in scattered
    slots."""
    lanes = mod.vector_lanes()
    counts = [1, lanes - 1, lanes, lanes + 1, 2 * lanes + 3, 3 * lanes, 51]
    g = torch.Generator().manual_seed(lanes)
    for D in (8, 24, 64, 128):
        for hq, hkv in [(9, 3), (4, 4), (4, 1), (6, 2)]:
            for B in (1, 2, 5):
                lens = [counts[(D + hq + b * 3) % len(counts)] for b in range(B)]
                L, S = max(lens), 4 * max(lens) * B + 7
                k_cache, v_cache = (torch.randn(S, hkv * D, generator=g) for _ in range(2))
                slots = torch.stack([torch.randperm(S, generator=g)[:L] for _ in lens])
                q = torch.randn(B, hq * D, generator=g)
                got = mod.decode_attention(q, k_cache, v_cache, slots.reshape(-1),
                                           torch.tensor(lens), L, D).double()
                want = attention64(q, k_cache, v_cache, slots, lens, D)
                err = (got - want).abs().max().item()
                assert err < 1e-5 * (1 + want.abs().max().item()), (
                    f"decode_attention with {lanes}-float vectors, head_dim {D}, Hq={hq}, "
                    f"Hkv={hkv}, keys per request {lens}: {err:.2e} off float64")


def test_decode_attention_equals_float64_over_shapes(kmod):
    check_decode_attention(kmod)


def test_extreme_values_in_silu_and_attention(kmod):
    """Values far outside randn's range, where a fast exp must still saturate properly: gates
    of +-300 (silu(g) is g or 0, never NaN) and attention scores hundreds apart (the softmax
    is one-hot, not NaN or a uniform average), against float64."""
    g = torch.Generator().manual_seed(7)
    for h in (15, 64, 100):
        gu = torch.rand(3, 2 * h, generator=g) * 600 - 300
        want = silu_and_mul64(gu)
        got = kmod.silu_and_mul(gu).double()
        err = (got - want).abs().max().item()
        assert err < 1e-5 * (1 + want.abs().max().item()), f"silu_and_mul, gates +-300: {err:.2e}"
    hkv, G, D, L, lens = 2, 2, 24, 40, [40, 17, 33]
    B, S = len(lens), 128
    k_cache, v_cache = torch.randn(S, hkv * D, generator=g), torch.randn(S, hkv * D, generator=g)
    slots = torch.stack([torch.randperm(S, generator=g)[:L] for _ in lens])
    for q_scale in (1.0, 60.0):  # 60: scores hundreds apart
        q = torch.randn(B, hkv * G * D, generator=g) * q_scale
        got = kmod.decode_attention(q, k_cache, v_cache, slots.reshape(-1), torch.tensor(lens),
                                    L, D).double()
        want = attention64(q, k_cache, v_cache, slots, lens, D)
        for b, n in enumerate(lens):
            err = (got[b] - want[b]).abs().max().item()
            assert err < 1e-4, (f"decode_attention, q x {q_scale}, request {b} ({n} keys): "
                                f"{err:.2e} off float64")

# ----------------------------------------------------------------------------- the choice
def _config(name="tiny-qwen2", **kw):
    from minisgl.distributed import DistributedInfo
    from minisgl.engine import EngineConfig

    args = {"model_path": str(model_path(name)), "tp_info": DistributedInfo(0, 1),
            "dtype": torch.float32, "max_running_req": 2, "num_page_override": 64,
            "max_seq_len_override": 32}
    return EngineConfig(**{**args, **kw})


def _two_reqs(engine):
    from minisgl.core import Req, SamplingParams

    reqs = []
    for row in range(2):
        engine.page_table[row, :32] = torch.arange(row * 32, row * 32 + 32)
        reqs.append(Req(input_ids=torch.tensor([5, 6, 7 + row], dtype=torch.int32),
                        table_idx=row, cached_len=0, output_len=4, uid=row,
                        sampling_params=SamplingParams(max_tokens=4)))
    return reqs


def test_a_kernel_engine_binds_every_op_once_and_calls_each_kernel_per_layer(kmod):
    """``cpu_kernels=True``: backend "cpp", each op holds its kernel (the classes keep the
    learner's code), weights keep the checkpoint's layout, and a decode step of tiny-qwen2 (2
    layers) calls each kernel once per layer (the norms twice, plus the final norm), with K/V
    stored through the pool's ``store_kv``."""
    from benchmarks.measure import run_step
    from minisgl.engine import Engine
    from minisgl.layers import silu_and_mul

    engine = Engine(_config(cpu_kernels=True))
    try:
        assert engine.config.attention_backend == "cpp"
        layer = engine.model.model.layers.op_list[0]
        assert layer.input_layernorm._kernel is kernel.add_rmsnorm
        assert layer.self_attn.attn.rotary._kernel is kernel.rope
        assert layer.mlp._act_fn is kernel.silu_and_mul
        assert layer.self_attn.qkv_proj._matmul is kernel.small_batch_linear
        assert engine.model.lm_head._matmul is kernel.small_batch_linear
        assert layer.self_attn.qkv_proj.weight.stride(1) == 1, "the checkpoint's [out, in] rows"
        layers = len(engine.model.model.layers.op_list)
        assert engine.kv_cache._kernel is kernel.store_kv  # the pool is built with the ops
        assert engine.sampler._argmax is kernel.argmax  # built inside build_ops too
        names = ["rmsnorm", "fused_add_rmsnorm", "silu_and_mul", "rope_inplace",
                 "decode_attention", "linear", "store_kv", "argmax_rows"]
        counts = dict.fromkeys(names + ["pool.store_kv"], 0)
        real, real_store = kernel._MODULE, engine.kv_cache.store_kv

        class Spy:
            def __getattr__(self, name):
                def call(*args):
                    counts[name] += 1
                    return getattr(real, name)(*args)
                return call

        def store_spy(*args):
            counts["pool.store_kv"] += 1
            return real_store(*args)

        reqs = _two_reqs(engine)
        run_step(engine, reqs, "prefill")
        kernel._MODULE = engine.attn_backend._module = Spy()
        engine.kv_cache.store_kv = store_spy
        try:
            run_step(engine, reqs, "decode")
        finally:
            kernel._MODULE = engine.attn_backend._module = real
            del engine.kv_cache.store_kv
        # linear: qkv, o, gate_up, down in each layer, then the LM head
        assert counts == {"rmsnorm": 1, "fused_add_rmsnorm": 2 * layers, "silu_and_mul": layers,
                          "rope_inplace": layers, "decode_attention": layers,
                          "linear": 4 * layers + 1, "store_kv": layers,
                          "argmax_rows": 1, "pool.store_kv": layers}, counts
    finally:
        engine.shutdown()
    # the kernels' rope is a table of its own: a default Engine built next runs 2.8
    engine = Engine(_config())
    try:
        layer = engine.model.model.layers.op_list[0]
        assert engine.config.attention_backend == "torch"
        assert layer.self_attn.attn.rotary._kernel is None
        assert layer.input_layernorm._kernel is None
        assert layer.mlp._act_fn is silu_and_mul
        assert layer.self_attn.qkv_proj._matmul is F.linear
        assert engine.kv_cache._kernel is None
        assert engine.sampler._argmax is not kernel.argmax
    finally:
        engine.shutdown()


def test_a_kernel_engine_prefetches_each_layers_rows_after_its_qkv_matmul(kmod):
    """In a decode step of tiny-qwen2 with the kernels, each layer's qkv projection plans that
    layer's key and value rows (the cpp backend's views of the pool) at the step's slots, and
    no other matmul (o, gate_up, down, the LM head) plans any: the attention's rows are read
    ahead right before the attention, by the worker the qkv matmul leaves idle."""
    from benchmarks.measure import run_step
    from minisgl.engine import Engine

    engine = Engine(_config(cpu_kernels=True))
    try:
        forget_kv_notes(kmod)
        seen = []
        prepare = engine.attn_backend.prepare_metadata

        def keep(batch):
            prepare(batch)
            seen.append(batch.attn_metadata)

        engine.attn_backend.prepare_metadata = keep
        reqs = _two_reqs(engine)
        run_step(engine, reqs, "prefill")
        run_step(engine, reqs, "decode")
        md = seen[-1]
        slots = md.kv_slots.view(len(reqs), md.max_kv_len).tolist()
        lens = md.seq_lens.tolist()
        for i, layer in enumerate(engine.model.model.layers.op_list):
            k_rows, v_rows = engine.attn_backend._rows[i]
            assert kmod.kv_read_ahead_plan(layer.self_attn.qkv_proj.weight) == kv_spans(
                slots, lens, k_rows, v_rows), f"layer {i}: its qkv matmul must plan its rows"
            for op in (layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                assert kmod.kv_read_ahead_plan(op.weight) == [], (
                    f"layer {i}: no attention follows {type(op).__name__}")
    finally:
        engine.shutdown()


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-llama"], ids=["tied-with-bias", "untied"])
def test_a_kernel_engine_keeps_its_weights_in_one_buffer_of_2mb_pages(kmod, name):
    """``place_weights``: after the build every weight is the checkpoint's, bit for bit, and they
    all lie in one buffer that starts on a 2 MB boundary, in state-dict order, 64-byte aligned,
    none overlapping; Linux was asked for huge pages there (VmFlags ``hg``). A tied LM head
    still reads the embedding table, and a decode step gives the default Engine's tokens."""
    from benchmarks.measure import run_step, smaps
    from minisgl.engine import Engine
    from minisgl.models import load_weight

    engine = Engine(_config(name, cpu_kernels=True))
    try:
        checkpoint = dict(load_weight(model_path(name)))  # the Engine has set the tp info
        state = engine.model.state_dict()
        assert set(state) <= set(checkpoint), set(state) - set(checkpoint)
        for key, t in state.items():
            assert torch.equal(t, checkpoint[key]), f"{key}: not the checkpoint's values"
            assert t.is_contiguous(), f"{key}: placed weights must be contiguous"
        storages = {t.untyped_storage().data_ptr() for t in state.values()}
        assert len(storages) == 1, f"the weights lie in {len(storages)} buffers, not one"
        ptrs = [(t.data_ptr(), t.numel() * t.element_size(), key) for key, t in state.items()]
        assert ptrs[0][0] % (2 << 20) == 0, "the buffer must start on a 2 MB boundary"
        for p, _, key in ptrs:
            assert p % 64 == 0, f"{key} does not start a cache line"
        for (p, n, key), (q, _, nxt) in itertools.pairwise(ptrs):
            assert p + n <= q, f"{key} overlaps {nxt} (or the order is not the state dict's)"
        assert ptrs[-1][0] + ptrs[-1][1] - ptrs[0][0] <= sum(n + 64 for _, n, _ in ptrs)
        lm_head = engine.model.lm_head
        if lm_head.tie_word_embeddings:
            assert "lm_head.weight" not in state
            assert lm_head._tied_embedding.weight is engine.model.model.embed_tokens.weight
        else:
            assert "lm_head.weight" in state
        if pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled").exists():
            maps = smaps(ptrs[0][0], ptrs[0][0] + 1)
            flags = maps[0].get("VmFlags", "").split() if maps else None
            assert flags is not None and "hg" in flags, (
                f"the weights' mapping was not advised for huge pages (VmFlags {flags})")
            assert "sh" not in flags, ("the weights' mapping is shared memory (shmem), whose "
                                       "huge pages are a setting of their own, off by default: "
                                       "map it private")
        reqs = _two_reqs(engine)
        got = [run_step(engine, reqs, "prefill")] + [run_step(engine, reqs, "decode")
                                                      for _ in range(3)]
    finally:
        engine.shutdown()
    engine = Engine(_config(name))
    try:  # a default Engine leaves the weights where the loader put them
        state = engine.model.state_dict()
        assert len({t.untyped_storage().data_ptr() for t in state.values()}) > 1
        reqs = _two_reqs(engine)
        want = [run_step(engine, reqs, "prefill")] + [run_step(engine, reqs, "decode")
                                                       for _ in range(3)]
    finally:
        engine.shutdown()
    assert got == want, f"placed weights changed the greedy tokens: {got} != {want}"


def test_place_weights_frees_each_loader_tensor_before_the_next_copy(kmod, monkeypatch):
    """On op trees of its own (no Engine): float32 weights of every shape, a strided one
    and an empty one included, are copied with their values and shapes and swapped in through
    their attribute paths; other dtypes stay where they are; and when each copy is swapped in,
    the loader tensors swapped before it are already freed (the build needs one tensor's worth
    of memory more, not the whole model's)."""
    import weakref

    from minisgl.kernel import weights as kweights
    from minisgl.layers import BaseOP, OPList

    class Leaf(BaseOP):
        def __init__(self, *shapes):
            for i, s in enumerate(shapes):
                setattr(self, f"w{i}", torch.randn(*s))

        def forward(self):
            return None

    class Tree(BaseOP):
        def __init__(self):
            self.embed = Leaf((50, 8))
            self.layers = OPList([Leaf((3, 5), (7,), (0, 4)), Leaf((16, 33), (1,))])
            self.layers.op_list[1].strided = torch.randn(9, 6).t()  # [6, 9], stride (1, 6)
            self.ids = torch.arange(5)  # int64: not a weight the kernels read
            self.half = torch.randn(4, 4, dtype=torch.bfloat16)  # other float dtypes stay too
            self.wide = torch.randn(3, dtype=torch.float64)
            self.ghost = torch.empty(2, 3, device="meta")  # not on the CPU: stays
            self.head = Leaf((11, 8))

        def forward(self):
            return None

    tree = Tree()
    kept = {k: t for k, t in tree.state_dict().items()
            if t.dtype != torch.float32 or t.device.type != "cpu"}
    before = {k: t.clone() for k, t in tree.state_dict().items() if k not in kept}
    refs = {k: weakref.ref(t) for k, t in tree.state_dict().items() if k not in kept}
    swapped, alive_at_swap = [], []
    real_swap = kweights._swap_in

    def watch(model, key, tensor):
        alive_at_swap.append([k for k in swapped if refs[k]() is not None])
        real_swap(model, key, tensor)
        swapped.append(key)

    monkeypatch.setattr(kweights, "_swap_in", watch)
    placed = kweights.place_weights(tree)
    state = tree.state_dict()
    for key, t in kept.items():
        assert state[key] is t, f"{key} ({t.dtype}, {t.device}) must stay where it is"
    assert swapped == list(before), "every float32 CPU weight, in state-dict order"
    for key, t in before.items():
        got = state[key]
        assert got.dtype == torch.float32 and got.shape == t.shape and torch.equal(got, t), key
        assert got.is_contiguous() and got.data_ptr() % 64 == 0, key
        assert got.untyped_storage().data_ptr() == placed.untyped_storage().data_ptr()
    assert all(not alive for alive in alive_at_swap), (
        f"loader tensors still referenced while later ones were copied: {alive_at_swap}")
    assert placed.data_ptr() % (2 << 20) == 0



def test_place_weights_without_memory_says_so_and_swaps_nothing(kmod, monkeypatch):
    """A buffer the OS will not map (no memory) is a MemoryError that names the ways out, raised
    before any weight is swapped: the model keeps its loader tensors."""
    from minisgl.kernel import weights as kweights
    from minisgl.layers import BaseOP

    class Leaf(BaseOP):
        def __init__(self):
            self.weight = torch.randn(5, 7)

        def forward(self):
            return None

    leaf = Leaf()
    original = leaf.weight
    real = kweights.weight_buffer
    monkeypatch.setattr(kweights, "weight_buffer", lambda nbytes: real(nbytes + (1 << 50)))
    with pytest.raises(MemoryError, match="cpu_kernels=False"):
        kweights.place_weights(leaf)
    assert leaf.weight is original, "nothing is swapped when the buffer cannot be mapped"


DEFAULT_ENGINE = r"""
import sys, torch
from minisgl.engine import Engine, EngineConfig
from minisgl.distributed import DistributedInfo
from benchmarks.measure import run_step
from minisgl.core import Req, SamplingParams
engine = Engine(EngineConfig(model_path=MODEL, tp_info=DistributedInfo(0, 1), dtype=torch.float32,
                             max_running_req=1, num_page_override=64, max_seq_len_override=32,
                             cpu_kernels=KERNELS))
engine.page_table[0, :32] = torch.arange(32)
req = Req(input_ids=torch.tensor([5, 6, 7], dtype=torch.int32), table_idx=0, cached_len=0,
          output_len=4, uid=0, sampling_params=SamplingParams(max_tokens=4))
toks = run_step(engine, [req], "prefill") + run_step(engine, [req], "decode")
print("imported", "minisgl.kernel" in sys.modules, "backend", engine.config.attention_backend,
      "tokens", toks)
engine.shutdown()
"""


def _run_engine(tmp_path, kernels: bool, **env_extra) -> subprocess.CompletedProcess:
    code = DEFAULT_ENGINE.replace("MODEL", repr(str(model_path("tiny-llama")))).replace(
        "KERNELS", repr(kernels))
    return run_script(code, timeout=600, **env_extra)


def test_a_default_engine_imports_and_compiles_nothing(tmp_path):
    out = _run_engine(tmp_path, False, MINISGL_KERNEL_CACHE=str(tmp_path / "cache"), CXX="false")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "imported False backend torch tokens" in out.stdout, out.stdout
    assert "minisgl.kernel" not in out.stderr and not (tmp_path / "cache").exists(), out.stderr


@pytest.mark.slow
def test_without_a_compiler_a_kernel_engine_says_why_and_runs_the_learner_code(kmod, tmp_path):
    out = _run_engine(tmp_path, True, MINISGL_KERNEL_CACHE=str(tmp_path / "cache"), CXX="false")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stderr.splitlines() if "could not be built" in ln]
    assert len(lines) == 1 and "C++ compiler" in lines[0], out.stderr
    assert "backend torch tokens" in out.stdout, out.stdout
    with_kernels = _run_engine(tmp_path, True)  # the default cache: built by `kmod`
    assert with_kernels.returncode == 0, with_kernels.stderr[-3000:]
    assert "backend cpp tokens" in with_kernels.stdout
    assert out.stdout.split("tokens")[1] == with_kernels.stdout.split("tokens")[1], (
        out.stdout, with_kernels.stdout)


@pytest.mark.slow
def test_a_compile_error_is_named_with_its_file_and_line(tmp_path):
    """A learner's typo in chapter 07's C++ must come back as the compiler's own first error
    (file, line, what), not as ninja's last line ("build stopped: subcommand failed") with
    advice to install a compiler that is there. A copy of the package with one bad line
    appended to a header: load() returns None and says, once, where the error is."""
    import shutil

    pkg = tmp_path / "pkg"
    shutil.copytree(PACKAGE_TREE / "minisgl", pkg / "minisgl",
                    ignore=shutil.ignore_patterns("__pycache__"))
    header = pkg / "minisgl" / "kernel" / "csrc" / "small_ops.h"
    header.write_text(header.read_text() + "\nint this_is_not_cpp = ;\n")
    code = ("from minisgl import kernel\n"
            "print('module', kernel.load(), 'reason', kernel.unavailable_reason())\n")
    env = {**os.environ, "PYTHONPATH": str(pkg), "MINISGL_KERNEL_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code], cwd=pkg, env=env, text=True,  # not ROOT:
                         capture_output=True, timeout=600, check=False)  # its minisgl comes first
    assert out.returncode == 0 and "module None" in out.stdout, (out.stdout, out.stderr[-3000:])
    said = [ln for ln in out.stderr.splitlines() if "could not be built" in ln]
    assert len(said) == 1, out.stderr[-3000:]
    assert "small_ops.h:" in said[0] and "error:" in said[0], (
        f"the message must name the compiler's first error, with its file and line: {said[0]}")
    assert "Fix the C++" in said[0] and "need a C++ compiler" not in said[0], said[0]


def test_cpu_kernels_is_validated():
    with pytest.raises(ValueError, match="float32 only"):
        _config(cpu_kernels=True, dtype=torch.bfloat16).validate()
    with pytest.raises(TypeError, match="use True .* or False"):
        _config(cpu_kernels=None).validate()


# ----------------------------------------------------------------------------- the build
BUILD = r"""
import sys
from minisgl.kernel import build
mod = build.load_or_build(["-O3"])
print("lanes", mod.vector_lanes(), "ok")
"""


def _build_proc(cache: pathlib.Path, **env_extra) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(PACKAGE_TREE), "MINISGL_KERNEL_CACHE": str(cache),
           **env_extra}
    return subprocess.Popen([sys.executable, "-c", BUILD], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _folder(cache: pathlib.Path) -> pathlib.Path:
    return cache / kbuild.build_key(kbuild.source_bytes(), ["-O3"])


@pytest.mark.slow
def test_a_killed_build_a_truncated_and_a_corrupt_library_all_end_in_a_working_build(kmod,
                                                                                     tmp_path):
    """A builder killed while compiling holds no lock: the next one rebuilds at once. A library
    cut short (a full disk) or with changed bytes is never loaded (it could kill the process):
    it is deleted and rebuilt."""
    cache = tmp_path / "cache"
    first = _build_proc(cache)
    deadline = time.monotonic() + 120
    while not list(_folder(cache).glob("build-*/*.ninja")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert first.poll() is None, f"the first build ended early: {first.communicate()}"
    time.sleep(3)  # the compiler is running now
    first.send_signal(signal.SIGKILL)
    first.wait()
    t0 = time.monotonic()
    second = _build_proc(cache)
    out, err = second.communicate(timeout=600)
    assert second.returncode == 0 and "ok" in out, err[-3000:]
    assert "waiting for" not in err, "a killed builder must not be waited for"
    print(f"rebuilt after a killed build in {time.monotonic() - t0:.0f} s")
    lib = next(_folder(cache).glob("*.so"))
    assert kbuild._verified(_folder(cache), lib.stem) == lib
    assert not list(_folder(cache).glob("build-*")), "the killed build's folder is cleaned up"
    assert oct(_folder(cache).stat().st_mode & 0o777) == "0o700", "the cache is private"

    good = lib.read_bytes()
    corrupt = bytearray(good)
    corrupt[len(good) // 2: len(good) // 2 + 64] = b"\xff" * 64
    lib.write_bytes(bytes(corrupt))
    assert kbuild._verified(_folder(cache), lib.stem) is None, "changed bytes must be refused"

    lib.write_bytes(good[: len(good) // 3])  # truncated
    assert kbuild._verified(_folder(cache), lib.stem) is None
    third = _build_proc(cache)
    out, err = third.communicate(timeout=600)
    assert third.returncode == 0 and "ok" in out, (
        f"a truncated library must be rebuilt, not loaded (rc {third.returncode}): {err[-3000:]}")
    assert "compiling" in err, "the truncated library should have been rebuilt"
    assert lib.read_bytes() != good[: len(good) // 3]


def test_a_live_builder_is_waited_for_then_the_wait_ends_with_a_message(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    folder = kbuild._private_dir(kbuild._private_dir(cache) / kbuild.build_key(
        kbuild.source_bytes(), ["-O3"]))
    monkeypatch.setenv("MINISGL_KERNEL_CACHE", str(cache))
    monkeypatch.setenv("MINISGL_KERNEL_LOCK_TIMEOUT", "1")
    with open(folder / "build.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("process 12345")
        held.flush()
        with pytest.raises(kbuild.KernelBuildError, match=r"process 12345 has been building .* "
                                                          r"MINISGL_KERNEL_CACHE"):
            kbuild.load_or_build(["-O3"])


def test_the_cache_is_private(tmp_path, monkeypatch):
    cache = tmp_path / "shared-cache"
    cache.mkdir(mode=0o777)
    cache.chmod(0o777)
    kbuild._private_dir(cache)
    assert cache.stat().st_mode & 0o077 == 0, "a cache others can write to must be made private"


def test_the_streams_benchmark_reads_every_line_once(monkeypatch):
    """``benchmarks/bench_streams.py`` backs chapter 07's claim that several streams per thread
    read memory faster than one. A pattern that read some lines twice (and others never) could
    look faster for the wrong reason, so the reader counts what it read (a buffer of 1.0 floats:
    2 per line) and the script refuses a count that is not every line once. Checked here on a
    small buffer, and with the runs of a block made to overlap."""
    import shutil

    import benchmarks.bench_streams as bs

    if not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        pytest.skip("needs a C compiler")
    table = bs.run(1, 2, 16 << 20, (4 << 20, 64 << 10, 8 << 10))
    rows = [r.split("|")[1:-1] for r in table.splitlines()
            if r.startswith("| ") and r.split("|")[1].strip().endswith(("KB", "MB"))]
    # one row per block, each ratio against the 1-stream cell of its row (another cell may
    # round to 1.00x too: 4 streams read as fast as one in a run on a Zen 4)
    assert [r[0].strip() for r in rows] == ["4 MB", "64 KB", "8 KB"], table
    assert all(r[1].strip().endswith("(1.00x)") and len(r) == 5 for r in rows), table
    monkeypatch.setattr(bs, "C_SOURCE", bs.C_SOURCE.replace("b0 + s * run + off", "b0 + off"))
    with pytest.raises(SystemExit, match="must read every line once"):
        bs.run(1, 2, 16 << 20, (64 << 10,))


def test_the_floor_benchmark_counts_only_multiply_adds_that_ran(monkeypatch, tmp_path):
    """``benchmarks/bench_floor.py`` backs the claim that at batch 16 the multiply-adds alone
    take most of a step: it divides the step's multiply-adds by a peak rate that a small C
    program measures. A program whose loop ran fewer iterations than it counts would report a
    peak too high, and so a floor too low. Each of its chains must end where only millions of
    steps take it; here the same program with its loop cut to a thousandth is refused."""
    import shutil

    import benchmarks.bench_floor as bf

    if not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        pytest.skip("needs a C compiler")
    mod = kernel.load()
    lanes = mod.vector_lanes() if mod is not None else 4  # the kernels' vectors, as the script
    exe = bf.compile_fma(tmp_path, lanes)
    assert bf.fma_peak(exe, 2, lanes, 6_000_000) > 0
    monkeypatch.setattr(bf, "C_SOURCE", bf.C_SOURCE.replace("it < iters;", "it < iters / 1000;"))
    assert bf.C_SOURCE.count("it < iters / 1000;") == 1
    (tmp_path / "short").mkdir()
    short = bf.compile_fma(tmp_path / "short", lanes)
    with pytest.raises(SystemExit, match="did not run its iterations"):
        bf.fma_peak(short, 2, lanes, 6_000_000)
    with pytest.raises(ValueError, match="5 million steps"):
        bf.fma_peak(exe, 2, lanes, 1000)
