# Chapter 06 (06_engine_and_sampler.ipynb): the engine package's public names.
"""The Engine, its config, the sampler and the graph runner.

Each name is imported from its file when first used (``from minisgl.engine import Engine``): a
check cell that needs only the sampler imports sample.py, never engine.py, so a file left broken
by an earlier run blocks only the cells that use it, not the cell that rewrites it.
"""

import importlib

_WHERE = {"BatchSamplingArgs": "sample", "Engine": "engine", "EngineConfig": "config",
          "ForwardOutput": "engine", "GraphRunner": "graph", "Sampler": "sample"}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value  # found directly from now on
    return value
