# Chapter 03 (03_models_and_weights.ipynb): the models package's public names.
"""Model configuration, the decoder for Llama / Qwen2 / Qwen3, and streaming weight loading."""

from .base import BaseLLMModel
from .config import ModelConfig, RotaryConfig
from .register import create_model, get_model_class
from .weight import load_weight

__all__ = ["BaseLLMModel", "ModelConfig", "RotaryConfig", "create_model", "get_model_class",
           "load_weight"]
