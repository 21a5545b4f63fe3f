"""Where a decode step's time goes, part by part, in both configurations (batch 1, 4, 16).

The step is the milestone's ``step()`` (``measure.run_step``). Each part is timed by wrapping,
on this Engine's objects only, the functions the step calls, so the parts add up to the step:

- **matmuls**: every linear op's ``forward`` (qkv, o, gate_up, down) and the LM head's;
- **norms**, **rope**, **activation**: the ``RMSNormFused`` ops, the rotary op, the MLP's
  activation;
- **attention**: the backend's ``forward`` for each layer; its **store_kv** part (the pool's
  writer, chapter 04) is shown on its own line as well;
- **the layers' Python**: ``model.forward`` less the parts above (each layer's own code: the
  splits and views, the calls from op to op);
- **metadata** (``prepare_metadata``), **sampling** (``sampler.prepare`` + ``sampler.sample``),
  **checks** (``forward_batch``'s checks of the batch), and **the step's Python** (the rest of
  the step: filling the batch, ``forward_batch`` around the model, appending the tokens).

A wrapped call costs about a microsecond more than a plain one: the table gives the step with
and without the wrappers (interleaved), so that cost is visible. Medians over the steps of all
rounds; rounds interleave the two configurations, one Engine at a time.

    python benchmarks/bench_step_parts.py [--rounds 3] [--steps 32] [--threads N] [--no-readme]
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
from benchmarks.bench_decode import CONFIGS, Engines
from benchmarks.measure import (
    batch_prompts,
    bench_parser,
    header,
    run_and_record,
)

BATCHES = (1, 4, 16)
LEAVES = ("matmuls", "norms", "rope", "activation", "attention", "embedding")


class Parts:
    """Seconds per part of the current step, from wrappers put on one Engine's objects."""

    def __init__(self) -> None:
        self.sec: dict[str, float] = defaultdict(float)
        self.on = False
        self._saved: list[tuple] = []  # (object, attribute, what it held, whether its own)

    def wrap(self, label: str, obj, name: str) -> None:
        """Time every call of ``obj.name`` under ``label`` (an instance attribute shadows the
        method for this object only)."""
        f, sec = getattr(obj, name), self.sec
        self._saved.append((obj, name, f, name in vars(obj)))

        def timed(*args, **kwargs):
            if not self.on:
                return f(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                sec[label] += time.perf_counter() - t0

        setattr(obj, name, timed)

    def restore(self) -> None:
        """Take the wrappers off again: the objects are as they were built."""
        for obj, name, f, own in reversed(self._saved):
            if own:
                setattr(obj, name, f)
            else:
                delattr(obj, name)
        self._saved.clear()

    def instrument(self, engine) -> None:
        model = engine.model
        layers = model.model.layers.op_list
        ropes = {}
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            for op in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                self.wrap("matmuls", op, "forward")
            self.wrap("norms", layer.input_layernorm, "forward")
            self.wrap("norms", layer.post_attention_layernorm, "forward")
            self.wrap("activation", mlp, "_act_fn")
            ropes[id(attn.attn.rotary)] = attn.attn.rotary  # layers may share one rotary op
        for rotary in ropes.values():
            self.wrap("rope", rotary, "forward")
        self.wrap("matmuls", model.lm_head, "forward")
        self.wrap("norms", model.model.norm, "forward")
        self.wrap("embedding", model.model.embed_tokens, "forward")
        self.wrap("model.forward", model, "forward")
        self.wrap("attention", engine.attn_backend, "forward")
        self.wrap("store_kv", engine.kv_cache, "store_kv")
        self.wrap("metadata", engine.attn_backend, "prepare_metadata")
        self.wrap("sampling", engine.sampler, "prepare")
        self.wrap("sampling", engine.sampler, "sample")
        self.wrap("checks", engine, "_check_batch")


def step_parts(runner, parts: Parts, batch: int, steps: int, warmup: int = 4) -> list[dict]:
    """Per step: the whole step's seconds ("step") and each part's, with the wrappers on."""
    reqs = runner.make_reqs(batch_prompts(batch), steps + warmup + 1)
    runner.step(reqs, "prefill")
    out = []
    for i in range(steps + warmup):
        parts.sec.clear()
        parts.on = True
        t0 = time.perf_counter()
        runner.step(reqs, "decode")
        total = time.perf_counter() - t0
        parts.on = False
        if i >= warmup:
            out.append({"step": total, **parts.sec})
    return out


def run(model_path: Path, rounds: int, steps: int, threads: int | None = None) -> str:
    from transformers import AutoTokenizer

    from minisgl import kernel

    tok = AutoTokenizer.from_pretrained(model_path)
    why_not = None if kernel.load() is not None else str(kernel.unavailable_reason())
    configs = [False] + ([True] if why_not is None else [])
    engines = Engines(model_path, tok, threads)
    load_before = os.getloadavg()[0]
    timed: dict[tuple, list[dict]] = defaultdict(list)  # (config, batch) -> per-step parts
    plain: dict[tuple, list[float]] = defaultdict(list)  # the same steps without wrappers
    for r in range(rounds):
        for k in (configs if r % 2 == 0 else configs[::-1]):
            runner, parts = engines.get(k), Parts()
            for b in BATCHES:
                plain[k, b] += runner.decode_times(b, steps)
                parts.instrument(engines.engine)
                try:
                    timed[k, b] += step_parts(runner, parts, b, steps)
                finally:
                    parts.restore()
    threads = torch.get_num_threads()
    engines.close()

    def med(k, b, label) -> float:
        return statistics.median(s.get(label, 0.0) for s in timed[k, b]) * 1e3

    def derived(k, b) -> dict[str, float]:
        """Medians of each part, and the two Python remainders, per step."""
        rows = {}
        for s in timed[k, b]:
            layers_py = s.get("model.forward", 0.0) - sum(s.get(x, 0.0) for x in LEAVES)
            step_py = s["step"] - sum(s.get(x, 0.0) for x in
                                      ("model.forward", "metadata", "sampling", "checks"))
            s["the layers' Python"], s["the step's Python"] = layers_py, step_py
        for label in ("step", *LEAVES, "store_kv", "the layers' Python", "metadata",
                      "sampling", "checks", "the step's Python"):
            rows[label] = med(k, b, label)
        return rows

    cols = [(k, b) for b in BATCHES for k in configs]
    vals = {c: derived(*c) for c in cols}
    lines = [
        (f"{header(model_path, 'float32', threads)}; medians of {rounds} interleaved rounds x "
         f"{steps} steps "
         f"(short prompts: 6 to {steps + 10} tokens of context); load average before / after "
         f"{load_before:.1f} / {os.getloadavg()[0]:.1f}."),
        "",
        ("ms per decode step, each part's median (so the parts need not add up to the step's "
         "median exactly):"),
        "",
        "| part | " + " | ".join(f"{CONFIGS[k].split(' (')[0]}, batch {b}" for k, b in cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    labels = {"step": "**the step, with the wrappers**", "store_kv": "  of which store_kv"}
    for label in vals[cols[0]]:
        cells = []
        for c in cols:
            v, step = vals[c][label], vals[c]["step"]
            cells.append(f"{v:.2f}" if label == "step" else f"{v:.2f} ({100 * v / step:.0f}%)")
        lines.append(f"| {labels.get(label, label)} | " + " | ".join(cells) + " |")
    lines.append("| the step without the wrappers | " + " | ".join(
        f"{statistics.median(plain[c]) * 1e3:.2f}" for c in cols) + " |")
    if why_not:
        lines += ["", f"The kernels could not be built ({why_not}): one configuration only."]
    ratios = "; ".join(
        f"{CONFIGS[c]}: " + ", ".join(
            f"batch {b} {statistics.median(plain[c, b]) / statistics.median(plain[c, 1]):.2f}x"
            for b in BATCHES[1:]) for c in configs)
    lines += ["", f"Each batch's step against batch 1's (without the wrappers): {ratios}."]
    k = configs[-1]
    rest = vals[k, 1]["step"] - vals[k, 1]["matmuls"]
    lines += ["", (f"At batch 1, {CONFIGS[k]}: everything but the matmuls takes {rest:.2f} ms "
                   "of the step (with the wrappers' cost).")]
    return "\n".join(lines)


def main() -> None:
    run_and_record(bench_parser(__doc__).parse_args(), run, "BENCH_PARTS",
                   "Where a decode step's time goes (`bench_step_parts.py`)")


if __name__ == "__main__":
    main()
