# Chapter 00 (00_step0_skeleton.ipynb): the naive step-0 generator that stage 1 replaces.
"""Step 0: a whole decoder-only LLM as a handful of plain torch functions.

One `ids` tensor and one `pos` tensor go in, float32 logits come out. Weights sit in a dict,
the KV cache in Python lists that grow with `torch.cat`, and the next token is the `argmax`.
It is slow on purpose: the rest of the workbook replaces it piece by piece, and benchmarks
keep it as the baseline to measure against.

    model.py       Step0Model, load_model: config and weights of a HF checkpoint folder
    layers.py      linear, embedding, rms_norm, rope, attention, mlp: one function per layer
    generation.py  forward (all layers, the KV lists) and generate (greedy decoding)
"""

from .generation import forward, generate
from .layers import attention, embedding, linear, mlp, rms_norm, rope
from .model import Step0Model, load_model

__all__ = ["Step0Model", "attention", "embedding", "forward", "generate", "linear", "load_model",
           "mlp", "rms_norm", "rope"]
