"""Decode-step benchmark: step 0, minisgl at batch 1..16, HF transformers, and the roofline.

One process, one model, the same prompts, the same thread count, measured side by side and
interleaved (so drift of the machine cannot favour one side); medians, absolute times and ratios.
Writes the table to stdout and into benchmarks/README.md (between the BENCH_DECODE markers).

    python benchmarks/bench_decode.py [--model models/SmolLM2-135M-Instruct] [--rounds 3]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.measure import (  # noqa: E402
    PROMPTS,
    ROOT,
    MinisglRunner,
    hf_decode_times,
    hf_generate_tokens_per_s,
    interleave,
    median_ms,
    read_bandwidth,
    step0_decode_times,
    update_readme,
    weight_bytes,
)

BATCHES = (1, 2, 4, 8, 16)
TORCH_OPS_BATCHES = (1, 4)  # also measured with the kernels switched off
LOAD_BEFORE = os.getloadavg()[0]


def run(model_path: Path, rounds: int, steps: int) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from minisgl import kernel, step0
    from minisgl.distributed import DistributedInfo
    from minisgl.engine import Engine, EngineConfig

    tok = AutoTokenizer.from_pretrained(model_path)

    class Engines:
        """One Engine at a time (one per process): the default one (chapter 07's kernels) or one
        with ``cpu_kernels=False`` (every layer on its torch code, the weights in the layout
        F.linear gets then, the LM head's oneDNN copy), rebuilt whenever a job wants the other."""

        def __init__(self) -> None:
            self.engine, self.mode, self.runner = None, None, None

        def get(self, kernels: bool) -> MinisglRunner:
            if self.mode is not kernels:
                self.close()
                self.engine = Engine(EngineConfig(
                    model_path=str(model_path), tp_info=DistributedInfo(0, 1),
                    dtype=torch.float32, max_running_req=max(BATCHES),
                    num_page_override=max(BATCHES) * 256, max_seq_len_override=256,
                    cpu_kernels=None if kernels else False))
                self.mode, self.runner = kernels, MinisglRunner(self.engine, tok)
            return self.runner

        def close(self) -> None:
            if self.engine is not None:
                self.engine.shutdown()
            self.engine, self.mode, self.runner = None, None, None

    engines = Engines()
    engines.get(True)
    threads = torch.get_num_threads()
    kernels = kernel.enabled()  # the Engine's default: chapter 07's fused C++ kernels
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    s0 = step0.load_model(model_path)
    prompt = PROMPTS[0]

    bw = read_bandwidth()
    wbytes = weight_bytes(model_path)
    roof = wbytes / bw

    jobs = [lambda b=b: engines.get(True).decode_times(b, steps) for b in BATCHES]
    jobs += [lambda b=b: engines.get(False).decode_times(b, steps)
             for b in TORCH_OPS_BATCHES if kernels]
    jobs += [lambda: hf_decode_times(hf, tok, prompt, steps),
             lambda: step0_decode_times(model_path, tok, prompt, steps, model=s0)]
    samples = interleave(rounds, *jobs)
    engines.close()
    ms = {f"minisgl b{b}": median_ms(s) for b, s in zip(BATCHES, samples)}
    if kernels:
        ms.update({f"torch ops b{b}": median_ms(s)
                   for b, s in zip(TORCH_OPS_BATCHES, samples[len(BATCHES):])})
    hf_ms, s0_ms = median_ms(samples[-2]), median_ms(samples[-1])
    hf_gen = hf_generate_tokens_per_s(hf, tok, PROMPTS, n=16)

    one = ms["minisgl b1"]
    rows = [
        ("roofline (weights / read bandwidth)", roof * 1e3, 1, None),
        ("step 0 (naive skeleton)", s0_ms, 1, None),
        ("HF transformers, per token with its cache", hf_ms, 1, None),
    ] + [(f"minisgl, batch {b}", ms[f"minisgl b{b}"], b, None) for b in BATCHES]
    rows += [(f"minisgl, batch {b}, torch ops (`cpu_kernels=False`)", ms[f"torch ops b{b}"], b,
              None) for b in TORCH_OPS_BATCHES if kernels]
    lines = [
        f"Model `{model_path.relative_to(ROOT) if model_path.is_relative_to(ROOT) else model_path}`"
        f", float32, {threads} threads, {platform.processor() or platform.machine()}, torch "
        f"{torch.__version__}; fused C++ kernels "
        f"{'on' if kernels else 'unavailable: ' + str(kernel.unavailable_reason())}; "
        f"{datetime.date.today()}; medians of {rounds} interleaved rounds "
        f"x {steps} steps; load average before the run {LOAD_BEFORE:.1f} (anything above ~0.5 "
        "means other processes shared the 2 cores and disturbed the numbers).",
        "",
        f"Weights {wbytes / 1e6:.0f} MB (tied embeddings once); read bandwidth "
        f"{bw / 1e9:.1f} GB/s -> roofline {roof * 1e3:.1f} ms per decode step.",
        "",
        "| what | ms per step | tokens per step | tokens/s | vs minisgl b1 step | vs HF per token |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, t, n, _ in rows:
        lines.append(f"| {name} | {t:.1f} | {n} | {n * 1e3 / t:.1f} | {t / one:.2f}x | "
                     f"{t / hf_ms:.2f}x |")
    lines.append(f"| HF `generate`, 4 prompts, left padding, 16 tokens | "
                 f"{4 * 1e3 / hf_gen:.1f} | 4 | {hf_gen:.1f} | - | - |")
    b4 = ms["minisgl b4"]
    lines += [
        "",
        "Targets (issue: milestone) and where this run stands:",
        "",
        f"- single decode step vs HF per token: {one / hf_ms:.2f}x (target <= 0.85x, stretch "
        "<= 0.8x)",
        f"- single decode step vs step 0: {one / s0_ms:.2f}x (target <= 1.05x)",
        f"- single decode step vs roofline: {one / (roof * 1e3):.2f}x (stretch <= 1.2x)",
        f"- batch-4 throughput vs HF batched generate: {(4e3 / b4) / hf_gen:.2f}x (target >= 1.5x)",
        f"- batch-4 step vs single step: {b4 / one:.2f}x (stretch <= 1.3x; the chapter text "
        "reports 1.63x)",
    ]
    if kernels:
        lines.append("- the fused kernels against an Engine with `cpu_kernels=False` (interleaved): "
                     + ", ".join(
            f"batch {b} {ms[f'torch ops b{b}'] / ms[f'minisgl b{b}']:.2f}x faster"
            for b in TORCH_OPS_BATCHES))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--no-readme", action="store_true", help="print only")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    table = run(Path(args.model).resolve(), args.rounds, args.steps)
    print(table)
    if not args.no_readme:
        update_readme("BENCH_DECODE", "Decode step (`bench_decode.py`)", table)


if __name__ == "__main__":
    main()
