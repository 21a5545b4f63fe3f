"""GPU checks: the Engine on an NVIDIA GPU, against Hugging Face and against itself.

Every test needs CUDA and is skipped with that reason on other machines; the FlashInfer tests
also need the ``flashinfer`` package (``pytest.importorskip``). What they check:

1. float32, torch backend: greedy tokens of 4 prompts in one batch, 16 steps, equal HF's greedy
   tokens (HF on the CPU), with CUDA graphs for decode and without;
2. a decode batch replayed through a CUDA graph (padded with the dummy request to a captured
   size) gives the logits of the same batch run eagerly by ``model.forward()``;
3. bfloat16: teacher-forced logits (prompt, then HF's float32 greedy tokens fed back) stay
   within ``bf16_bounds`` of HF's own bfloat16 logits;
4. FlashInfer (page sizes 1 and 16, prefill with a cached prefix): its bfloat16 logits agree
   with the torch backend's within the same bounds.

The bfloat16 tolerance is measured, not guessed: bfloat16 keeps 8 significant bits, so every
rounding moves a value by up to 2**-9 of itself, and over 30 layers these add up. HF's own
bfloat16 run differs from its float32 run by ``ref`` (mean and max |difference| over the same
logits). An implementation as accurate as HF's differs from HF's bfloat16 by at most about
``2 * ref`` (both are within ``ref`` of the float32 logits), so the bounds are
``mean <= 2 * ref_mean + 0.05`` and ``max <= 2 * ref_max + 0.25``, and our own distance to the
float32 logits may not exceed ``1.5 * ref_mean + 0.05`` on average. On the CPU with SmolLM2 and
these prompts ``ref`` was mean 0.12-0.20, max 0.5-2.2 (logits up to about 40 in size), and our
bfloat16 engine was within mean 0.12, max 0.9 of HF's bfloat16.

Model: ``$MINISGL_GPU_MODEL``, else ``models/SmolLM2-135M-Instruct``. ``benchmarks/gpu_check.sh``
builds a seeded random stand-in with SmolLM2's shapes where the real model is absent.
``MINISGL_GPU_TEST_DEVICE=cpu`` dry-runs the tests that need neither graphs nor FlashInfer on the
CPU (this file's own code, not the GPU path).
"""

from __future__ import annotations

import functools
import pathlib

import pytest
import torch
from helpers import ROOT

from minisgl.utils.env import read_env

DEVICE = read_env("MINISGL_GPU_TEST_DEVICE", str, "cuda", choices=("cuda", "cpu"))
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                 reason="needs an NVIDIA GPU with CUDA")]
needs_graphs = pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need the GPU (dry run)")

# SmolLM2's tokenizer on: "The capital of France is", "List three prime numbers:",
# "def fibonacci(n):", "Once upon a time," (fixed ids: no tokenizer needed on the GPU machine)
PROMPTS = [[504, 3575, 282, 4649, 314], [6106, 1296, 9552, 2966, 42],
           [1604, 3987, 46477, 24, 94, 727], [6403, 1980, 253, 655, 28]]
N = 16
ROW = 128  # page-table entries per request (max_seq_len_override)


def model_path() -> pathlib.Path:
    path = read_env("MINISGL_GPU_MODEL", pathlib.Path, ROOT / "models" / "SmolLM2-135M-Instruct")
    if not (path / "config.json").exists():
        pytest.fail(f"{path} is missing: run `make models`, or benchmarks/gpu_check.sh (it builds "
                    "a stand-in of SmolLM2's shape), or set MINISGL_GPU_MODEL", pytrace=False)
    return path


def make_engine(dtype, backend="torch", page_size=1, graphs=True):
    from minisgl.distributed import DistributedInfo
    from minisgl.engine import Engine, EngineConfig

    return Engine(EngineConfig(
        model_path=str(model_path()), tp_info=DistributedInfo(0, 1), dtype=dtype,
        max_running_req=4, attention_backend=backend, page_size=page_size, device=DEVICE,
        cuda_graph_max_bs=8 if graphs else 0, max_seq_len_override=ROW,
        num_page_override=4 * ROW // page_size + 1))


def make_reqs(engine, prompts, n):
    from minisgl.core import Req, SamplingParams

    reqs = []
    for row, ids in enumerate(prompts):  # row r owns slots r*ROW .. r*ROW + ROW - 1: page-aligned
        engine.page_table[row, :ROW] = torch.arange(row * ROW, (row + 1) * ROW)
        reqs.append(Req(input_ids=torch.tensor(ids, dtype=torch.int32), table_idx=row,
                        cached_len=0, output_len=n, uid=row,
                        sampling_params=SamplingParams(max_tokens=n)))
    return reqs


def fill_batch(engine, reqs, phase):
    """The batch's fields built on the CPU, as the milestone's loop builds them; forward_batch
    moves them to the device."""
    from minisgl.core import Batch

    batch = Batch(reqs=list(reqs), phase=phase)
    engine.graph_runner.pad_batch(batch)
    table = engine.page_table.cpu()
    pr = batch.padded_reqs
    batch.positions = torch.cat([torch.arange(r.cached_len, r.device_len) for r in pr]).int()
    batch.input_ids = torch.cat([r.input_ids[r.cached_len:r.device_len] for r in pr])
    batch.out_loc = torch.cat([table[r.table_idx, r.cached_len:r.device_len] for r in pr])
    engine.attn_backend.prepare_metadata(batch)
    return batch


def generate(engine, prompts, n=N):
    reqs = make_reqs(engine, prompts, n)
    outs = [[] for _ in reqs]
    for step in range(n):
        batch = fill_batch(engine, reqs, "prefill" if step == 0 else "decode")
        out = engine.forward_batch(batch, engine.sampler.prepare(batch))
        assert out.next_tokens_cpu.device.type == "cpu" and \
            out.next_tokens_gpu.device == engine.device, "next tokens: one copy on each side"
        for i, r in enumerate(reqs):
            r.append_host(out.next_tokens_cpu[i:i + 1])
            outs[i].append(int(out.next_tokens_cpu[i]))
    return outs


def forward_logits(engine, batch):
    """The real requests' logits (float32, on the CPU) of one ``Engine.forward_batch``, taken
    where it hands them to the sampler (through the CUDA graph when one is used)."""
    seen = []
    sample = engine.sampler.sample
    engine.sampler.sample = lambda logits, args: (seen.append(logits.float().cpu()),
                                                  sample(logits, args))[1]
    try:
        engine.forward_batch(batch, engine.sampler.prepare(batch))
    finally:
        del engine.sampler.sample  # the instance attribute: the class's method is back
    return seen[0]


def teacher_forced(engine, seqs, n=N, first_chunk=None):
    """Logits ``[n, V]`` per request: the prompt, then the tokens of ``seqs`` fed back one step
    at a time. ``first_chunk``: prefill the first that many prompt tokens alone, then the rest as
    a prefill with a cached prefix."""
    prompts = [s[: len(s) - n] for s in seqs]
    reqs = make_reqs(engine, prompts, n)
    rows = [[] for _ in reqs]
    if first_chunk is not None:
        full = [r.input_ids for r in reqs]
        for r in reqs:
            r.input_ids, r.device_len = r.input_ids[:first_chunk], first_chunk
        forward_logits(engine, fill_batch(engine, reqs, "prefill"))  # caches the prefix
        for r, ids in zip(reqs, full):  # the rest of the prompt, after a cached prefix
            r.input_ids, r.device_len = ids, len(ids)
    for step in range(n):
        batch = fill_batch(engine, reqs, "prefill" if step == 0 else "decode")
        for i, row in enumerate(forward_logits(engine, batch)):
            rows[i].append(row)
        for r, s in zip(reqs, seqs):
            if step < n - 1:
                r.append_host(torch.tensor([s[len(s) - n + step]]))
    return [torch.stack(r) for r in rows]


@functools.lru_cache(maxsize=None)
def hf_model(dtype, device):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path(), dtype=dtype).eval().to(device)


@functools.lru_cache(maxsize=None)
def hf_sequences(n=N):
    """Each prompt followed by HF's float32 greedy continuation: the argmax of HF's last logits,
    appended n times (HF on the CPU, whole sequence each step: no cache API, no stop at EOS)."""
    hf = hf_model(torch.float32, "cpu")
    seqs = []
    for ids in PROMPTS:
        seq = list(ids)
        with torch.no_grad():
            for _ in range(n):
                seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
        seqs.append(tuple(seq))
    return tuple(seqs)


@functools.lru_cache(maxsize=None)
def hf_logits(dtype, n=N):
    """HF's logits at the positions ``teacher_forced`` computes (HF on the test device)."""
    hf = hf_model(dtype, DEVICE)
    out = []
    for s in hf_sequences(n):
        with torch.no_grad():
            logits = hf(torch.tensor([s], device=DEVICE)).logits[0].float().cpu()
        out.append(logits[len(s) - n - 1: len(s) - 1])
    return out


def diff(a, b):
    d = torch.cat([(x - y).abs().flatten() for x, y in zip(a, b)])
    return float(d.mean()), float(d.max())


def bf16_bounds():
    """(mean, max) allowed between two bfloat16 runs: see the module docstring."""
    ref_mean, ref_max = diff(hf_logits(torch.bfloat16), hf_logits(torch.float32))
    return 2 * ref_mean + 0.05, 2 * ref_max + 0.25, ref_mean, ref_max


def assert_bf16_close(ours, theirs, what):
    lim_mean, lim_max, ref_mean, ref_max = bf16_bounds()
    mean, worst = diff(ours, theirs)
    print(f"{what}: mean |diff| {mean:.3f} (bound {lim_mean:.3f}), max {worst:.3f} (bound "
          f"{lim_max:.3f}); HF bf16 vs HF fp32: mean {ref_mean:.3f}, max {ref_max:.3f}")
    assert mean <= lim_mean and worst <= lim_max, (
        f"{what}: logits differ by mean {mean:.3f} / max {worst:.3f}, more than two bfloat16 "
        f"runs should (bounds {lim_mean:.3f} / {lim_max:.3f}, from HF's own bf16-vs-fp32 "
        f"difference {ref_mean:.3f} / {ref_max:.3f})")


# ----------------------------------------------------------------------------- 1. tokens
@pytest.mark.parametrize("graphs", [pytest.param(True, marks=needs_graphs), False],
                         ids=["cuda-graphs", "eager"])
def test_torch_backend_float32_gives_hf_greedy_tokens(graphs):
    engine = make_engine(torch.float32, graphs=graphs)
    try:
        assert engine.device.type == DEVICE, f"the Engine runs on {engine.device}, not {DEVICE}"
        if graphs:
            assert engine.graph_runner.graph_map, "no CUDA graph was captured on the GPU"
        outs = generate(engine, PROMPTS)
    finally:
        engine.shutdown()
    for ids, got, want in zip(PROMPTS, outs, hf_sequences()):
        want = list(want[len(ids):])
        assert got == want, (
            f"prompt {ids}: the Engine on {DEVICE} (float32, torch backend, graphs={graphs}) "
            f"generated {got}, HF {want}; first difference at step "
            f"{next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)}")


# ----------------------------------------------------------------------------- 2. graphs
GRAPH_CASES = [("torch", torch.float32), ("torch", torch.bfloat16), ("fi", torch.bfloat16)]


@needs_graphs
@pytest.mark.parametrize("backend,dtype", GRAPH_CASES, ids=["torch-fp32", "torch-bf16", "fi-bf16"])
def test_cuda_graph_replay_gives_the_eager_logits(backend, dtype):
    if backend == "fi":
        pytest.importorskip("flashinfer")
    engine = make_engine(dtype, backend=backend)
    try:
        reqs = make_reqs(engine, PROMPTS[:3], 4)
        forward_logits(engine, fill_batch(engine, reqs, "prefill"))
        for r, t in zip(reqs, (11, 12, 13)):
            r.append_host(torch.tensor([t]))
        batch = fill_batch(engine, reqs, "decode")
        assert batch.padded_size == 4, (
            f"a decode batch of 3 must be padded with the dummy request to the captured size 4, "
            f"got {batch.padded_size} (captured: {sorted(engine.graph_runner.graph_map)})")
        assert engine.graph_runner.can_use_cuda_graph(batch)
        for name in ("input_ids", "positions", "out_loc"):
            setattr(batch, name, getattr(batch, name).to(engine.device))
        with torch.no_grad(), engine.ctx.forward_batch(batch):
            eager = engine.model.forward()[:3].float().cpu()
            graph = engine.graph_runner.replay(batch).float().cpu()  # same k, v stored again
    finally:
        engine.shutdown()
    assert graph.shape == eager.shape == (3, eager.shape[1])
    assert torch.equal(graph.argmax(-1), eager.argmax(-1)), "graph and eager pick other tokens"
    if dtype == torch.float32:
        torch.testing.assert_close(graph, eager, atol=1e-3, rtol=1e-4)
    else:  # one rounding apart at most here and there: far inside the bfloat16 bounds
        mean, worst = diff([graph], [eager])
        assert mean <= 0.05 and worst <= 1.0, f"graph vs eager ({backend}, bf16): {mean}, {worst}"


# ----------------------------------------------------------------------------- 3. bfloat16
def test_bfloat16_logits_close_to_hf_bfloat16():
    engine = make_engine(torch.bfloat16)
    try:
        ours = teacher_forced(engine, hf_sequences())
    finally:
        engine.shutdown()
    assert_bf16_close(ours, hf_logits(torch.bfloat16), f"minisgl bf16 ({DEVICE}) vs HF bf16")
    mean32, _ = diff(ours, hf_logits(torch.float32))
    _, _, ref_mean, _ = bf16_bounds()
    assert mean32 <= 1.5 * ref_mean + 0.05, (
        f"minisgl bf16 is further from HF's float32 logits (mean {mean32:.3f}) than HF's own "
        f"bfloat16 run is ({ref_mean:.3f})")


# ----------------------------------------------------------------------------- 4. FlashInfer
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_bfloat16_matches_the_torch_backend(page_size):
    pytest.importorskip("flashinfer")
    if DEVICE != "cuda":
        pytest.skip("FlashInfer runs on the GPU only")
    results = {}
    for backend in ("torch", "fi"):
        engine = make_engine(torch.bfloat16, backend=backend, page_size=page_size)
        try:
            assert engine.config.attention_backend == backend
            results[backend] = teacher_forced(engine, hf_sequences(), first_chunk=3)
        finally:
            engine.shutdown()
    assert_bf16_close(results["fi"], results["torch"], f"fi vs torch backend, ps={page_size}")
    assert_bf16_close(results["fi"], hf_logits(torch.bfloat16), f"fi vs HF bf16, ps={page_size}")
