# Chapter 01 (01_req_batch_context.ipynb): DistributedInfo and the process-wide tp info.
"""Which tensor-parallel rank this process is, out of how many.

Every layer that shards its weights reads ``get_tp_info()`` in its constructor, so the Engine sets
it before building the model. With ``size == 1`` nothing is sharded and no process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DistributedInfo:
    rank: int
    size: int

    def __post_init__(self) -> None:
        if not (isinstance(self.rank, int) and isinstance(self.size, int)):
            raise TypeError(f"DistributedInfo(rank={self.rank!r}, size={self.size!r}): both must "
                            "be ints, e.g. DistributedInfo(0, 1) for a single process.")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"DistributedInfo(rank={self.rank}, size={self.size}): need "
                             "0 <= rank < size; a single process is DistributedInfo(0, 1).")

    def is_primary(self) -> bool:
        return self.rank == 0


_TP_INFO: DistributedInfo | None = None


def set_tp_info(rank: int, size: int) -> None:
    global _TP_INFO
    if _TP_INFO is not None:
        raise RuntimeError(f"tp info is already set to {_TP_INFO}: call reset_tp_info() (or "
                           "engine.shutdown()) before setting it again.")
    _TP_INFO = DistributedInfo(rank, size)


def get_tp_info() -> DistributedInfo:
    if _TP_INFO is None:
        raise RuntimeError("tp info is not set: the Engine sets it; in a test or notebook call "
                           "set_tp_info(0, 1) before building layers.")
    return _TP_INFO


def try_get_tp_info() -> DistributedInfo | None:
    return _TP_INFO


def reset_tp_info() -> None:
    global _TP_INFO
    _TP_INFO = None
