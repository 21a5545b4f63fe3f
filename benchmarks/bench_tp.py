"""Tensor-parallel decode step on the CPU: tp=2 (two processes, one thread each) against tp=1.

A random Llama-shaped model large enough for the matmuls to dominate a decode step (hidden 1024,
16 query / 8 KV heads, 8 layers, MLP 4096, vocabulary 32768: ~190M parameters, 0.76 GB in
float32), built with ``EngineConfig(use_dummy_weight=True)`` from a config.json in a temporary
folder. Contenders, all with a batch of 4 decode requests:

- tp=1, 1 thread: the whole model, one core;
- tp=1, 2 threads: the whole model, both cores inside each matmul;
- tp=2, 1 thread per rank: half of every weight per process, plus 2 all-reduces per layer and
  the LM head's all-gather over gloo (loopback TCP).

Each round measures every contender (tp=2 in a fresh pair of processes), so that drift of a
shared machine cannot favour one; medians over all rounds. Writes the table to stdout and into
benchmarks/README.md (between the BENCH_TP markers).

    python benchmarks/bench_tp.py [--rounds 3] [--steps 32]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from tp_milestone import MAX_LEN, engine_config, launch  # noqa: E402

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.measure import machine_line, median_ms, update_readme

BATCH = 4
CONFIG = {  # a Llama-architecture config; only the shapes matter (the weights are random)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
    "num_attention_heads": 16, "num_key_value_heads": 8, "num_hidden_layers": 8,
    "intermediate_size": 4096, "vocab_size": 32768, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "hidden_act": "silu", "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}


def write_model(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG, indent=2))
    return folder


def decode_times(engine, steps: int, warmup: int = 4) -> list[float]:
    """Per-step seconds of ``steps`` decode steps of BATCH requests (after a prefill)."""
    from minisgl.core import Req, SamplingParams

    from benchmarks.measure import run_step

    gen, n, width = torch.Generator().manual_seed(0), steps + warmup + 1, MAX_LEN
    reqs = []
    for row in range(BATCH):
        engine.page_table[row, :width] = torch.arange(row * width, (row + 1) * width)
        reqs.append(Req(input_ids=torch.randint(3, CONFIG["vocab_size"], (8 + row,),
                                                generator=gen, dtype=torch.int32),
                        table_idx=row, cached_len=0, output_len=n, uid=row, cache_handle=None,
                        sampling_params=SamplingParams(max_tokens=n)))
    run_step(engine, reqs, "prefill")
    times = []
    for i in range(steps + warmup):
        t0 = time.perf_counter()
        run_step(engine, reqs, "decode")
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def tp_rank(rank: int, tp_size: int, model: str, steps: int) -> list[float]:
    """One rank of the tp=2 contender: its Engine (random weights), then timed decode steps."""
    from minisgl.engine import Engine
    engine = Engine(engine_config(model, rank, tp_size, n_reqs=BATCH, use_dummy_weight=True))
    try:
        return decode_times(engine, steps)
    finally:
        engine.shutdown()


def run(rounds: int, steps: int) -> str:
    from minisgl.engine import Engine

    with tempfile.TemporaryDirectory(prefix="minisgl-bench-tp-") as tmp:
        model = str(write_model(Path(tmp) / "random-llama"))
        load = os.getloadavg()
        engine = Engine(engine_config(model, 0, 1, n_reqs=BATCH, use_dummy_weight=True))
        params = sum(t.numel() for t in engine.model.state_dict().values())
        samples: dict[str, list[float]] = {"tp1_t1": [], "tp1_t2": [], "tp2": []}
        try:
            for r in range(rounds):
                torch.set_num_threads(1)
                samples["tp1_t1"] += decode_times(engine, steps)
                torch.set_num_threads(2)
                samples["tp1_t2"] += decode_times(engine, steps)
                torch.set_num_threads(1)  # the parent waits while the two ranks run
                samples["tp2"] += launch(tp_rank, 2, (model, steps), timeout=600)[0]
                print(f"round {r + 1}/{rounds} done", file=sys.stderr)
        finally:
            engine.shutdown()
    ms = {k: median_ms(v) for k, v in samples.items()}
    base = ms["tp1_t1"]
    rows = [("tp=1, 1 thread", ms["tp1_t1"], 1),
            ("tp=1, 2 threads", ms["tp1_t2"], 2),
            ("tp=2, 1 thread per rank (2 processes, gloo)", ms["tp2"], 2)]
    lines = [
        (f"Random Llama-shaped model (hidden 1024, 16/8 heads, 8 layers, MLP 4096, vocab 32768; "
         f"{params / 1e6:.0f}M parameters, {params * 4 / 1e9:.2f} GB float32), batch of "
         f"{BATCH} decode requests; {machine_line()}; {datetime.date.today()}; medians of "
         f"{rounds} interleaved rounds x {steps} steps."),
        "",
        "| what | cores used | ms per decode step | vs tp=1, 1 thread | vs tp=1, 2 threads |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, t, cores in rows:
        lines.append(f"| {name} | {cores} | {t:.1f} | {t / base:.2f}x | "
                     f"{t / ms['tp1_t2']:.2f}x |")
    n_coll = 2 * CONFIG["num_hidden_layers"] + 2
    lines += [
        "",
        (f"Load average before / after: {load[0]:.1f} / {os.getloadavg()[0]:.1f} (other work "
         "on the machine slows the two-core contenders most)."),
        "",
        (f"What it shows: tp=2 takes {ms['tp2'] / base:.2f}x the time of tp=1 on one core and "
         f"{ms['tp2'] / ms['tp1_t2']:.2f}x that of tp=1 with two threads. Each rank multiplies "
         "by half of every weight, so with two idle cores the ideal is 0.5x the one-thread step; "
         f"what tp=2 adds is {n_coll} collectives per step (an all-reduce after o_proj and "
         "down_proj in every layer, one after the embedding, the LM head's all-gather) over "
         "loopback TCP, and both ranks share one memory bus."),
    ]
    if ms["tp2"] < ms["tp1_t2"]:
        lines[-1] += (" Here tp=2 beat two threads in one process: at every matmul the two "
                      "threads wait for each other, so on a busy machine one descheduled thread "
                      "holds up both, while two single-threaded ranks only meet at the collectives.")
    else:
        lines[-1] += (" Two threads in one process split the same matmuls with no copies and no "
                      "messages, so on one machine tensor parallelism buys nothing; it is for "
                      "models that do not fit one device, with a device (and its memory "
                      "bandwidth) per rank.")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--no-readme", action="store_true", help="print only")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    table = run(args.rounds, args.steps)
    print(table)
    if not args.no_readme:
        update_readme("BENCH_TP", "Tensor parallelism on the CPU (`bench_tp.py`)", table)


if __name__ == "__main__":
    from benchmarks.bench_tp import main as _main  # so that spawn finds tp_rank by module name

    _main()
