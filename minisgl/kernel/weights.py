# Chapter 07 (07_stage1_milestone.ipynb): the weights in one buffer of 2 MB pages.
"""``place_weights(model)``: called once by an Engine built with the kernels, after loading.

A decode step streams every weight from memory. With 4 KB pages the core's TLB covers a few
MB, and it walks the page table again every 4 KB; with 2 MB pages (Linux's transparent huge
pages, asked for with ``madvise``) the translations of all the weights stay cached. The
weights are copied into one buffer that starts on a 2 MB boundary, in state-dict order, each on
its own cache line, and swapped in one at a time (each loader tensor is freed before the next
copy). Without huge pages (THP set to ``never``) it is plain memory: the same values, the same
speed as before.
"""

from __future__ import annotations

import torch

LINE = 64  # bytes: each weight starts a cache line


def weight_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeroed memory (uint8) starting on a 2 MB boundary, huge pages asked for.

    The kernels' library maps it (``weight_buffer``, ``csrc/linear.h`` part 4) and so knows when
    it is freed: its workers read ahead there and nowhere else (chapter 07, reading ahead)."""
    from minisgl import kernel  # not at the top: the package imports this module

    module = kernel.load()
    if module is None:
        raise RuntimeError(f"the weight buffer is mapped by the C++ kernels, which are not "
                           f"available here ({kernel.unavailable_reason()}): build the Engine "
                           f"with cpu_kernels=False")
    try:
        return module.weight_buffer(nbytes)
    except torch.OutOfMemoryError as e:
        raise MemoryError(
            f"cannot map {nbytes / 1e6:.0f} MB for the weights in 2 MB pages ({e}): the Engine "
            "copies them there once, one tensor at a time. Free some memory, lower "
            "memory_ratio, or build the Engine with cpu_kernels=False.") from e


def _swap_in(model, key: str, tensor: torch.Tensor) -> None:
    """Set the weight whose state-dict key is ``key`` (its attribute path, chapter 02)."""
    *path, name = key.split(".")
    op = model
    for part in path:
        op = getattr(op, part)
    setattr(op, name, tensor)


def float_weights(model) -> dict[str, torch.Tensor]:
    """The weights ``place_weights`` moves: every float32 CPU tensor of the state dict, by key."""
    return {key: t for key, t in model.state_dict().items()
            if t.dtype == torch.float32 and t.device.type == "cpu"}


def place_weights(model, map_buffer=None) -> torch.Tensor:
    """Copy every float32 CPU weight of ``model`` into one buffer (``map_buffer(nbytes)``;
    None: ``weight_buffer``) and swap the copies in: same values, same shapes, contiguous, each
    64-byte aligned. Returns the buffer (every placed weight is a view of it)."""
    weights = float_weights(model)
    size = {key: -(-t.numel() * 4 // LINE) * LINE for key, t in weights.items()}
    buffer = (map_buffer or weight_buffer)(sum(size.values()))
    at = 0
    for key in list(weights):
        t = weights.pop(key)  # the dict's reference goes now, the model's at the swap
        copy = buffer[at:at + t.numel() * 4].view(torch.float32).view(t.shape)
        copy.copy_(t)
        _swap_in(model, key, copy)
        del t
        at += size[key]
    return buffer
