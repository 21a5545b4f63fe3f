"""Chapter 07 (d): the fused C++ kernels of ``minisgl.kernel``.

References: the torch code each kernel replaces (the layers of chapter 02 with the kernels
switched off), dense causal attention in float64 (chapter 05's harness), and Hugging Face's
logits through a whole Engine (``test_ch06_engine.py`` runs its HF comparisons with the kernels
on, the Engine's default, and with ``cpu_kernels=False``). Also: the switch (an Engine turns it
on and off; the layers use the kernels only then), the clear errors of bad input, and the
fallback to the torch code when the C++ cannot be built.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from helpers import model_path
from minisgl import kernel

ROOT = pathlib.Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("clean_globals")


@pytest.fixture
def kernels_on():
    if not kernel.set_enabled(True):
        pytest.skip(f"the C++ kernels cannot be built here: {kernel.unavailable_reason()}")
    yield
    kernel.set_enabled(False)


def both(fn):
    """``fn()`` with the kernels off (the torch code), then on."""
    kernel.set_enabled(False)
    ref = fn()
    assert kernel.set_enabled(True)
    return ref, fn()


def strided_rows(t: int, width: int, extra: int = 7, seed: int = 0) -> torch.Tensor:
    """``[t, width]`` rows that are a view into wider rows (like q inside the fused qkv)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, width + extra, generator=g)[:, 3: 3 + width]


# ----------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("t", [1, 4, 300])  # 300 rows: parallel_for splits them over threads
def test_fused_add_rmsnorm_equals_the_torch_code(kernels_on, t):
    from minisgl.layers import RMSNormFused

    norm = RMSNormFused(576, 1e-5)
    norm.weight = torch.randn(576, generator=torch.Generator().manual_seed(1))
    x, res = strided_rows(t, 576, seed=2), torch.randn(t, 576)

    def run(residual):
        r = None if residual is None else residual.clone()
        y, r2 = norm.forward(x, r)
        return y, (x if r2 is x else r2)

    for residual in (None, res):
        (y_ref, r_ref), (y, r) = both(lambda: run(residual))
        torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r, r_ref, atol=0, rtol=0)  # the add itself is exact


@pytest.mark.parametrize("t", [1, 4, 300])
def test_silu_and_mul_equals_the_torch_code(kernels_on, t):
    from minisgl.layers import silu_and_mul

    x = strided_rows(t, 2 * 1536, seed=3) * 4
    ref, got = both(lambda: silu_and_mul(x))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [True, False], ids=["q-and-k-adjacent", "separate"])
@pytest.mark.parametrize("t", [1, 5, 300])
def test_rope_equals_the_torch_code(kernels_on, fused, t):
    from minisgl.layers import get_rope

    rope = get_rope(64, 64, 4096, 10000.0)
    hq, hkv, d = 9, 3, 64
    positions = torch.randint(0, 4096, (t,), generator=torch.Generator().manual_seed(4))
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=torch.Generator().manual_seed(5))

    def run():
        buf = qkv.clone()
        if fused:  # views of one fused tensor: rotated in one pass
            q, k, _ = buf.split([hq * d, hkv * d, hkv * d], dim=-1)
        else:
            q, k = buf[:, : hq * d].clone(), buf[:, hq * d: (hq + hkv) * d].clone()
        q, k = rope.forward(positions.int(), q, k)
        return torch.cat([q, k], dim=1), buf[:, (hq + hkv) * d:]

    (qk_ref, v_ref), (qk, v) = both(run)
    torch.testing.assert_close(qk, qk_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(v, v_ref), "rope must not touch v, which follows k in the fused qkv"


@pytest.mark.parametrize("lengths", [[7, 7, 7], [7, 2, 20, 11], [1]], ids=["equal", "ragged",
                                                                           "one-token"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("n_dummy", [0, 2])
def test_decode_attention_equals_dense_attention(kernels_on, lengths, hq, hkv, n_dummy):
    """Through chapter 05's harness: scattered pages of 4 slots, GQA, ragged lengths and padding
    dummies; every real row equals float64 dense causal attention, and no slot outside
    out_loc changes."""
    from test_ch05_attention import NUM_LAYERS, make_env, run_and_compare

    env = make_env(hq, hkv, 32, ps=4, seed=len(lengths) + hq + n_dummy)
    reqs = [env.add_req(n - 1, n) for n in lengths]
    batch = env.make_batch(reqs, "decode", n_dummy=n_dummy)
    calls = []
    real = kernel.store_and_decode_attention
    before = env.pool._kv_buffer.clone()

    def spy(*args):
        calls.append(1)
        return real(*args)

    kernel.store_and_decode_attention = spy
    try:
        run_and_compare(env, batch, what=f"the fused decode kernel, lengths {lengths}, Hq={hq}, "
                                         f"Hkv={hkv}, {n_dummy} dummies")
    finally:
        kernel.store_and_decode_attention = real
    assert len(calls) == NUM_LAYERS, "the decode batch did not go through the kernel"
    touched = torch.zeros(env.pool.num_slots, dtype=torch.bool)
    touched[batch.out_loc.long()] = True
    now = env.pool._kv_buffer.view(2, NUM_LAYERS, -1, env.hkv, env.d)
    was = before.view(2, NUM_LAYERS, -1, env.hkv, env.d)
    assert torch.equal(now[:, :, ~touched], was[:, :, ~touched]), "a slot outside out_loc changed"


# ----------------------------------------------------------------------------- bad input
# rows: 1..16 in chunks of 4 plus a remainder; (N, K): whole tiles and 16-float chunks, a short
# last tile (N % 4) and a K % 16 tail, SmolLM2's gate_up and LM-head-like widths
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 13, 16])
@pytest.mark.parametrize("n,k", [(3072, 576), (577, 33), (6, 15), (1, 7)])
def test_linear_equals_a_float64_matmul(kernels_on, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k + 5, generator=g)[:, 2: 2 + k]  # rows inside wider rows
    w = torch.randn(n, k + 3, generator=g)[:, :k]  # weight rows with a stride > k
    b = torch.randn(n, generator=g)
    ref = x.double() @ w.double().T
    for bias, want in [(None, ref), (b, ref + b.double())]:
        y = kernel.linear(x, w, bias)
        assert y.shape == (m, n) and y.dtype == torch.float32
        err = (y.double() - want).abs().max().item()
        assert err < 1e-4 * (1 + want.abs().max().item()), (
            f"linear({m}x{k} @ {n}x{k}, bias={bias is not None}) is {err:.2e} off float64")


@pytest.mark.parametrize("flags,lanes", [(["-O3"], 4), (["-O3", "-mavx2", "-mfma", "-fopenmp"], 8)],
                         ids=["4-lanes-no-openmp", "8-lanes"])
def test_linear_with_narrower_vectors(kernels_on, flags, lanes):
    """``linear``'s vector follows the compiler's target: 16 floats with AVX-512, 8 with AVX2,
    4 otherwise (SSE, an ARM laptop's NEON). Build the narrower ones here and check them too."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the flags below are x86 ones")
    try:
        mod = kernel._build(flags)
    except Exception as e:  # a compiler without these flags: nothing to check here
        pytest.skip(f"cannot build with {flags}: {e}")
    assert mod.vector_lanes() == lanes, f"{flags} should give {lanes}-float vectors"
    g = torch.Generator().manual_seed(lanes)
    for m, n, k in [(1, 577, 33), (4, 96, 64), (7, 6, 15), (16, 130, 576)]:
        x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n)
        want = x.double() @ w.double().T + b.double()
        err = (mod.linear(x, w, b).double() - want).abs().max().item()
        assert err < 1e-4 * (1 + want.abs().max().item()), (
            f"{lanes}-lane linear({m}x{k} @ {n}x{k}) is {err:.2e} off float64")


def test_the_linear_layers_and_lm_head_use_the_kernel_for_a_few_rows(kernels_on):
    from minisgl.layers.linear import input_major, matmul

    w, b = torch.randn(96, 64), torch.randn(96)
    for rows in (1, 4, kernel.LINEAR_MAX_ROWS):
        x = torch.randn(rows, 64)
        assert kernel.linear_applies(x, w)
        assert torch.allclose(matmul(x, w, b), torch.nn.functional.linear(x, w, b), atol=1e-5)
    big = torch.randn(kernel.LINEAR_MAX_ROWS + 1, 64)
    assert not kernel.linear_applies(big, w), "a prefill's many rows go to MKL"
    assert not kernel.linear_applies(big[:2], input_major(w)), (
        "an input-major weight (stride(0) == 1) must go to F.linear, not the kernel")
    assert not kernel.linear_applies(big[:2], w.double())
    kernel.set_enabled(False)
    assert not kernel.linear_applies(big[:2], w), "switched off: F.linear"


def test_bad_input_gets_a_clear_error(kernels_on):
    m = kernel.load()
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
    q, k, v = torch.randn(1, 16), torch.randn(1, 8), torch.randn(1, 8)
    one = torch.tensor([1])
    with pytest.raises(RuntimeError, match="outside the pool"):
        m.store_and_decode_attention(q, k, v, k_cache, k_cache.clone(), torch.tensor([16]),
                                     torch.tensor([0, 1]), one, 2, 8)
    with pytest.raises(RuntimeError, match="kv slot 40 is outside the pool"):
        m.store_and_decode_attention(q, k, v, k_cache, k_cache.clone(), one,
                                     torch.tensor([40, 1]), torch.tensor([2]), 2, 8)
    assert torch.equal(k_cache, torch.zeros(16, 8)), "a refused call must not write the pool"
    with pytest.raises(RuntimeError, match="input-major weight"):
        m.linear(x, torch.randn(8, 3).t(), None)  # [3, 8] stored input-major
    with pytest.raises(RuntimeError, match=r"the weight must be \[out_features, 8\]"):
        m.linear(x, torch.randn(3, 9), None)
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32 CPU vector of 3"):
        m.linear(x, torch.randn(3, 8), torch.randn(4))


# ----------------------------------------------------------------------------- the switch
def test_layers_use_the_kernels_only_when_switched_on():
    from minisgl.layers import RMSNormFused

    norm = RMSNormFused(8, 1e-6)
    norm.weight = torch.ones(8)
    x = torch.randn(3, 8)
    kernel.set_enabled(False)
    assert not kernel.applies(x)
    if kernel.set_enabled(True):
        assert kernel.applies(x)
        assert not kernel.applies(x.double()) and not kernel.applies(x.t()), (
            "float64 or column-strided rows must keep the torch code")
        kernel.set_enabled(False)
        assert not kernel.applies(x)


def test_an_engine_runs_every_kernel_in_each_step_and_switches_them_off_after():
    """A decode step of tiny-qwen2 (2 layers) calls each kernel once per layer (the norms twice,
    plus the final norm); shutdown switches the kernels off; ``cpu_kernels=False`` keeps them
    off."""
    from minisgl.core import Req, SamplingParams
    from minisgl.distributed import DistributedInfo
    from minisgl.engine import Engine, EngineConfig

    from benchmarks.measure import run_step

    def config(**kw):
        return EngineConfig(model_path=str(model_path("tiny-qwen2")),
                            tp_info=DistributedInfo(0, 1), dtype=torch.float32,
                            max_running_req=2, num_page_override=64, max_seq_len_override=32, **kw)

    engine = Engine(config())
    try:
        if not kernel.enabled():
            pytest.skip(f"the C++ kernels cannot be built here: {kernel.unavailable_reason()}")
        layers = len(engine.model.model.layers.op_list)
        names = ["rmsnorm", "fused_add_rmsnorm", "silu_and_mul", "rope_inplace",
                 "store_and_decode_attention", "linear"]
        counts = dict.fromkeys(names, 0)
        real = kernel._MODULE

        class Spy:
            def __getattr__(self, name):
                def call(*args):
                    counts[name] += 1
                    return getattr(real, name)(*args)
                return call

        reqs = []
        for row in range(2):
            engine.page_table[row, :32] = torch.arange(row * 32, row * 32 + 32)
            reqs.append(Req(input_ids=torch.tensor([5, 6, 7 + row], dtype=torch.int32),
                            table_idx=row, cached_len=0, output_len=4, uid=row,
                            sampling_params=SamplingParams(max_tokens=4)))
        run_step(engine, reqs, "prefill")
        kernel._MODULE = Spy()
        try:
            run_step(engine, reqs, "decode")
        finally:
            kernel._MODULE = real
        # linear: qkv, o, gate_up, down in each layer, then the LM head
        assert counts == {"rmsnorm": 1, "fused_add_rmsnorm": 2 * layers, "silu_and_mul": layers,
                          "rope_inplace": layers, "store_and_decode_attention": layers,
                          "linear": 4 * layers + 1}, counts
        weights = linear_weights(engine.model)
        assert weights and all(w.stride(1) == 1 for w in weights), (
            "with the kernels on at load, linear weights keep the checkpoint's [out, in] rows")
        assert engine.model.lm_head.packed_bytes == 0, "the kernel needs no oneDNN LM-head copy"
    finally:
        engine.shutdown()
    assert not kernel.enabled(), "Engine.shutdown must switch the kernels off"
    engine = Engine(config(cpu_kernels=False))
    try:
        assert not kernel.enabled()
        weights = linear_weights(engine.model)
        assert weights and all(w.stride(0) == 1 for w in weights), (
            "with cpu_kernels=False, linear weights are stored input-major for F.linear")
    finally:
        engine.shutdown()


def linear_weights(model):
    """The weight of every linear op under ``model`` (walking ops and their op lists)."""
    from minisgl.layers import BaseOP
    from minisgl.layers.linear import _LinearTPImpl

    found, todo = [], [model]
    while todo:
        op = todo.pop()
        if isinstance(op, _LinearTPImpl):
            found.append(op.weight)
            continue
        for value in vars(op).values():
            values = value if isinstance(value, (list, tuple)) else [value]
            todo += [v for v in values if isinstance(v, BaseOP)]
    return found


def test_an_engine_that_fails_to_build_switches_the_kernels_off(monkeypatch):
    """The Engine switches the kernels on *before* it loads the model (the linear layers pick
    their weight layout then); if building fails afterwards, the switch must be off again."""
    import minisgl.engine.engine as engine_module
    from minisgl.distributed import DistributedInfo
    from minisgl.engine import Engine, EngineConfig

    if kernel.load() is None:
        pytest.skip(f"the C++ kernels cannot be built here: {kernel.unavailable_reason()}")
    monkeypatch.setattr(engine_module, "available_memory", lambda device: 1 << 20)
    with pytest.raises(MemoryError):  # no room for the KV pool, after the weights loaded
        Engine(EngineConfig(model_path=str(model_path("tiny-llama")),
                            tp_info=DistributedInfo(0, 1), dtype=torch.float32,
                            num_page_override=None, memory_ratio=0.5))
    assert not kernel.enabled(), "a failed Engine must switch the kernels off"


def test_cpu_kernels_true_needs_float32():
    from minisgl.distributed import DistributedInfo
    from minisgl.engine import EngineConfig

    cfg = EngineConfig(model_path=str(model_path("tiny-llama")), tp_info=DistributedInfo(0, 1),
                       dtype=torch.bfloat16, cpu_kernels=True)
    with pytest.raises(ValueError, match="float32 only"):
        cfg.validate()


# ----------------------------------------------------------------------------- fallback
FALLBACK = r"""
import torch
from minisgl import kernel
from minisgl.distributed import DistributedInfo
from minisgl.engine import Engine, EngineConfig
from benchmarks.measure import run_step
from minisgl.core import Req, SamplingParams
engine = Engine(EngineConfig(model_path=MODEL, tp_info=DistributedInfo(0, 1), dtype=torch.float32,
                             max_running_req=1, num_page_override=64, max_seq_len_override=32))
engine.page_table[0, :32] = torch.arange(32)
req = Req(input_ids=torch.tensor([5, 6, 7], dtype=torch.int32), table_idx=0, cached_len=0,
          output_len=4, uid=0, sampling_params=SamplingParams(max_tokens=4))
toks = run_step(engine, [req], "prefill") + run_step(engine, [req], "decode")
print("enabled", kernel.enabled(), "tokens", toks)
engine.shutdown()
"""


@pytest.mark.parametrize("how", ["MINISGL_KERNELS=0", "no compiler"])
def test_without_the_kernels_the_engine_runs_the_torch_code(how, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if how == "no compiler":  # an empty cache and a compiler that always fails
        env.update(MINISGL_KERNEL_CACHE=str(tmp_path / "cache"), CXX="false")
    else:
        env["MINISGL_KERNELS"] = "0"
    code = FALLBACK.replace("MODEL", repr(str(model_path("tiny-llama"))))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "enabled False tokens" in out.stdout, out.stdout
    if how == "no compiler":
        assert "could not be built" in out.stderr and "C++ compiler" in out.stderr, out.stderr
    else:
        assert "could not be built" not in out.stderr, out.stderr
    kernel.set_enabled(False)
    with_torch = out.stdout.split("tokens", 1)[1].strip()
    if kernel.load() is not None:  # the same two tokens with the kernels
        env2 = {**os.environ, "PYTHONPATH": str(ROOT)}
        out2 = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env2,
                              capture_output=True, text=True, timeout=300)
        assert out2.returncode == 0, out2.stderr[-3000:]
        assert f"enabled True tokens {with_torch}" in out2.stdout, (out.stdout, out2.stdout)
