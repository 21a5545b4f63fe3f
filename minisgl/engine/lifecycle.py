# Chapter 06 (06_engine_and_sampler.ipynb): one live Engine per process (a notebook's lifecycle).
"""One global context and one tp info per process, so one live Engine. A notebook cell that builds
an Engine runs again and again: the new Engine replaces the live one once it is complete. While
it builds, the live one lends it the globals (``_set_aside``); a failed build gives them back
(``_give_back``); a complete one shuts the old one down with a one-line notice (``retire``).
What ``shutdown()`` releases is in shutdown.py.
"""

from __future__ import annotations

import sys

import torch

from minisgl import core
from minisgl.core import reset_global_ctx, set_global_ctx
from minisgl.distributed import (DistributedCommunicator, reset_tp_info, set_tp_info,
                                 try_get_tp_info)
from minisgl.layers import rotary, set_rope_device

from .shutdown import Releasable

def live_engine():
    # Kept on `sys`, outside minisgl, so that reloading minisgl's modules keeps track of it. A
    # strong reference: an Engine nobody holds any more still owns the globals until shut down.
    live = getattr(sys, "_minisgl_live_engine", None)
    return None if live is None or live._closed else live


def _set_aside(live) -> dict | None:
    """The live Engine keeps running but lends the globals (context, tp info, rope device,
    communicator plugins) to the Engine being built; returns what to give back on failure."""
    if live is None:
        return None
    saved = {"ctx": core._GLOBAL_CTX, "tp_info": try_get_tp_info(), "owns": dict(live._owns),
             "rope": rotary._ROPE_DEVICE, "plugins": DistributedCommunicator.plugins}
    reset_global_ctx()
    reset_tp_info()
    live._owns.update(ctx=False, tp_info=False)  # not its to release while set aside
    return saved


def _give_back(live, saved: dict | None) -> None:
    """The new Engine failed: the live one gets its globals back and keeps working."""
    if live is None or saved is None or live._closed:
        return
    reset_global_ctx()
    reset_tp_info()
    if saved["ctx"] is not None:
        set_global_ctx(saved["ctx"])
    if saved["tp_info"] is not None:
        set_tp_info(saved["tp_info"].rank, saved["tp_info"].size)
    set_rope_device(saved["rope"])
    DistributedCommunicator.plugins = saved["plugins"]
    live._owns.update(saved["owns"])


def retire(old, new, why: str) -> None:
    """Shut ``old`` down now that ``new`` holds the globals (``old`` resets none of them)."""
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


class OneLiveEngine(Releasable):
    """What ``Engine.__init__`` does around the build itself."""

    def _begin_build(self, config) -> None:
        """Before the build: set the live Engine aside; the globals are this one's from now."""
        live = live_engine()
        if live is not None and live._owns.get("dist") and config.tp_info.size > 1:
            raise RuntimeError(
                f"an Engine with tp size {live.config.tp_info.size} is still live in this process "
                "and holds its process group (one per process): call its shutdown() before "
                "building another tp Engine.")
        self._closed, self._closed_why = False, None
        self._prev_threads = torch.get_num_threads()
        self._replacing = live  # may be retired early to make room (memory.determine_num_pages)
        self._saved = _set_aside(live)  # the globals are clear now: what the build sets is ours
        self._owns = {"tp_info": True, "ctx": True, "dist": False}

    def _end_build(self, ok: bool) -> None:
        """After the build: retire the old Engine, or (failed) give it its globals back."""
        live, self._replacing = self._replacing, None
        if not ok:
            self._release()
            _give_back(live, self._saved)  # a failed build leaves the live Engine working
            return
        sys._minisgl_live_engine = self
        if live is not None:
            retire(live, self, "one per process")
