# Chapter 03 (03_models_and_weights.ipynb): the MLP and attention blocks shared by all models.
"""``GatedMLP`` (gate_up -> silu * up -> down) and ``RopeAttn`` (qkv -> attention -> o_proj).

The attribute names (``gate_up_proj``, ``qkv_proj``, ``q_norm``, ...) are the state-dict keys,
so they match Hugging Face's names except for the two fused projections.
"""

from __future__ import annotations

import torch

from minisgl.layers import (
    AttentionLayer,
    LinearColParallelMerged,
    LinearOProj,
    LinearQKVMerged,
    LinearRowParallel,
    RMSNorm,
    StateLessOP,
    gelu_and_mul,
    silu_and_mul,
)
from minisgl.layers.base import BaseOP
from minisgl.layers.impls import current_ops

from .config import ModelConfig

_ACTIVATIONS = {"silu": silu_and_mul, "gelu": gelu_and_mul}


class GatedMLP(BaseOP):
    def __init__(self, config: ModelConfig) -> None:
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; supported: "
                             f"{', '.join(_ACTIVATIONS)}")
        self.gate_up_proj = LinearColParallelMerged(
            config.hidden_size, [config.intermediate_size, config.intermediate_size],
            has_bias=False)
        fused = current_ops().silu_and_mul if config.hidden_act == "silu" else None
        self._act_fn = fused or _ACTIVATIONS[config.hidden_act]  # fused: chosen when built
        self.down_proj = LinearRowParallel(config.intermediate_size, config.hidden_size,
                                           has_bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self._act_fn(self.gate_up_proj.forward(x)))


class RopeAttn(BaseOP):
    def __init__(self, config: ModelConfig, layer_id: int, *, has_attn_bias: bool = False,
                 has_qk_norm: bool = False) -> None:
        head_dim = config.head_dim
        self.qkv_proj = LinearQKVMerged(config.hidden_size, head_dim, config.num_qo_heads,
                                        config.num_kv_heads, has_bias=has_attn_bias)
        self.has_qk_norm = has_qk_norm
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if has_qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if has_qk_norm else None
        self.attn: StateLessOP = AttentionLayer(layer_id, config.num_qo_heads, config.num_kv_heads,
                                                head_dim, config.rotary_config,
                                                q_norm=self.q_norm, k_norm=self.k_norm)
        self.o_proj = LinearOProj(config.num_qo_heads * head_dim, config.hidden_size,
                                  has_bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj.forward(self.attn.forward(self.qkv_proj.forward(x)))
