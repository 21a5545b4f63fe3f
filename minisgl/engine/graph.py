# Chapter 06 (06_engine_and_sampler.ipynb): the GraphRunner (CUDA graphs for decode; padding).
"""On a GPU, a decode step launches hundreds of tiny kernels; capturing them once in a CUDA graph
per batch size and replaying it removes the launch overhead. A batch whose size has no graph is
padded with the dummy request up to the nearest captured size.

On the CPU there are no graphs (``max_graph_bs == 0``): ``pad_batch`` pads nothing, and the model
runs eagerly. Capture and replay (CUDA only) come last: a CPU reader may stop before them.
"""

from __future__ import annotations

from typing import Dict, List

import torch

from minisgl.core import Batch, Req, get_global_ctx


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


class GraphRunner:
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
# --- part 2: on a GPU, capture and replay ---

    def _capture(self) -> None:
        """One graph per batch size, each recording the model's decode forward on dummies.

        A graph replays fixed kernels on fixed addresses, so everything it reads lives in
        buffers allocated here once: token ids, positions and out_loc (refreshed by ``replay``),
        the attention metadata (the backend's buffers, refreshed by ``prepare_for_replay``), and
        the logits it writes. All graphs share one memory pool (they never run at the same time);
        the largest is captured first so that the pool is sized once.
        """
        max_bs, dev = max(self.graph_bs_list), self.device
        dummy_slot = int(get_global_ctx().page_table[self.dummy_req.table_idx, 0])
        self._input_ids = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        self._positions = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        # dummies write only the dummy page, during the warm-up as in every replay
        self._out_loc = torch.full((max_bs,), dummy_slot, dtype=torch.int32, device=dev)
        self._logits = torch.empty(max_bs, self.vocab_size, dtype=torch.float32, device=dev)
        ctx = get_global_ctx()
        pool = None
        side = torch.cuda.Stream(dev)
        with torch.no_grad():
            for bs in sorted(self.graph_bs_list, reverse=True):
                batch = Batch(reqs=[self.dummy_req] * bs, phase="decode")
                batch.padded_reqs = batch.reqs
                batch.input_ids = self._input_ids[:bs]
                batch.positions = self._positions[:bs]
                batch.out_loc = self._out_loc[:bs]
                self.attn_backend.prepare_for_capture(batch)  # metadata on the backend's buffers
                graph = torch.cuda.CUDAGraph()
                with ctx.forward_batch(batch):
                    # warm up outside the graph (on a side stream, as PyTorch advises): lazy
                    # initialisations (cuBLAS workspaces, kernel selection) must not be captured
                    side.wait_stream(torch.cuda.current_stream(dev))
                    with torch.cuda.stream(side):
                        self._logits[:bs] = self.model.forward()
                    torch.cuda.current_stream(dev).wait_stream(side)
                    with torch.cuda.graph(graph, pool=pool):
                        self._logits[:bs] = self.model.forward()
                pool = graph.pool()
                self.graph_map[bs] = graph
        torch.cuda.synchronize(dev)

    def replay(self, batch: Batch) -> torch.Tensor:
        """Run a padded decode batch (inputs already on the device, metadata prepared) through
        its graph; returns a view of the static logits ``[B, V]`` (float32), valid until the next
        replay."""
        bs = batch.padded_size
        self._input_ids[:bs].copy_(batch.input_ids)
        self._positions[:bs].copy_(batch.positions)
        self._out_loc[:bs].copy_(batch.out_loc)
        self.attn_backend.prepare_for_replay(batch)
        self.graph_map[bs].replay()
        return self._logits[: batch.size]

    def destroy_cuda_graphs(self) -> None:
        self.graph_map.clear()
        for name in ("_input_ids", "_positions", "_out_loc", "_logits"):
            self.__dict__.pop(name, None)
        self.max_graph_bs = 0
        self.graph_bs_list = []
