"""Two builds of chapter 07's C++ kernels in one Engine: this tree's against a git revision's.

A change to the kernels is worth keeping when the Engine's decode step gets faster, and that is
hard to see on a host whose memory bandwidth drifts by 20% between runs. So this benchmark keeps
everything but the C++ fixed: one process, one Engine (``cpu_kernels=True``), its weights loaded
and placed once, and two compiled libraries: this tree's ``minisgl/kernel/csrc*`` (the cached
build) and the same files at ``--against`` (compiled aside, in a temporary folder). Each round
runs every batch size with one library, then with the other, swapped in by pointing
``minisgl.kernel._MODULE`` and the "cpp" attention backend at it; the Python side (the ops, the
wrappers, ``place_weights``) stays this tree's. Each build reads its own copy of the weights, in a
buffer it mapped itself (``own_weights``): a library reads ahead only there, so with one copy the
other build ran without its read-ahead (an A-A run on 2026-12-06 then gave 0.973x). Reported per
batch size: the median step of each build and the median of the per-round ratios ("paired"),
which drift between rounds moves much less than it moves two separate runs. Both builds must
give the same greedy tokens. Each build chooses its own prefetch distance for the 2-7-row
loop: this tree's tunes it in the first decode steps of each batch size, before any timed step
(``MinisglRunner.tune_prefetch``), a revision before 2026-12-06's session 50 measured one
distance once, by streaming a large weight.

Why not the matmuls alone? A benchmark that calls ``linear`` back to back with one x leaves x in
both cores' caches; in a step, x was just written by the calling thread (a norm, attention,
silu). A change to the copy of x measured 0.92x that way and 0.97x in the step.

    python benchmarks/bench_kernel_ab.py --against HEAD~1 [--rounds 5] [--steps 16]
        [--batches 1,4,16] [--threads N]

Prints only (the comparison is about a revision, not the tree); the figures go in a note.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.measure import PROMPTS, ROOT, MinisglRunner, header, median_ms, paired_ratio
from minisgl.kernel.weights import _swap_in, float_weights, place_weights

KERNEL_DIR = "minisgl/kernel"
NEEDED = ("linear", "rmsnorm", "fused_add_rmsnorm", "rope_inplace", "silu_and_mul", "store_kv",
          "decode_attention", "argmax_rows")


def kernel_sources(rev: str, dest: Path) -> Path:
    """``csrc.cpp`` and ``csrc/*`` as they are at ``rev``, written under ``dest``."""
    def git(*a: str) -> bytes:
        try:
            r = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, timeout=120)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"git {' '.join(a)} gave no answer in 120 s (a lock held by another "
                             f"git process?): run it by hand to see why") from None
        if r.returncode:
            raise SystemExit(f"git {' '.join(a)}: {r.stderr.decode().strip()} (is --against a "
                             f"revision of this repository?)")
        return r.stdout

    names = git("ls-tree", "-r", "--name-only", rev, "--", f"{KERNEL_DIR}/csrc.cpp",
                f"{KERNEL_DIR}/csrc").decode().split()
    if f"{KERNEL_DIR}/csrc.cpp" not in names:
        raise SystemExit(f"{rev} has no {KERNEL_DIR}/csrc.cpp: nothing to compare")
    for name in names:
        out = dest / Path(name).relative_to(KERNEL_DIR)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(git("show", f"{rev}:{name}"))
    return dest / "csrc.cpp"


def build_at(rev: str, work: Path):
    from torch.utils.cpp_extension import load

    from minisgl import kernel

    source = kernel_sources(rev, work / "src")
    (work / "build").mkdir()
    print(f"compiling the kernels of {rev} (a minute or two) ...", file=sys.stderr, flush=True)
    module = load("minisgl_kernel_ab", sources=[str(source)], extra_cflags=kernel.build_flags(),
                  build_directory=str(work / "build"), verbose=False)
    missing = [f for f in NEEDED if not hasattr(module, f)]
    if missing:
        raise SystemExit(f"the kernels of {rev} lack {', '.join(missing)}: this benchmark swaps "
                         f"C++ libraries under one Python side, so both need the same functions")
    return module


def own_weights(model, module) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """The model's weights placed (``place_weights``) in a buffer that ``module`` mapped itself
    (its ``weight_buffer``), and those copies by state-dict key; the model keeps them. A library
    reads ahead only inside buffers it mapped (chapter 07, reading ahead): with one buffer for
    both builds, the build that did not map it would run without its read-ahead, and the
    comparison would measure that. A build without ``weight_buffer`` (older than 8b18314) reads
    ahead anywhere: it shares the copy the model holds."""
    if not hasattr(module, "weight_buffer"):
        return None, float_weights(model)
    buffer = place_weights(model, module.weight_buffer)
    return buffer, float_weights(model)


def run(args) -> str:
    from transformers import AutoTokenizer

    from minisgl import kernel
    from minisgl.distributed import DistributedInfo
    from minisgl.engine import Engine, EngineConfig

    current = kernel.load()
    if current is None:
        raise SystemExit(f"the kernels cannot be built here: {kernel.unavailable_reason()}")
    batches = [int(b) for b in args.batches.split(",")]
    model = Path(os.path.abspath(args.model))
    tok = AutoTokenizer.from_pretrained(model)
    with tempfile.TemporaryDirectory(prefix="minisgl-kernel-ab-") as tmp:
        other = build_at(args.against, Path(tmp))
        rows = max(*batches, len(PROMPTS))  # the token check runs all the prompts at once
        engine = Engine(EngineConfig(
            model_path=str(model), tp_info=DistributedInfo(0, 1), dtype=torch.float32,
            max_running_req=rows, num_page_override=rows * 256,
            max_seq_len_override=256, cpu_kernels=True, num_threads=args.threads))
        try:
            if engine.config.attention_backend != "cpp":
                raise SystemExit("cpu_kernels=True but the Engine runs the torch code")
            runner = MinisglRunner(engine, tok)
            builds = {"this tree": current, args.against: other}

            placed = {name: own_weights(engine.model, module) for name, module in builds.items()}

            def use(name: str) -> None:
                kernel._MODULE = builds[name]
                engine.attn_backend._module = builds[name]
                for key, t in placed[name][1].items():
                    _swap_in(engine.model, key, t)

            tokens = {}
            for name in builds:  # the same greedy tokens with both libraries
                use(name)
                tokens[name] = runner.greedy_tokens(PROMPTS, 16)
            same = tokens["this tree"] == tokens[args.against]
            steps: dict[tuple[int, str], list[float]] = {}
            for _ in range(args.rounds):
                for b in batches:
                    for name in builds:
                        use(name)
                        times = runner.decode_times(b, args.steps, warmup=2)
                        steps.setdefault((b, name), []).append(median_ms(times))
            threads = torch.get_num_threads()
        finally:
            kernel._MODULE = current
            engine.shutdown()
    what = f"decode steps, `cpu_kernels=True`, this tree's kernels against `{args.against}`"
    lines = [f"{header(model, what, threads)}; {args.rounds} interleaved rounds x {args.steps} "
             f"steps; the same greedy tokens (4 prompts, 16 steps): {'yes' if same else 'NO'}.",
             "", f"| batch | this tree, ms | `{args.against}`, ms | this tree / "
             f"`{args.against}`, paired |", "|---:|---:|---:|---:|"]
    for b in batches:
        a, o = steps[(b, "this tree")], steps[(b, args.against)]
        paired = paired_ratio(a, o)
        lines.append(f"| {b} | {statistics.median(a):.2f} | {statistics.median(o):.2f} | "
                     f"{paired:.3f}x |")
    if not same:
        lines.append("\nThe two builds gave different greedy tokens: a difference beyond "
                     "rounding, to be found before any timing counts.")
    return "\n".join(lines)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", required=True, help="a git revision (HEAD~1, a commit, a tag)")
    ap.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.rounds < 1 or args.steps < 1:
        raise SystemExit("--rounds and --steps must be at least 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(run(args))


if __name__ == "__main__":
    main()
