# Chapter 06 (06_engine_and_sampler.ipynb, GPU part): capture and replay CUDA graphs for decode.
"""What the GraphRunner does on a GPU only: capture one graph per batch size (``_capture``), replay
the one that fits a padded decode batch (``replay``), and let them go (``destroy_cuda_graphs``).
A graph replays fixed kernels on fixed addresses, so everything it reads or writes lives in
buffers allocated once, here. Written and tested on the CPU for its arithmetic only: it has not
yet run on a GPU (``tests/test_gpu.py`` compares a replay with the eager forward where CUDA is).
"""

from __future__ import annotations

import torch

from minisgl.core import Batch, get_global_ctx


class CudaGraphs:
    """Mixed into GraphRunner: uses its ``device``, ``model``, ``attn_backend``, ``dummy_req``,
    ``vocab_size``, ``graph_bs_list`` and ``graph_map``."""

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
