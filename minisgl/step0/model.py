# Chapter 00 (00_step0_skeleton.ipynb): step 0's model: a config and a dict of weights.
"""Read a Hugging Face checkpoint folder into a plain dict of float32 tensors."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open


@dataclass
class Step0Model:
    config: dict  # config.json as read
    weights: dict[str, torch.Tensor]  # checkpoint name -> float32 tensor
    num_layers: int
    num_heads: int  # Hq
    num_kv_heads: int  # Hkv
    head_dim: int  # D
    eps: float  # RMSNorm epsilon
    rope_theta: float  # base of the rotary frequencies


def load_model(path) -> Step0Model:
    """Read config.json and every *.safetensors file of a HF checkpoint folder."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    # transformers 5 calls it rope_parameters; older configs say rope_scaling (None = default)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"{path.name} uses rope_type={rope_type!r}: step 0 supports only the "
                         "default rope; chapter 02 adds llama3/yarn")
    weights = {}
    for file in sorted(path.glob("*.safetensors")):  # a big checkpoint is split into shards
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                weights[name] = f.get_tensor(name).float()  # step 0 computes in float32
    if "lm_head.weight" not in weights:  # tied: the output layer reuses the embedding table
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    heads = config["num_attention_heads"]
    return Step0Model(
        config, weights, config["num_hidden_layers"], heads,
        config.get("num_key_value_heads", heads),
        config.get("head_dim") or config["hidden_size"] // heads,  # Qwen3 may set its own D
        config["rms_norm_eps"], float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
    )
