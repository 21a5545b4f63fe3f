"""What this machine allows a decode step at batch 1, 4 and 16: the arithmetic's floor.

A decode step does one multiply-add per weight and row of the batch. At the cores' peak rate of
multiply-adds that takes a time no kernel can beat, and it grows with the batch, while the bytes
of the weights, read once per step whatever the batch, do not. At one row the step waits on
memory; at 16 rows on a 2-core CPU the arithmetic alone may take longer than a whole batch-1
step. This script measures how much longer, side by side, in interleaved rounds:

- **the FMA peak**: a small C program (compiled here with the kernels' flags, ``MINISGL_KERNEL_ISA``,
  so with the same vectors as chapter 07's ``linear``) runs chains of independent vector
  multiply-adds on every thread, nothing else: float multiply-adds per second, all threads;
- **`x.sum()`** over 1 GiB: the roofline's yardstick for the memory (see the README: the kernels
  read several streams at once and can beat it, so it is a yardstick here, not a floor);
- **the decode step** of ``cpu_kernels=True`` at batch 1, 4 and 16 (the milestone's ``step()``).

Reported per batch: the step, its ratio to batch 1's (the median of the rounds' ratios), the
weights' bytes at ``x.sum()``'s bandwidth, the step's multiply-adds at the peak, and those
multiply-adds against batch 1's step: the lowest "batch b against a single step" ratio that any
float32 implementation could show on this host while batch 1 runs as fast as it does. Only the
matmuls' multiply-adds are counted (attention's, the norms' and RoPE's are left out), so that
floor is a lower bound.

    python benchmarks/bench_floor.py [--rounds 7] [--steps 16] [--threads N] [--no-readme]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_decode import Engines
from benchmarks.measure import (
    ReadPass,
    bench_parser,
    c_compiler,
    header,
    run_and_record,
    weight_bytes,
)

BATCHES = (1, 4, 16)

# ACC independent chains of LANES-float multiply-adds per thread: enough chains to cover the
# FMA's latency on every core measured (4 cycles, 2 per cycle). The program runs 12 and 24 chains
# and keeps the faster: 24 sums spill on 16 vector registers (AVX2, SSE), 12 may not fill a
# core with 32 (AVX-512, NEON).
C_SOURCE = r"""
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef struct { long iters; int acc; float out; } Job;
static double now(void) {
  struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec;
}
#define CHAINS(N)                                                                    \
  static float chains##N(long iters) {                                               \
    vec a[N], b, c;                                                                  \
    for (int l = 0; l < LANES; ++l) { b[l] = 0.999999f; c[l] = 1e-7f; }              \
    for (int i = 0; i < N; ++i) for (int l = 0; l < LANES; ++l) a[i][l] = 1 + i * 1e-3f; \
    for (long it = 0; it < iters; ++it) {                                            \
      _Pragma("GCC unroll 24") for (int i = 0; i < N; ++i) a[i] = a[i] * b + c;      \
      __asm__ volatile("" : "+x"(b));                                                \
    }                                                                                \
    float s = 0;                                                                     \
    for (int i = 0; i < N; ++i) s += a[i][0];                                        \
    return s;                                                                        \
  }
CHAINS(12)
CHAINS(24)
static void* run(void* arg) {
  Job* j = arg;
  j->out = j->acc == 12 ? chains12(j->iters) : chains24(j->iters);
  return NULL;
}
int main(int argc, char** argv) {  /* threads, iterations: chains, seconds, thread 0's sum */
  int threads = atoi(argv[1]);
  long iters = atol(argv[2]);
  pthread_t h[64];
  Job jobs[64];
  for (int acc = 12; acc <= 24; acc += 12) {
    double t0 = now();
    for (int t = 0; t < threads; ++t) {
      jobs[t] = (Job){iters * 24 / acc, acc, 0};
      pthread_create(&h[t], 0, run, &jobs[t]);
    }
    for (int t = 0; t < threads; ++t) pthread_join(h[t], 0);
    printf("%d %.9f %.6f\n", acc, now() - t0, jobs[0].out);
  }
  return 0;
}
"""


def compile_fma(folder: Path, lanes: int) -> Path:
    """The peak program, built with the kernels' flags (so with their vector width)."""
    from minisgl.kernel import build_flags

    cc = c_compiler("bench_floor")
    src, exe = folder / "fma.c", folder / "fma"
    src.write_text(C_SOURCE)
    flags = [f for f in build_flags() if not f.startswith("-falign")]
    try:
        r = subprocess.run([cc, *flags, f"-DLANES={lanes}", "-pthread", str(src), "-o",
                            str(exe)], capture_output=True, text=True, timeout=120, check=False)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{cc} took over 2 minutes to compile a 50-line C file (about a second "
                         "when idle): is the machine swapping?") from None
    if r.returncode:
        raise SystemExit(f"{cc} could not compile the FMA program with {flags}: "
                         f"{r.stderr.strip()[-500:]}")
    return exe


def fma_peak(exe: Path, threads: int, lanes: int, iters: int = 20_000_000) -> float:
    """Float multiply-adds per second on ``threads`` threads: the faster of 12 and 24 chains
    (``iters`` steps of each of 24 chains, twice as many of each of 12)."""
    if iters < 5_000_000:
        raise ValueError(f"iters={iters}: the chains need 5 million steps or more to show that "
                         "they ran (see the check below)")
    try:
        out = subprocess.run([str(exe), str(threads), str(iters)], capture_output=True,
                             text=True, timeout=300, check=True).stdout
    except subprocess.TimeoutExpired:
        raise SystemExit("the FMA program took over 5 minutes (about a second when idle): is the "
                         "machine very busy?") from None
    best = 0.0
    for line in out.splitlines():
        acc, sec, total = line.split()
        # each chain is a = a * b + c with b = 1 - 1e-6, c = 1e-7, from a = 1: it falls toward
        # c / (1 - b) = 0.1 (in float32 it stops a few percent above, where a step no longer
        # changes a), below 0.11 only after 4.5 million steps or more. A sum above that means
        # the compiler cut the loop short, and the peak would be wrong.
        if not 0.095 * int(acc) <= float(total) <= 0.11 * int(acc):
            raise SystemExit(f"the FMA program's {acc} chains ended at a sum of {total}, not "
                             f"near {0.1 * int(acc):g}: its loop did not run its iterations "
                             "(a compiler that shortened it?), so its peak would be wrong")
        fmas = threads * (iters * 24 // int(acc)) * int(acc) * lanes
        best = max(best, fmas / float(sec))
    return best


def run(model_path: Path, rounds: int, steps: int, threads: int | None = None) -> str:
    from transformers import AutoTokenizer

    from minisgl import kernel

    mod = kernel.load()
    if mod is None:
        raise SystemExit(f"bench_floor measures chapter 07's kernels, which could not be built: "
                         f"{kernel.unavailable_reason()}")
    lanes = int(mod.vector_lanes())
    tok = AutoTokenizer.from_pretrained(model_path)
    engines = Engines(model_path, tok, threads)
    runner = engines.get(True)
    nthreads = torch.get_num_threads()  # the Engine's, while it lives
    load_before = os.getloadavg()[0]
    nbytes = weight_bytes(model_path)
    params = nbytes // 4  # float32: one multiply-add per weight and row
    read = ReadPass(1.0)
    peaks, bws = [], []
    steps_ms: dict[int, list[float]] = {b: [] for b in BATCHES}
    with tempfile.TemporaryDirectory() as tmp:
        exe = compile_fma(Path(tmp), lanes)
        for r in range(rounds):
            peaks.append(fma_peak(exe, nthreads, lanes))
            bws.append(read.bandwidth(read.times(3)))
            for b in (BATCHES if r % 2 == 0 else BATCHES[::-1]):
                steps_ms[b] += [t * 1e3 for t in runner.decode_times(b, steps)]
    engines.close()
    peak, bw = statistics.median(peaks), statistics.median(bws)
    step = {b: statistics.median(steps_ms[b]) for b in BATCHES}

    def per_round(b: int) -> list[float]:  # each round's median step at batch b
        return [statistics.median(steps_ms[b][r * steps:(r + 1) * steps]) for r in range(rounds)]

    ones = per_round(1)
    mem_ms = nbytes / bw * 1e3
    lines = [
        (f"{header(model_path, 'float32, fused kernels (`cpu_kernels=True`)', threads)}; "
         f"{rounds} interleaved rounds of {steps} decode steps per batch, one FMA measurement "
         f"and three `x.sum()` passes each; load average before / after {load_before:.1f} / "
         f"{os.getloadavg()[0]:.1f}."),
        "",
        (f"FMA peak, {nthreads} threads, {lanes} floats a vector: **{peak / 1e9:.1f} billion "
         f"float multiply-adds a second** (median; rounds: "
         f"{', '.join(f'{p / 1e9:.1f}' for p in peaks)}). `x.sum()`: **{bw / 1e9:.1f} GB/s** "
         f"(rounds: {', '.join(f'{x / 1e9:.1f}' for x in bws)}). The weights: "
         f"{nbytes / 1e6:.0f} MB, {params / 1e6:.1f} million multiply-adds per row of the batch."),
        "",
        ("| batch | the step, ms | the step / batch 1's, paired | the weights at `x.sum()`'s "
         "bandwidth, ms | the multiply-adds at the FMA peak, ms | the step / its multiply-adds "
         "| its multiply-adds / batch 1's step, paired |"),
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in BATCHES:
        fma_ms = params * b / peak * 1e3
        ratio = statistics.median(x / y for x, y in zip(per_round(b), ones))
        bound = statistics.median(fma_ms / y for y in ones)
        lines.append(f"| {b} | {step[b]:.2f} | {ratio:.2f}x | {mem_ms:.2f} | {fma_ms:.2f} | "
                     f"{step[b] / fma_ms:.2f}x | {bound:.2f}x |")
    last = BATCHES[-1]
    fma_last = params * last / peak * 1e3
    lines += ["", (f"At batch {last} the multiply-adds alone take {fma_last:.2f} ms at the peak, "
                   f"{statistics.median(fma_last / y for y in ones):.2f}x batch 1's step "
                   f"(paired by round; batch 1's median {step[1]:.2f} ms): no float32 "
                   f"implementation can bring batch {last} below that ratio on this host while "
                   "batch 1 runs this fast, and a faster batch 1 only raises it.")]
    return "\n".join(lines)


def main() -> None:
    ap = bench_parser(__doc__)
    ap.set_defaults(rounds=7, steps=16)
    args = ap.parse_args()
    if args.rounds < 1 or args.steps < 1:
        raise SystemExit(f"--rounds and --steps must be 1 or more, got {args.rounds} and "
                         f"{args.steps}")
    run_and_record(args, run, "BENCH_FLOOR",
                   "What this machine allows a decode step (`bench_floor.py`)")


if __name__ == "__main__":
    main()
