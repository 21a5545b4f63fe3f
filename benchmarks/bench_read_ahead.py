"""Reading the next weights ahead: the kernels' decode step with the read-ahead on and off.

Between two matmuls of a decode step the calling thread runs a norm, rope, attention and the
layer's Python; memory sits idle meanwhile, and the kernels' worker thread would only spin.
Since 2026-12-03 ``linear`` (csrc/linear.h) remembers which weight followed which, and after a
call the workers read the weights that followed it last time, up to a budget (by default the
size of one core's L2, read from sysfs, 512 KiB where Linux does not say; until 2026-12-06 the
last-level cache's, which cost a Zen 2 5-9% of its step). Since session 47 they load one byte
per line, and only inside the Engine's weight buffer (``weight_buffer``); before, they issued
prefetch hints, which gained nothing on the Zen 2. This benchmark sets that budget
(``set_read_ahead``) between interleaved rounds, in one process and one Engine
(``cpu_kernels=True``), and times:

- decode steps (the milestone's ``step()``) at batch 1, 4 and 16;
- the 121 matmuls of a step back to back (the Engine's own weights, one row, nothing between
  the calls): there is no idle memory to use, so the read-ahead can only cost here;
- decode steps at batch 1 beside one, then four busy processes (started here, stopped by their
  pids): a worker that reads ahead holds its core meanwhile, so this table puts your code's step
  (chapters 01-06, ``cpu_kernels=False``, MKL's ``F.linear``) beside the kernels' with and
  without read-ahead.

Budget 0 is the kernels without read-ahead. Ratios are against it (below 1: faster): the
median of the per-round ratios, which the host's drift between rounds moves less than it moves
the medians themselves.

    python benchmarks/bench_read_ahead.py [--rounds 5] [--steps 24] [--threads N] [--no-readme]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_decode import Engines
from benchmarks.measure import bench_parser, header, paired_ratio, run_and_record

BATCHES = (1, 4, 16)
BUDGETS = (0, 2 << 20, 8 << 20, 32 << 20)  # bytes; the default joins them
BUSY = (1, 4)  # busy processes beside the batch-1 steps


def matmul_times(engine, passes: int = 5) -> list[float]:
    """Seconds per pass over the Engine's 121 matmul weights, one row, back to back."""
    from minisgl import kernel

    mod = kernel.load()
    model = engine.model
    weights = []
    for layer in model.model.layers.op_list:
        attn, mlp = layer.self_attn, layer.mlp
        weights += [op.weight for op in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                         mlp.down_proj)]
    head = model.lm_head  # tied to the embedding in SmolLM2: the embedding's weight
    weights.append(head._tied_embedding.weight if head.tie_word_embeddings else head.weight)
    xs = {w.shape[1]: torch.randn(1, w.shape[1]) for w in weights}
    out = []
    for i in range(passes + 1):
        t0 = time.perf_counter()
        for w in weights:
            mod.linear(xs[w.shape[1]], w, None)
        if i:
            out.append(time.perf_counter() - t0)
    return out


def run(model_path: Path, rounds: int, steps: int, threads: int | None = None) -> str:
    from transformers import AutoTokenizer

    from minisgl import kernel

    mod = kernel.load()
    if mod is None:
        return f"The kernels could not be built ({kernel.unavailable_reason()}): nothing to measure."
    tok = AutoTokenizer.from_pretrained(model_path)
    engines = Engines(model_path, tok, threads)
    runner = engines.get(True)
    load_before = os.getloadavg()[0]
    default = mod.set_read_ahead(0)
    budgets = sorted({*BUDGETS, default})
    times: dict[tuple, list[float]] = defaultdict(list)
    rounds_ms: dict[tuple, list[float]] = defaultdict(list)  # one median per round: paired ratios
    try:
        for r in range(rounds):
            for budget in (budgets if r % 2 == 0 else budgets[::-1]):
                mod.set_read_ahead(budget)
                for b in BATCHES:
                    got = runner.decode_times(b, steps)
                    times[budget, b] += got
                    rounds_ms[budget, b].append(statistics.median(got))
                got = matmul_times(engines.engine)
                times[budget, "mm"] += got
                rounds_ms[budget, "mm"].append(statistics.median(got))
        for n_busy in BUSY:
            busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    for _ in range(n_busy)]
            try:
                for r in range(rounds):
                    for job in (("torch", 0, default) if r % 2 == 0 else (default, 0, "torch")):
                        runner = engines.get(job != "torch")
                        if job != "torch":
                            mod.set_read_ahead(job)
                        times[job, "busy", n_busy] += runner.decode_times(1, steps)
            finally:
                for p in busy:  # only the processes started here, by their pid
                    p.kill()
                    p.wait()
    finally:
        mod.set_read_ahead(default)
    threads = torch.get_num_threads()
    engines.close()

    ms = {key: statistics.median(v) * 1e3 for key, v in times.items()}

    def size(n: int) -> str:
        return f"{n >> 20} MiB" if n % (1 << 20) == 0 else f"{n >> 10} KiB"
    cols = [*BATCHES, "mm"]
    lines = [
        (f"{header(model_path, 'float32, `cpu_kernels=True`', threads)}; medians of {rounds} "
         f"interleaved rounds "
         f"(x {steps} decode steps, x 5 passes over the matmuls); default budget "
         f"{size(default)}; load average before / after {load_before:.1f} / "
         f"{os.getloadavg()[0]:.1f}."),
        "",
        "ms (against no read-ahead, the median of the per-round ratios):",
        "",
        "| read-ahead | " + " | ".join(f"decode step, batch {b}" for b in BATCHES)
        + " | 121 matmuls back to back, 1 row |",
        "|---|" + "---:|" * len(cols),
    ]
    for budget in budgets:
        label = "none (budget 0)" if budget == 0 else size(budget) + (
            " (the default)" if budget == default else "")
        cells = [f"{ms[budget, c]:.1f}" for c in cols]
        if budget:
            cells = [f"{cell} ({paired_ratio(rounds_ms[budget, c], rounds_ms[0, c]):.2f}x)"
                     for cell, c in zip(cells, cols)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", ("Beside busy processes (each a Python loop), decode step at batch 1, ms "
                   "(against your code's step, whose matmuls are MKL's `F.linear`):"), "",
              ("| busy processes | your code (`cpu_kernels=False`) | kernels, no read-ahead | "
               f"kernels, {size(default)} read-ahead (the default) |"),
              "|---:|---:|---:|---:|"]
    for n in BUSY:
        t, off, on = (ms[job, "busy", n] for job in ("torch", 0, default))
        lines.append(f"| {n} | {t:.1f} | {off:.1f} ({off / t:.2f}x) | {on:.1f} ({on / t:.2f}x) |")
    return "\n".join(lines)


def main() -> None:
    ap = bench_parser(__doc__)
    ap.set_defaults(rounds=5, steps=24)
    run_and_record(ap.parse_args(), run, "BENCH_READ_AHEAD",
                   "Reading the next weights ahead (`bench_read_ahead.py`)")


if __name__ == "__main__":
    main()
