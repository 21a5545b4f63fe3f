# Chapter 02 (02_op_layer.ipynb): the gated activations of the MLP.
"""``silu_and_mul(x) = silu(gate) * up`` where ``x = [gate | up]`` along the last dim."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    d = x.shape[-1] // 2
    y = F.silu(x[..., :d])  # a fresh [..., d] tensor: the gate half
    y.mul_(x[..., d:])
    return y if out is None else out.copy_(y)


def gelu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    d = x.shape[-1] // 2
    y = F.gelu(x[..., :d])
    y.mul_(x[..., d:])
    return y if out is None else out.copy_(y)
