# Chapter 07 (07_stage1_milestone.ipynb): the weights in one buffer of 2 MB pages.
"""``place_weights(model)``: called once by an Engine built with the kernels, after loading.

A decode step streams every weight from memory. With 4 KB pages the core's TLB covers a few
MB, and it walks the page table again every 4 KB; with 2 MB pages (Linux's transparent huge
pages, asked for with ``madvise``) the translations of all the weights stay cached. The
weights are copied into one buffer that starts on a 2 MB boundary, in state-dict order, each on
its own cache line, and swapped in one at a time (each loader tensor is freed before the next
copy). Without huge pages (another OS, THP set to ``never``) it is plain memory: the same
values, the same speed as before.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20  # bytes: a transparent huge page on x86-64 and arm64 Linux
LINE = 64  # bytes: each weight starts a cache line


def weight_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeroed memory (uint8) starting on a 2 MB boundary, huge pages asked for."""
    try:  # private and anonymous: a shared mapping would be shmem, whose huge pages are off
        mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (AttributeError, TypeError):  # no such mmap here (Windows): plain memory
        return torch.zeros(nbytes, dtype=torch.uint8)
    except OSError as e:
        raise MemoryError(
            f"cannot map {nbytes / 1e6:.0f} MB for the weights in 2 MB pages ({e}): the Engine "
            "copies them there once, one tensor at a time. Free some memory, lower "
            "memory_ratio, or build the Engine with cpu_kernels=False.") from e
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; asked before any page is touched
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel built without THP: 4 KB pages, the same values
            pass
    raw = torch.frombuffer(mm, dtype=torch.uint8)  # keeps the mapping alive while viewed
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start:start + nbytes]


def _swap_in(model, key: str, tensor: torch.Tensor) -> None:
    """Set the weight whose state-dict key is ``key`` (its attribute path, chapter 02)."""
    *path, name = key.split(".")
    op = model
    for part in path:
        op = getattr(op, part)
    setattr(op, name, tensor)


def place_weights(model) -> torch.Tensor:
    """Copy every float32 CPU weight of ``model`` into one buffer (``weight_buffer``) and swap
    the copies in: same values, same shapes, contiguous, each 64-byte aligned. Returns the
    buffer (every placed weight is a view of it)."""
    weights = {key: t for key, t in model.state_dict().items()
               if t.dtype == torch.float32 and t.device.type == "cpu"}
    size = {key: -(-t.numel() * 4 // LINE) * LINE for key, t in weights.items()}
    buffer = weight_buffer(sum(size.values()))
    at = 0
    for key in list(weights):
        t = weights.pop(key)  # the dict's reference goes now, the model's at the swap
        copy = buffer[at:at + t.numel() * 4].view(torch.float32).view(t.shape)
        copy.copy_(t)
        _swap_in(model, key, copy)
        del t
        at += size[key]
    return buffer
