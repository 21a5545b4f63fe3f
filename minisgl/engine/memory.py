# Chapter 06 (06_engine_and_sampler.ipynb): how many KV pages fit, and what memory there is.
"""The KV pool gets what memory the weights leave: ``memory_ratio`` of the memory that was free
before the weights loaded, minus the weights, in pages of ``kv_cache_bytes_per_page`` bytes,
capped at what ``max_running_req`` requests of ``max_seq_len`` tokens could ever use (or exactly
``num_page_override`` pages). An Engine being replaced frees its memory too: it counts as free,
and it is shut down early when the new pool does not fit beside it.
"""

from __future__ import annotations

import torch

from .lifecycle import retire

_GiB = 1 << 30


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


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def held_bytes(engine, device: torch.device) -> int:
    """Bytes of ``device`` memory a live Engine frees when it shuts down (0 for another device)."""
    if engine is None or engine._closed or engine.device != device:
        return 0
    return (_nbytes(engine.model.state_dict().values()) + _nbytes([engine.page_table])
            + (engine.num_pages + 1) * engine.config.kv_cache_bytes_per_page)


def _make_room(engine, need: int) -> None:
    """Shut the Engine being replaced down early when ``need`` bytes do not fit beside it."""
    old = engine._replacing
    if old is not None and not old._closed and need > available_memory(engine.device):
        retire(old, engine, "early, to make room for this one's KV pool")


def determine_num_pages(engine, free_before_model: int) -> int:
    """Pages of the KV pool (the dummy page not counted); every tp rank gets the same number."""
    config = engine.config
    per_page = config.kv_cache_bytes_per_page
    reclaim = held_bytes(engine._replacing, engine.device)
    free = free_before_model + reclaim
    if engine.device.type == "cpu":  # tp ranks on one machine share its memory
        free //= config.tp_info.size
    model_bytes = _nbytes(engine.model.state_dict().values())
    # BEGIN SOLUTION 6.6: the pages that fit beside the weights, capped at what requests can use
    budget = config.memory_ratio * free - model_bytes
    useful = -(-config.max_running_req * config.max_seq_len // config.page_size)  # ceil
    num_pages = min(int(budget // per_page), useful)
    # END SOLUTION
    if config.num_page_override is not None:  # the override wins over the budget
        num_pages = config.num_page_override
        need, have = (num_pages + 1) * per_page, available_memory(engine.device) + reclaim
        if need > have:
            raise MemoryError(
                f"num_page_override={num_pages} asks for a KV pool of {need / _GiB:.2f} GiB "
                f"({per_page} bytes per page) but only {have / _GiB:.2f} GiB is "
                "available: use fewer pages (or a smaller page_size).")
        _make_room(engine, need)
        return num_pages
    if num_pages < 1:
        raise MemoryError(
            f"memory_ratio={config.memory_ratio} leaves no room for the KV pool: "
            f"{free / _GiB:.2f} GiB was available, the weights take "
            f"{model_bytes / _GiB:.2f} GiB and one page needs {per_page} bytes. Raise "
            "memory_ratio, or set num_page_override to a number of pages that fits.")
    if engine.tp_cpu_group is not None:  # every rank must hold the same number of pages
        import torch.distributed as dist

        pages = torch.tensor([num_pages], dtype=torch.int64)
        dist.all_reduce(pages, op=dist.ReduceOp.MIN, group=engine.tp_cpu_group)
        num_pages = int(pages.item())
    _make_room(engine, (num_pages + 1) * per_page)
    return num_pages
