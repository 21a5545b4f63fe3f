"""GPU check: the decode step of SmolLM2 in bfloat16 on an NVIDIA GPU, beside HF and the roofline.

Meant for a session that is lent a GPU (run by benchmarks/gpu_check.sh, which runs the GPU tests
first). Works from the working tree (``PYTHONPATH=.``, nothing installed) with torch >= 2.4 and
transformers 5; writes Markdown to stdout.

    PYTHONPATH=. python3 benchmarks/gpu_check.py bench [--model DIR] [--device cuda] [--dry-run]
    PYTHONPATH=. python3 benchmarks/gpu_check.py standin --out DIR

- decode step: wall time of one whole step of a decode batch (the batch's fields filled on the
  CPU, ``prepare_metadata``, ``sampler.prepare``, ``forward_batch``, which samples and copies
  the tokens back), median over ``--steps`` steps after a warm-up; with CUDA graphs (the default
  Engine) and without;
- HF: ``generate`` in bfloat16 on the same device, greedy, batch of equal prompts; per step =
  (time for 1 + steps new tokens - time for 1 new token) / steps;
- roofline: the bytes of the weights as the Engine holds them (bfloat16, tied embedding once)
  divided by the device's measured read bandwidth (a large ``x.sum()``): no decode step can read
  its weights faster. (KV-cache reads are small here and not counted.)

``standin`` writes a seeded random checkpoint with SmolLM2-135M's exact shapes (config below):
the GPU machine has no network and the real model (0.5 GB) is too large to carry there. Its
timings are the real model's (same shapes, same bytes); its tokens mean nothing.

``--dry-run --device cpu`` exercises every code path on the CPU with tiny sizes
(``models/tiny-llama`` unless ``--model`` says otherwise).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# SmolLM2-135M-Instruct's config.json (models/SmolLM2-135M-Instruct), for the stand-in
SMOLLM2_CONFIG = {
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "tie_word_embeddings": True, "initializer_range": 0.02, "attention_bias": False,
    "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}}
# SmolLM2's tokenizer on the benchmarks' prompts (benchmarks/measure.py PROMPTS)
PROMPT_IDS = [[504, 3575, 282, 4649, 314], [6106, 1296, 9552, 2966, 42],
              [1604, 3987, 46477, 24, 94, 727], [6403, 1980, 253, 655, 28]]
MAX_LEN = 256  # page-table entries per request

from benchmarks.measure import run_step


def make_standin(out: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    if (out / "config.json").exists():
        print(f"stand-in already at {out}")
        return
    torch.manual_seed(0)
    cfg = LlamaConfig(**SMOLLM2_CONFIG)
    cfg.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(cfg).float().eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    (out / "STANDIN.txt").write_text("Seeded random weights with SmolLM2-135M-Instruct's shapes "
                                     "(benchmarks/gpu_check.py standin).\n")
    print(f"wrote a random stand-in of SmolLM2's shape to {out}")


# ----------------------------------------------------------------------------- measurements
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_bandwidth(device: torch.device, nbytes: int, repeats: int = 9) -> float:
    """Bytes per second of a read-only pass (``x.sum()``) over ``nbytes`` of float32."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    x.sum()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        x.sum()
        sync(device)
        times.append(time.perf_counter() - t0)
    del x
    return nbytes / statistics.median(times)


def engine_weight_bytes(engine) -> int:
    tensors = {id(t): t for t in engine.model.state_dict().values()}.values()
    return sum(t.numel() * t.element_size() for t in tensors)


def build_engine(model: Path, device: str, dtype, max_bs: int, graphs: bool):
    from minisgl.distributed import DistributedInfo
    from minisgl.engine import Engine, EngineConfig

    return Engine(EngineConfig(
        model_path=str(model), tp_info=DistributedInfo(0, 1), dtype=dtype,
        max_running_req=max_bs, device=device, attention_backend="auto",
        cuda_graph_max_bs=max_bs if graphs else 0, max_seq_len_override=MAX_LEN,
        num_page_override=max_bs * MAX_LEN))


def minisgl_step_times(engine, batch_size: int, steps: int, warmup: int) -> list[float]:
    from minisgl.core import Req, SamplingParams

    reqs = []
    for row in range(batch_size):
        engine.page_table[row, :MAX_LEN] = torch.arange(row * MAX_LEN, (row + 1) * MAX_LEN)
        ids = torch.tensor(PROMPT_IDS[row % len(PROMPT_IDS)], dtype=torch.int32)
        reqs.append(Req(input_ids=ids, table_idx=row, cached_len=0, output_len=steps + warmup + 1,
                        uid=row, sampling_params=SamplingParams(ignore_eos=True)))
    run_step(engine, reqs, "prefill")
    times = []
    for i in range(steps + warmup):
        t0 = time.perf_counter()
        run_step(engine, reqs, "decode")  # forward_batch returns with the tokens on the CPU: synced
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def hf_step_time(hf, device: torch.device, batch_size: int, steps: int) -> float:
    ids = torch.tensor([PROMPT_IDS[0]] * batch_size, device=device)
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=0)
        sync(device)
        return time.perf_counter() - t0

    run(2)  # warm-up
    short = statistics.median(run(1) for _ in range(3))
    long = statistics.median(run(1 + steps) for _ in range(3))
    return max(long - short, 0.0) / steps


def versions() -> str:
    import transformers

    try:
        import flashinfer

        fi = getattr(flashinfer, "__version__", "installed")
    except ImportError:
        fi = "not installed"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (f"{gpu}; Python {platform.python_version()}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, FlashInfer {fi}")


def bench(args) -> None:
    from transformers import AutoModelForCausalLM

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu --dry-run for a dry run")
    model = Path(args.model or (ROOT / "models" / ("tiny-llama" if args.dry_run else
                                                   "SmolLM2-135M-Instruct")))
    if not (model / "config.json").exists():
        raise SystemExit(f"{model} is missing: `python3 benchmarks/gpu_check.py standin --out "
                         f"{model}` builds a stand-in of SmolLM2's shape")
    batches = (1, 2) if args.dry_run else (1, 4, 16, 64)
    steps, warmup = (2, 1) if args.dry_run else (args.steps, 4)
    nbytes = (16 << 20) if args.dry_run else (2 << 30)
    dtype = torch.bfloat16
    max_bs = max(batches)

    t_start = time.perf_counter()
    bw = read_bandwidth(device, nbytes)
    results = {}
    for graphs in (True, False):
        engine = build_engine(model, args.device, dtype, max_bs, graphs)
        try:
            backend = engine.config.attention_backend
            wbytes = engine_weight_bytes(engine)
            captured = sorted(engine.graph_runner.graph_map)
            for b in batches:
                results[graphs, b] = statistics.median(
                    minisgl_step_times(engine, b, steps, warmup))
        finally:
            engine.shutdown()
        if graphs:
            graph_note = f"CUDA graphs captured for batch sizes {captured}" if captured else \
                "no CUDA graphs (CPU)"
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval().to(device)
    hf_times = {b: hf_step_time(hf, device, b, steps) for b in batches}
    del hf
    roof = wbytes / bw

    standin = (model / "STANDIN.txt").exists()
    dry = f" (DRY RUN on {args.device}: tiny sizes, numbers mean nothing)" if args.dry_run else ""
    print(f"## GPU check: decode step, bfloat16{dry}\n")
    print(f"- machine: {versions()}")
    print(f"- model: `{model}`" + (" (random stand-in with SmolLM2's shapes: timings hold, "
                                   "tokens do not)" if standin else ""))
    print(f"- minisgl: attention backend `{backend}`, {graph_note}; page size 1, "
          f"{MAX_LEN}-token page-table rows")
    print(f"- weights as held: {wbytes / 1e6:.1f} MB; read bandwidth of `x.sum()` over "
          f"{nbytes >> 20} MiB: {bw / 1e9:.0f} GB/s; roofline {roof * 1e3:.3f} ms per step")
    print(f"- medians of {steps} steps after {warmup} warm-up steps; HF: `generate`, same dtype "
          "and device, batch of equal prompts\n")
    print("| batch | minisgl, graphs (ms) | minisgl, eager (ms) | HF generate (ms/step) | "
          "tokens/s (graphs) | graphs vs roofline | HF / minisgl graphs |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for b in batches:
        g, e, h = results[True, b], results[False, b], hf_times[b]
        print(f"| {b} | {g * 1e3:.3f} | {e * 1e3:.3f} | {h * 1e3:.3f} | {b / g:.0f} | "
              f"{g / roof:.2f}x | {h / g:.2f}x |")
    print(f"\n(total {time.perf_counter() - t_start:.0f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="measure the decode step (Markdown to stdout)")
    b.add_argument("--model", default=None)
    b.add_argument("--device", default="cuda")
    b.add_argument("--steps", type=int, default=32)
    b.add_argument("--dry-run", action="store_true", help="tiny sizes: exercise the code paths")
    s = sub.add_parser("standin", help="write a random checkpoint with SmolLM2's shapes")
    s.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if args.cmd == "standin":
        make_standin(Path(args.out))
    else:
        bench(args)


if __name__ == "__main__":
    main()
