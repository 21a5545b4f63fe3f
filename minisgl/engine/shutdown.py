# Chapter 06 (06_engine_and_sampler.ipynb): shutdown(): what an Engine gives back.
"""``shutdown()`` releases the model, the KV pool and the page table, the process-wide globals this
Engine set (the context, the tp info, a tp process group), and torch's thread count as it found
it. A shut down Engine says why when used: ``forward_batch`` raises, and so does reading one of
the released parts (``engine.page_table``), naming the newer Engine when one replaced it.
"""

from __future__ import annotations

import gc
import sys

import torch

from minisgl.core import reset_global_ctx
from minisgl.distributed import destroy_distributed, reset_tp_info

RELEASED = ("model", "kv_cache", "page_table", "attn_backend", "graph_runner", "sampler",
            "dummy_req")  # what shutdown() lets go of


class Releasable:
    """Mixed into Engine (through OneLiveEngine): ``shutdown()`` and what a shut down Engine says."""

    def _why_closed(self) -> str:
        return {"replaced": "this Engine was replaced by a newer Engine (one per process) and shut "
                "down: use the newer Engine, or build a new one."}.get(
                    self.__dict__.get("_closed_why"), "this Engine was shut down: build a new one.")

    def __getattr__(self, name: str):
        # only called for attributes that do not exist: say why when shutdown() released them
        if self.__dict__.get("_closed_why") is not None and name in RELEASED:
            raise AttributeError(f"engine.{name} is gone: {self._why_closed()}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _release(self) -> None:
        if self._owns.get("ctx"):
            reset_global_ctx()
        if self._owns.get("tp_info"):
            reset_tp_info()
        destroy_distributed()
        if self._owns.pop("dist", False) and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()  # the group this Engine created (tp > 1)
        torch.set_num_threads(self._prev_threads)
        for name in RELEASED:
            self.__dict__.pop(name, None)
        if getattr(self, "ctx", None) is not None:
            self.ctx.kv_cache = self.ctx.attn_backend = self.ctx.page_table = None
        gc.collect()
        if getattr(self, "device", None) is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()  # so the next Engine's free-memory reading sees it again

    def shutdown(self) -> None:
        """Release the model, the KV pool and every global this Engine set."""
        if self._closed:
            return
        if getattr(self, "graph_runner", None) is not None:
            self.graph_runner.destroy_cuda_graphs()
        self._release()
        self._closed = True
        self._closed_why = self.__dict__.get("_closed_why") or "shutdown"
        if getattr(sys, "_minisgl_live_engine", None) is self:
            sys._minisgl_live_engine = None
