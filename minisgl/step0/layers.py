# Chapter 00 (00_step0_skeleton.ipynb): step 0's layers, one plain function each.
"""The layers of a Llama-style decoder as functions of tensors (no modules, no state)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    """SwiGLU: down(silu(gate(x)) * up(x)); p is the layer's prefix, e.g. "model.layers.3.mlp."."""
    gate, up = linear(x, weights, p + "gate_proj"), linear(x, weights, p + "up_proj")  # [T, I]
    return linear(F.silu(gate) * up, weights, p + "down_proj")  # [T, hidden]
