# Chapter 06 (06_engine_and_sampler.ipynb): the Engine: builds everything, runs one batch.
"""The Engine builds every part of stage 1 in dependency order and runs one batch at a time.

Order matters: the tp info before any layer (layers read it when built), the implementation set
before the model (each op keeps what it was built with), the context before the model runs
(layers read it when run), the model before the KV pool (the pool is sized from what memory the
weights leave), the pool and page table before the attention backend (it keeps references to
both), and the dummy request before the GraphRunner (padding uses it).
"""

from __future__ import annotations

import dataclasses
import gc
import os
from typing import Any, NamedTuple

import torch

from minisgl.attention import create_attention_backend, resolve_attn_backend
from minisgl.core import (Batch, Context, Req, reset_global_ctx, set_global_ctx,
                          try_get_global_ctx)
from minisgl.distributed import destroy_distributed, reset_tp_info, set_tp_info
from minisgl.kvcache import create_kvcache_pool, create_page_table
from minisgl.layers import TORCH_OPS, OpImpls, build_ops, set_rope_device
from minisgl.models import create_model, load_weight
from minisgl.utils import torch_dtype

from .config import EngineConfig, resolve_device
from .graph import GraphRunner
from .live import Globals, forget, live_engine, set_live
from .sample import BatchSamplingArgs, Sampler

_GiB = 1 << 30
RELEASED = ("model", "kv_cache", "page_table", "attn_backend", "graph_runner", "sampler",
            "dummy_req")  # what shutdown() lets go of


class ForwardOutput(NamedTuple):
    next_tokens_gpu: torch.Tensor  # [B] int32 on the engine's device
    next_tokens_cpu: torch.Tensor  # [B] int32 on the CPU, ready to read
    copy_done_event: Any  # None: forward_batch already waited for the copy


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        """Check the config, take the globals over from a live Engine, choose the
        implementations, build every part (``_init``)."""
        config.validate()  # nothing global has been touched yet
        old = live_engine()
        if old is not None and old.tp_cpu_group is not None and config.tp_info.size > 1:
            raise RuntimeError(
                f"an Engine with tp size {old.config.tp_info.size} is still live in this process "
                "and holds its process group (one per process): call its shutdown() before "
                "building another tp Engine.")
        self._closed, self._closed_why, self._replacing = False, None, old
        self._prev_threads = torch.get_num_threads()  # a failed build puts it back
        self.device = resolve_device(config.device, config.tp_info.rank)
        self.dtype, self.tp_cpu_group = config.dtype, None
        self._check_pool_fits(config)  # before anything is allocated
        saved = Globals.set_aside() if old is not None else None
        ok = False
        try:
            if config.tp_info.size > 1:  # the optional tp section's process group
                from minisgl.distributed.group import join_process_group

                self.tp_cpu_group = join_process_group(
                    config.tp_info, config.distributed_addr, config.distributed_timeout,
                    self.device)
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            torch.manual_seed(42)
            torch.set_num_threads(config.num_threads or cpu_count())  # shutdown() puts it back
            self.ops = self._choose_ops(config)  # before the model: each op keeps its own
            self.config = dataclasses.replace(  # the caller's config keeps "auto"
                config, attention_backend=self._backend_name(config))
            with build_ops(self.ops):
                self._init(self.config)
            if self.ops.place_weights is not None:  # chapter 07: the weights in 2 MB pages
                self.ops.place_weights(self.model)
            ok = True
        finally:
            self._replacing = None
            if not ok:  # a failed build leaves no globals behind, and the live Engine working
                self._release(holds_globals=True)
                if saved is not None and not old._closed:
                    saved.restore()
        set_live(self)
        if old is not None:
            old._retire("one per process", self)

    def _choose_ops(self, config: EngineConfig) -> OpImpls:
        """The chapters' torch code, or (``cpu_kernels=True``) chapter 07's kernels. Where they
        cannot be built, one line says why and the chapters' code runs."""
        if not config.cpu_kernels:
            return TORCH_OPS  # the default imports nothing of chapter 07
        from minisgl import kernel

        return kernel.op_impls() if kernel.load() is not None else TORCH_OPS

    def _backend_name(self, config: EngineConfig) -> str:
        """``"auto"`` -> a real name: the kernels' backend when they run, else chapter 05's."""
        if config.attention_backend == "auto" and self.ops.name == "cpp":
            return "cpp"
        return resolve_attn_backend(config.attention_backend, self.device, config.dtype)
# --- part 2: _init, every part in dependency order ---

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
        self.num_pages = self._determine_num_pages(free_before_model)
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
# --- part 3: how many KV pages ---

    def _check_pool_fits(self, config: EngineConfig) -> None:
        """``num_page_override`` pages must fit in the memory available now (what a live Engine
        would free counts): checked before the build allocates anything."""
        if config.num_page_override is None:
            return  # the pool is sized from the memory left (_determine_num_pages)
        per_page = config.kv_cache_bytes_per_page
        need = (config.num_page_override + 1) * per_page  # + the dummy page
        have = available_memory(self.device) + self._reclaimable()
        if need > have:
            raise MemoryError(
                f"num_page_override={config.num_page_override} asks for a KV pool of "
                f"{need / _GiB:.2f} GiB ({per_page} bytes per page) but only {have / _GiB:.2f} "
                "GiB is available: use fewer pages (or a smaller page_size).")

    def _reclaimable(self) -> int:
        """Bytes of this device's memory the Engine being replaced frees when it shuts down."""
        old = self._replacing
        if old is None or old._closed or old.device != self.device:
            return 0
        return (nbytes(old.model.state_dict().values()) + nbytes([old.page_table])
                + (old.num_pages + 1) * old.config.kv_cache_bytes_per_page)

    def _determine_num_pages(self, free_before_model: int) -> int:
        """Pages of the KV pool (the dummy page not counted); every tp rank gets the same number.
        The Engine being replaced is shut down early when the pool does not fit beside it."""
        config = self.config
        free = free_before_model + self._reclaimable()
        if self.device.type == "cpu":  # tp ranks on one machine share its memory
            free //= config.tp_info.size
        model_bytes = nbytes(self.model.state_dict().values())
        num_pages = self.pages_that_fit(config, free, model_bytes)
        if config.num_page_override is not None:  # the override wins over the budget
            num_pages = config.num_page_override  # (it fits: _check_pool_fits)
        elif num_pages < 1:
            raise MemoryError(
                f"memory_ratio={config.memory_ratio} leaves no room for the KV pool: "
                f"{free / _GiB:.2f} GiB was available, the weights take "
                f"{model_bytes / _GiB:.2f} GiB and one page needs "
                f"{config.kv_cache_bytes_per_page} bytes. Raise memory_ratio, or set "
                "num_page_override to a number of pages that fits.")
        elif self.tp_cpu_group is not None:  # every rank must hold the same number of pages
            import torch.distributed as dist

            pages = torch.tensor([num_pages], dtype=torch.int64)
            dist.all_reduce(pages, op=dist.ReduceOp.MIN, group=self.tp_cpu_group)
            num_pages = int(pages.item())
        old = self._replacing
        need = (num_pages + 1) * config.kv_cache_bytes_per_page
        if old is not None and not old._closed and need > available_memory(self.device):
            old._retire("early, to make room for this one's KV pool", self)
        return num_pages

    @staticmethod
    def pages_that_fit(config, free: int, model_bytes: int) -> int:
        """``memory_ratio`` of ``free`` bytes, less the weights, in pages; capped at the pages
        ``max_running_req`` requests of ``max_seq_len`` tokens could ever fill."""
        per_page = config.kv_cache_bytes_per_page
        # BEGIN SOLUTION 6.6: the pages that fit beside the weights, capped at what requests can use
        budget = config.memory_ratio * free - model_bytes
        useful = -(-config.max_running_req * config.max_seq_len // config.page_size)  # ceil
        num_pages = min(int(budget // per_page), useful)
        # END SOLUTION
        return num_pages
# --- part 4: forward_batch, and the batch boundary ---

    def forward_batch(self, batch: Batch, args: BatchSamplingArgs) -> ForwardOutput:
        """Run the model on a prepared batch, advance each request, sample its next token."""
        if self._closed:
            raise RuntimeError(self._why_closed())
        self._check_batch(batch)
        _check_args(batch, args)
        if self.device.type != "cpu":  # inputs built on the host move to the device once
            for name in ("input_ids", "positions", "out_loc"):
                setattr(batch, name, getattr(batch, name).to(self.device, non_blocking=True))
        # inference mode, as the official server runs: no autograd, and a view or a new tensor
        # skips the version counter no_grad still keeps (about 1% of a CPU decode step)
        with torch.inference_mode():
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

    def _check_batch(self, batch: Batch) -> None:
        """The batch is padded, filled and prepared, fits this Engine, and its fields agree with
        its requests: a loop over the requests, and over the [T] values as Python ints."""
        padded = batch.padded_size  # raises when pad_batch was not called
        for name in ("input_ids", "positions", "out_loc"):
            if getattr(batch, name) is None:
                raise RuntimeError(f"batch.{name} was never set: fill input_ids, positions and "
                                   "out_loc before engine.forward_batch (see step() in chapter 07).")
        if batch.attn_metadata is None:
            raise RuntimeError("batch.attn_metadata is not set: call "
                               "engine.attn_backend.prepare_metadata(batch) first.")
        max_req = self.config.max_running_req
        if batch.size > max_req:
            raise ValueError(f"the batch has {batch.size} requests but the Engine was built with "
                             f"max_running_req={max_req}: split the batch or raise it.")
        rows = set()  # rows outside the table: prepare_metadata refused them already
        for r in batch.reqs:
            if r.table_idx == max_req:
                raise IndexError(f"Req(uid={r.uid}).table_idx={r.table_idx} is outside the page "
                                 f"table's rows 0..{max_req - 1} (row {max_req} is the dummy's).")
            if r.table_idx in rows:
                raise ValueError(f"table_idx={r.table_idx} is used by two requests in one batch: "
                                 "each request needs its own page-table row.")
            rows.add(r.table_idx)
            self._check_req(r, batch.is_decode)
        self._check_tensors(batch, padded)
# --- part 5: the batch boundary, continued ---

    def _check_req(self, r: Req, is_decode: bool) -> None:
        if r.remain_len < 1:
            raise ValueError(f"Req(uid={r.uid}) is finished: it holds all max_device_len="
                             f"{r.max_device_len} tokens (prompt + output_len={r.output_len}) "
                             "and another forward would sample one token more; take it out "
                             "of the batch.")
        if r.max_device_len > self.max_seq_len:
            raise ValueError(f"Req(uid={r.uid}): prompt + max tokens = {r.max_device_len} > "
                             f"max_seq_len={self.max_seq_len}: shorten the prompt or lower "
                             f"output_len{self._longer_requests_advice()}.")
        if is_decode and r.extend_len != 1:
            raise ValueError(f"Req(uid={r.uid}) computes {r.extend_len} tokens in a decode "
                             "batch: a decode step computes exactly one token per request "
                             "(the LM head keeps every row); put it in a prefill batch.")

    def _check_tensors(self, batch: Batch, padded: int) -> None:
        reqs = batch.padded_reqs
        total = sum(r.extend_len for r in reqs)
        for name in ("input_ids", "positions", "out_loc"):
            t = getattr(batch, name)
            if t.dim() != 1 or t.shape[0] != total:
                raise ValueError(f"batch.{name} has shape {tuple(t.shape)} but the requests "
                                 f"compute {total} tokens (sum of extend_len): rebuild it.")
            if t.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"batch.{name} has dtype {t.dtype}: it must hold integers "
                                "(torch.int32).")
        # the values as Python ints, three torch calls in all: a decode step checks a handful of
        # numbers, and a torch op per check cost more than the checks (after the LM head has
        # emptied the caches, 10-20 us each)
        pos, loc, ids = (getattr(batch, n).tolist() for n in ("positions", "out_loc", "input_ids"))
        want = [p for r in reqs for p in range(r.cached_len, r.device_len)]
        if pos != want:
            at = next(i for i, (p, w) in enumerate(zip(pos, want)) if p != w)
            r = reqs[_owner(reqs, at)]
            raise ValueError(f"batch.positions does not match the requests: Req(uid={r.uid}) "
                             f"computes positions cached_len..device_len-1 = {r.cached_len}.."
                             f"{r.device_len - 1}, but position {at} of the batch holds "
                             f"{pos[at]}: rebuild positions from the requests.")
        slots = self.kv_cache.num_slots
        if loc and (min(loc) < 0 or max(loc) >= slots):
            raise IndexError(f"batch.out_loc holds slot {min(loc) if min(loc) < 0 else max(loc)}, "
                             f"outside the KV pool's slots 0..{slots - 1}: fill the page table "
                             f"with slots below {slots - self.config.page_size} (the last page "
                             "is the dummy's).")
        if batch.is_prefill and len(set(loc)) != total:
            raise ValueError("batch.out_loc repeats a KV slot: two tokens of this prefill would "
                             "write the same place in the pool; give every token its own slot "
                             "(each request its own page-table row and pages).")
        vocab = self.config.model_config.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            bad = next(i for i, t in enumerate(ids) if not 0 <= t < vocab)  # the first bad one
            r = reqs[_owner(reqs, bad)]
            raise ValueError(f"batch.input_ids holds token id {ids[bad]} (Req(uid={r.uid})),"
                             f" outside the vocabulary 0..{vocab - 1}: token ids come from this "
                             "model's tokenizer; check the prompt's ids.")

    def _longer_requests_advice(self) -> str:
        """How a longer request could fit, in terms of the options that limit it."""
        config = self.config
        positions = config.model_config.rotary_config.max_position
        if self.max_seq_len < config.max_seq_len:  # the KV pool is the limit
            return (f", or give the Engine a larger KV pool (it holds {self.num_pages} pages of "
                    f"{config.page_size} tokens): raise num_page_override or memory_ratio")
        if config.max_seq_len < positions:
            return (", or build the Engine with a larger max_seq_len_override (at most the "
                    f"model's {positions} positions)")
        return f" (the model has {positions} positions, no more)"
# --- part 6: shutdown, and an Engine replaced by a newer one ---

    def shutdown(self) -> None:
        """Release the model, the KV pool and every global this Engine set."""
        if self._closed:
            return
        if getattr(self, "graph_runner", None) is not None:
            self.graph_runner.destroy_cuda_graphs()
        self._release(holds_globals=try_get_global_ctx() is getattr(self, "ctx", None))
        forget(self)

    def _retire(self, why: str, successor: "Engine") -> None:
        """Shut down because ``successor`` holds the globals now (it keeps the thread count)."""
        if self._closed:
            return
        if successor.config.tp_info.is_primary():  # with tp > 1, only rank 0 prints
            print(f"Engine: shutting down the Engine that was live before this one ({why}).")
        threads = torch.get_num_threads()
        successor._prev_threads = self._prev_threads  # its shutdown() restores the count from
        self.shutdown()                               # before both
        torch.set_num_threads(threads)
        self._closed_why = "replaced"

    def _release(self, holds_globals: bool) -> None:
        if holds_globals:  # the globals are this Engine's (not lent to a newer one)
            reset_global_ctx()
            reset_tp_info()
            destroy_distributed()
        if self.tp_cpu_group is not None and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()  # the group this Engine joined (tp > 1)
        torch.set_num_threads(self._prev_threads)
        for name in RELEASED:
            self.__dict__.pop(name, None)
        if getattr(self, "ctx", None) is not None:
            self.ctx.kv_cache = self.ctx.attn_backend = self.ctx.page_table = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # so the next Engine's free-memory reading sees it again
        self._closed, self._closed_why = True, self._closed_why or "shutdown"

    def _why_closed(self) -> str:
        if self._closed_why == "replaced":
            return ("this Engine was replaced by a newer Engine (one per process) and shut "
                    "down: use the newer Engine, or build a new one.")
        return "this Engine was shut down: build a new one."

    def __getattr__(self, name: str):
        # only called for attributes that do not exist: say why when shutdown() released them
        if self.__dict__.get("_closed") and name in RELEASED:
            raise AttributeError(f"engine.{name} is gone: {self._why_closed()}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
# --- part 7: helpers (no Engine state) ---


def _check_args(batch: Batch, args: BatchSamplingArgs) -> None:
    """The sampling args must be this batch's: row b of the args is request b's."""
    if not hasattr(args, "temperatures"):
        raise TypeError(f"args must be the BatchSamplingArgs of engine.sampler.prepare(batch), "
                        f"got {type(args).__name__}.")
    reqs = getattr(args, "reqs", None)
    if reqs is not None:
        same = len(reqs) == batch.size and all(a is b for a, b in zip(reqs, batch.reqs))
    else:  # built by hand: at least the number of rows must match
        same = args.temperatures is None or args.temperatures.shape[0] == batch.size
    if not same:
        prepared = (f"requests {[r.uid for r in reqs]}" if reqs is not None
                    else f"{args.temperatures.shape[0]} requests")
        raise ValueError(f"these sampling args were prepared for another batch ({prepared}), "
                         f"not for this one (requests {[r.uid for r in batch.reqs]}): call "
                         "engine.sampler.prepare(batch) for each batch you forward.")


def _owner(reqs, at: int) -> int:
    """Which request computes token ``at`` of the batch (its index in ``reqs``)."""
    ends = torch.tensor([r.extend_len for r in reqs]).cumsum(0)
    return int((ends <= at).sum())


def available_memory(device: torch.device) -> int:
    """Bytes this process may still allocate on ``device`` (CPU: MemAvailable)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil  # pragma: no cover - macOS and others without /proc

    return psutil.virtual_memory().available


def cpu_count() -> int:
    """CPU cores this process may run on (all cores where the OS cannot tell, e.g. macOS)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def nbytes(tensors) -> int:
    """Bytes of the distinct tensors (a tied LM head shares the embedding's)."""
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def weight_state_dict(model, config: EngineConfig, device: torch.device) -> dict:
    """The checkpoint's tensors in ``config.dtype`` (random ones with ``use_dummy_weight``): the
    load boundary, where a tensor that does not fit the dtype is refused by name."""
    if config.use_dummy_weight:
        return {k: torch.randn(v.shape, dtype=v.dtype, device=device) * 0.02
                for k, v in model.state_dict().items()}
    state = {}
    for name, t in load_weight(config.model_path, device):  # finite floats (checked)
        if t.dtype != config.dtype:
            was, t = t.dtype, t.to(config.dtype)
            if not bool(torch.isfinite(t).all()):
                wider = ", or torch.float32" if was != torch.float32 else ""
                raise ValueError(f"weight {name} does not fit in {config.dtype}: converted from "
                                 f"the checkpoint's {was}, it holds inf; build the Engine "
                                 f"with dtype={was}{wider}.")
        state[name] = t
    return state
