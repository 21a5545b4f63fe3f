"""The step's Python with hot and with cold caches, and a step whose model runs without its Python.

At batch 1 with ``cpu_kernels=True`` a decode step spends about 2.5 ms outside its 121 matmuls
(``bench_step_parts.py``): norms, rope, attention, sampling, and the Python around them (the
layers' ops and views, metadata, checks, the milestone's ``step()``). This benchmark separates
that Python from the kernels' own work. One Engine, the milestone's step at batch 1 (``--batch``
for another), four ways, interleaved round by round:

- **kernels**: the Engine as built; the time inside ``linear`` calls is measured.
- **stand-ins, caches hot**: every C++ kernel the step calls is replaced, on this Engine only,
  by a stand-in that computes nothing and returns a preallocated tensor of the right shape
  (``rope_inplace`` and ``store_kv`` do nothing). What is left is the step's Python and the
  calls themselves, with every cache warm: nothing streams.
- **stand-ins, caches cold**: the same, except that each matmul's stand-in first reads as many
  bytes as the real weight from a 1.2 GiB buffer it walks through (``x.sum()`` on a slice), as
  the real weights stream through the caches between the calls. The reading is timed and left
  out, so the same Python is measured after the caches were emptied, as in a real step. (The
  reading runs on torch's threads, whose spinning after it is part of what is measured, as the
  kernels' workers spin after a real matmul.)
- **replayed**: what a recorded step would cost (the CPU counterpart of chapter 06's CUDA graph).
  Once, the kernel calls of one decode step's ``model.forward`` are recorded (each with the
  tensors it got); then in every step the model's ``forward`` is replaced, on this Engine only,
  by a loop that makes the same calls back to back and returns the recorded logits. The rest
  of the step (metadata, checks, sampling, the milestone's ``step()``) runs as it is. The
  kernels do the recorded step's work (the same weights, the same key slots), so the time is
  the real one; only the tokens are meaningless. The loop's own Python (one call per kernel)
  is counted: a replay driven from C++ would cost less.

The stand-ins' tokens are meaningless (they are not compared); each configuration gets fresh
requests. "Outside the matmuls" is the step less the time inside ``linear`` calls (the kernel,
or the stand-in and its reading). Medians over the steps of all rounds.

The replayed step shows what removing the model's Python would buy, and what it would not: the
gaps between the matmuls were also time in which memory could work ahead (the hardware's
prefetchers, the workers' read-ahead), so the matmuls back to back take longer than inside a
real step.

    python benchmarks/bench_python_floor.py [--batch 1] [--rounds 3] [--steps 32] [--threads N]
                                            [--no-readme]
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_decode import Engines
from benchmarks.measure import batch_prompts, bench_parser, header, run_and_record

MODES = {"kernels": "the kernels (`cpu_kernels=True`)",
         "hot": "stand-ins, caches hot",
         "cold": "stand-ins, caches cold (each matmul's bytes read, not counted)",
         "replayed": "the kernels, the model's calls replayed back to back (no layer Python)"}


# What each stand-in returns, by kernel name: (key of its preallocated output, its shape from
# the arguments, its dtype); None: the kernel returns nothing (it works in place).
STAND_INS = {
    "rmsnorm": ("norm", lambda x, *a: x.shape, torch.float32),
    "fused_add_rmsnorm": ("norm", lambda x, *a: x.shape, torch.float32),
    "silu_and_mul": ("act", lambda x: (x.shape[0], x.shape[1] // 2), torch.float32),
    "decode_attention": ("attn", lambda q, *a: q.shape, torch.float32),
    "argmax_rows": ("argmax", lambda logits: (logits.shape[0],), torch.int64),
    "rope_inplace": None,
    "store_kv": None,
}


class StandIns:
    """The compiled module seen through this object: ``linear`` timed, and in the stand-in
    modes every kernel of a decode step replaced (anything else goes to the real module)."""

    def __init__(self, real, mode: str, stream: torch.Tensor | None) -> None:
        self.real, self.mode, self.stream, self.pos = real, mode, stream, 0
        self.inside = 0.0  # seconds inside linear calls since the last reset
        self.read = 0.0  # of which reading the stream (cold mode)
        self._outs: dict = {}
        self.recorded: list | None = None  # set: every kernel call goes here as (name, args)
        if mode in ("hot", "cold"):  # made once: a stand-in costs one Python call, no more
            for name, spec in STAND_INS.items():
                setattr(self, name, self._stand_in(spec))

    def _stand_in(self, spec):
        if spec is None:
            return lambda *args: None
        key, shape, dtype = spec
        return lambda *args: self._out(key, shape(*args), dtype)

    def _out(self, key, shape, dtype=torch.float32) -> torch.Tensor:
        t = self._outs.get(key)
        if t is None or tuple(t.shape) != tuple(shape):
            t = self._outs[key] = torch.zeros(shape, dtype=dtype)
        return t

    def __getattr__(self, name):  # not a stand-in (nor linear): the real module's
        f = getattr(self.real, name)
        if self.recorded is None:  # recording only during replay_model's one step
            return f

        def recorded(*args):
            if self.recorded is not None:
                self.recorded.append((name, args))
            return f(*args)
        return recorded

    def linear(self, x, w, bias=None):
        t0 = time.perf_counter()
        try:
            if self.mode in ("kernels", "replayed"):
                if self.recorded is not None:
                    self.recorded.append(("linear", (x, w, bias)))
                return self.real.linear(x, w, bias)
            if self.mode == "cold":
                n = w.numel()
                if self.pos + n > self.stream.numel():
                    self.pos = 0
                r0 = time.perf_counter()
                self.stream[self.pos: self.pos + n].sum()
                self.read += time.perf_counter() - r0
                self.pos += n
            return self._out(("linear", w.shape[0]), (x.shape[0], w.shape[0]))
        finally:
            self.inside += time.perf_counter() - t0


def replay_model(runner, proxy: StandIns, reqs) -> None:
    """Record the kernel calls of one decode step's ``model.forward``; from then on the model's
    ``forward`` (this Engine's only) makes those calls back to back and returns the recorded
    logits (``restore_model`` undoes it)."""
    model = runner.engine.model
    forward = model.forward

    def recording():
        proxy.recorded = []
        try:
            logits = forward()
        finally:
            calls, proxy.recorded = proxy.recorded, None
        if not calls or calls[-1][0] != "linear":
            raise RuntimeError("the replayed mode expects the model's last kernel call to be the "
                               "LM head's linear; run it with cpu_kernels=True on a decoder model")
        plan = [(proxy.linear if n == "linear" else getattr(proxy.real, n), args)
                for n, args in calls]

        def replayed():
            for f, args in plan:
                f(*args)
            return logits  # the LM head's output of the recorded step
        model.forward = replayed
        return logits

    model.forward = recording
    runner.step(reqs, "decode")


def restore_model(runner) -> None:
    vars(runner.engine.model).pop("forward", None)


def timed_steps(runner, proxy: StandIns, batch: int, steps: int,
                warmup: int = 4) -> list[tuple]:
    """(step seconds, seconds outside linear, seconds reading the stream) per decode step."""
    reqs = runner.make_reqs(batch_prompts(batch), steps + warmup + 2)
    runner.step(reqs, "prefill")
    if proxy.mode == "replayed":
        replay_model(runner, proxy, reqs)
    out = []
    for i in range(steps + warmup):
        proxy.inside = proxy.read = 0.0
        t0 = time.perf_counter()
        runner.step(reqs, "decode")
        total = time.perf_counter() - t0
        if i >= warmup:
            out.append((total - proxy.read, total - proxy.inside, proxy.read))
    return out


def run(model_path: Path, rounds: int, steps: int, threads: int | None = None,
        batch: int = 1) -> str:
    from transformers import AutoTokenizer

    from minisgl import kernel

    if kernel.load() is None:
        return f"The kernels could not be built ({kernel.unavailable_reason()}): nothing to measure."
    tok = AutoTokenizer.from_pretrained(model_path)
    engines = Engines(model_path, tok, threads)
    runner = engines.get(True)
    runner.tune_prefetch(batch)  # with the real kernels, before any stand-in or timed step
    engine, real = runner.engine, kernel._MODULE
    stream = torch.ones((1200 << 20) // 4)  # 1.2 GiB: more than twice the weights
    stream.sum()  # touch every page once
    load_before = os.getloadavg()[0]
    res: dict[str, list[tuple]] = {m: [] for m in MODES}
    try:
        for r in range(rounds):
            for mode in (MODES if r % 2 == 0 else list(MODES)[::-1]):
                proxy = StandIns(real, mode, stream)
                kernel._MODULE = engine.attn_backend._module = proxy
                try:
                    res[mode] += timed_steps(runner, proxy, batch, steps)
                finally:
                    kernel._MODULE = engine.attn_backend._module = real
                    restore_model(runner)
        threads = torch.get_num_threads()
    finally:
        engines.close()

    def med(mode, i) -> float:
        return statistics.median(s[i] for s in res[mode]) * 1e3

    lines = [
        (f"{header(model_path, 'float32', threads)}; batch {batch}; medians of {rounds} "
         f"interleaved rounds x {steps} steps; load average before / after {load_before:.1f} / "
         f"{os.getloadavg()[0]:.1f}."),
        "",
        "| the step's kernels | the step (ms) | outside the matmuls (ms) |",
        "|---|---:|---:|",
    ]
    for mode, label in MODES.items():
        lines.append(f"| {label} | {med(mode, 0):.2f} | {med(mode, 1):.2f} |")
    hot, cold, real_rest = med("hot", 1), med("cold", 1), med("kernels", 1)
    step, rstep, rrest = med("kernels", 0), med("replayed", 0), med("replayed", 1)
    lines += ["", (f"The same Python took {cold / hot:.2f}x as long after the caches were "
                   f"emptied as with them warm ({cold:.2f} against {hot:.2f} ms); with the real "
                   f"kernels everything outside the matmuls took {real_rest:.2f} ms."),
              "", (f"With the model's kernel calls replayed back to back, the time outside the "
                   f"matmuls fell from {real_rest:.2f} to {rrest:.2f} ms, and the matmuls took "
                   f"{rstep - rrest:.2f} ms against {step - real_rest:.2f}: the step "
                   f"{rstep:.2f} against {step:.2f} ms ({rstep / step:.2f}x).")]
    return "\n".join(lines)


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--batch", type=int, default=1, help="requests per decode step (default 1)")
    args = ap.parse_args()
    if args.batch < 1:
        ap.error(f"--batch must be at least 1, got {args.batch}")
    run_and_record(args, functools.partial(run, batch=args.batch), "BENCH_PYFLOOR",
                   "The step's Python, hot and cold (`bench_python_floor.py`)")


if __name__ == "__main__":
    main()
