# Chapter 06 (06_engine_and_sampler.ipynb): the Engine: builds everything, runs one batch.
"""The Engine builds every part of stage 1 in dependency order and runs one batch at a time.

Order matters: the tp info before any layer (layers read it when built), the context before the
model (layers read it when run), the model before the KV pool (the pool is sized from what memory
the weights leave), the pool and page table before the attention backend (it keeps references
to both), and the dummy request before the GraphRunner (padding uses it).
"""

from __future__ import annotations

import gc
import os
import socket
import sys
from typing import Any, NamedTuple

import torch

from minisgl.attention import create_attention_backend, resolve_attn_backend
from minisgl.core import Batch, Context, Req, reset_global_ctx, set_global_ctx
from minisgl.distributed import (DistributedCommunicator, destroy_distributed, reset_tp_info,
                                 set_tp_info, try_get_tp_info)
from minisgl.kvcache import create_kvcache_pool, create_page_table
from minisgl.layers import set_rope_device
from minisgl.models import create_model, load_weight
from minisgl.utils import torch_dtype

from .config import EngineConfig, loopback_host_port
from .graph import GraphRunner
from .sample import BatchSamplingArgs, Sampler

_GiB = 1 << 30
_RELEASED = ("model", "kv_cache", "page_table", "attn_backend", "graph_runner", "sampler",
             "dummy_req")  # what shutdown() lets go of


class ForwardOutput(NamedTuple):
    next_tokens_gpu: torch.Tensor  # [B] int32 on the engine's device
    next_tokens_cpu: torch.Tensor  # [B] int32 on the CPU, ready to read
    copy_done_event: Any  # None: forward_batch already waited for the copy


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


def _resolve_device(name: str, tp_rank: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", tp_rank)
    return torch.device(name)


def _loopback_interface() -> str:
    """The loopback interface's name ("lo" on Linux, "lo0" on macOS)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:  # pragma: no cover
        names = []
    return next((n for n in names if n in ("lo", "lo0")), "lo")


def _cpu_count() -> int:
    """CPU cores this process may run on (all cores where the OS cannot tell, e.g. macOS)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _live_engine() -> "Engine | None":
    # Kept on `sys`, outside minisgl, so that reloading minisgl's modules keeps track of it. A
    # strong reference: an Engine that nobody holds any more still owns the global context and
    # tp info until it is shut down, so it must stay reachable for the next Engine to shut down.
    return getattr(sys, "_minisgl_live_engine", None)


def _set_aside(live: "Engine | None") -> dict | None:
    """While a new Engine builds, the live one keeps running but gives up the process-wide
    globals (the context, the tp info, the rope device, the communicator's plugins): the new
    Engine's ``_init`` sets its own. Returns what to give back if the build fails."""
    if live is None:
        return None
    from minisgl import core
    from minisgl.layers import rotary

    saved = {"ctx": core._GLOBAL_CTX, "tp_info": try_get_tp_info(), "owns": dict(live._owns),
             "rope": rotary._ROPE_DEVICE, "plugins": DistributedCommunicator.plugins}
    reset_global_ctx()
    reset_tp_info()
    live._owns.update(ctx=False, tp_info=False)  # not its to release while set aside
    return saved


def _give_back(live: "Engine | None", saved: dict | None) -> None:
    """The new Engine failed: the live one gets its globals back and keeps working."""
    if live is None or saved is None or live._closed:
        return
    from minisgl.layers import set_rope_device

    reset_global_ctx()
    reset_tp_info()
    if saved["ctx"] is not None:
        set_global_ctx(saved["ctx"])
    if saved["tp_info"] is not None:
        set_tp_info(saved["tp_info"].rank, saved["tp_info"].size)
    set_rope_device(saved["rope"])
    DistributedCommunicator.plugins = saved["plugins"]
    live._owns.update(saved["owns"])


def _held_bytes(engine: "Engine", device: torch.device) -> int:
    """Bytes of ``device`` memory a live Engine frees when it shuts down (weights, KV pool, page
    table); 0 for another device."""
    if engine._closed or engine.device != device:
        return 0
    held = {id(t): t for t in engine.model.state_dict().values()}
    total = sum(t.numel() * t.element_size() for t in held.values())
    total += (engine.num_pages + 1) * engine.config.kv_cache_bytes_per_page
    return total + engine.page_table.numel() * engine.page_table.element_size()


def _retire(old: "Engine", new: "Engine", why: str) -> None:
    """Shut ``old`` down now that ``new`` holds the globals: ``old`` resets none of them (it
    gave them up in ``_set_aside``), and ``new`` keeps its thread count and plugins."""
    if old._closed:
        return
    if new.config.tp_info.is_primary():  # with tp > 1, only rank 0 prints
        print(f"Engine: shutting down the Engine that was live before this one ({why}).")
    threads, plugins = torch.get_num_threads(), DistributedCommunicator.plugins
    new._prev_threads = old._prev_threads  # new.shutdown() restores the count from before both
    old.shutdown()
    old._closed_why = "replaced"
    torch.set_num_threads(threads)
    DistributedCommunicator.plugins = plugins


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        """Build every part; a live Engine is replaced only once this one is complete."""
        config.validate()  # nothing global has been touched yet
        live = _live_engine()
        if live is not None and live._closed:
            live = None
        if live is not None and live._owns.get("dist") and config.tp_info.size > 1:
            raise RuntimeError(
                f"an Engine with tp size {live.config.tp_info.size} is still live in this process "
                "and holds its process group (one per process): call its shutdown() before "
                "building another tp Engine.")
        self._closed = False
        self._closed_why: str | None = None
        self._prev_threads = torch.get_num_threads()
        self._owns = {"tp_info": False, "ctx": False, "dist": False}
        self._replacing = live  # may be shut down early to make room (_determine_num_pages)
        saved = _set_aside(live)
        try:
            self.tp_cpu_group = self._init_communication(config)  # None when tp=1
            kernels = self._want_cpu_kernels(config)  # chapter 07's optional implementation
            self._init(config)
            if kernels:
                from minisgl import kernel

                kernel.bind(self.model)
        except BaseException:
            self._release()
            _give_back(live, saved)  # a failed build leaves the live Engine working
            raise
        finally:
            self._replacing = None
        sys._minisgl_live_engine = self
        if live is not None:
            _retire(live, self, "one per process")

    def _why_closed(self) -> str:
        if self.__dict__.get("_closed_why") == "replaced":
            return ("this Engine was replaced by a newer Engine (one per process) and shut down: "
                    "use the newer Engine, or build a new one.")
        return "this Engine was shut down: build a new one."

    def __getattr__(self, name: str):
        # only called for attributes that do not exist: say why when shutdown() released them
        if self.__dict__.get("_closed_why") is not None and name in _RELEASED:
            raise AttributeError(f"engine.{name} is gone: {self._why_closed()}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _init(self, config: EngineConfig) -> None:
        # BEGIN SOLUTION 6.4: initialise every part, in dependency order
        self.device = _resolve_device(config.device, config.tp_info.rank)
        object.__setattr__(config, "attention_backend",  # "auto" -> a real name
                           resolve_attn_backend(config.attention_backend, self.device,
                                                config.dtype))
        self.config = config
        set_tp_info(config.tp_info.rank, config.tp_info.size)
        self._owns["tp_info"] = True
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(42)
        torch.set_num_threads(config.num_threads or _cpu_count())
        self.dtype = config.dtype
        self.ctx = Context(page_size=config.page_size)
        set_global_ctx(self.ctx)
        self._owns["ctx"] = True
        free_before_model = available_memory(self.device)

        model_config = config.model_config
        set_rope_device(self.device)
        with torch.device("meta"), torch_dtype(config.dtype):
            self.model = create_model(model_config)  # placeholders only: no memory yet
        self.model.load_state_dict(self._load_weight_state_dict(config))

        self.num_pages = self._determine_num_pages(free_before_model, config)
        self.kv_cache = create_kvcache_pool(model_config, num_pages=self.num_pages + 1,
                                            page_size=config.page_size, dtype=self.dtype,
                                            device=self.device)  # + 1: the dummy page
        self.ctx.kv_cache = self.kv_cache
        self.max_seq_len = min(config.max_seq_len, self.num_pages * config.page_size)
        self.page_table = create_page_table(config.max_running_req, self.max_seq_len,
                                            dummy_slot=self.num_pages * config.page_size,
                                            device=self.device)
        self.ctx.page_table = self.page_table
        self.attn_backend = create_attention_backend(config.attention_backend, model_config)
        self.ctx.attn_backend = self.attn_backend
        self.sampler = Sampler(self.device, model_config.vocab_size)
        self.dummy_req = Req(input_ids=torch.tensor([0], dtype=torch.int32),
                             table_idx=config.max_running_req, cached_len=0, output_len=1,
                             uid=-1, sampling_params=None, cache_handle=None)
        self.graph_runner = GraphRunner(self.device, self.model, self.attn_backend,
                                        config.cuda_graph_bs, config.cuda_graph_max_bs,
                                        self.page_table.shape[1], model_config.vocab_size,
                                        self.dummy_req)
        # END SOLUTION

    def _want_cpu_kernels(self, config: EngineConfig) -> bool:
        """``cpu_kernels=True``: use chapter 07's fused C++ kernels in this Engine. The choice
        is made here, once: the kernels are built (or found in their cache), ``"auto"`` picks
        the ``"cpp"`` attention backend, and after ``_init`` the model's ops are bound to the
        kernels (``kernel.bind``). Where they cannot be built, one line says why and the Engine
        runs the chapters' code. The default (False) imports and compiles nothing."""
        if not config.cpu_kernels:
            return False
        from minisgl import kernel

        if kernel.load() is None:
            return False
        if config.attention_backend == "auto":
            object.__setattr__(config, "attention_backend", "cpp")
        return True

    def _init_communication(self, config: EngineConfig):
        """tp > 1: join the process group of the ``size`` ranks (one Engine per process).

        Every rank calls this with the same address; rank 0 listens there and the call returns
        once all ``size`` ranks have joined (or raises after ``distributed_timeout`` seconds).
        Returns the group that carries CPU tensors (gloo), or None when tp=1.
        """
        if config.tp_info.size == 1:
            return None
        import datetime

        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process: an "
                               "Engine with tp > 1 creates its own process group; call "
                               "torch.distributed.destroy_process_group() first.")
        device = _resolve_device(config.device, config.tp_info.rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        host, port = loopback_host_port(config.distributed_addr)
        lo = _loopback_interface()  # gloo's and NCCL's own sockets: on loopback too
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = lo
        timeout = datetime.timedelta(seconds=config.distributed_timeout)
        size = config.tp_info.size
        if config.tp_info.rank == 0:  # the store listens on 127.0.0.1, never on every interface
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind((host, port))
                listener.listen(max(64, size))
            except OSError as e:
                listener.close()
                raise RuntimeError(f"rank 0 cannot listen on {host}:{port} ({e}): set "
                                   "MINISGL_DIST_ADDR to a free port, e.g. "
                                   "tcp://127.0.0.1:29500.") from e
            store = dist.TCPStore(host, port, size, True, timeout,
                                  master_listen_fd=listener.detach())  # the store owns it now
        else:
            store = dist.TCPStore(host, port, size, False, timeout)
        dist.init_process_group(backend, store=store, rank=config.tp_info.rank, world_size=size,
                                timeout=timeout)
        self._owns["dist"] = True
        return dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")

    def _load_weight_state_dict(self, config: EngineConfig) -> dict:
        if config.use_dummy_weight:
            return {k: torch.randn(v.shape, dtype=v.dtype, device=self.device) * 0.02
                    for k, v in self.model.state_dict().items()}
        state = {}
        for name, t in load_weight(config.model_path, self.device):  # finite floats (checked)
            if t.dtype != self.dtype:
                was, t = t.dtype, t.to(self.dtype)
                if not bool(torch.isfinite(t).all()):
                    wider = ", or torch.float32" if was != torch.float32 else ""
                    raise ValueError(f"weight {name} does not fit in {self.dtype}: converted from "
                                     f"the checkpoint's {was}, it holds inf; build the Engine "
                                     f"with dtype={was}{wider}.")
            state[name] = t
        return state

    def _make_room(self, need: int) -> None:
        """The Engine being replaced is shut down early when this one's KV pool (``need``
        bytes) does not fit beside it; the config and the weights were checked already."""
        old = self._replacing
        if old is not None and not old._closed and need > available_memory(self.device):
            _retire(old, self, "early, to make room for this one's KV pool")

    def _determine_num_pages(self, free_before_model: int, config: EngineConfig) -> int:
        cache_per_page = config.kv_cache_bytes_per_page
        model_bytes = sum(t.numel() * t.element_size()
                          for t in {id(t): t for t in self.model.state_dict().values()}.values())
        old = self._replacing  # the Engine this one replaces frees its memory: count it as free
        reclaim = _held_bytes(old, self.device) if old is not None else 0
        if config.num_page_override is not None:
            num_pages = config.num_page_override
            need = (num_pages + 1) * cache_per_page
            have = available_memory(self.device) + reclaim
            if need > have:
                raise MemoryError(
                    f"num_page_override={num_pages} asks for a KV pool of {need / _GiB:.2f} GiB "
                    f"({cache_per_page} bytes per page) but only {have / _GiB:.2f} GiB is "
                    "available: use fewer pages (or a smaller page_size).")
            self._make_room(need)
            return num_pages
        free_before_model += reclaim
        if self.device.type == "cpu":  # tp ranks on one machine share its memory
            free_before_model //= config.tp_info.size
        budget = config.memory_ratio * free_before_model - model_bytes
        # never more slots than max_running_req requests of max_seq_len tokens can use
        useful = -(-config.max_running_req * config.max_seq_len // config.page_size)
        num_pages = min(int(budget // cache_per_page), useful)
        if num_pages < 1:
            raise MemoryError(
                f"memory_ratio={config.memory_ratio} leaves no room for the KV pool: "
                f"{free_before_model / _GiB:.2f} GiB was available, the weights take "
                f"{model_bytes / _GiB:.2f} GiB and one page needs {cache_per_page} bytes. Raise "
                "memory_ratio, or set num_page_override to a number of pages that fits.")
        if self.tp_cpu_group is not None:  # every rank must hold the same number of pages
            import torch.distributed as dist

            pages = torch.tensor([num_pages], dtype=torch.int64)
            dist.all_reduce(pages, op=dist.ReduceOp.MIN, group=self.tp_cpu_group)
            num_pages = int(pages.item())
        self._make_room((num_pages + 1) * cache_per_page)
        return num_pages

    # ------------------------------------------------------------------ one step
    def _check_batch(self, batch: Batch) -> None:
        """Clear errors for a batch that cannot be computed (cheap: a loop over the requests)."""
        if batch.padded_reqs is None:
            raise RuntimeError("batch.padded_reqs is not set: call "
                               "engine.graph_runner.pad_batch(batch) first.")
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
        seen = set()
        width = self.page_table.shape[1]
        for r in batch.reqs:
            if not 0 <= r.table_idx < max_req:
                raise IndexError(f"Req(uid={r.uid}).table_idx={r.table_idx} is outside the page "
                                 f"table's rows 0..{max_req - 1} (row {max_req} is the dummy's).")
            if r.table_idx in seen:
                raise ValueError(f"table_idx={r.table_idx} is used by two requests in one batch: "
                                 "each request needs its own page-table row.")
            seen.add(r.table_idx)
            if r.remain_len < 1:
                raise ValueError(f"Req(uid={r.uid}) is finished: it holds all max_device_len="
                                 f"{r.max_device_len} tokens (prompt + output_len={r.output_len}) "
                                 "and another forward would sample one token more; take it out "
                                 "of the batch.")
            if r.max_device_len > self.max_seq_len:
                raise ValueError(f"Req(uid={r.uid}): prompt + max tokens = {r.max_device_len} > "
                                 f"max_seq_len={self.max_seq_len}: shorten the prompt or lower "
                                 f"output_len{self._longer_requests_advice()}.")
            if r.device_len > width:
                raise ValueError(f"Req(uid={r.uid}) has {r.device_len} tokens but page-table rows "
                                 f"hold {width}.")
            if batch.is_decode and r.extend_len != 1:
                raise ValueError(f"Req(uid={r.uid}) computes {r.extend_len} tokens in a decode "
                                 "batch: a decode step computes exactly one token per request "
                                 "(the LM head keeps every row); put it in a prefill batch.")
        total = sum(r.extend_len for r in batch.padded_reqs)
        for name in ("input_ids", "positions", "out_loc"):
            t = getattr(batch, name)
            if t.dim() != 1 or t.shape[0] != total:
                raise ValueError(f"batch.{name} has shape {tuple(t.shape)} but the requests "
                                 f"compute {total} tokens (sum of extend_len): rebuild it.")
            if t.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"batch.{name} has dtype {t.dtype}: it must hold integers "
                                "(torch.int32).")
        slots = self.kv_cache.num_slots
        lo, hi = int(batch.out_loc.min()), int(batch.out_loc.max())
        if lo < 0 or hi >= slots:
            raise IndexError(f"batch.out_loc holds slot {lo if lo < 0 else hi}, outside the KV "
                             f"pool's slots 0..{slots - 1}: fill the page table with slots below "
                             f"{slots - self.config.page_size} (the last page is the dummy's).")
        vocab = self.config.model_config.vocab_size
        ids = batch.input_ids
        lo, hi = torch.aminmax(ids)  # one pass over the ids
        if int(lo) < 0 or int(hi) >= vocab:
            at = int(((ids < 0) | (ids >= vocab)).nonzero()[0])  # the first bad token
            ends = torch.tensor([r.extend_len for r in batch.padded_reqs]).cumsum(0)
            r = batch.padded_reqs[int((ends <= at).sum())]
            raise ValueError(f"batch.input_ids holds token id {int(ids[at])} (Req(uid={r.uid})), "
                             f"outside the vocabulary 0..{vocab - 1}: token ids come from this "
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

    def _check_args(self, batch: Batch, args: BatchSamplingArgs) -> None:
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
                             f"not for this one (requests "
                             f"{[r.uid for r in batch.reqs]}): call engine.sampler.prepare(batch) "
                             "for each batch you forward.")

    def forward_batch(self, batch: Batch, args: BatchSamplingArgs) -> ForwardOutput:
        """Run the model on a prepared batch, advance each request, sample its next token."""
        if self._closed:
            raise RuntimeError(self._why_closed())
        self._check_batch(batch)
        self._check_args(batch, args)
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

    # ------------------------------------------------------------------ teardown
    def _release(self) -> None:
        from minisgl import core

        if self._owns.get("ctx") and core._GLOBAL_CTX is getattr(self, "ctx", None):
            reset_global_ctx()
        if self._owns.get("tp_info"):
            reset_tp_info()
        destroy_distributed()
        if self._owns.get("dist"):  # the process group this Engine created (tp > 1)
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self._owns["dist"] = False
        torch.set_num_threads(self._prev_threads)
        for name in ("model", "kv_cache", "page_table", "attn_backend", "graph_runner",
                     "sampler", "dummy_req"):
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
