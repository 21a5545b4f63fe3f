# Chapter 06 (06_engine_and_sampler.ipynb): the engine package's public names.
"""The Engine, its config, the sampler and the graph runner."""

from .config import EngineConfig
from .engine import Engine, ForwardOutput
from .graph import GraphRunner
from .sample import BatchSamplingArgs, Sampler

__all__ = ["BatchSamplingArgs", "Engine", "EngineConfig", "ForwardOutput", "GraphRunner",
           "Sampler"]
