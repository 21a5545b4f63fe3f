# Chapter 06 (06_engine_and_sampler.ipynb): tensor parallelism on one machine: start the ranks.
"""Run the milestone's batch with the model split over ``tp`` processes (gloo on the CPU).

    python -m minisgl.launch --tp 2 [--model PATH] [--page-size N] [--timeout S]

``launch(fn, tp_size, args)`` is the general part: it picks a free local port, starts ``tp_size``
processes with ``torch.multiprocessing`` (spawn: each rank is a fresh interpreter, no state
copied from the parent), and calls ``fn(rank, tp_size, *args)`` in each, with one thread per
rank and ``MINISGL_DIST_ADDR`` pointing at that port, where every rank's Engine meets the others
(``init_process_group``). When a rank raises, the others are killed (a rank blocked in a
collective would otherwise wait for its peer until ``distributed_timeout``) and the launcher
raises that rank's error; when the run outlives ``timeout``, every rank is killed. It returns
each rank's return value. Only rank 0 prints: the other ranks' stdout is discarded.

A process group lives as long as the Engine that created it. Building a second tp Engine in the
same processes needs a new address: on the old one, a rank that gets there first could meet the
previous group's store, still open on a slower rank, and read its stale entries.

The command line runs the milestone's four prompts (prefill + 15 greedy decode steps) with tp=1
in this process first, then with tp ranks, and rank 0 prints the tokens and whether they match.
The model's head counts decide which tp sizes work: each rank needs a whole number of query heads
(and of KV heads, or one whole KV head copied on several ranks). The check runs here, before any
process starts. SmolLM2-135M has 9 query heads and 3 KV heads, so tp=2 is refused; without
``--model``, the launcher picks the first model (Qwen3-0.6B, SmolLM2, tiny-qwen2) that splits.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, List, Sequence

import torch

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["The capital of France is", "List three prime numbers:", "def fibonacci(n):",
           "Once upon a time,"]
CANDIDATES = ("models/Qwen3-0.6B", "models/SmolLM2-135M-Instruct", "models/tiny-qwen2")
FAIL_ENV = "MINISGL_TP_FAIL_RANK"  # testing hook: that rank raises after its prefill
MAX_LEN = 256  # token slots per request in the page table (placed by hand, as in the milestone)


class RankFailed(RuntimeError):
    """A rank raised or died; the message holds its traceback (or its exit code)."""


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _ByValue:
    """A tensor on its way back to the launcher, as raw bytes in a numpy array.

    Sent as is, a tensor would cross the queue as a handle to shared memory that the rank must
    keep serving, and ranks exit right after sending. Bytes work for every dtype (bfloat16 too).
    """

    def __init__(self, t: torch.Tensor) -> None:
        t = t.detach().cpu().contiguous()
        self.dtype, self.shape = t.dtype, tuple(t.shape)
        self.data = t.reshape(-1).view(torch.uint8).numpy()

    def tensor(self) -> torch.Tensor:
        return torch.from_numpy(self.data).view(self.dtype).reshape(self.shape)


def _pack(obj: Any) -> Any:
    """Tensors inside lists, tuples and dicts -> _ByValue (everything else as it is)."""
    if isinstance(obj, torch.Tensor):
        return _ByValue(obj)
    if type(obj) in (list, tuple):
        return type(obj)(_pack(x) for x in obj)
    if type(obj) is dict:
        return {k: _pack(v) for k, v in obj.items()}
    return obj


def _unpack(obj: Any) -> Any:
    if isinstance(obj, _ByValue):
        return obj.tensor()
    if type(obj) in (list, tuple):
        return type(obj)(_unpack(x) for x in obj)
    if type(obj) is dict:
        return {k: _unpack(v) for k, v in obj.items()}
    return obj


def _rank_main(rank: int, tp_size: int, addr: str, fn: Callable, args: tuple, results) -> None:
    """What each spawned process runs (``torch.multiprocessing`` passes ``rank`` first)."""
    os.environ["MINISGL_DIST_ADDR"] = addr  # EngineConfig.distributed_addr reads it
    torch.set_num_threads(1)
    if rank != 0:  # only rank 0 prints; errors still reach stderr
        sys.stdout = open(os.devnull, "w")
    results.put((rank, _pack(fn(rank, tp_size, *args))))  # back to the launcher via a pipe


def launch(fn: Callable, tp_size: int, args: Sequence[Any] = (), timeout: float = 120.0,
           on_start: Callable[[List[int]], None] | None = None) -> List[Any]:
    """Run ``fn(rank, tp_size, *args)`` in ``tp_size`` spawned processes; return every rank's
    result (``fn`` must be a module-level function and its results picklable).

    Raises RankFailed with the first failing rank's traceback, or TimeoutError after
    ``timeout`` seconds; in both cases every rank has been killed and reaped before it returns.
    ``on_start`` receives the ranks' pids (tests use it to check nothing is left behind).
    """
    import torch.multiprocessing as mp

    addr = f"tcp://127.0.0.1:{free_port()}"
    queue = mp.get_context("spawn").SimpleQueue()
    ctx = mp.start_processes(_rank_main, args=(tp_size, addr, fn, tuple(args), queue),
                             nprocs=tp_size, join=False, start_method="spawn")
    if on_start is not None:
        on_start(ctx.pids())
    results = {}
    deadline = time.monotonic() + timeout
    try:
        while True:
            done = ctx.join(timeout=max(0.0, min(0.2, deadline - time.monotonic())))
            while not queue.empty():  # read results as they come: a rank exits only once the
                rank, value = queue.get()  # pipe has taken all of its result
                results[rank] = _unpack(value)
            if done:
                break
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the {tp_size} ranks did not finish within {timeout:.0f} s; "
                                   "every rank was stopped. A rank waiting in a collective for "
                                   "a peer that never comes looks like this.")
    except mp.ProcessRaisedException as e:  # join() has already stopped the other ranks
        raise RankFailed(f"rank {e.error_index} failed, so the run was stopped:{e}") from None
    except mp.ProcessExitedException as e:
        raise RankFailed(f"rank {e.error_index} died ({e}), so the run was stopped.") from None
    finally:
        for p in ctx.processes:  # whatever happened, no rank outlives the launcher
            if p.is_alive():
                p.kill()
            p.join()
        queue.close()
    return [results[rank] for rank in range(tp_size)]


# ----------------------------------------------------------------------------- the milestone
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


class Runner:
    """Drive an Engine by hand, as the milestone's ``step()`` does."""

    def __init__(self, engine, prompt_ids: Sequence[Sequence[int]], n: int) -> None:
        from minisgl.core import Req, SamplingParams

        self.engine = engine
        self.reqs = []
        for row, ids in enumerate(prompt_ids):
            engine.page_table[row, :MAX_LEN] = torch.arange(row * MAX_LEN, (row + 1) * MAX_LEN)
            self.reqs.append(Req(input_ids=torch.tensor(ids, dtype=torch.int32), table_idx=row,
                                 cached_len=0, output_len=n, uid=row, cache_handle=None,
                                 sampling_params=SamplingParams(max_tokens=n)))

    def batch(self, phase: str):
        """The next batch with its fields filled in (input ids, positions, out_loc, metadata)."""
        from minisgl.core import Batch

        engine, reqs = self.engine, self.reqs
        batch = Batch(reqs=reqs, phase=phase)
        engine.graph_runner.pad_batch(batch)
        batch.positions = torch.cat([torch.arange(r.cached_len, r.device_len)
                                     for r in reqs]).int()
        batch.input_ids = torch.cat([r.input_ids[r.cached_len: r.device_len] for r in reqs])
        batch.out_loc = torch.cat([engine.page_table[r.table_idx, r.cached_len: r.device_len]
                                   for r in reqs])
        engine.attn_backend.prepare_metadata(batch)
        return batch

    def step(self, phase: str, feed: Sequence[int] | None = None) -> List[int]:
        """One forward + greedy sample; appends the sampled tokens (or ``feed``) to the requests."""
        batch = self.batch(phase)
        out = self.engine.forward_batch(batch, self.engine.sampler.prepare(batch))
        tokens = out.next_tokens_cpu.tolist()
        for i, r in enumerate(self.reqs):
            t = tokens[i] if feed is None else feed[i]
            r.append_host(torch.tensor([t], dtype=torch.int32))
        return tokens


def generate(engine, prompt_ids: Sequence[Sequence[int]], n: int = 16,
             fail_rank: int | None = None) -> List[List[int]]:
    """Prefill + ``n - 1`` decode steps for all prompts in one batch; the tokens per prompt."""
    runner = Runner(engine, prompt_ids, n)
    outs = [[t] for t in runner.step("prefill")]
    if fail_rank is not None and engine.config.tp_info.rank == fail_rank:
        raise RuntimeError(f"rank {fail_rank}: failure injected by {FAIL_ENV}={fail_rank}")
    for _ in range(n - 1):
        for i, t in enumerate(runner.step("decode")):
            outs[i].append(t)
    return outs


def prompt_ids(model: str, prompts: Sequence[str] = PROMPTS) -> List[List[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return [tok(p).input_ids for p in prompts]


def milestone_rank(rank: int, tp_size: int, model: str, ids, n: int, page_size: int,
                   expected) -> List[List[int]]:
    """One rank of the tp run: build the Engine (it joins the process group), generate, report."""
    from minisgl.engine import Engine

    fail = os.environ.get(FAIL_ENV)
    engine = Engine(engine_config(model, rank, tp_size, page_size, len(ids)))
    try:
        outs = generate(engine, ids, n, fail_rank=int(fail) if fail else None)
    finally:
        engine.shutdown()
    if rank == 0:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        for p, o, e in zip(PROMPTS, outs, expected):
            print(f"  {p!r:30} -> {tok.decode(o)[:32]!r:36} matches tp=1: {o == e}")
    return outs


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
    ap = argparse.ArgumentParser(prog="python -m minisgl.launch", description=__doc__,
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
    from minisgl.launch import main as _main  # the module's own functions, so spawn finds them

    sys.exit(_main())
