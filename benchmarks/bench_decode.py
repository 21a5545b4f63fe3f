"""Decode-step benchmark: minisgl's two implementations side by side, step 0, HF, the roofline.

An Engine runs either the chapters' torch code (``EngineConfig(cpu_kernels=False)``, the
default: "your code") or chapter 07's fused C++ kernels (``cpu_kernels=True``). Both are measured
at batch 1, 2, 4, 8 and 16 in one process, beside step 0, HF ``transformers`` and the roofline,
with the same prompts and thread count, interleaved round by round (so drift of the machine
cannot favour one side). One Engine lives at a time; it is rebuilt when a job needs the other
configuration. Medians, absolute times and ratios; the table goes to stdout and into
benchmarks/README.md (between the BENCH_DECODE markers). When the kernels cannot be built, their
rows say why and the rest still runs.

    python benchmarks/bench_decode.py [--model models/SmolLM2-135M-Instruct] [--rounds 3]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.measure import (
    PROMPTS,
    MinisglRunner,
    ReadPass,
    bench_parser,
    header,
    hf_decode_times,
    hf_generate_tokens_per_s,
    huge_pages_line,
    interleave,
    median_ms,
    run_and_record,
    step0_decode_times,
    weight_bytes,
)

BATCHES = (1, 2, 4, 8, 16)
CONFIGS = {False: "your code (`cpu_kernels=False`)", True: "fused kernels (`cpu_kernels=True`)"}
LOAD_BEFORE = os.getloadavg()[0]


class Engines:
    """One Engine at a time (one per process), with ``cpu_kernels`` as a job asks; rebuilt only
    when the next job wants the other configuration."""

    def __init__(self, model_path: Path, tok, threads: int | None) -> None:
        self.model_path, self.tok, self.threads = model_path, tok, threads
        self.engine, self.kernels, self.runner = None, None, None

    def get(self, kernels: bool) -> MinisglRunner:
        from minisgl.distributed import DistributedInfo
        from minisgl.engine import Engine, EngineConfig

        if self.kernels is not kernels:
            self.close()
            self.engine = Engine(EngineConfig(
                model_path=str(self.model_path), tp_info=DistributedInfo(0, 1),
                dtype=torch.float32, max_running_req=max(BATCHES),
                num_page_override=max(BATCHES) * 256, max_seq_len_override=256,
                cpu_kernels=kernels, num_threads=self.threads))
            if kernels and self.engine.config.attention_backend != "cpp":
                raise RuntimeError("cpu_kernels=True but the Engine runs the torch code")
            self.kernels, self.runner = kernels, MinisglRunner(self.engine, self.tok)
        return self.runner

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        self.engine, self.kernels, self.runner = None, None, None


def run(model_path: Path, rounds: int, steps: int, threads: int | None = None) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from minisgl import kernel, step0

    if threads:  # HF and step 0 too (the Engine sets this while it lives, and restores it)
        torch.set_num_threads(threads)

    tok = AutoTokenizer.from_pretrained(model_path)
    why_not = None if kernel.load() is not None else str(kernel.unavailable_reason())
    configs = [False] + ([True] if why_not is None else [])
    engines = Engines(model_path, tok, threads)
    engines.get(configs[-1])
    pages = huge_pages_line(engines.engine) if True in configs else None
    threads = torch.get_num_threads()
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    s0 = step0.load_model(model_path)
    prompt = PROMPTS[0]

    reader = ReadPass()  # the roofline's bandwidth, measured in every round with the rest
    wbytes = weight_bytes(model_path)

    keys = [(k, b) for k in configs[::-1] for b in BATCHES]  # the Engine just built first
    jobs = [lambda k=k, b=b: engines.get(k).decode_times(b, steps) for k, b in keys]
    jobs += [lambda: hf_decode_times(hf, tok, prompt, steps),
             lambda: step0_decode_times(model_path, tok, prompt, steps, model=s0),
             reader.times]

    samples = interleave(rounds, *jobs)
    engines.close()
    load_after = os.getloadavg()[0]
    ms = {key: median_ms(s) for key, s in zip(keys, samples)}
    hf_ms, s0_ms = median_ms(samples[-3]), median_ms(samples[-2])
    bw = reader.bandwidth(samples[-1])
    roof = wbytes / bw
    hf_gen = hf_generate_tokens_per_s(hf, tok, PROMPTS, n=16)
    roof_ms = roof * 1e3

    lines = [
        (f"{header(model_path, 'float32', threads)}; medians of "
         f"{rounds} interleaved rounds x {steps} steps; load average before / after the run "
         f"{LOAD_BEFORE:.1f} / {load_after:.1f} (well above 0, other processes shared the cores "
         "and disturbed the numbers)."),
        "",
        (f"Weights {wbytes / 1e6:.0f} MB (tied embeddings once); read bandwidth "
         f"{bw / 1e9:.1f} GB/s (`x.sum()` over 1 GiB, interleaved with the rounds) -> roofline "
         f"{roof_ms:.1f} ms per decode step."
         + (f" Fused kernels: {pages}." if pages else "")),
        "",
    ]
    lines += [
        "| what | ms per step | tokens per step | tokens/s | vs HF per token | vs roofline |",
        "|---|---:|---:|---:|---:|---:|",
    ]

    def row(what: str, t: float, n: int) -> str:
        return (f"| {what} | {t:.1f} | {n} | {n * 1e3 / t:.1f} | {t / hf_ms:.2f}x | "
                f"{t / roof_ms:.2f}x |")

    lines += [row("roofline (weights / read bandwidth)", roof_ms, 1),
              row("step 0 (naive skeleton)", s0_ms, 1),
              row("HF transformers, per token with its cache", hf_ms, 1),
              (f"| HF `generate`, 4 prompts, left padding, 16 tokens | {4e3 / hf_gen:.1f} | 4 | "
               f"{hf_gen:.1f} | - | - |")]
    for k in configs:
        lines += [row(f"minisgl, {CONFIGS[k]}, batch {b}", ms[k, b], b) for b in BATCHES]
    if why_not:
        lines.append(f"| minisgl, {CONFIGS[True]} | not measured: the kernels could not be built "
                     f"({why_not}) | - | - | - | - |")

    lines += ["", "Side by side (ms per decode step; tokens/s in brackets):", ""]
    head = "| batch | " + " | ".join(f"minisgl, {CONFIGS[k]}" for k in configs)
    lines += [head + (" | kernels vs your code |" if True in configs else " |"),
              "|---:|" + "---:|" * (len(configs) + (True in configs))]
    for b in BATCHES:
        cells = [f"{ms[k, b]:.1f} ({b * 1e3 / ms[k, b]:.0f})" for k in configs]
        if True in configs:
            r = ms[False, b] / ms[True, b]
            cells.append(f"{r:.2f}x faster" if r >= 1 else f"{1 / r:.2f}x slower")
        lines.append(f"| {b} | " + " | ".join(cells) + " |")

    lines += ["", "Targets (issue: milestone) and where this run stands, for each configuration:",
              ""]
    for k in configs:
        one, b4 = ms[k, 1], ms[k, 4]
        lines.append(
            f"- {CONFIGS[k]}: single step vs HF per token {one / hf_ms:.2f}x (target <= 0.85x, "
            f"stretch <= 0.8x); vs step 0 {one / s0_ms:.2f}x (target <= 1.05x); vs roofline "
            f"{one / roof_ms:.2f}x (stretch <= 1.2x); batch-4 throughput vs HF `generate` "
            f"{(4e3 / b4) / hf_gen:.2f}x (target >= 1.5x); batch-4 step vs single step "
            f"{b4 / one:.2f}x (stretch <= 1.3x)")
    return "\n".join(lines)


def main() -> None:
    run_and_record(bench_parser(__doc__).parse_args(), run, "BENCH_DECODE",
                   "Decode step (`bench_decode.py`)")


if __name__ == "__main__":
    main()
