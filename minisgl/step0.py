# Chapter 00 (00_step0_skeleton.ipynb): the naive step-0 generator that stage 1 replaces.
"""Step 0: a whole decoder-only LLM as a handful of plain torch functions.

One `ids` tensor and one `pos` tensor go in, float32 logits come out. Weights sit in a dict,
the KV cache in Python lists that grow with `torch.cat`, and the next token is the `argmax`.
It is slow on purpose: the rest of the workbook replaces it piece by piece, and benchmarks
keep it as the baseline to measure against.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
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


def linear(x: torch.Tensor, weights: dict, name: str) -> torch.Tensor:
    """x @ W.T, plus the bias when the checkpoint has one (Qwen2's q/k/v projections do)."""
    return F.linear(x, weights[name + ".weight"], weights.get(name + ".bias"))


def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table[ids]  # [T] -> [T, hidden]: one row of the table per token


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Scale each vector (last dim) to unit root-mean-square, then by `weight`; in float32."""
    # BEGIN SOLUTION 0.1: normalise x by the root-mean-square of its last dim, then multiply by weight
    x = x.float()  # squares of big activations lose precision in half types
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # [..., dim]
    return weight * x
    # END SOLUTION


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate every head of x [T, H, D] by its token's position (NeoX rotate-half layout)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)  # [D/2]
    angles = pos[:, None].float() * inv_freq  # [T, D/2]: position times frequency
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]  # [T, 1, D], same for every head
    x1, x2 = x[..., : d // 2], x[..., d // 2:]  # pairs are (i, i + D/2), not neighbours
    rotated = torch.cat([-x2, x1], dim=-1)  # [T, H, D]
    return x * angles.cos() + rotated * angles.sin()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of T new queries q [T, Hq, D] over all S keys/values k, v [S, Hkv, D].

    The new tokens are the last T of the S: new token t sits at position S - T + t and may look
    at keys 0 .. S - T + t. Returns [T, Hq * D].
    """
    T, S, D = q.shape[0], k.shape[0], q.shape[-1]
    group = q.shape[1] // k.shape[1]  # GQA: each KV head serves `group` query heads
    k = k.repeat_interleave(group, dim=1)  # [S, Hq, D]
    v = v.repeat_interleave(group, dim=1)  # [S, Hq, D]
    # BEGIN SOLUTION 0.2: scores = q.k / sqrt(D), mask the future with -inf, softmax in float32, weight v
    scores = torch.einsum("thd,shd->hts", q, k) / D**0.5  # [Hq, T, S]
    future = torch.triu(torch.ones(T, S, dtype=torch.bool), diagonal=S - T + 1)  # [T, S]
    scores = scores.masked_fill(future, float("-inf"))  # exp(-inf) = 0: no weight on the future
    probs = torch.softmax(scores.float(), dim=-1)  # [Hq, T, S], each row sums to 1
    out = torch.einsum("hts,shd->thd", probs, v)  # [T, Hq, D]
    # END SOLUTION
    return out.reshape(T, -1)  # [T, Hq * D]


def mlp(x: torch.Tensor, weights: dict, p: str) -> torch.Tensor:
    gate, up = linear(x, weights, p + "gate_proj"), linear(x, weights, p + "up_proj")  # [T, I]
    return linear(F.silu(gate) * up, weights, p + "down_proj")  # [T, hidden]


def forward(model: Step0Model, ids: torch.Tensor, pos: torch.Tensor, kv: list) -> torch.Tensor:
    """Run the new tokens ids [T] at positions pos [T]; return their float32 logits [T, V].

    kv holds one [k, v] pair per layer for the tokens seen so far (an empty list before the
    prefill); this call appends the new tokens' keys and values to it.
    """
    w, T, eps = model.weights, ids.shape[0], model.eps
    Hq, Hkv, D = model.num_heads, model.num_kv_heads, model.head_dim
    h = embedding(ids, w["model.embed_tokens.weight"])  # [T, hidden]
    for i in range(model.num_layers):
        p = f"model.layers.{i}."
        x = rms_norm(h, w[p + "input_layernorm.weight"], eps)  # [T, hidden]
        q = linear(x, w, p + "self_attn.q_proj").view(T, Hq, D)
        k = linear(x, w, p + "self_attn.k_proj").view(T, Hkv, D)
        v = linear(x, w, p + "self_attn.v_proj").view(T, Hkv, D)
        if p + "self_attn.q_norm.weight" in w:  # Qwen3 normalises each head before the rotation
            q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k = rope(q, pos, model.rope_theta), rope(k, pos, model.rope_theta)
        if len(kv) == i:  # first call: this layer's history starts empty
            kv.append([k[:0], v[:0]])
        # the naive cache: copy the whole history plus the new rows into fresh tensors
        kv[i][0] = torch.cat([kv[i][0], k])  # [S, Hkv, D]
        kv[i][1] = torch.cat([kv[i][1], v])  # [S, Hkv, D]
        h = h + linear(attention(q, kv[i][0], kv[i][1]), w, p + "self_attn.o_proj")
        h = h + mlp(rms_norm(h, w[p + "post_attention_layernorm.weight"], eps), w, p + "mlp.")
    h = rms_norm(h, w["model.norm.weight"], eps)  # [T, hidden]
    return linear(h, w, "lm_head").float()  # [T, V]


@torch.no_grad()
def generate(model: Step0Model, input_ids: list[int], max_new_tokens: int,
             on_step=None) -> list[int]:
    """Greedy decoding: one prefill over the prompt, then one decode step per further token.

    on_step(i, seconds) runs after each step; i = 0 is the prefill (which already yields the
    first new token), i >= 1 are decode steps.
    """
    if max_new_tokens <= 0:
        return []
    kv: list = []
    start = time.perf_counter()
    logits = forward(model, torch.tensor(input_ids), torch.arange(len(input_ids)), kv)  # [T, V]
    new = [int(logits[-1].argmax())]  # only the last row predicts a token we do not have yet
    if on_step is not None:
        on_step(0, time.perf_counter() - start)
    # BEGIN SOLUTION 0.3: decode loop: feed the newest token at its position, append the argmax
    for i in range(1, max_new_tokens):
        start = time.perf_counter()
        ids = torch.tensor([new[-1]])  # [1]: only the newest token; kv holds the rest
        pos = torch.tensor([len(input_ids) + i - 1])  # [1]: its place in the whole sequence
        logits = forward(model, ids, pos, kv)  # [1, V]; every layer's kv grows by one row
        new.append(int(logits[-1].argmax()))
        if on_step is not None:
            on_step(i, time.perf_counter() - start)
    # END SOLUTION
    return new
