# Chapter 02 (02_op_layer.ipynb): the op layer's public names.
"""The op layer: plain Python objects that own their weights, no ``nn.Module``."""

from .activation import gelu_and_mul, silu_and_mul
from .attention import AttentionLayer
from .base import BaseOP, OPList, StateLessOP
from .embedding import ParallelLMHead, VocabParallelEmbedding
from .impls import TORCH_OPS, OpImpls, build_ops, current_ops
from .linear import (
    LinearColParallelMerged,
    LinearOProj,
    LinearQKVMerged,
    LinearReplicated,
    LinearRowParallel,
)
from .norm import RMSNorm, RMSNormFused
from .rotary import RotaryEmbedding, get_rope, get_rope_device, set_rope_device

__all__ = [
    "AttentionLayer",
    "BaseOP",
    "LinearColParallelMerged",
    "LinearOProj",
    "LinearQKVMerged",
    "LinearReplicated",
    "LinearRowParallel",
    "OPList",
    "OpImpls",
    "ParallelLMHead",
    "RMSNorm",
    "RMSNormFused",
    "RotaryEmbedding",
    "StateLessOP",
    "TORCH_OPS",
    "VocabParallelEmbedding",
    "build_ops",
    "current_ops",
    "gelu_and_mul",
    "get_rope",
    "get_rope_device",
    "set_rope_device",
    "silu_and_mul",
]
