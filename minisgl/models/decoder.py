# Chapter 03 (03_models_and_weights.ipynb): one decoder for Llama, Qwen2 and Qwen3.
"""The decoder-only transformer that Llama 3, Qwen2.5 and Qwen3 share.

The three differ only in the attention block: Qwen2 adds biases to the q/k/v projections, Qwen3
normalises each head of q and k (RMSNorm) before RoPE. Everything else is identical, so one
file with two flags covers them.

Residual stream: each layer's input norm first adds the previous block's output into the
residual (``RMSNormFused``), so the residual add of the last MLP happens in the final norm.
"""

from __future__ import annotations

from typing import Tuple

import torch

from minisgl.core import get_global_ctx
from minisgl.layers import OPList, ParallelLMHead, RMSNormFused, VocabParallelEmbedding
from minisgl.layers.base import BaseOP

from .base import BaseLLMModel
from .config import ModelConfig
from .utils import GatedMLP, RopeAttn


class DecoderLayer(BaseOP):
    def __init__(self, config: ModelConfig, layer_id: int, *, has_attn_bias: bool,
                 has_qk_norm: bool) -> None:
        self.self_attn = RopeAttn(config, layer_id, has_attn_bias=has_attn_bias,
                                  has_qk_norm=has_qk_norm)
        self.mlp = GatedMLP(config)
        self.input_layernorm = RMSNormFused(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNormFused(config.hidden_size, config.rms_norm_eps)
        self._layer_id = layer_id

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> Tuple[torch.Tensor, torch.Tensor]:
        # BEGIN SOLUTION 3.2: norm -> attention -> norm (adds the residual) -> MLP
        x, residual = self.input_layernorm.forward(x, residual)
        x = self.self_attn.forward(x)
        x, residual = self.post_attention_layernorm.forward(x, residual)
        x = self.mlp.forward(x)
        # END SOLUTION
        return x, residual


class DecoderModel(BaseOP):
    def __init__(self, config: ModelConfig, *, has_attn_bias: bool, has_qk_norm: bool) -> None:
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = OPList([
            DecoderLayer(config, i, has_attn_bias=has_attn_bias, has_qk_norm=has_qk_norm)
            for i in range(config.num_layers)
        ])
        self.norm = RMSNormFused(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` token ids -> ``[T, hidden]`` final hidden states."""
        x = self.embed_tokens.forward(input_ids)
        residual = None
        for layer in self.layers.op_list:
            x, residual = layer.forward(x, residual)
        return self.norm.forward(x, residual)[0]


class DecoderForCausalLM(BaseLLMModel):
    """``model`` (the decoder stack) plus ``lm_head``; subclasses set the two flags."""

    has_attn_bias = False
    has_qk_norm = False

    def __init__(self, config: ModelConfig) -> None:
        self.model = DecoderModel(config, has_attn_bias=self.has_attn_bias,
                                  has_qk_norm=self.has_qk_norm)
        tied = config.tie_word_embeddings
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size,
                                      tie_word_embeddings=tied,
                                      tied_embedding=self.model.embed_tokens if tied else None)

    def forward(self) -> torch.Tensor:
        input_ids = get_global_ctx().batch.input_ids
        return self.lm_head.forward(self.model.forward(input_ids))


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama 3 (and SmolLM2): no q/k/v bias, no q/k norm."""


class Qwen2ForCausalLM(DecoderForCausalLM):
    """Qwen2 / Qwen2.5: q, k and v projections have biases."""

    has_attn_bias = True


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3: per-head RMSNorm of q and k before RoPE, no biases."""

    has_qk_norm = True
