# Chapter 06 (06_engine_and_sampler.ipynb): the Engine: builds everything, runs one batch.
"""The Engine builds every part of stage 1 in dependency order and runs one batch at a time.

Order matters: the tp info before any layer (layers read it when built), the context before the
model (layers read it when run), the model before the KV pool (the pool is sized from what memory
the weights leave), the pool and page table before the attention backend (it keeps references
to both), and the dummy request before the GraphRunner (padding uses it).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from minisgl.attention import create_attention_backend, resolve_attn_backend
from minisgl.core import Batch, Context, Req, set_global_ctx
from minisgl.distributed import set_tp_info
from minisgl.kvcache import create_kvcache_pool, create_page_table
from minisgl.layers import set_rope_device
from minisgl.models import create_model
from minisgl.utils import torch_dtype

from .checks import check_args, check_batch
from .config import EngineConfig
from .graph import GraphRunner
from .lifecycle import OneLiveEngine
from .memory import available_memory, determine_num_pages
from .sample import BatchSamplingArgs, Sampler
from .setup import cpu_count, resolve_device, want_cpu_kernels, weight_state_dict


class ForwardOutput(NamedTuple):
    next_tokens_gpu: torch.Tensor  # [B] int32 on the engine's device
    next_tokens_cpu: torch.Tensor  # [B] int32 on the CPU, ready to read
    copy_done_event: Any  # None: forward_batch already waited for the copy


class Engine(OneLiveEngine):
    def __init__(self, config: EngineConfig) -> None:
        """Check the config, take over the process (lifecycle.py), build every part (``_init``)."""
        config.validate()  # nothing global has been touched yet
        self._begin_build(config)
        ok = False
        try:
            self.config, self.dtype = config, config.dtype  # config: resolved in place below
            self.device = resolve_device(config.device, config.tp_info.rank)
            self.tp_cpu_group = None
            if config.tp_info.size > 1:  # the optional tp section's process group
                from .tp import join_process_group

                self.tp_cpu_group = join_process_group(self, config, self.device)
            kernels = want_cpu_kernels(config)  # chapter 07's optional implementation
            object.__setattr__(config, "attention_backend",  # "auto" -> a real name
                               resolve_attn_backend(config.attention_backend, self.device,
                                                    config.dtype))
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            torch.manual_seed(42)
            torch.set_num_threads(config.num_threads or cpu_count())  # shutdown() puts it back
            self._init(config)
            if kernels:
                from minisgl import kernel

                kernel.bind(self.model)
            ok = True
        finally:
            self._end_build(ok)  # a failed build gives the live Engine its globals back

    def _init(self, config: EngineConfig) -> None:
        # BEGIN SOLUTION 6.4: initialise every part, in dependency order
        set_tp_info(config.tp_info.rank, config.tp_info.size)
        self.ctx = Context(page_size=config.page_size)
        set_global_ctx(self.ctx)
        free_before_model = available_memory(self.device)
        set_rope_device(self.device)
        with torch.device("meta"), torch_dtype(config.dtype):
            self.model = create_model(config.model_config)  # placeholders only: no memory yet
        self.model.load_state_dict(weight_state_dict(self.model, config, self.device))
        self.num_pages = determine_num_pages(self, free_before_model)
        self.kv_cache = create_kvcache_pool(config.model_config, num_pages=self.num_pages + 1,
                                            page_size=config.page_size, dtype=self.dtype,
                                            device=self.device)  # + 1: the dummy page
        self.ctx.kv_cache = self.kv_cache
        self.max_seq_len = min(config.max_seq_len, self.num_pages * config.page_size)
        self.page_table = create_page_table(config.max_running_req, self.max_seq_len,
                                            dummy_slot=self.num_pages * config.page_size,
                                            device=self.device)
        self.ctx.page_table = self.page_table
        self.attn_backend = create_attention_backend(config.attention_backend, config.model_config)
        self.ctx.attn_backend = self.attn_backend
        vocab_size = config.model_config.vocab_size
        self.sampler = Sampler(self.device, vocab_size)
        self.dummy_req = Req(input_ids=torch.tensor([0], dtype=torch.int32),
                             table_idx=config.max_running_req, cached_len=0, output_len=1,
                             uid=-1, sampling_params=None, cache_handle=None)
        self.graph_runner = GraphRunner(self.device, self.model, self.attn_backend,
                                        config.cuda_graph_bs, config.cuda_graph_max_bs,
                                        self.page_table.shape[1], vocab_size, self.dummy_req)
        # END SOLUTION

    def forward_batch(self, batch: Batch, args: BatchSamplingArgs) -> ForwardOutput:
        """Run the model on a prepared batch, advance each request, sample its next token."""
        if self._closed:
            raise RuntimeError(self._why_closed())
        check_batch(self, batch)
        check_args(batch, args)
        if self.device.type != "cpu":  # inputs built on the host move to the device once
            for name in ("input_ids", "positions", "out_loc"):
                setattr(batch, name, getattr(batch, name).to(self.device, non_blocking=True))
        with torch.no_grad():
            # BEGIN SOLUTION 6.5: forward inside the context, advance the requests, sample
            with self.ctx.forward_batch(batch):
                if self.graph_runner.can_use_cuda_graph(batch):
                    logits = self.graph_runner.replay(batch)
                else:
                    logits = self.model.forward()
            for req in batch.reqs:
                req.complete_one()
            next_tokens = self.sampler.sample(logits[: batch.size], args).to(torch.int32)
            # END SOLUTION
        next_tokens_cpu = next_tokens.to("cpu")  # on CUDA this waits for the copy
        return ForwardOutput(next_tokens, next_tokens_cpu, None)
