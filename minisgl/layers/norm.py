# Chapter 02 (02_op_layer.ipynb): RMSNorm and the fused residual-add + RMSNorm.
"""RMSNorm: scale each row to unit root-mean-square, then multiply by a learned weight.

``y = x / sqrt(mean(x**2) + eps) * weight``, computed in float32 and cast back to x's dtype
before the weight multiply (the order Hugging Face uses, so float32 results are bit-identical).
"""

from __future__ import annotations

from typing import Tuple

import torch

from .base import BaseOP
from .impls import current_ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # BEGIN SOLUTION 2.6: RMSNorm in float32, cast back to x's dtype, then multiply by weight
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
    # END SOLUTION


class RMSNorm(BaseOP):
    def __init__(self, size: int, eps: float) -> None:
        self.eps = eps
        self.weight = torch.empty(size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def forward_inplace(self, x: torch.Tensor) -> None:
        """Normalise ``x`` in place (``x`` may be a strided view, e.g. q inside qkv)."""
        x.copy_(rms_norm(x, self.weight, self.eps))


class RMSNormFused(BaseOP):
    """Residual add + RMSNorm in one op, as every decoder layer uses it twice.

    ``forward(x, None)`` returns ``(norm(x), x)``: the input becomes the residual stream.
    ``forward(x, residual)`` first adds ``x`` into ``residual`` (in place), then returns
    ``(norm(residual), residual)``.
    """

    def __init__(self, size: int, eps: float) -> None:
        self.eps = eps
        self.weight = torch.empty(size)
        self._kernel = current_ops().add_rmsnorm  # None: the code below (impls.py)

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> Tuple[torch.Tensor, torch.Tensor]:
        if self._kernel is not None:  # a fused kernel this op was built with
            return self._kernel(x, residual, self.weight, self.eps)
        # BEGIN SOLUTION 2.7: the first call starts the residual stream; later calls add into it
        if residual is None:
            return rms_norm(x, self.weight, self.eps), x
        residual.add_(x)
        return rms_norm(residual, self.weight, self.eps), residual
        # END SOLUTION
