"""Reading memory as one stream or several: why chapter 07's `linear` reads its weight in runs.

At one row of x a matmul's speed is the speed at which the cores read its weight. The usual
yardstick for that speed, and this project's roofline, is ``x.sum()`` over a large tensor: each
thread reads its share front to back, one stream. This benchmark asks whether one stream per
core is all the memory gives. A small C program (compiled here with the system's C compiler,
no torch) reads the same 1 GiB buffer (2 MB pages asked for, as the Engine's weights) on every
thread, one vector add per 32 bytes, in several patterns: each thread's share is cut into
blocks, each block into S runs of equal length, and the thread takes the next line of every run
in turn (S streams at once, each read front to back), block after block. Every 4-byte word holds
the number of its line, and the script checks the sum of what each pattern read: every line
once, or it stops. S = 1 is the plain front-to-back read. The block sizes
cover a whole share, the chunks a call of ``linear`` gives a thread (tens to hundreds of KB),
and runs only a few KB apart, like adjacent weight rows.

Reported: GB/s per pattern (median of the rounds) and the median of the per-round ratios to
one stream with the same block size, the rounds interleaved with ``x.sum()`` over 1 GiB (torch,
as many threads) as the roofline's yardstick.

    python benchmarks/bench_streams.py [--rounds 7] [--threads N] [--no-readme]
"""

from __future__ import annotations

import datetime
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.measure import ReadPass, c_compiler, cpu_info, update_readme

STREAMS = (1, 2, 4, 8)
BLOCKS = (256 << 20, 4 << 20, 256 << 10, 64 << 10, 16 << 10, 8 << 10)  # bytes per thread

C_SOURCE = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
typedef unsigned v8 __attribute__((vector_size(32)));
typedef struct { const char* p; size_t bytes, block; int streams; unsigned out; } Job;
static double now(void) {
  struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec;
}
static void* run(void* arg) {  /* the thread's share: blocks of S runs, a line of each in turn */
  Job* j = arg;
  v8 a = {0}, b = {0};
  size_t run = j->block / j->streams / 64 * 64;
  for (size_t b0 = 0; b0 + j->block <= j->bytes; b0 += j->block)
    for (size_t off = 0; off < run; off += 64)
      for (int s = 0; s < j->streams; ++s) {
        const v8* q = (const v8*)(j->p + b0 + s * run + off);
        a += q[0];
        b += q[1];
      }
  a += b;
  j->out = a[0];
  return NULL;
}
int main(int argc, char** argv) {  /* threads, bytes per thread, (streams block) pairs */
  int threads = atoi(argv[1]);
  size_t share = strtoull(argv[2], 0, 10), bytes = share * threads;
  char* p = mmap(0, bytes + (2 << 20), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) { perror("mmap"); return 1; }
  p = (char*)(((size_t)p + (2 << 20) - 1) & ~(size_t)((2 << 20) - 1));
#ifdef MADV_HUGEPAGE
  madvise(p, bytes, MADV_HUGEPAGE);
#endif
  for (size_t i = 0; i < bytes / 4; ++i) ((unsigned*)p)[i] = (unsigned)(i / 16);  /* its line */
  pthread_t h[64];
  Job jobs[64];
  for (int i = 3; i + 1 < argc; i += 2) {
    int streams = atoi(argv[i]);
    size_t block = strtoull(argv[i + 1], 0, 10);
    double t0 = now();
    for (int t = 0; t < threads; ++t) {
      jobs[t] = (Job){p + t * share, share, block, streams, 0};
      pthread_create(&h[t], 0, run, &jobs[t]);
    }
    for (int t = 0; t < threads; ++t) pthread_join(h[t], 0);
    double dt = now() - t0;
    unsigned sum = 0;  /* of the line numbers read, each twice, modulo 2^32 */
    for (int t = 0; t < threads; ++t) sum += jobs[t].out;
    printf("%d %zu %.9f %u\n", streams, block, dt, sum);
  }
  return 0;
}
"""


def compile_reader(folder: Path) -> Path:
    cc = c_compiler("bench_streams")
    src, exe = folder / "streams.c", folder / "streams"
    src.write_text(C_SOURCE)
    for flags in (["-march=native"], []):  # a compiler that rejects -march=native: plain -O2
        try:
            r = subprocess.run([cc, "-O2", *flags, "-pthread", str(src), "-o", str(exe)],
                               capture_output=True, text=True, timeout=120, check=False)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"{cc} took over 2 minutes to compile a 60-line C file (about a "
                             "second when idle): is the machine swapping?") from None
        if r.returncode == 0:
            return exe
    raise SystemExit(f"{cc} could not compile the reader: {r.stderr.strip()[-500:]}")


def run(rounds: int, threads: int, total: int = 1 << 30, blocks=BLOCKS) -> str:
    """The table, from ``rounds`` rounds of every pattern over ``total`` bytes (each thread's
    share a whole number of the largest block)."""
    share = total // threads // max(blocks) * max(blocks)
    if share == 0:
        raise SystemExit(f"{total} bytes on {threads} threads leave no whole block of "
                         f"{max(blocks)} bytes per thread: use fewer threads")
    gib = share * threads  # bytes read per pattern
    pairs = [(s, b) for b in blocks for s in STREAMS]
    seconds = {p: [] for p in pairs}
    sums = []
    yardstick = ReadPass(gib / (1 << 30))
    with tempfile.TemporaryDirectory() as tmp:
        exe = compile_reader(Path(tmp))
        for r in range(rounds):
            order = pairs if r % 2 == 0 else pairs[::-1]
            args = [str(exe), str(threads), str(share)] + [str(v) for p in order for v in p]
            try:
                out = subprocess.run(args, capture_output=True, text=True, timeout=600,
                                     check=True).stdout
            except subprocess.TimeoutExpired:
                raise SystemExit("the reader took over 10 minutes for one round (a few seconds "
                                 "when idle): is the machine swapping or very busy?") from None
            for line in out.splitlines():
                s, b, t, total_read = line.split()
                lines = gib // 64  # each holds its number; each read adds it twice
                if int(total_read) != lines * (lines - 1) % (1 << 32):
                    raise SystemExit(f"the reader's pattern of {s} streams in blocks of {b} "
                                     f"bytes did not read each of the {lines} lines once (the "
                                     "sum of their numbers is off): a pattern must read every "
                                     "line once")
                seconds[(int(s), int(b))].append(float(t))
            sums.append(yardstick.bandwidth(yardstick.times(3)))

    def gbs(p):
        return gib / statistics.median(seconds[p]) / 1e9

    def ratio(p):
        return statistics.median(a / b for a, b in zip(seconds[(1, p[1])], seconds[p]))

    def size(b):
        return f"{b >> 20} MB" if b >= 1 << 20 else f"{b >> 10} KB"

    model, isa = cpu_info()
    lines = [
        (f"{model} ({isa}), {os.cpu_count()} CPUs; {datetime.date.today()}; {threads} reader "
         f"threads; {gib / (1 << 30):g} GiB read per pattern; medians of {rounds} interleaved rounds; load "
         f"average {os.getloadavg()[0]:.1f} after."),
        "",
        (f"`x.sum()` over as many bytes, {torch.get_num_threads()} torch threads, interleaved: "
         f"{statistics.median(sums) / 1e9:.1f} GB/s."),
        "",
        "| block per thread (run length = block / streams) | "
        + " | ".join(f"{s} stream{'s' if s > 1 else ''}" for s in STREAMS) + " |",
        "|---|" + "---:|" * len(STREAMS),
    ]
    for b in blocks:
        cells = [f"{gbs((s, b)):.1f} GB/s ({ratio((s, b)):.2f}x)" for s in STREAMS]
        lines.append(f"| {size(b)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None,
                    help="reader threads (default: torch's, every core)")
    ap.add_argument("--no-readme", action="store_true", help="print only")
    args = ap.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be 1 or more, got {args.rounds}")
    threads = args.threads or torch.get_num_threads()
    if not 1 <= threads <= 64:
        raise SystemExit(f"--threads must be 1 to 64, got {threads}")
    table = run(args.rounds, threads)
    print(table)
    if not args.no_readme:
        update_readme("BENCH_STREAMS", "Reading in several streams (`bench_streams.py`)", table)


if __name__ == "__main__":
    main()
