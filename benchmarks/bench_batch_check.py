"""What the Engine's batch-boundary check costs per step (issue 24: batch fields consistent with
their requests, cheap enough for every step), side by side with the decode step it guards.

    python benchmarks/bench_batch_check.py [--threads N]

SmolLM2-135M, float32, the milestone's prompts: after a prefill, for decode batches of 1, 4 and
16 requests, the median time of ``Engine._check_batch`` on the step's filled batch (the check
``forward_batch`` runs first) and of a whole decode step (``measure.run_step``), interleaved,
and their ratio. Prints the CPU and the table.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.measure import MinisglRunner, bench_parser, machine_line  # noqa: E402


def main() -> int:
    args = bench_parser(__doc__).parse_args()
    from transformers import AutoTokenizer

    from minisgl.core import Batch
    from minisgl.distributed import DistributedInfo
    from minisgl.engine import Engine, EngineConfig

    model = Path(args.model)
    engine = Engine(EngineConfig(model_path=str(model), tp_info=DistributedInfo(0, 1),
                                 dtype=torch.float32, max_running_req=16, num_page_override=16 * 64,
                                 max_seq_len_override=64, num_threads=args.threads))
    runner = MinisglRunner(engine, AutoTokenizer.from_pretrained(model), max_len=64)
    print(machine_line(args.threads))
    print("| decode batch | batch check, µs | decode step, ms | check / step |")
    print("|---:|---:|---:|---:|")
    for size in (1, 4, 16):
        reqs = runner.make_reqs([f"prompt {i}:" for i in range(size)], 40)
        runner.step(reqs, "prefill")
        checks, steps = [], []
        for _ in range(12):
            batch = Batch(reqs=reqs, phase="decode")
            engine.graph_runner.pad_batch(batch)
            pr = batch.padded_reqs
            batch.positions = torch.cat([torch.arange(r.cached_len, r.device_len) for r in pr]).int()
            batch.input_ids = torch.cat([r.input_ids[r.cached_len: r.device_len] for r in pr])
            batch.out_loc = torch.cat([engine.page_table[r.table_idx, r.cached_len: r.device_len]
                                       for r in pr])
            engine.attn_backend.prepare_metadata(batch)
            t0 = time.perf_counter()
            for _ in range(20):
                engine._check_batch(batch)
            checks.append((time.perf_counter() - t0) / 20)
            t0 = time.perf_counter()
            runner.step(reqs, "decode")
            steps.append(time.perf_counter() - t0)
        c, s = statistics.median(checks), statistics.median(steps)
        print(f"| {size} | {c * 1e6:.0f} | {s * 1e3:.1f} | {c / s:.2%} |")
    engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
