# Chapter 02 (02_op_layer.ipynb): the attention layer (q/k norm, rotary, then the backend).
"""The attention *layer* owns no weights: it splits the fused qkv projection, applies the
optional per-head q/k RMSNorm (Qwen3) and RoPE, and hands q, k, v to the context's attention
backend (chapter 05), which stores k, v in the KV pool and attends. The KV pool therefore holds
post-norm, post-RoPE keys and raw values.
"""

from __future__ import annotations

import torch

from minisgl.core import get_global_ctx
from minisgl.distributed import get_tp_info
from minisgl.utils import div_even

from .base import StateLessOP
from .norm import RMSNorm
from .rotary import get_rope


class AttentionLayer(StateLessOP):
    def __init__(self, layer_id: int, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 rotary_config, q_norm: RMSNorm | None = None,
                 k_norm: RMSNorm | None = None) -> None:
        if num_qo_heads % num_kv_heads != 0:
            raise ValueError(f"num_qo_heads={num_qo_heads} is not a multiple of "
                             f"num_kv_heads={num_kv_heads}: grouped-query attention needs it.")
        tp = get_tp_info().size
        self.layer_id = layer_id
        self.head_dim = head_dim
        self.num_qo_heads = div_even(num_qo_heads, tp)
        self.num_kv_heads = div_even(num_kv_heads, tp, allow_replicate=True)
        self.qo_attn_dim = self.num_qo_heads * head_dim
        self.kv_attn_dim = self.num_kv_heads * head_dim
        scaling = rotary_config.scaling
        self.rotary = get_rope(head_dim, rotary_config.rotary_dim, rotary_config.max_position,
                               rotary_config.base,
                               tuple(sorted(scaling.items())) if scaling else None)
        self.q_norm = q_norm  # owned (and named in the state dict) by the parent RopeAttn
        self.k_norm = k_norm

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        """``qkv [T, (Hq + 2*Hkv) * D]`` -> attention output ``[T, Hq * D]``."""
        ctx = get_global_ctx()
        # BEGIN SOLUTION 2.9: split, q/k norm, rotary, then the backend
        # split_with_sizes: what Tensor.split, a Python function in torch, ends up calling
        q, k, v = qkv.split_with_sizes([self.qo_attn_dim, self.kv_attn_dim, self.kv_attn_dim],
                                       dim=-1)
        if self.q_norm is not None:
            self.q_norm.forward_inplace(q.view(-1, self.num_qo_heads, self.head_dim))
        if self.k_norm is not None:
            self.k_norm.forward_inplace(k.view(-1, self.num_kv_heads, self.head_dim))
        q, k = self.rotary.forward(ctx.batch.positions, q, k)
        o = ctx.attn_backend.forward(q.view(-1, self.num_qo_heads, self.head_dim), k, v,
                                     self.layer_id, ctx.batch)
        # END SOLUTION
        return o.view(-1, self.qo_attn_dim)
