"""The next attention's rows read ahead: the kernels' decode step with that on and off.

Between two layers' attention a decode step streams about 14 MB of weights through the caches,
so every key and value row decode attention reads comes from memory. Since session 55,
``decode_attention`` (chapter 07, ``csrc/attention.h`` part 4) notes which matmul ran just
before it (the layer's qkv projection), and after that matmul the kernels' worker prefetches the
layer's rows while the calling thread runs rope, ``store_kv`` and the layer's Python.
``set_kv_read_ahead`` turns it off and on. This benchmark does so step by step, alternating, in
one process and one Engine (``cpu_kernels=True``), so that the host's drift falls on both alike,
and times each decode step (the milestone's ``step()``) and the attention inside it (the cpp
backend's ``forward``, all 30 layers: ``store_kv`` and ``decode_attention``), at batch 1, 4 and
16. It also checks that both ways give the same greedy tokens.

    python benchmarks/bench_kv_read_ahead.py [--rounds 4] [--steps 24] [--threads N] [--no-readme]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_decode import Engines
from benchmarks.bench_step_parts import Parts
from benchmarks.measure import batch_prompts, bench_parser, header, run_and_record

BATCHES = (1, 4, 16)
WARMUP = 4


def run(model_path: Path, rounds: int, steps: int, threads: int | None = None) -> str:
    from transformers import AutoTokenizer

    from minisgl import kernel

    mod = kernel.load()
    if mod is None:
        return f"The kernels could not be built ({kernel.unavailable_reason()}): nothing to measure."
    tok = AutoTokenizer.from_pretrained(model_path)
    engines = Engines(model_path, tok, threads)
    runner = engines.get(True)
    parts = Parts()  # times the cpp backend's forward, on this Engine only
    load_before = os.getloadavg()[0]
    step_s: dict[tuple, list[float]] = defaultdict(list)
    attn_s: dict[tuple, list[float]] = defaultdict(list)
    same = {}
    try:
        for b in BATCHES:
            runner.tune_prefetch(b)
            tokens = []
            for on in (True, False):
                mod.set_kv_read_ahead(on)
                tokens.append(runner.greedy_tokens(batch_prompts(b), 12))
            same[b] = tokens[0] == tokens[1]
        parts.wrap("attention", engines.engine.attn_backend, "forward")
        parts.on = True
        for r in range(rounds):
            for b in BATCHES:
                reqs = runner.make_reqs(batch_prompts(b), 2 * steps + WARMUP + 1)
                runner.step(reqs, "prefill")
                for i in range(2 * steps + WARMUP):
                    on = (i + r) % 2 == 1
                    mod.set_kv_read_ahead(on)
                    parts.sec.clear()
                    t0 = time.perf_counter()
                    runner.step(reqs, "decode")
                    if i >= WARMUP:
                        step_s[b, on].append(time.perf_counter() - t0)
                        attn_s[b, on].append(parts.sec["attention"])
    finally:
        mod.set_kv_read_ahead(True)
        parts.restore()
    threads = torch.get_num_threads()
    engines.close()

    def ms(xs: list[float]) -> float:
        return statistics.median(xs) * 1e3

    lines = [
        (f"{header(model_path, 'float32, `cpu_kernels=True`', threads)}; {rounds} rounds x "
         f"{2 * steps} decode steps per batch, the read-ahead of the attention's rows off and "
         f"on in turn, step by step; medians; load average before / after {load_before:.1f} / "
         f"{os.getloadavg()[0]:.1f}."),
        "",
        ("| batch | step, off (ms) | step, on (ms) | on / off | attention, off (ms) | "
         "attention, on (ms) | on / off | the same greedy tokens |"),
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for b in BATCHES:
        s0, s1 = ms(step_s[b, False]), ms(step_s[b, True])
        a0, a1 = ms(attn_s[b, False]), ms(attn_s[b, True])
        lines.append(f"| {b} | {s0:.2f} | {s1:.2f} | {s1 / s0:.3f}x | {a0:.3f} | {a1:.3f} | "
                     f"{a1 / a0:.3f}x | {'yes' if same[b] else '**no**'} |")
    return "\n".join(lines)


def main() -> None:
    ap = bench_parser(__doc__)
    ap.set_defaults(rounds=4, steps=24)
    run_and_record(ap.parse_args(), run, "BENCH_KV_READ_AHEAD",
                   "The next attention's rows read ahead (`bench_kv_read_ahead.py`)")


if __name__ == "__main__":
    main()
