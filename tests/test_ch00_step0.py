"""Chapter 00: the step-0 skeleton (minisgl/step0/) against Hugging Face transformers.

References: HF's models (greedy tokens, full-sequence logits, its RMSNorm module) and plain
per-query torch loops for attention. Exercises: 0.1 rms_norm, 0.2 attention, 0.3 decode loop,
0.4 the KV cache in forward.
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
from helpers import SMOL, hf_greedy, hf_model, model_path, tokenizer

from minisgl import step0

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
TEACHER_FORCED = ["tiny-llama", "tiny-qwen2", "tiny-qwen3"]
PREFILL, TOTAL = 6, 12  # teacher forcing: prefill 6 tokens, then 6 single-token decode steps


@functools.cache
def load(name: str) -> step0.Step0Model:
    return step0.load_model(model_path(name))


def fixed_ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed))


def reference_attention(q, k, v):
    """Plain loop: query t (the (S - T + t)-th token) attends keys 0 .. S - T + t of its KV head."""
    T, Hq, D = q.shape
    S, Hkv, _ = k.shape
    out = torch.empty(T, Hq, D)
    for t in range(T):
        last = S - T + t
        for h in range(Hq):
            kh = h // (Hq // Hkv)
            w = torch.softmax(k[: last + 1, kh] @ q[t, h] / D**0.5, dim=0)  # [last + 1]
            out[t, h] = w @ v[: last + 1, kh]
    return out.reshape(T, Hq * D)


# ----------------------------------------------------------------------------- the pieces


@pytest.mark.parametrize("shape,eps", [((5, 64), 1e-6), ((3, 4, 32), 1e-6), ((4, 16), 0.5)])
def test_rms_norm_matches_hf(shape, eps):
    """A large eps too: where eps goes (inside the root, added to the mean) shows only then."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    ref = LlamaRMSNorm(shape[-1], eps=eps)
    with torch.no_grad():
        ref.weight.copy_(torch.rand(shape[-1], generator=torch.Generator().manual_seed(1)) + 0.5)
        x = 3 * torch.randn(shape, generator=torch.Generator().manual_seed(2))
        got, want = step0.rms_norm(x, ref.weight, eps), ref(x)
    assert got.shape == want.shape, (
        f"Exercise 0.1 (rms_norm): output shape {tuple(got.shape)}, expected {tuple(want.shape)}; "
        "take the mean over the last dim with keepdim=True")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: (
        "Exercise 0.1 (rms_norm) differs from HF's LlamaRMSNorm: compute "
        "x * rsqrt(mean(x^2 over the last dim) + eps) in float32, then multiply by weight.\n" + m))


def test_rms_norm_computes_in_float32():
    """Half-precision input: the squares of big activations overflow float16 (max 65504)."""
    g = torch.Generator().manual_seed(5)
    x = (300 * torch.randn(4, 64, generator=g)).half()
    w = torch.rand(64, generator=g) + 0.5
    got = step0.rms_norm(x, w, 1e-6)
    xd = x.double()
    want = w.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert got.dtype == torch.float32 and torch.allclose(got.double(), want, atol=1e-4,
                                                         rtol=1e-4), (
        f"Exercise 0.1 (rms_norm): with float16 input of size ~300 the result ({got.dtype}) "
        "differs from the float64 formula: convert x to float32 first (x = x.float()), then "
        "square; 300² overflows float16")


@pytest.mark.parametrize("T,S,Hq,Hkv", [(5, 5, 4, 2), (1, 7, 4, 2), (3, 8, 6, 3), (1, 1, 2, 1)])
def test_attention_matches_reference(T, S, Hq, Hkv):
    g = torch.Generator().manual_seed(T * 100 + S)
    q, k, v = (torch.randn(n, h, 16, generator=g) for n, h in ((T, Hq), (S, Hkv), (S, Hkv)))
    got = step0.attention(q, k, v)
    assert got.shape == (T, Hq * 16), (
        f"Exercise 0.2 (attention): output shape {tuple(got.shape)}, expected {(T, Hq * 16)} "
        "(the einsum with v must give [T, Hq, D])")
    kind = "prefill (T == S)" if T == S else f"{T} new token(s) over {S} keys (decode-like)"
    torch.testing.assert_close(got, reference_attention(q, k, v), atol=1e-5, rtol=1e-5,
                               msg=lambda m: (
        f"Exercise 0.2 (attention) is wrong for {kind}: new token t may see keys "
        f"0 .. S - T + t, so mask with torch.triu(ones(T, S), diagonal=S - T + 1); scale the "
        f"scores by 1/sqrt(D) and softmax over the keys (last dim).\n" + m))


def forward(model, ids, pos, kv):
    """step0.forward; an error inside it is Exercise 0.4's (the only exercise in forward: the
    layers it calls were tested above)."""
    try:
        return step0.forward(model, ids, pos, kv)
    except Exception as e:
        raise AssertionError(
            f"Exercise 0.4 (the KV cache in forward): forward over {len(ids)} token(s) with "
            f"{kv[0][0].shape[0] if kv and kv[0] else 0} cached raised {type(e).__name__}: {e}; "
            "on the first call every layer i appends its own empty [k, v] pair (when "
            "len(kv) == i)") from e


def test_forward_grows_the_cache():
    """7 tokens in three calls sharing kv (4, 2 at once, 1) give the logits of one call."""
    model, ids = load("tiny-llama"), fixed_ids(7, seed=4)
    kv: list = []
    with torch.no_grad():
        full = forward(model, ids, torch.arange(7), [])
        parts = []
        for start, end in [(0, 4), (4, 6), (6, 7)]:
            parts.append(forward(model, ids[start:end], torch.arange(start, end), kv))
            rows = [(k.shape[0], v.shape[0]) for k, v in kv]
            assert rows == [(end, end)] * model.num_layers, (
                f"Exercise 0.4 (the KV cache): after tokens 0..{end - 1} each of the "
                f"{model.num_layers} layers should cache {end} rows of k and of v, got {rows}: "
                "append one empty [k, v] pair per layer on the first call, then torch.cat the "
                "new rows after the old ones")
    torch.testing.assert_close(torch.cat(parts), full, atol=1e-4, rtol=1e-4, msg=lambda m: (
        "Exercise 0.4 (the KV cache): three calls sharing kv disagree with one call over all "
        "tokens; the new rows go last (torch.cat([kv[i][0], k])), where attention expects "
        "them.\n" + m))


def test_causal_mask_hides_the_future():
    """Changing token 7 of a 10-token prefill must leave the logits at positions 0..6 alone."""
    model = load("tiny-llama")
    ids = fixed_ids(10, seed=3)
    changed = ids.clone()
    changed[7] = (ids[7] + 1234) % 49152
    with torch.no_grad():
        a = forward(model, ids, torch.arange(10), [])
        b = forward(model, changed, torch.arange(10), [])
    for t in range(7):
        torch.testing.assert_close(b[t], a[t], atol=1e-5, rtol=1e-5, msg=lambda m, t=t: (
            f"Exercise 0.2 (attention): the logits at position {t} changed when only token 7 "
            f"changed, so token {t} sees the future; mask the scores above the diagonal with "
            f"-inf.\n" + m))
    assert not torch.allclose(a[7:], b[7:]), (
        "the logits at positions 7..9 did not change when token 7 changed: attention ignores "
        "the keys (Exercise 0.2) or forward does not use the new token")


# ----------------------------------------------------------------------------- whole models


@pytest.mark.parametrize("name", TEACHER_FORCED)
def test_teacher_forced_logits_match_hf(name):
    """Prefill 6 tokens, then feed tokens 6..11 one at a time through the KV lists."""
    model, ids = load(name), fixed_ids(TOTAL)
    with torch.no_grad():
        want = hf_model(name)(ids[None]).logits[0].float()  # [TOTAL, V], one full forward
        kv: list = []
        got = step0.forward(model, ids[:PREFILL], torch.arange(PREFILL), kv)
    assert got.shape == (PREFILL, want.shape[-1]) and got.dtype == torch.float32, (
        f"{name}: forward must return float32 logits [T, V] = {(PREFILL, want.shape[-1])}, got "
        f"{got.dtype} {tuple(got.shape)}")
    torch.testing.assert_close(got, want[:PREFILL], atol=1e-4, rtol=1e-4, msg=lambda m: (
        f"{name}: the prefill logits (positions 0..{PREFILL - 1}) differ from HF's; check "
        "Exercise 0.1 (rms_norm), Exercise 0.2 (attention, causal mask) and Exercise 0.4 (k "
        "and v each cached in their own slot: attention reads the values from kv[i][1]).\n"
        + m))
    for t in range(PREFILL, TOTAL):
        with torch.no_grad():
            step = step0.forward(model, ids[t:t + 1], torch.tensor([t]), kv)
        torch.testing.assert_close(step[0], want[t], atol=1e-4, rtol=1e-4, msg=lambda m, t=t: (
            f"{name}: decode step at position {t} (one new token, {t + 1} keys) differs from "
            "HF while the prefill matched; check Exercise 0.2 (attention): with T = 1 < S the "
            "new token must see every cached key (diagonal = S - T + 1).\n" + m))
    assert len(kv) == model.num_layers and all(k.shape[0] == TOTAL for k, _ in kv), (
        f"{name}: kv should hold one [k, v] pair per layer with {TOTAL} rows each, got "
        f"{[tuple(k.shape) for k, _ in kv]}")


def test_llama3_rope_is_refused():
    with pytest.raises(ValueError, match="default rope") as info:
        step0.load_model(model_path("tiny-llama3-rope"))
    assert "chapter 02" in str(info.value), "the error should say that chapter 02 adds llama3"


def test_generate_decode_steps(monkeypatch):
    """Each decode step feeds the newest token alone, at its position, with the same kv list.

    A position off by one changes the logits only slightly (RoPE sees distances), so greedy
    tokens can still match; this records what generate passes to forward instead."""
    from minisgl.step0 import generation

    model, prompt, calls = load("tiny-llama"), fixed_ids(6, seed=7).tolist(), []
    real = generation.forward

    def recording(model, ids, pos, kv):
        cached, began = kv[0][0].shape[0] if kv else 0, time.perf_counter()
        out = real(model, ids, pos, kv)
        calls.append((ids.tolist(), pos.tolist(), cached))
        ran.append(time.perf_counter() - began)
        return out

    ran, reported = [], []  # each forward's own time; (seconds, when) of each on_step call
    monkeypatch.setattr(generation, "forward", recording)
    new = generation.generate(model, prompt, 4, on_step=lambda i, s: reported.append(
        (i, s, time.perf_counter())))
    assert len(new) == 4 and len(calls) == 4, (
        f"Exercise 0.3 (decode loop): generate(..., 4) made {len(calls)} forward calls and "
        f"returned {len(new)} tokens; expected one prefill and 3 decode steps, 4 tokens")
    for i, (ids, pos, cached) in enumerate(calls[1:], start=1):
        want = len(prompt) + i - 1
        assert (ids, pos, cached) == ([new[i - 1]], [want], want), (
            f"Exercise 0.3 (decode loop): decode step {i} fed tokens {ids} at positions {pos} "
            f"with {cached} cached rows; expected [{new[i - 1]}] at [{want}] (len(input_ids) + "
            f"i - 1) with {want} cached rows (the same kv list every step)")
    assert [i for i, _, _ in reported] == [0, 1, 2, 3], (
        f"Exercise 0.3 (decode loop): on_step was called with i = {[i for i, _, _ in reported]}; "
        "expected 0 (the prefill), 1, 2, 3")
    for i in range(1, 4):
        seconds, said, before = reported[i][1], reported[i][2], reported[i - 1][2]
        assert ran[i] <= seconds <= said - before, (
            f"Exercise 0.3 (decode loop): on_step({i}, seconds) got {seconds * 1e3:.1f} ms, but "
            f"the step's forward took {ran[i] * 1e3:.1f} ms and only {(said - before) * 1e3:.1f} "
            "ms passed since the previous on_step: time each decode step on its own (restart "
            "the timer at the top of every step)")


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_smollm2_greedy_matches_hf(prompt):
    ids = tokenizer()(prompt)["input_ids"]
    steps = []
    got = step0.generate(load(SMOL), ids, 16, on_step=lambda i, s: steps.append(i))
    want = hf_greedy(SMOL, ids, 16)
    assert len(got) == 16, f"generate returned {len(got)} tokens, expected 16 (Exercise 0.3)"
    assert got[:len(want)] == want, (
        f"{SMOL} on {prompt!r}: step 0 gives {got}, HF greedy gives {want}. If the first "
        "token matches but later ones do not, check Exercise 0.3 (feed back the argmax token "
        "at position len(prompt) + i - 1, keep the same kv list).")
    assert len(want) == 16 or want[-1] in (hf_model(SMOL).generation_config.eos_token_id, 2), (
        "HF stopped early without an end-of-sequence token")
    assert steps == list(range(16)), (
        f"on_step should be called with i = 0 (prefill), 1, ..., 15; got {steps} (Exercise 0.3)")


def quick_check() -> None:
    """Fast self-consistency smoke test of minisgl.step0 on tiny-llama (no HF model needed)."""
    model = step0.load_model(model_path("tiny-llama"))
    ids = fixed_ids(8, seed=5)
    with torch.no_grad():
        full = step0.forward(model, ids, torch.arange(8), [])  # [8, V]
        kv: list = []
        parts = [step0.forward(model, ids[:5], torch.arange(5), kv)]
        parts += [step0.forward(model, ids[t:t + 1], torch.tensor([t]), kv) for t in range(5, 8)]
    torch.testing.assert_close(torch.cat(parts), full, atol=1e-4, rtol=1e-4, msg=lambda m: (
        "step0: prefill 5 + 3 decode steps disagrees with one 8-token prefill (Exercise 0.2)\n"
        + m))
    out = step0.generate(model, ids[:5].tolist(), 3)
    with torch.no_grad():
        again = step0.forward(model, torch.tensor(ids[:5].tolist() + out[:2]), torch.arange(7), [])
    if out != again[4:].argmax(-1).tolist():
        raise AssertionError(f"step0.generate gave {out}, the argmax chain of a full forward gives "
                             f"{again[4:].argmax(-1).tolist()} (Exercise 0.3)")


def test_quick_check():
    quick_check()


@pytest.mark.parametrize("eos", ["int", "list"])
def test_generate_never_stops_early(eos):
    """generate (Exercise 0.3) makes exactly max_new_tokens tokens, even when the config's
    eos_token_id comes up: when to stop is the caller's choice."""
    model = step0.load_model(model_path("tiny-llama"))
    prompt = [5, 17, 923, 4410, 88, 31]
    want = step0.generate(model, prompt, 5)
    model.config["eos_token_id"] = want[1] if eos == "int" else [want[1], want[0]]
    got = step0.generate(model, prompt, 5)
    assert got == want, (
        f"Exercise 0.3 (generate): with eos_token_id {model.config['eos_token_id']} it gave "
        f"{got}, not {want}: make exactly max_new_tokens tokens, never stop early")
