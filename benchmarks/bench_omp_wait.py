"""Waiting threads under load: the fused kernels' matmuls of one decode step, several ways.

Since 2026-12-02 (issue "the second backend at the memory limit") the kernels no longer use
OpenMP: they run on their own threads (``Workers``, csrc/common.h), which take chunks from one
counter, spin briefly (yielding the core after a few microseconds) and then sleep. The OpenMP
settings below then change only torch's own ops; run with ``--other`` on a checkout of the
kernels before that date to measure the OpenMP version beside today's. The history:

A kernel that splits its work over two threads pays for a hand-off at every call: the other
thread must be woken, and the caller waits for it at the end. Until this benchmark, the kernels
used ``at::parallel_for`` (OpenMP, torch's libgomp), whose threads *spin* for about 3 ms after
each call; on a busy machine a spinning thread that loses its core makes the next call wait for
its next time slice, 121 times per step. A version whose other chunk ran on torch's inter-op
threads (``at::launch``, which sleep while they wait) was measured against it with this probe and
in whole decode steps: much faster under load, but on an idle machine a third slower at batch 4
(its sleeping thread competes with the OpenMP threads of torch's own ops), so the kernels kept
``at::parallel_for`` (benchmarks/README.md, "Threads that wait").

This probe times the 121 matmuls of one SmolLM2 decode step at batch 1 (``kernel.linear`` on the
checkpoint's shapes) in a fresh process per variant, with and without extra load (busy-looping
processes started here, one per core, stopped by their pid afterwards):

- ``spin``: two threads, libgomp's default wait policy (what an Engine gets);
- ``passive``: two threads, ``OMP_WAIT_POLICY=passive`` in the environment (process-wide);
- ``dynamic``: two threads, ``omp_set_dynamic(1)`` on the calling thread (libgomp then gives a
  region at most ``cores - load average`` threads);
- ``one``: one thread.

``--other PATH`` measures another checkout's kernels too, interleaved (``git worktree add
/tmp/before <commit>`` for another version of the kernels): that is the comparison the
README records. Prints the median, fastest and slowest pass per variant and the ratio to
``one``; changes nothing.

    python benchmarks/bench_omp_wait.py [--passes 15] [--rounds 2] [--other /tmp/before]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]  # [out, in]

PROBE = r"""
import ctypes, json, statistics, sys, time, torch
variant, passes = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(1 if variant == "one" else 2)
if variant == "dynamic":
    ctypes.CDLL("libgomp.so.1").omp_set_dynamic(1)   # torch's libgomp, already loaded
from minisgl import kernel
kmod = kernel.load()
print("kernels:", kernel.__file__, kmod.__name__, file=sys.stderr)
shapes = json.loads(sys.argv[3])
torch.manual_seed(0)
ws = [torch.randn(n, k) * 0.02 for n, k in shapes]
xs = {k: torch.randn(1, k) for _, k in shapes}
for w in ws[:8]:
    kmod.linear(xs[w.shape[1]], w, None)
times = []
for _ in range(passes):
    t0 = time.perf_counter()
    for w in ws:
        kmod.linear(xs[w.shape[1]], w, None)
    times.append(time.perf_counter() - t0)
print(json.dumps(times))
"""


def probe(variant: str, passes: int, tree: Path = ROOT) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.pop("OMP_NUM_THREADS", None)
    env.pop("OMP_WAIT_POLICY", None)
    if variant == "passive":
        env["OMP_WAIT_POLICY"] = "passive"
    out = subprocess.run([sys.executable, "-c", PROBE, variant, str(passes), json.dumps(SHAPES)],
                         env=env, cwd=tree, capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    if "could not be built" in out.stderr:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default="spin,passive,dynamic,one")
    ap.add_argument("--other", type=Path, default=None,
                    help="another checkout (e.g. a `git worktree` of an earlier commit): its "
                         "kernels are measured too, interleaved, as variants 'other:...'")
    ap.add_argument("--no-load", action="store_true", help="skip the run with extra load")
    args = ap.parse_args()
    variants = args.variants.split(",")
    if args.other:
        variants += [f"other:{v}" for v in variants]
    for loaded in (False,) if args.no_load else (False, True):
        hogs = []
        if loaded:
            hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                    for _ in range(os.cpu_count() or 2)]
            time.sleep(1)
        try:
            runs = {v: [] for v in variants}
            for _ in range(args.rounds):  # interleaved: drift of the machine favours no variant
                for v in variants:
                    other = v.startswith("other:")
                    runs[v] += probe(v.removeprefix("other:"), args.passes,
                                     args.other if other else ROOT)
        finally:
            for h in hogs:
                h.kill()
                h.wait()
        load = os.getloadavg()
        print(f"\n{'with' if loaded else 'without'} {len(hogs)} extra busy processes "
              f"(load average now {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}), "
              f"{os.cpu_count()} CPUs, {len(SHAPES)} matmuls per pass")
        ref = sorted(runs["one"])[len(runs["one"]) // 2] if "one" in runs else None
        for v in variants:
            t = sorted(runs[v])
            med = t[len(t) // 2]
            ratio = f"  median {med / ref:5.2f}x one thread's" if ref else ""
            print(f"  {v:8} median {med * 1e3:7.1f} ms, fastest {t[0] * 1e3:6.1f} ms, "
                  f"slowest {t[-1] * 1e3:7.1f} ms{ratio}")


if __name__ == "__main__":
    main()
