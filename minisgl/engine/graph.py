# Chapter 06 (06_engine_and_sampler.ipynb): the GraphRunner (CUDA graphs for decode; padding).
"""On a GPU, a decode step launches hundreds of tiny kernels; capturing them once in a CUDA graph
per batch size and replaying it removes the launch overhead. A batch whose size has no graph is
padded with the dummy request up to the nearest captured size.

On the CPU there are no graphs (``max_graph_bs == 0``): ``pad_batch`` pads nothing, and the model
runs eagerly. Capture and replay (CUDA only) are in cuda_graph.py.
"""

from __future__ import annotations

from typing import Dict, List

import torch

from minisgl.core import Batch, Req

from .cuda_graph import CudaGraphs


def _determine_cuda_graph_bs(cuda_graph_bs: List[int] | None, cuda_graph_max_bs: int | None,
                             device: torch.device) -> List[int]:
    if device.type != "cuda":
        return []
    if cuda_graph_bs is not None:
        return sorted(set(cuda_graph_bs))
    max_bs = 16 if cuda_graph_max_bs is None else cuda_graph_max_bs
    if max_bs < 1:
        return []
    return sorted({b for b in [1, 2, 4] + list(range(8, max_bs + 1, 8)) if b <= max_bs})


class GraphRunner(CudaGraphs):
    def __init__(self, device: torch.device, model, attn_backend, cuda_graph_bs: List[int] | None,
                 cuda_graph_max_bs: int | None, max_seq_len: int, vocab_size: int,
                 dummy_req: Req) -> None:
        self.device = device
        self.model = model
        self.attn_backend = attn_backend
        self.dummy_req = dummy_req
        self.vocab_size = vocab_size
        self.graph_bs_list = _determine_cuda_graph_bs(cuda_graph_bs, cuda_graph_max_bs, device)
        self.graph_map: Dict[int, "torch.cuda.CUDAGraph"] = {}
        if self.graph_bs_list:
            try:  # only this call may say "no graph support"; a failed capture must not hide
                attn_backend.init_capture_graph(max_seq_len, self.graph_bs_list)
            except NotImplementedError as e:
                print(f"GraphRunner: {e}; decode batches run eagerly.")
                self.graph_bs_list = []
            else:
                self._capture()
        self.max_graph_bs = max(self.graph_bs_list, default=0)

    def pad_batch(self, batch: Batch) -> None:
        """Set ``batch.padded_reqs``: the requests, plus dummies up to a captured size."""
        # BEGIN SOLUTION 6.3: pad decode batches to the smallest captured size that fits
        padded_size = batch.size
        if batch.is_decode and 0 < batch.size <= self.max_graph_bs:
            padded_size = next(bs for bs in self.graph_bs_list if bs >= batch.size)
        batch.padded_reqs = batch.reqs + [self.dummy_req] * (padded_size - batch.size)
        # END SOLUTION

    def can_use_cuda_graph(self, batch: Batch) -> bool:
        return batch.is_decode and batch.size <= self.max_graph_bs and \
            batch.padded_size in self.graph_map
