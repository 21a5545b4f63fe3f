"""A default Engine runs exactly the learner's code.

Every exercise region (found from the ``# BEGIN SOLUTION`` markers in ``minisgl/``, not from a
list kept by hand) of a module the Engine imports must execute: those the Engine's construction
does not run are its forward path, and each of them must run in the prefill step and in the
decode steps, line-traced with ``sys.settrace``. A fast path in front of an exercise, a
process-wide switch that sends a layer elsewhere, or an op bound to another implementation
would leave a region unexecuted, and this test names it. The same trace of an Engine built with
``cpu_kernels=True`` shows which exercises the kernels replace: that is the test's own check
that it can see a bypass.

The batches are prepared as a scheduler would: pages from ``allocate_pages`` (4.4, which expands
them with ``pages_to_slots``, 4.2), ``out_loc`` from ``batch_out_loc`` (its row map is 4.3), one
greedy request and one sampled with top-k and top-p (6.1).
"""

from __future__ import annotations

import pathlib
import re
import sys

import pytest
import torch

from helpers import model_path, require_kernels

ROOT = pathlib.Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^\s+# (BEGIN SOLUTION (\d+\.\d+):|END SOLUTION)")
# exercises that by design run only in a prefill: the mask of several query rows (a decode
# step's single query needs none). Checked below to be exactly what the trace shows.
PREFILL_ONLY = {"5.1"}
# exercises a one-process (tp=1) Engine never needs: sharding the checkpoint's tensors (tp=1
# loads them whole; tests/test_tp.py runs it with two ranks). Checked below to be exactly the
# exercises that did not run at all.
TP_ONLY = {"3.3"}
pytestmark = pytest.mark.usefixtures("clean_globals")


def exercise_regions() -> dict[str, tuple[str, range]]:
    """Exercise id -> (file, the line numbers strictly between its two markers)."""
    found = {}
    for path in sorted((ROOT / "minisgl").rglob("*.py")):
        begin = None
        for no, line in enumerate(path.read_text().splitlines(), 1):
            m = MARKER.match(line)
            if m and m.group(2):
                begin = (m.group(2), no)
            elif m and begin:
                found[begin[0]] = (str(path), range(begin[1] + 1, no))
                begin = None
    return found


class LineTrace:
    """Record (file, line) of every line executed in ``files`` while active."""

    def __init__(self, files) -> None:
        self.files, self.hits = set(files), set()

    def _global(self, frame, event, arg):
        return self._local if frame.f_code.co_filename in self.files else None

    def _local(self, frame, event, arg):
        if event == "line":
            self.hits.add((frame.f_code.co_filename, frame.f_lineno))
        return self._local

    def __enter__(self):
        self.hits = set()
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)

    def ran(self, regions) -> set[str]:
        return {eid for eid, (f, lines) in regions.items()
                if any((f, no) in self.hits for no in lines)}


def trace_engine(cpu_kernels: bool, name: str = "tiny-qwen3"):
    """Trace an Engine's construction, its prefill and its decode steps: three sets of ids."""
    from minisgl.core import Batch, Req, SamplingParams
    from minisgl.distributed import DistributedInfo
    from minisgl.engine import Engine, EngineConfig
    from minisgl.kvcache import allocate_pages, batch_out_loc, batch_positions

    regions = exercise_regions()
    tracer = LineTrace({f for f, _ in regions.values()})
    ps = 4
    config = EngineConfig(model_path=str(model_path(name)), tp_info=DistributedInfo(0, 1),
                          dtype=torch.float32, max_running_req=2, num_page_override=32,
                          max_seq_len_override=32, page_size=ps, cpu_kernels=cpu_kernels)
    with tracer:
        engine = Engine(config)
    built = tracer.ran(regions)
    try:
        params = [SamplingParams(max_tokens=4),
                  SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=4)]
        # 8 prompt tokens fill two pages: the first decode step needs a third one
        reqs = [Req(input_ids=torch.randint(3, 1000, (n,), dtype=torch.int32,
                                            generator=torch.Generator().manual_seed(n)),
                    table_idx=1 - i, cached_len=0, output_len=4, uid=i, sampling_params=sp)
                for i, (n, sp) in enumerate(zip((8, 5), params))]  # table_idx != batch position
        free_pages = list(range(16))  # enough pages for both requests

        def schedule(phase):  # what a scheduler does: pages for the new tokens, then the batch
            for r in reqs:
                allocate_pages(engine.page_table, r, free_pages, ps)
            batch = Batch(reqs=reqs, phase=phase)
            engine.graph_runner.pad_batch(batch)
            batch.positions = batch_positions(reqs)
            batch.input_ids = torch.cat([r.input_ids[r.cached_len:r.device_len] for r in reqs])
            batch.out_loc = batch_out_loc(engine.page_table, reqs, batch.positions)
            return batch

        phases = {}
        for phase in ("prefill", "decode", "decode"):
            with tracer:
                batch = schedule(phase)
                engine.attn_backend.prepare_metadata(batch)
                out = engine.forward_batch(batch, engine.sampler.prepare(batch))
                for i, r in enumerate(reqs):
                    r.append_host(out.next_tokens_cpu[i:i + 1])
            phases.setdefault(phase, set()).update(tracer.ran(regions))
    finally:
        engine.shutdown()
    return regions, built, phases["prefill"], phases["decode"]


def engine_modules() -> set[str]:
    """Files of the minisgl modules ``minisgl.engine`` imports, in a fresh process (others,
    such as chapter 00's generator or the FlashInfer backend, are not the Engine's code)."""
    import subprocess

    code = ("import sys\nfrom minisgl.engine import Engine  # noqa: F401\n"
            "print('\\n'.join(m.__file__ for n, m in sys.modules.items()\n"
            "                 if n.split('.')[0] == 'minisgl' and getattr(m, '__file__', None)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=120)
    return set(out.stdout.split())


def coverage_problems(regions, built, prefill, decode) -> list[str]:
    """What a default Engine's trace shows of exercises that did not run where they should."""
    def ordered(ids):
        return sorted(ids, key=lambda e: tuple(map(int, e.split("."))))

    imported = engine_modules()
    engine_ids = {eid for eid, (f, _) in regions.items() if f in imported}
    assert len(engine_ids) >= 20, f"found only {sorted(engine_ids)}: are the markers gone?"
    problems = []
    never = ordered(engine_ids - built - prefill - decode - TP_ONLY)
    if never:
        problems.append(f"exercise(s) {never} never ran in a default Engine (build, prefill, "
                        "decode): something sits in front of the learner's code (a fast path, "
                        "a switch, a bound implementation)")
    if not TP_ONLY <= engine_ids or TP_ONLY & (built | prefill | decode):
        problems.append(f"TP_ONLY {TP_ONLY} is out of date: it ran at tp=1")
    forward = engine_ids - built - TP_ONLY
    if forward - prefill - set(never):
        problems.append(f"exercise(s) {ordered(forward - prefill - set(never))} did not run in "
                        "the prefill step")
    if forward - decode - PREFILL_ONLY - set(never):
        problems.append(f"exercise(s) {ordered(forward - decode - PREFILL_ONLY - set(never))} "
                        "did not run in the decode steps")
    if not PREFILL_ONLY <= forward or PREFILL_ONLY & decode:
        problems.append(f"PREFILL_ONLY {PREFILL_ONLY} is out of date: decode ran "
                        f"{PREFILL_ONLY & decode}")
    return problems


def test_a_default_engine_runs_every_exercise_on_its_forward_path():
    problems = coverage_problems(*trace_engine(cpu_kernels=False))
    assert not problems, "\n".join(problems)


def test_the_check_fails_on_a_fast_path_in_front_of_an_exercise(monkeypatch):
    """Planted: the KV store replaced by equivalent torch code outside exercise 4.1 (the tokens
    stay right, so only this check can see it); then RoPE skipped in decode steps."""
    from minisgl.kvcache import MHAKVCache
    from minisgl.layers import RotaryEmbedding

    real_rope, real_store = RotaryEmbedding.forward, MHAKVCache.store_kv

    def store_fast(self, k, v, out_loc, layer_id):
        shape = (-1, self.num_kv_heads, self.head_dim)
        self._k_buffer[layer_id].view(shape)[out_loc.long()] = k.reshape(shape)
        self._v_buffer[layer_id].view(shape)[out_loc.long()] = v.reshape(shape)

    monkeypatch.setattr(MHAKVCache, "store_kv", store_fast)
    problems = "\n".join(coverage_problems(*trace_engine(cpu_kernels=False)))
    assert "['4.1'] never ran" in problems, problems
    monkeypatch.setattr(MHAKVCache, "store_kv", real_store)
    monkeypatch.setattr(RotaryEmbedding, "forward",
                        lambda self, pos, q, k: q is None or real_rope(self, pos, q, k)
                        if pos.numel() > 2 else (q, k))  # decode steps skip the exercise
    problems = "\n".join(coverage_problems(*trace_engine(cpu_kernels=False)))
    assert "['2.8'] did not run in the decode steps" in problems, problems


def test_the_trace_sees_what_the_kernels_replace():
    """With ``cpu_kernels=True`` the decode steps skip the learner's norm (2.6, 2.7), rotary
    (2.8), the decode half of attention (5.3) and the pool's store (4.1: the pool, built with
    the kernels' set, hands it to the C++ ``store_kv``): the tracer above would have caught it."""
    require_kernels()
    regions, built, prefill, decode = trace_engine(cpu_kernels=True)
    _, _, _, default_decode = trace_engine(cpu_kernels=False)
    replaced = default_decode - decode
    assert {"2.7", "2.8", "4.1", "5.3"} <= replaced, (
        f"the kernel Engine's decode skipped {sorted(replaced)}; expected at least 2.7, 2.8, 4.1, "
        "5.3")
