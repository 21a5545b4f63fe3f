# Chapter 00 (00_step0_skeleton.ipynb): step 0's forward pass and greedy generation loop.
"""All layers of the model over T new tokens, and the prefill + decode loop around it."""

from __future__ import annotations

import time

import torch

from .layers import attention, embedding, linear, mlp, rms_norm, rope
from .model import Step0Model


def forward(model: Step0Model, ids: torch.Tensor, pos: torch.Tensor, kv: list) -> torch.Tensor:
    """Run the new tokens ids [T] at positions pos [T]; return their float32 logits [T, V].

    kv holds one [k, v] pair per layer for the tokens seen so far, oldest first (an empty list
    before the prefill); this call appends the new tokens' keys and values to it.
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
        # BEGIN SOLUTION 0.4: append the new k and v rows to this layer's cache kv[i] (torch.cat)
        if len(kv) == i:  # first call: this layer's history starts empty
            kv.append([k[:0], v[:0]])
        # the naive cache: copy the whole history plus the new rows into fresh tensors
        kv[i][0] = torch.cat([kv[i][0], k])  # [S, Hkv, D]
        kv[i][1] = torch.cat([kv[i][1], v])  # [S, Hkv, D]
        # END SOLUTION
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
