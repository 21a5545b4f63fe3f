"""The milestone's batch with the model split over ``--tp`` processes (tensor parallelism, gloo on
the CPU): chapter 06's optional tp section.

    python examples/tp_milestone.py --tp 2 [--model PATH] [--page-size N] [--tokens N] [--timeout S]

The four prompts run with tp=1 in this process first (the reference), then on ``tp`` ranks; rank 0
prints the tokens and whether they match. Each rank drives its Engine with the milestone's own
``make_reqs()`` and ``step()`` (read from examples/stage1_milestone.py, which is not run). A tp
size that does not split the model's heads is refused before any process starts; without
``--model``, the first of CANDIDATES whose heads split runs.

The launcher (``launch``) decides what happened from values only: each rank sends
``(rank, "ok", result)`` or ``(rank, "error", traceback)`` before it exits, and a rank that sent
nothing is judged by its exit code.
"""

from __future__ import annotations

import argparse
import ast
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, List, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
MILESTONE = ROOT / "examples" / "stage1_milestone.py"
CANDIDATES = ("models/Qwen3-0.6B", "models/SmolLM2-135M-Instruct", "models/tiny-qwen2")
PROMPTS = ["The capital of France is", "List three prime numbers:", "def fibonacci(n):",
           "Once upon a time,"]
FAIL_ENV = "MINISGL_TP_FAIL_RANK"  # testing hook: that rank raises after its prefill
MAX_LEN = 256  # token slots per request, placed by hand as the milestone's make_reqs() does


def engine_config(model: str, rank: int, tp_size: int, page_size: int = 1, n_reqs: int = 4,
                  **overrides):
    """The milestone's Engine settings (one thread, KV slots placed by hand)."""
    from minisgl.distributed import DistributedInfo
    from minisgl.engine import EngineConfig

    kw = dict(model_path=str(model), tp_info=DistributedInfo(rank, tp_size), dtype=torch.float32,
              max_running_req=n_reqs, page_size=page_size,
              num_page_override=n_reqs * MAX_LEN // page_size, max_seq_len_override=MAX_LEN,
              num_threads=1)
    kw.update(overrides)
    return EngineConfig(**kw)


def milestone_functions(engine, tok) -> tuple[Callable, Callable]:
    """The milestone's ``make_reqs(prompts, n)`` and ``step(reqs, phase)``, bound to ``engine``
    and ``tok``: their definitions are read from the milestone script and compiled here."""
    from minisgl.core import Batch, Req, SamplingParams

    tree = ast.parse(MILESTONE.read_text(), str(MILESTONE))
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef)
            and n.name in ("make_reqs", "step")]
    scope = {"torch": torch, "Batch": Batch, "Req": Req, "SamplingParams": SamplingParams,
             "engine": engine, "tok": tok}
    exec(compile(ast.Module(body=defs, type_ignores=[]), str(MILESTONE), "exec"), scope)
    return scope["make_reqs"], scope["step"]


def generate(engine, tok, prompts: Sequence[str], n: int = 16,
             fail_rank: int | None = None) -> List[List[int]]:
    """Prefill + ``n - 1`` decode steps for all prompts in one batch, with the milestone's
    ``step()``; the tokens per prompt."""
    make_reqs, step = milestone_functions(engine, tok)
    reqs = make_reqs(prompts, n)
    outs = [[t] for t in step(reqs, "prefill")]
    if fail_rank is not None and engine.config.tp_info.rank == fail_rank:
        raise RuntimeError(f"rank {fail_rank}: failure injected by {FAIL_ENV}={fail_rank}")
    for _ in range(n - 1):
        for i, t in enumerate(step(reqs, "decode")):
            outs[i].append(t)
    return outs


def milestone_rank(rank: int, tp_size: int, model: str, n: int, page_size: int,
                   expected, prompts: Sequence[str] = PROMPTS) -> List[List[int]]:
    """One rank of the tp run: build the Engine (it joins the process group), generate, report."""
    from minisgl.engine import Engine
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    from minisgl.utils import read_env

    fail = read_env(FAIL_ENV, int, None, low=0)
    engine = Engine(engine_config(model, rank, tp_size, page_size, len(prompts)))
    try:
        outs = generate(engine, tok, prompts, n, fail_rank=fail)
    finally:
        engine.shutdown()
    if rank == 0:
        for p, o, e in zip(prompts, outs, expected):
            print(f"  {p!r:30} -> {tok.decode(o)[:32]!r:36} matches tp=1: {o == e}")
    return outs


# ----------------------------------------------------------------------------- the launcher
class RankFailed(RuntimeError):
    """A rank raised or died; the message holds its traceback (or its exit code)."""


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _ByValue:
    """A tensor on its way back to the launcher, as raw bytes (a tensor sent as is would cross
    the queue as a handle to shared memory that the rank must keep serving after it exits)."""

    def __init__(self, t: torch.Tensor) -> None:
        t = t.detach().cpu().contiguous()
        self.dtype, self.shape = t.dtype, tuple(t.shape)
        self.data = t.reshape(-1).view(torch.uint8).numpy()

    def tensor(self) -> torch.Tensor:
        return torch.from_numpy(self.data).view(self.dtype).reshape(self.shape)


def _convert(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """``leaf`` applied to everything inside lists, tuples and dicts."""
    if type(obj) in (list, tuple):
        return type(obj)(_convert(x, leaf) for x in obj)
    if type(obj) is dict:
        return {k: _convert(v, leaf) for k, v in obj.items()}
    return leaf(obj)


def _rank_main(rank: int, tp_size: int, addr: str, fn: Callable, args: tuple, queue) -> None:
    """What each spawned process runs: ``fn(rank, tp_size, *args)``, then one message."""
    os.environ["MINISGL_DIST_ADDR"] = addr  # EngineConfig.distributed_addr reads it
    torch.set_num_threads(1)
    if rank != 0:  # only rank 0 prints; errors still reach stderr
        sys.stdout = open(os.devnull, "w")
    try:
        value = fn(rank, tp_size, *args)
    except BaseException:  # sent before this rank dies: it precedes any error it causes in peers
        import traceback

        queue.put((rank, "error", traceback.format_exc()))
        sys.exit(1)
    queue.put((rank, "ok", _convert(value, lambda x: _ByValue(x)
                                    if isinstance(x, torch.Tensor) else x)))


def launch(fn: Callable, tp_size: int, args: Sequence[Any] = (), timeout: float = 120.0,
           on_start: Callable[[List[int]], None] | None = None) -> List[Any]:
    """Run ``fn(rank, tp_size, *args)`` in ``tp_size`` spawned processes; every rank's result.

    Raises RankFailed with the first failing rank's traceback (or exit code), or TimeoutError
    after ``timeout`` seconds; either way every rank has been killed and reaped first.
    ``on_start`` receives the ranks' pids (tests use it to check nothing is left behind).
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    addr, queue = f"tcp://127.0.0.1:{free_port()}", ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank_main, args=(r, tp_size, addr, fn, tuple(args), queue))
             for r in range(tp_size)]
    for p in procs:
        p.start()
    if on_start is not None:
        on_start([p.pid for p in procs])
    results, failure, deadline = {}, None, time.monotonic() + timeout
    try:
        while len(results) < tp_size and failure is None:
            while not queue.empty():  # a rank exits only once the pipe has taken its message
                rank, status, value = queue.get()
                if status == "error":
                    failure = failure or f"rank {rank} failed, so the run was stopped:\n\n{value}"
                else:
                    results[rank] = _convert(value, lambda x: x.tensor()
                                             if isinstance(x, _ByValue) else x)
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                    and r not in results]
            if failure is None and dead and queue.empty():
                failure = f"rank {dead[0]} died (exit code {procs[dead[0]].exitcode}), so the run was stopped."
            if failure is None and len(results) < tp_size:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"the {tp_size} ranks did not finish within {timeout:.0f} "
                                       "s; every rank was stopped. A rank waiting in a collective "
                                       "for a peer that never comes looks like this.")
                time.sleep(0.05)
        if failure is not None:
            raise RankFailed(failure)
    finally:
        done = failure is None and len(results) == tp_size
        for p in procs:  # whatever happened, no rank outlives the launcher
            if done:
                p.join(timeout=max(1.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
            p.join()
        queue.close()
    return [results[rank] for rank in range(tp_size)]


# ----------------------------------------------------------------------------- the command line
def pick_model(tp: int) -> str | None:
    """The first of CANDIDATES that exists and whose heads split over ``tp`` ranks."""
    for rel in CANDIDATES:
        path = ROOT / rel
        if path.is_dir() and tp in engine_config(str(path), 0, 1).tp_sizes:
            return str(path)
    return None


def _short(path: str) -> str:
    p = Path(os.path.abspath(path))
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(path)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python examples/tp_milestone.py", description=__doc__,
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
    if args.page_size < 1 or MAX_LEN % args.page_size:  # make_reqs places 256 slots per request
        sizes = ", ".join(str(1 << i) for i in range(MAX_LEN.bit_length()))
        ap.error(f"--page-size {args.page_size}: each request's {MAX_LEN} token slots must fill "
                 f"whole pages; use one of {sizes}")
    if args.tokens < 1:
        ap.error(f"--tokens {args.tokens}: generate at least 1 token per prompt")
    if not args.timeout > 0:
        ap.error(f"--timeout {args.timeout}: need a positive number of seconds")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    model = args.model or pick_model(args.tp)
    if model is None:
        print(f"{ap.prog}: error: none of {', '.join(CANDIDATES)} exists with heads that split "
              f"over {args.tp} ranks: run `make models`, or pass --model.", file=sys.stderr)
        return 2
    smol = ROOT / CANDIDATES[1]
    if args.model is None and model != str(smol) and smol.is_dir():
        print(f"default model {_short(model)}: SmolLM2-135M cannot run with tp={args.tp} (its "
              f"heads split over {engine_config(str(smol), 0, 1).tp_sizes} ranks only)")
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
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    longest = max(len(tok(p).input_ids) for p in PROMPTS)
    if longest + args.tokens > MAX_LEN:
        ap.error(f"--tokens {args.tokens}: the longest prompt has {longest} tokens and each "
                 f"request has {MAX_LEN} token slots; use --tokens {MAX_LEN - longest} or fewer")
    engine = Engine(engine_config(model, 0, 1, args.page_size))  # the reference
    try:
        expected = generate(engine, tok, PROMPTS, args.tokens)
    finally:
        engine.shutdown()
    print(f"tp=1 computed in the launcher; now {args.tp} ranks, one thread each:")
    t0 = time.perf_counter()
    try:
        outs = launch(milestone_rank, args.tp, (model, args.tokens, args.page_size, expected),
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
