"""Chapter 03: models and weight loading (minisgl/models/) against Hugging Face transformers.

References: HF's configs (``AutoConfig``, ``LlamaConfig`` defaults), HF's models (state-dict
names and shapes, their tensors, their logits and greedy tokens) and the safetensors files read
with plain ``safe_open``. The whole model runs before chapter 05's attention backends exist, with
the stand-in attention of ``tests/standin_attention.py`` (no KV cache: every step recomputes the
whole sequence). Logits are compared with ``atol=1e-4, rtol=1e-4`` (float32 on both sides).
Exercises: 3.1 head counts / head_dim, 3.2 DecoderLayer.forward, 3.3 _shard, 3.4 merge buffering.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import shutil
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from helpers import SMOL, TINY_MODELS, hf_greedy, hf_model, model_path, tokenizer
from standin_attention import ContiguousAttention, prefill_logits

import minisgl.utils
from minisgl import core
from minisgl.distributed import (
    DistributedInfo,
    reset_tp_info,
    set_tp_info,
    try_get_tp_info,
)
from minisgl.models import ModelConfig, create_model, get_model_class, load_weight
from minisgl.models import weight as weight_mod

ALL_MODELS = TINY_MODELS + [SMOL]
ATOL = RTOL = 1e-4
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
         "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@pytest.fixture(scope="module", autouse=True)
def _earlier_chapters():
    from prereq import require

    require("01", "02")


@contextmanager
def single_process(rank: int = 0, size: int = 1):
    """tp info (rank, size) and a Context with the stand-in attention; restores what was there."""
    old_tp, old_ctx = try_get_tp_info(), core._GLOBAL_CTX
    reset_tp_info()
    core.reset_global_ctx()
    set_tp_info(rank, size)
    ctx = core.Context(page_size=1)
    ctx.attn_backend = ContiguousAttention()
    core.set_global_ctx(ctx)
    try:
        yield ctx
    finally:
        reset_tp_info()
        core.reset_global_ctx()
        if old_tp is not None:
            set_tp_info(old_tp.rank, old_tp.size)
        if old_ctx is not None:
            core.set_global_ctx(old_ctx)


@pytest.fixture(autouse=True)
def _globals():
    with single_process() as ctx:
        yield ctx


def hf_config(name: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path(name))


def build_meta(name: str):
    """The minisgl model on the meta device (no memory for weights), for the current tp info."""
    cfg = ModelConfig.from_hf(hf_config(name))
    with torch.device("meta"), minisgl.utils.torch_dtype(torch.float32):
        return create_model(cfg)


def build_and_load(name: str):
    """Build on meta, then stream the checkpoint in (tp info must be set: 1 rank)."""
    model = build_meta(name)
    model.load_state_dict({n: t for n, t in load_weight(model_path(name))})
    return model


@functools.cache
def loaded(name: str):
    return build_and_load(name)


def fixed_ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def fused_name(hf_name: str) -> str:
    """HF's name -> minisgl's: ``...self_attn.k_proj.weight`` -> ``...self_attn.qkv_proj.weight``."""
    parts = hf_name.split(".")
    return ".".join(FUSED.get(p, p) for p in parts)


def fused_parts(hf_name: str) -> tuple[list[str], int]:
    """The HF names fused with ``hf_name`` (in fused order) and its slot among them."""
    leaf = hf_name.split(".")[-2]
    group = [p for p, f in FUSED.items() if f == FUSED[leaf]]
    return [hf_name.replace(f".{leaf}.", f".{p}.") for p in group], group.index(leaf)


# ----------------------------------------------------------------------------- ModelConfig


@pytest.mark.parametrize("name", ALL_MODELS)
def test_config_matches_hf(name):
    hf = hf_config(name)
    cfg = ModelConfig.from_hf(hf)
    heads = (cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim)
    want = (hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
    assert heads == want, (
        f"Exercise 3.1 (ModelConfig.from_hf) on {name}: (num_qo_heads, num_kv_heads, head_dim) is "
        f"{heads}, HF's config says {want}. Read num_attention_heads and num_key_value_heads, and "
        "take head_dim from the config when it has one (hidden_size // heads only as a fallback).")
    fields = {
        "num_layers": hf.num_hidden_layers, "hidden_size": hf.hidden_size,
        "vocab_size": hf.vocab_size, "intermediate_size": hf.intermediate_size,
        "rms_norm_eps": hf.rms_norm_eps, "hidden_act": hf.hidden_act,
        "tie_word_embeddings": hf.tie_word_embeddings, "model_type": hf.model_type,
        "architectures": list(hf.architectures),
    }
    got = {k: getattr(cfg, k) for k in fields}
    assert got == fields, f"{name}: ModelConfig fields {got} differ from HF's {fields}"
    rope, rc = hf.rope_parameters, cfg.rotary_config
    assert (rc.head_dim, rc.rotary_dim, rc.max_position, rc.base) == (
        hf.head_dim, hf.head_dim, hf.max_position_embeddings, rope["rope_theta"]), (
        f"{name}: rotary_config {rc} should have head_dim = rotary_dim = {hf.head_dim}, "
        f"max_position {hf.max_position_embeddings}, base rope_parameters['rope_theta'] = "
        f"{rope['rope_theta']}")
    if rope.get("rope_type", "default") == "default":
        assert rc.scaling is None, f"{name}: default rope should give scaling=None, got {rc.scaling}"
    else:
        assert rc.scaling is not None and all(rc.scaling.get(k) == v for k, v in rope.items()), (
            f"{name}: rotary_config.scaling {rc.scaling} should carry every rope_parameters entry "
            f"{rope} (the rotary layer reads rope_type, factor, ... from it)")


def test_qwen3_head_dim_is_not_hidden_over_heads():
    hf = hf_config("tiny-qwen3")
    cfg = ModelConfig.from_hf(hf)
    assert hf.head_dim != hf.hidden_size // hf.num_attention_heads  # the point of this model
    assert cfg.head_dim == hf.head_dim == 32, (
        f"Exercise 3.1: tiny-qwen3 has head_dim {hf.head_dim} while hidden_size / heads = "
        f"{hf.hidden_size // hf.num_attention_heads}; ModelConfig.head_dim is {cfg.head_dim}. "
        "Prefer the config's head_dim.")


def test_config_defaults_match_hf():
    """A config without num_key_value_heads / head_dim gets the defaults HF's LlamaConfig uses."""
    from transformers import LlamaConfig

    kw = {"hidden_size": 96, "num_attention_heads": 6, "num_hidden_layers": 2,
          "intermediate_size": 64, "vocab_size": 100, "rms_norm_eps": 1e-5,
          "max_position_embeddings": 128}
    hf = LlamaConfig(**kw)
    bare = SimpleNamespace(**kw, architectures=["LlamaForCausalLM"])  # no kv heads, no head_dim
    cfg = ModelConfig.from_hf(bare)
    assert (cfg.num_kv_heads, cfg.head_dim) == (hf.num_key_value_heads, hf.head_dim), (
        f"Exercise 3.1: without num_key_value_heads / head_dim in the config, HF uses "
        f"num_kv_heads = num_attention_heads = {hf.num_key_value_heads} and head_dim = "
        f"hidden_size // num_attention_heads = {hf.head_dim}; got ({cfg.num_kv_heads}, "
        f"{cfg.head_dim})")
    assert cfg.rotary_config.base == hf.rope_parameters["rope_theta"]
    assert cfg.rotary_config.scaling is None


@pytest.mark.parametrize("case", ["None fields", "GQA without head_dim", "nested text_config"])
def test_config_optional_fields_none_or_nested(case):
    """Optional fields may be absent, present but None, or live in a nested text_config."""
    kw = {"hidden_size": 96, "num_attention_heads": 6, "num_hidden_layers": 2,
          "intermediate_size": 64, "vocab_size": 100, "rms_norm_eps": 1e-5,
          "max_position_embeddings": 128}
    if case == "None fields":  # HF keeps the attribute and stores None: fall back all the same
        cfg, want = SimpleNamespace(**kw, num_key_value_heads=None, head_dim=None), (6, 6, 16)
    elif case == "GQA without head_dim":
        cfg, want = SimpleNamespace(**kw, num_key_value_heads=2), (6, 2, 16)
    else:  # a multimodal config: the language model's numbers are in text_config
        cfg = SimpleNamespace(text_config=SimpleNamespace(**kw, num_key_value_heads=2, head_dim=24),
                              architectures=["LlamaForCausalLM"])
        want = (6, 2, 24)
    try:
        c = ModelConfig.from_hf(cfg)
    except Exception as e:
        raise AssertionError(f"Exercise 3.1 ({case}): ModelConfig.from_hf raised "
                             f"{type(e).__name__} ({e})") from e
    got = (c.num_qo_heads, c.num_kv_heads, c.head_dim)
    assert got == want, (
        f"Exercise 3.1 ({case}): (Hq, Hkv, D) should be {want}, got {got}. A missing or None "
        "num_key_value_heads means Hkv = Hq; a missing or None head_dim means hidden_size // Hq; "
        "read both from `text` (config.text_config when the config has one)")


def test_config_reads_older_rope_fields():
    """Configs written before transformers 5 keep rope_theta and rope_scaling apart."""
    hf = hf_config("tiny-llama3-rope")
    rope = dict(hf.rope_parameters)
    theta = rope.pop("rope_theta")
    old = SimpleNamespace(**{k: getattr(hf, k) for k in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "vocab_size", "intermediate_size", "rms_norm_eps", "max_position_embeddings",
        "architectures", "tie_word_embeddings")}, rope_theta=theta, rope_scaling=rope)
    new = ModelConfig.from_hf(hf)
    assert ModelConfig.from_hf(old).rotary_config == new.rotary_config, (
        "a config with rope_theta + rope_scaling (transformers 4 style) should give the same "
        "rotary_config as the same settings in rope_parameters")


def test_config_lacking_a_field_is_refused():
    hf = hf_config("tiny-llama")
    fields = {k: getattr(hf, k) for k in ("hidden_size", "num_hidden_layers",
                                          "num_attention_heads", "vocab_size", "rms_norm_eps",
                                          "max_position_embeddings")}
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelConfig.from_hf(SimpleNamespace(**fields))  # no intermediate_size


# ----------------------------------------------------------------------------- the model


@pytest.mark.parametrize("name", ALL_MODELS)
def test_state_dict_matches_hf(name):
    """Same keys and shapes as HF's state dict, with q/k/v and gate/up fused, lm_head tied."""
    from transformers import AutoModelForCausalLM

    hf_cfg = hf_config(name)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_cfg)
    want: dict[str, list] = {}
    for key, t in hf.state_dict().items():
        if key == "lm_head.weight" and hf_cfg.tie_word_embeddings:
            continue  # tied: the LM head reads the embedding's weight, no tensor of its own
        fused = fused_name(key)
        if fused in want and fused != key:  # one more part: its rows stack under the others
            want[fused][0] += t.shape[0]
        else:
            want[fused] = list(t.shape)
    model = build_meta(name)
    sd = model.state_dict()
    got = {k: list(t.shape) for k, t in sd.items()}
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    assert not missing and not extra, (
        f"{name}: state-dict keys differ from HF's (with q/k/v -> qkv_proj, gate/up -> "
        f"gate_up_proj{', lm_head tied' if hf_cfg.tie_word_embeddings else ''}): missing "
        f"{missing[:6]}, unexpected {extra[:6]}")
    wrong = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    assert not wrong, f"{name}: shapes (minisgl, HF) differ: {dict(list(wrong.items())[:6])}"
    dtypes = {t.dtype for t in sd.values()} | {t.device.type for t in sd.values()}
    assert dtypes == {torch.float32, "meta"}, (
        f"{name}: built under torch.device('meta') and torch_dtype(float32), every weight should "
        f"be a float32 meta tensor; found {dtypes}")


@pytest.mark.parametrize("name", TINY_MODELS)
def test_registry_picks_the_architecture(name):
    hf_cfg = hf_config(name)
    arch = hf_cfg.architectures[0]
    model = build_meta(name)
    assert type(model).__name__ == arch, f"{name}: create_model built {type(model).__name__}"
    sd = model.state_dict()
    has_bias = any(k.endswith("qkv_proj.bias") for k in sd)
    has_norm = any(k.endswith("q_norm.weight") for k in sd)
    assert (has_bias, has_norm) == (arch == "Qwen2ForCausalLM", arch == "Qwen3ForCausalLM"), (
        f"{arch}: q/k/v bias {has_bias}, q/k norm {has_norm}; Qwen2 has the bias, Qwen3 the norm")


def test_unsupported_architecture_is_refused():
    cfg = dataclasses.replace(ModelConfig.from_hf(hf_config("tiny-llama")),
                              architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        create_model(cfg)
    assert all(a in str(info.value) for a in SUPPORTED), (
        f"the error should name the supported architectures {SUPPORTED}: {info.value}")
    with pytest.raises(ValueError):
        get_model_class("GPT2LMHeadModel", cfg)


# ----------------------------------------------------------------------------- load_weight


class CountingHandle:
    """Wraps a safe_open handle and counts get_tensor calls."""

    def __init__(self, handle, counter):
        self._handle, self._counter = handle, counter

    def __enter__(self):
        self._inner = self._handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self._handle.__exit__(*exc)

    def keys(self):
        return self._inner.keys()

    def get_tensor(self, key):
        self._counter.append(key)
        return self._inner.get_tensor(key)


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-qwen3"])
def test_load_weight_streams(name, monkeypatch):
    read: list[str] = []
    real = weight_mod.safe_open
    monkeypatch.setattr(weight_mod, "safe_open",
                        lambda *a, **k: CountingHandle(real(*a, **k), read))
    gen = load_weight(model_path(name))
    assert inspect.isgenerator(gen), "load_weight must be a generator (use `yield`)"
    assert read == [], "load_weight read tensors before the first next(): open files lazily"
    used = 0  # checkpoint tensors that went into what was yielded so far
    worst = 0
    try:
        for key, tensor in gen:
            assert isinstance(key, str) and isinstance(tensor, torch.Tensor)
            used += {"qkv_proj": 3, "gate_up_proj": 2}.get(key.split(".")[-2], 1)
            worst = max(worst, len(read) - used)
    except AssertionError:
        raise
    except Exception as e:
        raise AssertionError(f"Exercise 3.4 ({name}): load_weight raised {type(e).__name__} ({e}). "
                             "Once all parts of a fused tensor are in, yield it and delete its "
                             "pending entry; qkv has 3 parts, gate_up 2") from e
    assert used == len(read), (
        f"Exercise 3.4 ({name}): load_weight read {len(read)} checkpoint tensors but what it "
        f"yielded accounts for {used}: yield each merged tensor under its fused name "
        "(...qkv_proj.weight, ...gate_up_proj.weight), every other tensor under its own")
    assert worst <= 3, (
        f"Exercise 3.4 ({name}): at one point {worst} tensors had been read but not yet yielded. "
        "Yield each fused tensor as soon as its last part arrives (at most k_proj + q_proj waiting "
        "for v_proj, and gate_proj waiting for up_proj), not all of them at the end.")


@pytest.mark.parametrize("name", TINY_MODELS)
def test_load_weight_merges_like_hf(name):
    hf_sd = hf_model(name).state_dict()
    try:
        got = dict(load_weight(model_path(name)))
    except Exception as e:
        raise AssertionError(f"Exercise 3.4 ({name}): load_weight raised {type(e).__name__} "
                             f"({e})") from e
    tied = hf_config(name).tie_word_embeddings
    for key, t in hf_sd.items():
        if key == "lm_head.weight" and tied:
            continue
        if fused_name(key) == key:
            assert key in got, f"{name}: load_weight did not yield {key}"
            assert torch.equal(got[key], t), f"{name}: {key} differs from the checkpoint's tensor"
    n_layers = hf_config(name).num_hidden_layers
    for i in range(n_layers):
        for kind in (["weight", "bias"] if f"model.layers.{i}.self_attn.q_proj.bias" in hf_sd
                     else ["weight"]):
            pre = f"model.layers.{i}.self_attn."
            want = torch.cat([hf_sd[f"{pre}{p}.{kind}"] for p in ("q_proj", "k_proj", "v_proj")])
            assert f"{pre}qkv_proj.{kind}" in got, (
                f"Exercise 3.4 ({name}): load_weight yielded no {pre}qkv_proj.{kind}")
            assert torch.equal(got[f"{pre}qkv_proj.{kind}"], want), (
                f"Exercise 3.4 ({name}): {pre}qkv_proj.{kind} should be torch.cat([q, k, v]) of "
                "the checkpoint's q_proj, k_proj, v_proj, in that order (the file stores them "
                "k, o, q, v: sort by slot, not by arrival)")
        pre = f"model.layers.{i}.mlp."
        want = torch.cat([hf_sd[f"{pre}gate_proj.weight"], hf_sd[f"{pre}up_proj.weight"]])
        assert torch.equal(got.get(f"{pre}gate_up_proj.weight", torch.empty(0)), want), (
            f"Exercise 3.4 ({name}): {pre}gate_up_proj.weight should be torch.cat([gate, up])")
    model_keys = set(build_meta(name).state_dict())
    yielded = set(got) - {"lm_head.weight"} if tied else set(got)
    assert yielded == model_keys, (
        f"{name}: load_weight's names and the model's state-dict keys differ: only yielded "
        f"{sorted(yielded - model_keys)[:5]}, never yielded {sorted(model_keys - yielded)[:5]}")


def expected_shard(key: str, full: torch.Tensor, hf_cfg, rank: int, tp: int) -> torch.Tensor:
    """What rank ``rank`` of ``tp`` must hold of HF tensor ``key``, derived from what it computes.

    Rank r computes query heads [r*Hq/tp, (r+1)*Hq/tp) and needs the KV heads those heads read
    under GQA; it computes columns [r*I/tp, ...) of the MLP and rows [r*V/tp, ...) of the vocab.
    """
    Hq, Hkv, D = hf_cfg.num_attention_heads, hf_cfg.num_key_value_heads, hf_cfg.head_dim
    if ".q_proj." in key:
        return full.view(Hq, D, *full.shape[1:])[rank * Hq // tp:(rank + 1) * Hq // tp].flatten(0, 1)
    if ".k_proj." in key or ".v_proj." in key:
        q_heads = range(rank * Hq // tp, (rank + 1) * Hq // tp)
        kv_heads = sorted({h // (Hq // Hkv) for h in q_heads})
        return full.view(Hkv, D, *full.shape[1:])[kv_heads].flatten(0, 1)
    if ".gate_proj." in key or ".up_proj." in key or "embed_tokens" in key or "lm_head" in key:
        rows = full.shape[0] // tp
        return full[rank * rows:(rank + 1) * rows]
    if ".o_proj." in key:
        cols = Hq * D // tp
        return full[:, rank * cols:(rank + 1) * cols]
    if ".down_proj." in key:
        cols = full.shape[1] // tp
        return full[:, rank * cols:(rank + 1) * cols]
    return full  # norms: every rank has the whole vector


def shard_by_hand(name, t, c, rank, tp):
    """Rank ``rank``'s part of checkpoint tensor ``name``, head by head (independent of _shard)."""
    rest, d = t.shape[1:], c.head_dim
    if ".q_proj." in name:
        n = c.num_qo_heads // tp
        return t.view(c.num_qo_heads, d, *rest)[rank * n:(rank + 1) * n].reshape(-1, *rest)
    if ".k_proj." in name or ".v_proj." in name:
        heads = t.view(c.num_kv_heads, d, *rest)
        if c.num_kv_heads >= tp:
            n = c.num_kv_heads // tp
            return heads[rank * n:(rank + 1) * n].reshape(-1, *rest)
        # the KV head that this rank's first query head reads
        return heads[rank * (c.num_qo_heads // tp) // (c.num_qo_heads // c.num_kv_heads)]
    if ".gate_proj." in name or ".up_proj." in name:
        return t.chunk(tp, 0)[rank]
    if ".o_proj." in name or ".down_proj." in name:
        return t.chunk(tp, 1)[rank]
    if "embed_tokens" in name or "lm_head" in name:
        n = -(-c.vocab_size // tp)
        return torch.cat([t, t.new_zeros(n * tp - t.shape[0], *rest)])[rank * n:(rank + 1) * n]
    return t


@pytest.mark.parametrize("hq,hkv,tp", [(4, 2, 2), (8, 2, 4), (4, 1, 2), (8, 4, 2), (8, 1, 4)])
def test_shard_matches_a_hand_split(hq, hkv, tp):
    """_shard alone (Exercise 3.3) on small named tensors, weights and 1-D biases, fewer KV heads
    than ranks included; V = 10 is not divisible by every tp."""
    c = SimpleNamespace(num_qo_heads=hq, num_kv_heads=hkv, head_dim=2, hidden_size=5,
                        intermediate_size=12, vocab_size=10)
    shapes = {"self_attn.q_proj.weight": (hq * 2, 5), "self_attn.q_proj.bias": (hq * 2,),
              "self_attn.k_proj.weight": (hkv * 2, 5), "self_attn.k_proj.bias": (hkv * 2,),
              "self_attn.v_proj.weight": (hkv * 2, 5), "self_attn.v_proj.bias": (hkv * 2,),
              "self_attn.o_proj.weight": (5, hq * 2), "mlp.gate_proj.weight": (12, 5),
              "mlp.up_proj.weight": (12, 5), "mlp.down_proj.weight": (5, 12),
              "input_layernorm.weight": (5,)}
    named = {f"model.layers.0.{k}": v for k, v in shapes.items()}
    named.update({"model.embed_tokens.weight": (10, 5), "lm_head.weight": (10, 5)})
    for name, shape in named.items():
        t = torch.arange(1.0, 1.0 + torch.Size(shape).numel()).view(shape)
        for rank in range(tp):
            where = f"{name} {tuple(shape)}, Hq={hq}, Hkv={hkv}, rank {rank} of tp={tp}"
            try:
                got = weight_mod._shard(name, t, c, DistributedInfo(rank, tp))
            except Exception as e:
                raise AssertionError(f"Exercise 3.3 (_shard) raised {type(e).__name__} on {where} "
                                     f"({e})") from e
            want = shard_by_hand(name, t, c, rank, tp)
            kv = ".k_proj." in name or ".v_proj." in name
            hint = (f"fewer KV heads than ranks: each rank keeps one whole KV head ([D] for a bias, "
                    f"[D, in] for a weight), head rank * Hkv // tp = {rank * hkv // tp}"
                    if kv and hkv < tp else
                    "q/k/v and gate/up split their rows, o_proj/down_proj their columns, the "
                    "vocabulary its rows padded to ceil(V / tp), norms stay whole")
            assert got.shape == want.shape and torch.equal(got, want), (
                f"Exercise 3.3 (_shard) on {where}: got a {tuple(got.shape)} tensor, expected "
                f"{tuple(want.shape)}; {hint}")


def load_by_hand(name: str, rank: int, tp: int) -> dict:
    """What load_weight must yield on rank ``rank`` of ``tp``, built from the learner's own _shard
    (Exercise 3.3, tested on its own above): every checkpoint tensor through _shard, the parts of
    a fused projection concatenated along dim 0 in order (q, k, v / gate, up)."""
    from safetensors import safe_open

    cfg = ModelConfig.from_hf(weight_mod.load_hf_config(model_path(name)))
    out, fused = {}, {}
    for file in sorted(model_path(name).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                if key.startswith(("vision_tower.", "multi_modal_projector.")):
                    continue
                n = key.removeprefix("language_model.")
                t = weight_mod._shard(n, f.get_tensor(key), cfg, DistributedInfo(rank, tp))
                part = next((p for p in n.split(".") if p in FUSED), None)
                if part is None:
                    out[n] = t
                else:
                    slot = [p for p in FUSED if FUSED[p] == FUSED[part]].index(part)
                    fused.setdefault(n.replace(f".{part}.", f".{FUSED[part]}."), {})[slot] = t
    out.update({n: torch.cat([p[i] for i in range(len(p))]) for n, p in fused.items()})
    return out


@pytest.mark.parametrize("name,tp", [("tiny-llama", 2), ("tiny-qwen3", 2), ("tiny-llama", 4)])
def test_load_weight_yields_what_shard_gives(name, tp):
    """Exercise 3.4 on its own: under tp > 1, every tensor load_weight yields is _shard's part of
    its checkpoint tensor, the non-fused ones (o_proj, down_proj, embed_tokens, lm_head) too."""
    unsharded = load_by_hand(name, 0, 1)
    for rank in range(tp):
        with single_process(rank, tp):
            try:
                got = dict(load_weight(model_path(name)))
            except Exception as e:  # _shard passed on its own: the loop around it is the suspect
                raise AssertionError(f"Exercise 3.4 ({name}, rank {rank} of {tp}): load_weight "
                                     f"raised {type(e).__name__} ({e})") from e
        want = load_by_hand(name, rank, tp)
        assert sorted(got) == sorted(want), (
            f"Exercise 3.4 ({name}, rank {rank} of {tp}): load_weight should yield {sorted(want)}; "
            f"missing {sorted(set(want) - set(got))}, unexpected {sorted(set(got) - set(want))}")
        for key, w in want.items():
            g = got[key]
            if g.shape == w.shape and torch.equal(g, w):
                continue
            assert not (g.shape == unsharded[key].shape != w.shape), (
                f"Exercise 3.4 ({name}, rank {rank} of {tp}): load_weight yielded the whole {key} "
                f"{tuple(g.shape)}, not this rank's shard {tuple(w.shape)}: pass EVERY checkpoint "
                "tensor through _shard before it is yielded or merged, the ones that are not "
                "merged (o_proj, down_proj, embed_tokens, lm_head) too")
            pytest.fail(f"Exercise 3.4 ({name}, rank {rank} of {tp}): load_weight yielded a "
                        f"{tuple(g.shape)} {key} that is not _shard of its checkpoint tensor "
                        f"({tuple(w.shape)}; a fused one: the sharded parts concatenated along "
                        "dim 0 in order q, k, v / gate, up)", pytrace=False)


@pytest.mark.parametrize("name,tp", [("tiny-llama", 2), ("tiny-qwen2", 2), ("tiny-qwen3", 2),
                                     ("tiny-qwen3", 4), ("tiny-llama", 4)])
def test_sharding_for_tp(name, tp):
    hf_cfg = hf_config(name)
    hf_sd = hf_model(name).state_dict()
    shards = []
    for rank in range(tp):
        with single_process(rank, tp):
            shard = dict(load_weight(model_path(name)))
            try:  # the shapes must be what chapter 02's layers of this rank expect
                build_meta(name).load_state_dict(dict(shard))
            except (KeyError, ValueError, RuntimeError) as e:
                qkv = shard.get("model.layers.0.self_attn.qkv_proj.weight")
                whole = (hf_cfg.num_attention_heads + 2 * hf_cfg.num_key_value_heads) * hf_cfg.head_dim
                if qkv is not None and qkv.shape[0] == whole:  # _shard itself passed its own test
                    pytest.fail(f"Exercise 3.4 ({name}, rank {rank} of {tp}): load_weight yielded "
                                f"the whole fused qkv_proj ({whole} rows) to one rank of {tp}: pass "
                                "every checkpoint tensor through _shard BEFORE merging (a fused "
                                f"name is not one _shard knows). {e}", pytrace=False)
                pytest.fail(f"Exercise 3.3 ({name}, rank {rank} of {tp}): the sharded tensors do "
                            f"not fit the rank's layers: {e}\nq/k/v are split by heads (with fewer "
                            "KV heads than ranks, each rank keeps one whole KV head), gate/up by "
                            "rows, o_proj/down_proj by columns; and load_weight (Exercise 3.4) "
                            "passes every checkpoint tensor through _shard before merging.",
                            pytrace=False)
        shards.append(shard)
    replicated = hf_cfg.num_key_value_heads < tp
    for key, full in hf_sd.items():
        if key == "lm_head.weight" and hf_cfg.tie_word_embeddings:
            continue
        is_kv = ".k_proj." in key or ".v_proj." in key
        hint = ("fewer KV heads than ranks: rank r keeps the one KV head its query heads read, "
                "r * Hkv // tp" if replicated and is_kv else
                "column-parallel tensors (q/k/v, gate/up) split their rows, o_proj / down_proj "
                "their columns, embed_tokens / lm_head their vocab rows, norms stay whole")
        parts = []
        for rank, shard in enumerate(shards):
            want = expected_shard(key, full, hf_cfg, rank, tp)
            got = shard[fused_name(key)]
            if fused_name(key) != key:  # cut this part out of [q | k | v] or [gate | up]
                siblings, slot = fused_parts(key)
                sizes = [expected_shard(s, hf_sd[s], hf_cfg, rank, tp).shape[0] for s in siblings]
                got = got.split(sizes)[slot] if got.shape[0] == sum(sizes) else got
            assert got.shape == want.shape and torch.equal(got, want), (
                f"Exercise 3.3 ({name}, rank {rank} of {tp}): this rank's part of {key} is "
                f"{tuple(got.shape)}, expected {tuple(want.shape)} holding the rows/columns this "
                f"rank computes; {hint}")
            parts.append(got)
        if "norm" in key or (replicated and is_kv):
            continue  # every rank holds the whole tensor / the one KV head it reads
        dim = 1 if (".o_proj." in key or ".down_proj." in key) else 0
        assert torch.equal(torch.cat(parts, dim), full), (
            f"Exercise 3.3 ({name}, tp={tp}): the ranks' parts of {key} do not concatenate back "
            "to the full tensor")


def test_vocab_shard_pads_the_last_rank():
    """V = 10 over 3 ranks: ceil(10/3) = 4 rows each, the last rank's 2 rows padded with zeros."""
    cfg = dataclasses.replace(ModelConfig.from_hf(hf_config("tiny-llama")), vocab_size=10)
    full = torch.arange(40, dtype=torch.float32).view(10, 4)
    padded = torch.cat([full, torch.zeros(2, 4)])  # 12 rows = 3 ranks x 4
    for rank in range(3):
        got = weight_mod._shard("model.embed_tokens.weight", full, cfg, DistributedInfo(rank, 3))
        assert torch.equal(got, padded[4 * rank:4 * rank + 4]), (
            f"Exercise 3.3: vocab rows of rank {rank} of 3 for V = 10 should be rows "
            f"{4 * rank}..{4 * rank + 3} (zero rows past the end, so every shard has ceil(V/tp) "
            f"rows as VocabParallelEmbedding expects), got {got.tolist()}")


def test_missing_folder_is_explained(tmp_path):
    path = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError) as info:
        list(load_weight(path))
    assert str(path) in str(info.value) and "make models" in str(info.value), (
        f"the error should name the folder and `make models`: {info.value}")


def test_folder_without_safetensors_is_explained(tmp_path):
    shutil.copy(model_path("tiny-llama") / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        list(load_weight(tmp_path))


# ----------------------------------------------------------------------------- whole models


@pytest.mark.parametrize("name", TINY_MODELS)
def test_prefill_logits_match_hf(name):
    """Teacher-forced: recompute the whole prefix for L = 5..12; compare the last position."""
    ids = fixed_ids(12)
    with torch.no_grad():
        want = hf_model(name)(torch.tensor([ids])).logits[0]  # [12, V], one full forward
    model = loaded(name)
    for L in range(5, 13):
        got = prefill_logits(model, [ids[:L]])
        assert got.shape == (1, want.shape[-1]), (
            f"{name}: a one-request prefill should give logits [1, V], got {tuple(got.shape)} "
            "(the LM head keeps the last token of each request)")
        torch.testing.assert_close(got[0], want[L - 1], atol=ATOL, rtol=RTOL, msg=lambda m, L=L: (
            f"{name}: last-position logits of a {L}-token prefill differ from HF's; check "
            "Exercise 3.2 (DecoderLayer.forward: input_layernorm -> self_attn -> "
            "post_attention_layernorm with the residual -> mlp) and Exercise 3.1 (head_dim).\n"
            + m))


def test_two_requests_in_one_prefill():
    name = "tiny-qwen3"
    a, b = fixed_ids(7, seed=1), fixed_ids(4, seed=2)
    got = prefill_logits(loaded(name), [a, b])
    with torch.no_grad():
        want = torch.stack([hf_model(name)(torch.tensor([s])).logits[0, -1] for s in (a, b)])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m: (
        f"{name}: two requests (7 and 4 tokens) in one prefill should give each one's own last "
        "logits, as two separate HF forwards do.\n" + m))


@pytest.mark.slow
def test_smollm2_greedy_matches_hf():
    """Free-running greedy generation, 16 steps, recomputing the whole sequence every step."""
    ids = tokenizer()("The capital of France is")["input_ids"]
    model = loaded(SMOL)
    seq = list(ids)
    for _ in range(16):
        seq.append(int(prefill_logits(model, [seq])[0].argmax()))
    got, want = seq[len(ids):], hf_greedy(SMOL, ids, 16)
    assert got[:len(want)] == want, (
        f"{SMOL}: minisgl's greedy tokens {got} differ from HF's {want}; the tiny models' logits "
        "tests point at the exercise when one is wrong")


def quick_check() -> None:
    """tiny-llama: build on meta, load, one forward with the stand-in = HF's last logits."""
    ids = fixed_ids(6, seed=7)
    with single_process():
        model = build_and_load("tiny-llama")
        got = prefill_logits(model, [ids])[0]
    with torch.no_grad():
        want = hf_model("tiny-llama")(torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m: (
        "minisgl.models on tiny-llama: the last logits differ from HF's (Exercises 3.1-3.4)\n"
        + m))


def test_quick_check():
    quick_check()
