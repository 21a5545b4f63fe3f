# Chapter 03 (03_models_and_weights.ipynb): the base class of every model.
"""A model is a BaseOP whose ``forward()`` takes no arguments and returns logits: the token ids,
positions and everything else come from the global context's active batch."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from minisgl.layers import BaseOP


class BaseLLMModel(BaseOP, ABC):
    @abstractmethod
    def forward(self) -> torch.Tensor: ...
