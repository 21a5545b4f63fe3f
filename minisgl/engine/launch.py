# Chapter 06 (06_engine_and_sampler.ipynb, optional tp section): the tensor-parallel command line.
"""Run the milestone's batch with the model split over ``tp`` processes (gloo on the CPU).

    python -m minisgl.engine.launch --tp 2 [--model PATH] [--page-size N] [--timeout S]

The four prompts run with tp=1 in this process first, then on ``tp`` ranks (ranks.py); rank 0
prints the tokens and whether they match. A tp size that does not split the model's heads is
refused before any process starts; without ``--model``, the first of CANDIDATES that splits runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Sequence

from .ranks import RankFailed, launch
from .tp_milestone import MAX_LEN, engine_config, generate, milestone_rank, prompt_ids

ROOT = Path(__file__).resolve().parents[2]
CANDIDATES = ("models/Qwen3-0.6B", "models/SmolLM2-135M-Instruct", "models/tiny-qwen2")


def pick_model(tp: int) -> str:
    """The first of CANDIDATES that exists and whose heads split over ``tp`` ranks."""
    for rel in CANDIDATES:
        path = ROOT / rel
        if path.is_dir() and not head_problem(str(path), tp):
            return str(path)
    raise FileNotFoundError(f"none of {', '.join(CANDIDATES)} exists with heads that split over "
                            f"{tp} ranks: run `make models`, or pass --model.")


def head_problem(model: str, tp: int) -> str | None:
    """EngineConfig.validate's message when ``tp`` does not divide the model's heads, else None."""
    try:
        engine_config(model, 0, tp).validate()
    except ValueError as e:
        if "tensor parallel size" in str(e):
            return str(e)
        raise
    return None


def _short(path: str) -> str:
    p = Path(os.path.abspath(path))
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(path)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minisgl.engine.launch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2, help="number of ranks (processes)")
    ap.add_argument("--model", help="model folder (default: the first of "
                    f"{', '.join(CANDIDATES)} whose heads split over --tp ranks)")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=16, help="tokens per prompt (prefill + decode)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds before every rank is "
                    "stopped")
    args = ap.parse_args(argv)
    if args.tp < 1:
        ap.error(f"--tp {args.tp}: need at least 1 rank")
    if args.page_size < 1 or MAX_LEN % args.page_size:
        sizes = ", ".join(str(1 << i) for i in range(MAX_LEN.bit_length()))
        ap.error(f"--page-size {args.page_size}: a page holds at least 1 token, and each "
                 f"request's {MAX_LEN} token slots must fill whole pages; use one of {sizes}")
    if args.tokens < 1:
        ap.error(f"--tokens {args.tokens}: generate at least 1 token per prompt")
    if not args.timeout > 0:
        ap.error(f"--timeout {args.timeout}: need a positive number of seconds")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.model is None:
        try:
            model = pick_model(args.tp)
        except FileNotFoundError as e:
            print(f"{ap.prog}: error: {e}", file=sys.stderr)
            return 2
        smol = str(ROOT / CANDIDATES[1])
        if model != smol and Path(smol).is_dir():
            print(f"default model {_short(model)}: SmolLM2-135M cannot run with tp={args.tp} "
                  f"({head_problem(smol, args.tp)})")
    else:
        model = args.model
    cfg = engine_config(model, 0, args.tp, args.page_size)
    try:  # a tp size that does not split the heads, a bad page size, no model: refused here,
        cfg.validate()  # before any process starts
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    mc = cfg.model_config
    print(f"model {_short(model)}: {mc.num_qo_heads} query heads, {mc.num_kv_heads} KV heads -> "
          f"per rank {mc.num_qo_heads // args.tp} query heads, "
          f"{max(1, mc.num_kv_heads // args.tp)} KV head(s)")

    from minisgl.engine import Engine

    ids = prompt_ids(model)
    longest = max(len(i) for i in ids)
    if longest + args.tokens > MAX_LEN:
        ap.error(f"--tokens {args.tokens}: the longest prompt has {longest} tokens and each "
                 f"request has {MAX_LEN} token slots; use --tokens {MAX_LEN - longest} or fewer")
    engine = Engine(engine_config(model, 0, 1, args.page_size, len(ids)))  # the reference
    try:
        expected = generate(engine, ids, args.tokens)
    finally:
        engine.shutdown()
    print(f"tp=1 computed in the launcher; now {args.tp} ranks, one thread each:")
    t0 = time.perf_counter()
    try:
        outs = launch(milestone_rank, args.tp, (model, ids, args.tokens, args.page_size, expected),
                      timeout=args.timeout)[0]
    except (RankFailed, TimeoutError) as e:
        print(f"launch failed: {e}", file=sys.stderr)
        return 1
    same = outs == expected
    print(f"tp={args.tp}: {time.perf_counter() - t0:.1f} s in all (start-up included); "
          f"all tokens match tp=1: {same}")
    return 0 if same else 1



if __name__ == "__main__":
    sys.exit(main())
