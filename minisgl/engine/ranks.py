# Chapter 06 (06_engine_and_sampler.ipynb, optional tp section): start the ranks, collect results.
"""``launch(fn, tp_size, args)`` picks a free local port, starts ``tp_size`` processes with
``torch.multiprocessing`` (spawn: each rank is a fresh interpreter, no state copied from the
parent), and calls ``fn(rank, tp_size, *args)`` in each, with one thread per rank and
``MINISGL_DIST_ADDR`` pointing at that port, where every rank's Engine meets the others. When a
rank raises, the others are killed (a rank blocked in a collective would otherwise wait for its
peer until ``distributed_timeout``) and ``launch`` raises that rank's error; past ``timeout``
every rank is killed. It returns each rank's return value. Only rank 0 prints. (A second tp
Engine in the same processes needs a new address: a fast rank could meet the old group's store.)
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any, Callable, List, Sequence

import torch


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
    try:
        value = fn(rank, tp_size, *args)
    except BaseException:  # sent before this rank dies: it precedes any error it causes in peers
        import traceback

        results.put((rank, RankFailed(traceback.format_exc())))
        raise
    results.put((rank, _pack(value)))  # back to the launcher via a pipe


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
    results, failures = {}, []
    deadline = time.monotonic() + timeout
    try:
        while True:
            done = ctx.join(timeout=max(0.0, min(0.2, deadline - time.monotonic())))
            while not queue.empty():  # read results as they come: a rank exits only once the
                rank, value = queue.get()  # pipe has taken all of its result
                if isinstance(value, RankFailed):
                    failures.append((rank, value))
                else:
                    results[rank] = _unpack(value)
            if done:
                break
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the {tp_size} ranks did not finish within {timeout:.0f} s; "
                                   "every rank was stopped. A rank waiting in a collective for "
                                   "a peer that never comes looks like this.")
    except mp.ProcessRaisedException as e:  # join() has already stopped the other ranks
        while not queue.empty():  # the first rank to fail, not the first failure join() saw
            rank, value = queue.get()
            if isinstance(value, RankFailed):
                failures.append((rank, value))
        rank, text = failures[0] if failures else (e.error_index, e)
        raise RankFailed(f"rank {rank} failed, so the run was stopped:\n\n{text}") from None
    except mp.ProcessExitedException as e:
        raise RankFailed(f"rank {e.error_index} died ({e}), so the run was stopped.") from None
    finally:
        for p in ctx.processes:  # whatever happened, no rank outlives the launcher
            if p.is_alive():
                p.kill()
            p.join()
        queue.close()
    return [results[rank] for rank in range(tp_size)]
