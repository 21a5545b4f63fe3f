# Chapter 06 (06_engine_and_sampler.ipynb): one live Engine per process (a notebook convenience).
"""A notebook cell that builds an Engine runs again and again. There is one global context and
one tp info per process, so one live Engine: the new one replaces the live one once it is
complete. While it builds, the live one lends it the globals (``Globals.set_aside``); a failed
build puts them back (``restore``), and the live Engine works on as if nothing happened.

Nothing here is part of the Engine's own story: a server builds one Engine and never needs it.
"""

from __future__ import annotations

import sys

from minisgl.core import reset_global_ctx, set_global_ctx, try_get_global_ctx
from minisgl.distributed import (DistributedCommunicator, reset_tp_info, set_tp_info,
                                 try_get_tp_info)
from minisgl.layers import get_rope_device, set_rope_device


def live_engine():
    """The live Engine, or None. Kept on ``sys``, outside minisgl, so that reloading minisgl's
    modules keeps track of it; a strong reference: an Engine nobody holds any more still owns
    the globals until it is shut down."""
    return getattr(sys, "_minisgl_live_engine", None)


def set_live(engine) -> None:
    sys._minisgl_live_engine = engine


def forget(engine) -> None:
    """``engine`` was shut down: no Engine is live unless another one already is."""
    if live_engine() is engine:
        sys._minisgl_live_engine = None


class Globals:
    """What an Engine holds process-wide: the context, the tp info, the rope device, the
    communicator's plugins."""

    def __init__(self) -> None:
        self.ctx, self.tp_info = try_get_global_ctx(), try_get_tp_info()
        self.rope_device, self.plugins = get_rope_device(), DistributedCommunicator.plugins

    @classmethod
    def set_aside(cls) -> "Globals":
        """Take the globals away from the live Engine (it keeps running); returns them."""
        saved = cls()
        reset_global_ctx()
        reset_tp_info()
        return saved

    def restore(self) -> None:
        """Give them back (the Engine that borrowed them failed to build)."""
        reset_global_ctx()
        reset_tp_info()
        if self.ctx is not None:
            set_global_ctx(self.ctx)
        if self.tp_info is not None:
            set_tp_info(self.tp_info.rank, self.tp_info.size)
        set_rope_device(self.rope_device)
        DistributedCommunicator.plugins = self.plugins
