# Chapter 01 (01_req_batch_context.ipynb): the communicator interface (all-reduce, all-gather).
"""How tensor-parallel ranks combine their partial results.

Row-parallel layers sum their partial outputs (all-reduce); the LM head concatenates its vocab
shards (all-gather along dim 0). Layers call the communicator only when ``tp_size > 1``, so a
single-process run needs no process group at all.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import List

import torch


class DistributedImpl(ABC):
    @abstractmethod
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def all_gather(self, x: torch.Tensor) -> torch.Tensor: ...


def _dist():
    """``torch.distributed``, once a process group exists (the Engine creates it when tp > 1)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("a tensor-parallel layer (tp size > 1) needs a process group, but "
                           "torch.distributed is not initialised: build the model inside an "
                           "Engine (it calls init_process_group when tp_info.size > 1), or use "
                           "`python examples/tp_milestone.py --tp N`, which starts one process per rank.")
    return dist


class TorchDistributedImpl(DistributedImpl):
    """``torch.distributed`` collectives (gloo on CPU); identity when the world has one rank."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place: every rank ends with the same total."""
        dist = _dist()
        if dist.get_world_size() == 1:
            return x
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[rows, ...]`` on each rank -> ``[world * rows, ...]``, rank 0's rows first."""
        dist = _dist()
        world = dist.get_world_size()
        if world == 1:
            return x
        out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        # all_gather_single is the newer name; older torch versions have only the other one
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, x.contiguous())
        return out


class DistributedCommunicator:
    """What layers hold: delegates to the last registered implementation."""

    plugins: List[DistributedImpl] = [TorchDistributedImpl()]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.plugins[-1].all_reduce(x)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return self.plugins[-1].all_gather(x)


def destroy_distributed() -> None:
    """Forget every plugin but the default one (Engine.shutdown() calls this)."""
    DistributedCommunicator.plugins = [TorchDistributedImpl()]
