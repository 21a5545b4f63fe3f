# Chapter 03 (03_models_and_weights.ipynb): ModelConfig and RotaryConfig from an HF config.
"""The handful of numbers the engine needs from a Hugging Face ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

REQUIRED_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                   "intermediate_size", "rms_norm_eps", "max_position_embeddings")


@dataclass(frozen=True)
class RotaryConfig:
    head_dim: int
    rotary_dim: int
    max_position: int
    base: float
    scaling: Dict[str, Any] | None


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    intermediate_size: int
    rms_norm_eps: float
    rotary_config: RotaryConfig
    hidden_act: str
    tie_word_embeddings: bool
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    model_type: str
    architectures: List[str]

    @property
    def is_moe(self) -> bool:
        return "moe" in self.model_type

    @classmethod
    def from_hf(cls, config: Any) -> "ModelConfig":
        """Read an HF ``PretrainedConfig`` (or anything with the same attributes)."""
        text = getattr(config, "text_config", None) or config
        missing = [f for f in REQUIRED_FIELDS if getattr(text, f, None) is None]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}: is this a decoder-only "
                             "language model's config (Llama / Qwen2 / Qwen3)?")
        # BEGIN SOLUTION 3.1: head counts and head_dim, with their defaults
        num_qo_heads = text.num_attention_heads
        num_kv_heads = getattr(text, "num_key_value_heads", None) or num_qo_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_qo_heads
        # END SOLUTION
        # transformers 5 keeps every rope setting in `rope_parameters`; older configs use
        # `rope_theta` + `rope_scaling`.
        rope = dict(getattr(text, "rope_parameters", None) or getattr(config, "rope_parameters",
                                                                      None) or {})
        if not rope:
            rope = dict(getattr(text, "rope_scaling", None) or {})
            rope.setdefault("rope_theta", getattr(text, "rope_theta", None)
                            or getattr(config, "rope_theta", None) or 10000.0)
        base = float(rope.get("rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default"))
        scaling = None if kind == "default" else rope
        return cls(
            num_layers=text.num_hidden_layers,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            hidden_size=text.hidden_size,
            vocab_size=text.vocab_size,
            intermediate_size=text.intermediate_size,
            rms_norm_eps=text.rms_norm_eps,
            rotary_config=RotaryConfig(head_dim, head_dim, text.max_position_embeddings, base,
                                       scaling),
            hidden_act=getattr(text, "hidden_act", "silu"),
            tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", None)
                                     or getattr(config, "tie_word_embeddings", False)),
            num_experts=getattr(text, "num_experts", 0) or 0,
            num_experts_per_tok=getattr(text, "num_experts_per_tok", 0) or 0,
            moe_intermediate_size=getattr(text, "moe_intermediate_size", 0) or 0,
            norm_topk_prob=bool(getattr(text, "norm_topk_prob", False)),
            model_type=getattr(text, "model_type", None) or "llama",
            architectures=list(getattr(config, "architectures", None) or ["LlamaForCausalLM"]),
        )
