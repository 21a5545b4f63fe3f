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


class TorchDistributedImpl(DistributedImpl):
    """``torch.distributed`` collectives (gloo on CPU); identity when the world has one rank."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if dist.get_world_size() == 1:
            return x
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        world = dist.get_world_size()
        if world == 1:
            return x
        out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x.contiguous())
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
