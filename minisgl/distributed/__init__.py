# Chapter 01 (01_req_batch_context.ipynb): the distributed package's public names.
"""Tensor-parallel identity (which rank am I, how many ranks) and the communicator."""

from .impl import DistributedCommunicator, DistributedImpl, TorchDistributedImpl, destroy_distributed
from .info import DistributedInfo, get_tp_info, reset_tp_info, set_tp_info, try_get_tp_info

__all__ = [
    "DistributedCommunicator",
    "DistributedImpl",
    "DistributedInfo",
    "TorchDistributedImpl",
    "destroy_distributed",
    "get_tp_info",
    "reset_tp_info",
    "set_tp_info",
    "try_get_tp_info",
]
