# Chapter 03 (03_models_and_weights.ipynb): architecture name -> model class.
"""The registry that turns ``config.architectures[0]`` into a model object."""

from __future__ import annotations

from minisgl.utils import Registry

from .base import BaseLLMModel
from .config import ModelConfig
from .decoder import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY: Registry[type] = Registry("architecture")
MODEL_REGISTRY.register("LlamaForCausalLM")(LlamaForCausalLM)
MODEL_REGISTRY.register("MistralForCausalLM")(LlamaForCausalLM)  # same layers as Llama
MODEL_REGISTRY.register("Qwen2ForCausalLM")(Qwen2ForCausalLM)
MODEL_REGISTRY.register("Qwen3ForCausalLM")(Qwen3ForCausalLM)


def get_model_class(arch: str, config: ModelConfig) -> BaseLLMModel:
    """Build the model for ``arch`` (returns an instance, as the official function does)."""
    if arch not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {arch!r}; supported: "
                         f"{', '.join(MODEL_REGISTRY.supported_names())}")
    return MODEL_REGISTRY[arch](config)


def create_model(model_config: ModelConfig) -> BaseLLMModel:
    return get_model_class(model_config.architectures[0], model_config)
