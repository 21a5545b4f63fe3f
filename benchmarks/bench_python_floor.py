"""The step's Python with hot and with cold caches: why the rest of a kernels' step is not 0.6 ms.

At batch 1 with ``cpu_kernels=True`` a decode step spends about 2.5 ms outside its 121 matmuls
(``bench_step_parts.py``): norms, rope, attention, sampling, and the Python around them (the
layers' ops and views, metadata, checks, the milestone's ``step()``). This benchmark separates
that Python from the kernels' own work. One Engine, the milestone's step at batch 1, three ways,
interleaved round by round:

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

The stand-ins' tokens are meaningless (they are not compared); each configuration gets fresh
requests. "Outside the matmuls" is the step less the time inside ``linear`` calls (the kernel,
or the stand-in and its reading). Medians over the steps of all rounds.

    python benchmarks/bench_python_floor.py [--rounds 3] [--steps 32] [--threads N] [--no-readme]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_decode import Engines
from benchmarks.measure import PROMPTS, bench_parser, header, run_and_record

MODES = {"kernels": "the kernels (`cpu_kernels=True`)",
         "hot": "stand-ins, caches hot",
         "cold": "stand-ins, caches cold (each matmul's bytes read, not counted)"}


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
        if mode != "kernels":  # made once: a stand-in costs one Python call, as little as can be
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
        return getattr(self.real, name)

    def linear(self, x, w, bias=None):
        t0 = time.perf_counter()
        try:
            if self.mode == "kernels":
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


def timed_steps(runner, proxy: StandIns, steps: int, warmup: int = 4) -> list[tuple]:
    """(step seconds, seconds outside linear, seconds reading the stream) per decode step."""
    reqs = runner.make_reqs([PROMPTS[0]], steps + warmup + 1)
    runner.step(reqs, "prefill")
    out = []
    for i in range(steps + warmup):
        proxy.inside = proxy.read = 0.0
        t0 = time.perf_counter()
        runner.step(reqs, "decode")
        total = time.perf_counter() - t0
        if i >= warmup:
            out.append((total - proxy.read, total - proxy.inside, proxy.read))
    return out


def run(model_path: Path, rounds: int, steps: int, threads: int | None = None) -> str:
    from transformers import AutoTokenizer

    from minisgl import kernel

    if kernel.load() is None:
        return f"The kernels could not be built ({kernel.unavailable_reason()}): nothing to measure."
    tok = AutoTokenizer.from_pretrained(model_path)
    engines = Engines(model_path, tok, threads)
    runner = engines.get(True)
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
                    res[mode] += timed_steps(runner, proxy, steps)
                finally:
                    kernel._MODULE = engine.attn_backend._module = real
        threads = torch.get_num_threads()
    finally:
        engines.close()

    def med(mode, i) -> float:
        return statistics.median(s[i] for s in res[mode]) * 1e3

    lines = [
        (f"{header(model_path, 'float32', threads)}; batch 1; medians of {rounds} interleaved "
         f"rounds x {steps} steps; load average before / after {load_before:.1f} / "
         f"{os.getloadavg()[0]:.1f}."),
        "",
        "| the step's kernels | the step (ms) | outside the matmuls (ms) |",
        "|---|---:|---:|",
    ]
    for mode, label in MODES.items():
        lines.append(f"| {label} | {med(mode, 0):.2f} | {med(mode, 1):.2f} |")
    hot, cold, real_rest = med("hot", 1), med("cold", 1), med("kernels", 1)
    lines += ["", (f"The same Python took {cold / hot:.2f}x as long after the caches were "
                   f"emptied as with them warm ({cold:.2f} against {hot:.2f} ms); with the real "
                   f"kernels everything outside the matmuls took {real_rest:.2f} ms.")]
    return "\n".join(lines)


def main() -> None:
    run_and_record(bench_parser(__doc__).parse_args(), run, "BENCH_PYFLOOR",
                   "The step's Python, hot and cold (`bench_python_floor.py`)")


if __name__ == "__main__":
    main()
