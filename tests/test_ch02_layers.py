"""Chapter 02: the op layer (minisgl/layers/) against Hugging Face transformers and plain torch.

References: HF's ``LlamaRMSNorm`` / ``Qwen3RMSNorm``, its rope code (``ROPE_INIT_FUNCTIONS``,
``LlamaRotaryEmbedding``, ``apply_rotary_pos_emb``), ``ACT2FN`` and ``LlamaMLP``; torch's
``F.linear`` / ``F.embedding``; ``nn.Module.state_dict`` for key names. Tensor parallelism is
checked in one process: every rank's layer is built and run in turn with a fake communicator, and
the test combines the ranks' results itself (the slicing of the full weights is written here,
independently of minisgl's loader).
Exercises: 2.1 state_dict, 2.2 load_state_dict, 2.3 merged column-parallel sizes, 2.4 QKV local
heads, 2.5 LM head last tokens, 2.6 rms_norm, 2.7 fused add + norm, 2.8 rotary, 2.9 attention.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from minisgl.core import Batch, Context, Req, reset_global_ctx, set_global_ctx
from minisgl.distributed import (
    DistributedCommunicator,
    DistributedImpl,
    reset_tp_info,
    set_tp_info,
)
from minisgl.layers import (
    AttentionLayer,
    BaseOP,
    LinearColParallelMerged,
    LinearOProj,
    LinearQKVMerged,
    LinearReplicated,
    LinearRowParallel,
    OPList,
    ParallelLMHead,
    RMSNorm,
    RMSNormFused,
    VocabParallelEmbedding,
    gelu_and_mul,
    get_rope,
    silu_and_mul,
)


@pytest.fixture(scope="module", autouse=True)
def _earlier_chapters():
    from prereq import require

    require("01")


pytestmark = pytest.mark.usefixtures("clean_globals")  # tests/conftest.py


# ----------------------------------------------------------------------------- helpers


def randn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def build(rank: int, tp: int, make):
    """``make()`` as rank ``rank`` of ``tp`` would run it (layers read the tp info when built)."""
    set_tp_info(rank, tp)
    try:
        return make()
    finally:
        reset_tp_info()


def loaded(op: BaseOP, state: dict) -> BaseOP:
    op.load_state_dict(dict(state))
    return op


class FakeMetadata:
    """Just what the LM head asks of the attention metadata: each request's last query row."""

    def __init__(self, extend_lens):
        self.cu_seqlens = torch.tensor([0, *extend_lens]).cumsum(0)

    def get_last_indices(self, bs: int) -> torch.Tensor:
        return self.cu_seqlens[1:bs + 1] - 1


def make_batch(extend_lens, phase: str) -> Batch:
    reqs = []
    for i, n in enumerate(extend_lens):
        total = n if phase == "prefill" else 5 + i  # decode: one new token after a cached prefix
        reqs.append(Req(input_ids=torch.arange(1, total + 1, dtype=torch.int32), table_idx=i,
                        cached_len=0 if phase == "prefill" else total - 1, output_len=4, uid=i,
                        sampling_params=None))
    batch = Batch(reqs=reqs, phase=phase)
    batch.attn_metadata = FakeMetadata([r.extend_len for r in reqs])
    return batch


@contextmanager
def active(batch: Batch, backend=None):
    """A global Context whose active batch is ``batch``, for the duration of the block."""
    ctx = Context(page_size=1)
    ctx.attn_backend = backend
    set_global_ctx(ctx)
    try:
        with ctx.forward_batch(batch):
            yield ctx
    finally:
        reset_global_ctx()


class FakeComm(DistributedImpl):
    """Stands in for the other ranks, in two passes over the ranks.

    record pass: ``all_reduce`` returns its input unchanged and ``all_gather`` tiles it (each rank
    sees only itself); every input is kept, per rank and call. replay pass: each call returns what
    the real collective returns, computed from every rank's recorded input (sum / rank-major cat).
    """

    def __init__(self, tp: int) -> None:
        self.tp, self.rank, self.replay, self.calls = tp, 0, False, 0
        self.seen = [[] for _ in range(tp)]

    def start(self, rank: int, replay: bool = False) -> None:
        self.rank, self.replay, self.calls = rank, replay, 0

    def _others(self, x):
        if not self.replay:
            self.seen[self.rank].append(x.clone())
            return None
        self.calls += 1
        return [calls[self.calls - 1] for calls in self.seen]

    def all_reduce(self, x):
        parts = self._others(x)
        return x if parts is None else torch.stack(parts).sum(0)

    def all_gather(self, x):
        parts = self._others(x)
        return x.repeat(self.tp, *([1] * (x.dim() - 1))) if parts is None else torch.cat(parts)


def run_ranks(tp: int, make, shards, inputs, monkeypatch):
    """Build and load every rank's layer, then run them: (outputs, recorded comm inputs, replays).

    ``shards[r]`` is rank r's state dict and ``inputs[r]`` its input.
    """
    comm = FakeComm(tp)
    monkeypatch.setattr(DistributedCommunicator, "plugins", [comm])
    layers = [loaded(build(r, tp, make), shards[r]) for r in range(tp)]
    outs = []
    for r in range(tp):
        comm.start(r)
        outs.append(layers[r].forward(inputs[r]))
    replays = []
    for r in range(tp):
        comm.start(r, replay=True)
        replays.append(layers[r].forward(inputs[r]))
    return outs, comm.seen, replays


def close(got, want, why: str, **tol) -> None:
    """``assert_close`` whose failure message starts with ``why`` (built before the call)."""
    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{why}\n{m}")


def single(make, state, x):
    """The tp = 1 result."""
    return loaded(build(0, 1, make), state).forward(x)


# Independent slicing of full weights, the way tensor parallelism splits them.
def rows_of(w, r, tp):
    n = w.shape[0] // tp
    return w[r * n:(r + 1) * n]


def cols_of(w, r, tp):
    n = w.shape[1] // tp
    return w[:, r * n:(r + 1) * n]


def vocab_rows(w, r, tp):
    n = -(-w.shape[0] // tp)  # ceil
    part = w[r * n:(r + 1) * n]
    return torch.cat([part, part.new_zeros(n - part.shape[0], *w.shape[1:])])


# ----------------------------------------------------------------------------- BaseOP


class _Tree(BaseOP):
    def __init__(self, h: int) -> None:
        self.scale = torch.ones(h)  # own tensors first, as nn.Module lists them
        self.norm = RMSNorm(h, 1e-6)
        self.eps = 1e-6  # not a tensor: skipped
        self.proj = LinearReplicated(h, 3, has_bias=True)
        self._scratch = torch.zeros(2)  # underscore: skipped
        self.act = silu_and_mul  # callable: skipped
        self.missing = None  # None: skipped
        self.layers = OPList([RMSNorm(h, 1e-6), RMSNorm(h, 1e-6)])

    def forward(self, x):
        return x


def _torch_mirror(h: int) -> torch.nn.Module:
    """The same tree as nn.Modules: its state_dict keys are the reference."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    m = torch.nn.Module()
    m.scale = torch.nn.Parameter(torch.ones(h))
    m.norm = LlamaRMSNorm(h)
    m.proj = torch.nn.Linear(h, 3, bias=True)
    m.layers = torch.nn.ModuleList([LlamaRMSNorm(h), LlamaRMSNorm(h)])
    return m


def test_state_dict_keys_follow_attribute_paths():
    tree = _Tree(4)
    got = tree.state_dict()
    want = list(_torch_mirror(4).state_dict())
    assert list(got) == want, (
        f"Exercise 2.1 (state_dict): keys {list(got)}, expected {want} (what torch.nn.Module "
        "gives for the same attribute tree): walk self.__dict__ in order, a tensor `name` becomes "
        "`prefix.name`, a BaseOP recurses with that prefix, skip names starting with '_' and "
        "everything else")
    assert got["norm.weight"] is tree.norm.weight and got["scale"] is tree.scale, (
        "Exercise 2.1 (state_dict): values must be the layer's own tensors, not copies")
    assert list(tree.proj.state_dict(prefix="model.proj")) == ["model.proj.weight",
                                                               "model.proj.bias"], (
        "Exercise 2.1 (state_dict): a prefix must be joined as 'prefix.name'")


def test_load_swaps_meta_placeholders():
    with torch.device("meta"):
        tree = _Tree(4)
    assert tree.proj.weight.is_meta, "under torch.device('meta') the placeholders must be meta"
    full = {k: randn(*v.shape, seed=i) for i, (k, v) in enumerate(tree.state_dict().items())}
    state = dict(full)
    try:
        tree.load_state_dict(state)
    except (KeyError, RuntimeError, ValueError) as e:
        pytest.fail(f"Exercise 2.2 (load_state_dict): a checkpoint that fits the model was "
                    f"refused ({type(e).__name__}: {e})"
                    + (": pop each key you use from state_dict (state_dict.pop(key)); keys left "
                       "over count as unexpected" if isinstance(e, RuntimeError) else ""),
                    pytrace=False)
    assert not state, (f"Exercise 2.2 (load_state_dict): used keys must be popped from the dict, "
                       f"left {sorted(state)}")
    after = tree.state_dict()
    for key, value in full.items():
        assert not after[key].is_meta, f"Exercise 2.2 (load_state_dict): {key} is still meta"
        assert torch.equal(after[key], value), (
            f"Exercise 2.2 (load_state_dict): {key} does not hold the checkpoint's values")
    assert after["norm.weight"] is full["norm.weight"], (
        "Exercise 2.2 (load_state_dict): swap the checkpoint tensor in (setattr), no copy")


def test_load_errors_name_the_problem():
    tree = _Tree(4)
    full = {k: torch.zeros(v.shape) for k, v in tree.state_dict().items()}

    missing = dict(full)
    del missing["layers.1.weight"]
    with pytest.raises(KeyError) as e:
        _Tree(4).load_state_dict(missing)
    assert "layers.1.weight" in str(e.value), f"the KeyError must name the missing key: {e.value}"

    extra = {**full, "lm_head.weight": torch.zeros(2), "rotary.inv_freq": torch.zeros(2)}
    with pytest.raises(RuntimeError) as e:
        _Tree(4).load_state_dict(extra)
    assert "lm_head.weight" in str(e.value) and "rotary.inv_freq" in str(e.value), (
        f"the RuntimeError must name the unexpected keys: {e.value}")

    for bad, what in [(torch.zeros(3, 5), "shape"), (torch.zeros(3, 4, dtype=torch.float64),
                                                      "dtype")]:
        try:
            _Tree(4).load_state_dict({**full, "proj.weight": bad})
        except ValueError as e:
            msg = str(e)
        else:
            pytest.fail(f"Exercise 2.2 (load_state_dict): a checkpoint tensor with the wrong "
                        f"{what} was loaded; compare its shape and dtype with the placeholder's "
                        "and raise ValueError (never convert it silently)", pytrace=False)
        assert "proj.weight" in msg, (
            f"Exercise 2.2 (load_state_dict): a {what} mismatch must raise ValueError naming "
            f"the key: {msg}")
        if what == "shape":
            assert any(s in msg for s in ("(3, 5)", "[3, 5]")) and any(
                s in msg for s in ("(3, 4)", "[3, 4]")), (
                f"Exercise 2.2 (load_state_dict): the ValueError must show both shapes: {msg}")
        else:
            assert "float64" in msg and "float32" in msg, (
                f"Exercise 2.2 (load_state_dict): the ValueError must show both dtypes: {msg}")


def test_oplist_keys_and_stateless():
    ops = OPList([RMSNorm(2, 1e-6), RMSNorm(2, 1e-6)])
    assert list(ops.state_dict(prefix="model.layers")) == ["model.layers.0.weight",
                                                           "model.layers.1.weight"]
    rope = get_rope(8, 8, 16, 10000.0)
    assert rope.state_dict() == {}, "the rope table is not a weight"
    with pytest.raises(RuntimeError):
        rope.load_state_dict({"inv_freq": torch.zeros(4)})


def test_linear_keeps_the_checkpoint_layout():
    """One weight layout everywhere: a loaded linear weight is the checkpoint's ``[out, in]``
    tensor itself, and the op's matmul is plain ``F.linear`` (chapter 07's kernels are bound
    only by an Engine built with ``cpu_kernels=True``)."""
    w = randn(6, 10, seed=3)
    lin = loaded(build(0, 1, lambda: LinearReplicated(10, 6, has_bias=False)), {"weight": w})
    assert lin.weight is w and lin.weight.is_contiguous(), "load_state_dict must keep the tensor"
    assert lin._matmul is F.linear
    x = randn(3, 10, seed=4)
    torch.testing.assert_close(lin.forward(x), F.linear(x, w))


# ----------------------------------------------------------------------------- linear + TP


def test_linear_layers_match_torch_at_tp1():
    x = randn(5, 12, seed=1)
    w, b = randn(8, 12, seed=2), randn(8, seed=3)
    torch.testing.assert_close(single(lambda: LinearReplicated(12, 8, True), {"weight": w,
                                                                          "bias": b}, x),
                               F.linear(x, w, b))
    torch.testing.assert_close(single(lambda: LinearRowParallel(12, 8, True),
                                      {"weight": w, "bias": b}, x), F.linear(x, w, b))
    gu = randn(2 * 6, 12, seed=4)
    shape = tuple(build(0, 1, lambda: LinearColParallelMerged(12, [6, 6], False)).weight.shape)
    assert shape == (12, 12), (
        f"Exercise 2.3 (merged column-parallel): output_sizes=[6, 6] at tp = 1 should give a "
        f"[12, 12] weight (6 gate rows + 6 up rows), got {list(shape)}: add every component's "
        "share, div_even(size, tp) for each")
    got = single(lambda: LinearColParallelMerged(12, [6, 6], False), {"weight": gu}, x)
    torch.testing.assert_close(got, F.linear(x, gu), msg=lambda m: (
        "Exercise 2.3 (merged column-parallel): at tp = 1 the layer is the whole [12, 12] "
        "matrix\n" + m))


def test_mlp_matches_hf_llama_mlp():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    hf = LlamaMLP(LlamaConfig(hidden_size=16, intermediate_size=24, hidden_act="silu",
                                num_attention_heads=4)).eval()
    gate_up = torch.cat([hf.gate_proj.weight, hf.up_proj.weight]).detach()
    up = loaded(build(0, 1, lambda: LinearColParallelMerged(16, [24, 24], False)),
                {"weight": gate_up})
    down = loaded(build(0, 1, lambda: LinearRowParallel(24, 16, False)),
                  {"weight": hf.down_proj.weight.detach()})
    x = randn(7, 16, seed=5)
    with torch.no_grad():
        want = hf(x)
    torch.testing.assert_close(down.forward(silu_and_mul(up.forward(x))), want, atol=1e-6,
                               rtol=1e-5, msg=lambda m: (
        "gate_up -> silu_and_mul -> down differs from HF's LlamaMLP\n" + m))


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_merged_column_parallel_concatenates(tp, bias, monkeypatch):
    H, I = 12, 16
    w = randn(2 * I, H, seed=10)
    b = randn(2 * I, seed=11)
    full = {"weight": w, **({"bias": b} if bias else {})}

    def shard(r):
        gate, up = w[:I], w[I:]
        s = {"weight": torch.cat([rows_of(gate, r, tp), rows_of(up, r, tp)])}
        if bias:
            s["bias"] = torch.cat([rows_of(b[:I], r, tp), rows_of(b[I:], r, tp)])
        return s

    def make():
        return LinearColParallelMerged(H, [I, I], has_bias=bias)

    layer = build(0, tp, make)
    assert layer.weight.shape == (2 * I // tp, H), (
        f"Exercise 2.3 (merged column-parallel): at tp = {tp} the local weight should be "
        f"[{2 * I // tp}, {H}] (each of gate and up split over the ranks), got "
        f"{tuple(layer.weight.shape)}")
    x = randn(5, H, seed=12)
    outs, seen, _ = run_ranks(tp, make, [shard(r) for r in range(tp)], [x] * tp, monkeypatch)
    assert all(not s for s in seen), "a column-parallel layer must not communicate"
    half = I // tp
    combined = torch.cat([o[:, :half] for o in outs] + [o[:, half:] for o in outs], dim=1)
    torch.testing.assert_close(combined, single(make, full, x), msg=lambda m: (
        f"merged column-parallel, tp = {tp}: gate shards then up shards of the ranks, "
        "concatenated, must equal the tp = 1 output\n" + m))


def _kv_heads_of_rank(r, tp, hq, hkv):
    """The KV heads rank r needs: those of its query heads (one, replicated, when tp > hkv)."""
    q_per_rank, group = hq // tp, hq // hkv
    first, last = r * q_per_rank, (r + 1) * q_per_rank - 1
    return list(range(first // group, last // group + 1))


@pytest.mark.parametrize("sizes,tp", [([6, 2], 4), ([6, 6], 4), ([2, 2], 4), ([8, 12], 8)])
def test_merged_column_parallel_refuses_uneven_components(sizes, tp):
    """Each component is split on its own: one that tp does not divide is refused, even when
    the total divides, and a component is never replicated."""
    with torch.device("meta"):
        try:
            layer = build(0, tp, lambda: LinearColParallelMerged(16, sizes, has_bias=False))
        except ValueError:
            return
    bad = next(n for n in sizes if n % tp)
    pytest.fail(f"Exercise 2.3 (merged column-parallel): output_sizes={sizes} at tp={tp} should "
                f"raise ValueError ({bad} rows cannot be split evenly over {tp} ranks), but it "
                f"built {layer.weight.shape[0]} local rows: use div_even(size, tp) for each "
                "component", pytrace=False)


@pytest.mark.parametrize("hq,hkv,tp", [(8, 2, 16), (4, 4, 8), (12, 3, 2), (24, 3, 4), (6, 2, 4)])
def test_qkv_parallel_refuses_uneven_heads(hq, hkv, tp):
    """Query heads are never replicated; KV heads split evenly, or are replicated evenly."""
    with torch.device("meta"):
        try:
            layer = build(0, tp, lambda: LinearQKVMerged(16, 2, hq, hkv, has_bias=False))
        except ValueError:
            return
    why = (f"{hq} query heads cannot be split over {tp} ranks (query heads are never "
           "replicated)" if hq % tp else f"{hkv} KV heads cannot be split or replicated evenly "
           f"over {tp} ranks")
    pytest.fail(f"Exercise 2.4 (QKV local heads): Hq={hq}, Hkv={hkv}, tp={tp} should raise "
                f"ValueError: {why}; it built a [{layer.weight.shape[0]}, 16] weight. Use "
                "div_even, with allow_replicate=True for the KV heads only", pytrace=False)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_qkv_parallel_splits_by_heads(tp, hkv, monkeypatch):
    hidden, hq, D = 16, 8, 4
    wq, wk, wv = randn(hq * D, hidden, seed=20), randn(hkv * D, hidden, seed=21), randn(
        hkv * D, hidden, seed=22)
    bq, bk, bv = randn(hq * D, seed=23), randn(hkv * D, seed=24), randn(hkv * D, seed=25)
    full = {"weight": torch.cat([wq, wk, wv]), "bias": torch.cat([bq, bk, bv])}

    def heads(w, hs):
        return torch.cat([w[h * D:(h + 1) * D] for h in hs])

    def shard(r):
        kv = _kv_heads_of_rank(r, tp, hq, hkv)
        return {"weight": torch.cat([rows_of(wq, r, tp), heads(wk, kv), heads(wv, kv)]),
                "bias": torch.cat([rows_of(bq, r, tp), heads(bk, kv), heads(bv, kv)])}

    def make():
        return LinearQKVMerged(hidden, D, hq, hkv, has_bias=True)

    local_kv = len(_kv_heads_of_rank(0, tp, hq, hkv))
    try:
        layer = build(0, tp, make)
    except ValueError as e:
        pytest.fail(f"Exercise 2.4 (QKV local heads): Hq={hq}, Hkv={hkv}, tp={tp} was refused "
                    f"({e})" + (": with more ranks than KV heads each rank keeps one whole KV "
                                "head (div_even(num_kv_heads, tp, allow_replicate=True))"
                                if hkv < tp else ""), pytrace=False)
    want_rows = (hq // tp + 2 * local_kv) * D
    assert layer.weight.shape == (want_rows, hidden), (
        f"Exercise 2.4 (QKV local heads): Hq={hq}, Hkv={hkv}, tp={tp}: each rank holds "
        f"{hq // tp} query head(s) and {local_kv} KV head(s)"
        + (" (replicated: more ranks than KV heads)" if hkv < tp else "")
        + f", so the weight is [{want_rows}, {hidden}], got {tuple(layer.weight.shape)}")
    x = randn(3, hidden, seed=26)
    outs, _, _ = run_ranks(tp, make, [shard(r) for r in range(tp)], [x] * tp, monkeypatch)
    ref = single(make, full, x)
    q_ref, k_ref, v_ref = ref.split([hq * D, hkv * D, hkv * D], dim=1)
    qs, per_head_k, per_head_v = [], {}, {}
    for r, o in enumerate(outs):
        q, k, v = o.split([hq // tp * D, local_kv * D, local_kv * D], dim=1)
        qs.append(q)
        for j, h in enumerate(_kv_heads_of_rank(r, tp, hq, hkv)):
            for store, t, ref_t, name in ((per_head_k, k, k_ref, "k"), (per_head_v, v, v_ref, "v")):
                store[h] = t[:, j * D:(j + 1) * D]
                close(store[h], ref_t[:, h * D:(h + 1) * D],
                      f"QKV tp={tp}, Hkv={hkv}: rank {r}'s {name} head {h} differs from the "
                      "tp = 1 output")
    torch.testing.assert_close(torch.cat(qs, dim=1), q_ref, msg=lambda m: (
        f"QKV tp={tp}: the ranks' query heads, concatenated, must equal the tp = 1 q\n" + m))
    assert sorted(per_head_k) == list(range(hkv)), "every KV head must live on some rank"


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("cls", [LinearOProj, LinearRowParallel])
@pytest.mark.parametrize("bias", [False, True])
def test_row_parallel_sums(tp, cls, bias, monkeypatch):
    IN, OUT = 16, 6
    w, b = randn(OUT, IN, seed=30), randn(OUT, seed=31)
    full = {"weight": w, **({"bias": b} if bias else {})}
    x = randn(4, IN, seed=32)

    def make():
        return cls(IN, OUT, has_bias=bias)

    shards = [{"weight": cols_of(w, r, tp), **({"bias": b} if bias else {})} for r in range(tp)]
    _, seen, replays = run_ranks(tp, make, shards, [cols_of(x, r, tp) for r in range(tp)],
                                 monkeypatch)
    ref = single(make, full, x)
    assert all(len(s) == 1 for s in seen), f"{cls.__name__} must all-reduce exactly once"
    partial_sum = sum(s[0] for s in seen)
    torch.testing.assert_close(partial_sum + (b if bias else 0), ref, msg=lambda m: (
        f"{cls.__name__} tp={tp}: the ranks' partial outputs (what goes into the all-reduce) must "
        "sum to the tp = 1 output" + (" minus the bias: add the bias once, after the "
                                      "all-reduce" if bias else "") + "\n" + m))
    for r, out in enumerate(replays):
        close(out, ref, f"{cls.__name__} tp={tp}: rank {r}'s output after the all-reduce must "
              "equal the tp = 1 output")


# ----------------------------------------------------------------------------- embedding + LM head


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_embedding(tp, monkeypatch):
    V, H = 50, 8  # 50 is not a multiple of 4: the last rank's shard is padded
    table = randn(V, H, seed=40)
    ids = torch.tensor([0, 49, 12, 13, 25, 38, 39, 7])
    want = F.embedding(ids, table)
    if tp == 1:
        got = single(lambda: VocabParallelEmbedding(V, H), {"weight": table}, ids)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        return
    outs, _, replays = run_ranks(tp, lambda: VocabParallelEmbedding(V, H),
                                 [{"weight": vocab_rows(table, r, tp)} for r in range(tp)],
                                 [ids] * tp, monkeypatch)
    torch.testing.assert_close(sum(outs), want, msg=lambda m: (
        f"embedding tp={tp}: each rank must return its own rows and zeros for ids it does not "
        "hold, so that the sum over ranks is the full lookup\n" + m))
    for r, out in enumerate(replays):
        torch.testing.assert_close(out, want)


def test_lm_head_prefill_keeps_last_token_of_each_request():
    V, H = 40, 8
    w = randn(V, H, seed=50)
    lens = [3, 1, 4]
    x = randn(sum(lens), H, seed=51)
    head = loaded(build(0, 1, lambda: ParallelLMHead(V, H)), {"weight": w})
    with active(make_batch(lens, "prefill")):
        got = head.forward(x)
    last = [2, 3, 7]
    assert got.shape == (len(lens), V), (
        f"Exercise 2.5 (LM head): a prefill of {len(lens)} requests ({lens} tokens) needs "
        f"{len(lens)} rows of logits, got shape {tuple(got.shape)}")
    torch.testing.assert_close(got, F.linear(x[last], w), msg=lambda m: (
        f"Exercise 2.5 (LM head): rows must be the logits of tokens {last} (each request's last "
        "token: batch.attn_metadata.get_last_indices(batch.size))\n" + m))


def test_lm_head_decode_keeps_every_row():
    V, H = 40, 8
    w = randn(V, H, seed=52)
    x = randn(5, H, seed=53)  # 3 real requests + 2 padding rows
    head = loaded(build(0, 1, lambda: ParallelLMHead(V, H)), {"weight": w})
    with active(make_batch([1, 1, 1], "decode")):
        got = head.forward(x)
    torch.testing.assert_close(got, F.linear(x, w), msg=lambda m: (
        "Exercise 2.5 (LM head): in decode every row (padding included) is kept\n" + m))


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_lm_head_adds_its_bias(tp, phase, monkeypatch):
    """A head built with bias=True adds it to every kept row, in both phases and split over the
    vocabulary (the reference is written out in float64, not the head's own code path)."""
    V, H = 45, 8
    w, b = randn(V, H, seed=70), randn(V, seed=71) + 3.0  # a bias far from zero
    lens = [3, 2] if phase == "prefill" else [1, 1, 1]
    x = randn(sum(lens) + (2 if phase == "decode" else 0), H, seed=72)  # decode: 2 padding rows
    rows = [2, 4] if phase == "prefill" else list(range(x.shape[0]))
    want = (x[rows].double() @ w.double().T + b.double()).float()
    with active(make_batch(lens, phase)):
        if tp == 1:
            outs = [single(lambda: ParallelLMHead(V, H, bias=True), {"weight": w, "bias": b}, x)]
        else:
            _, _, outs = run_ranks(tp, lambda: ParallelLMHead(V, H, bias=True),
                                   [{"weight": vocab_rows(w, r, tp), "bias": vocab_rows(b, r, tp)}
                                    for r in range(tp)], [x] * tp, monkeypatch)
    for r, got in enumerate(outs):
        assert got.shape == want.shape, (
            f"Exercise 2.5 (LM head, {phase}, tp={tp}): rank {r} returns {tuple(got.shape)}, "
            f"expected {tuple(want.shape)}")
        no_bias = torch.allclose(got, want - b, atol=1e-4)
        close(got, want, f"Exercise 2.5 (LM head, {phase}, tp={tp}): rank {r}'s logits differ "
              "from x @ W.T + b" + ("; the bias is missing: self._matmul(x, weight, self.bias)"
                                    if no_bias else ""), atol=1e-4, rtol=1e-4)


def test_lm_head_tied_uses_embedding_weight():
    """Tied (config.json's tie_word_embeddings): the LM head reads the embedding table. A
    checkpoint that also ships an lm_head.weight keeps the tying when that tensor is a copy of the
    table, and otherwise uses it, as Hugging Face does (tests/test_ch03_models.py compares)."""
    V, H = 40, 8

    class Tied(BaseOP):
        def __init__(self):
            self.embed_tokens = VocabParallelEmbedding(V, H)
            self.lm_head = ParallelLMHead(V, H, tie_word_embeddings=True,
                                          tied_embedding=self.embed_tokens)

        def forward(self, x):
            return self.lm_head.forward(x)

    table, own, x = randn(V, H, seed=54), randn(V, H, seed=55), randn(2, H, seed=56)
    for extra, want in [({}, table), ({"lm_head.weight": table.clone()}, table),
                        ({"lm_head.weight": own}, own)]:
        model = build(0, 1, Tied)
        assert list(model.state_dict()) == ["embed_tokens.weight"], (
            f"a tied LM head owns no weight of its own; keys: {list(model.state_dict())}")
        model.load_state_dict({"embed_tokens.weight": table, **extra})
        with active(make_batch([1, 1], "decode")):
            got = model.forward(x)
        what = ("no lm_head.weight" if not extra else "an lm_head.weight equal to the table"
                if want is table else "its own, different lm_head.weight")
        torch.testing.assert_close(got, x @ want.T, msg=lambda m: (
            f"tied LM head, checkpoint with {what}: logits must use "
            f"{'the embedding table' if want is table else 'that lm_head.weight'}\n" + m))
        keys = sorted(model.state_dict())
        assert keys == (["embed_tokens.weight"] if want is table else
                        ["embed_tokens.weight", "lm_head.weight"]), (
            f"tied LM head, checkpoint with {what}: state-dict keys {keys}")
    with pytest.raises(ValueError):
        build(0, 1, lambda: ParallelLMHead(V, H, tie_word_embeddings=True))


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_lm_head_vocab_parallel(tp, phase, monkeypatch):
    V, H = 50, 8
    w = randn(V, H, seed=57)
    lens = [3, 2] if phase == "prefill" else [1, 1, 1]
    x = randn(sum(lens), H, seed=58)
    with active(make_batch(lens, phase)):
        ref = single(lambda: ParallelLMHead(V, H), {"weight": w}, x)
        _, seen, replays = run_ranks(tp, lambda: ParallelLMHead(V, H),
                                     [{"weight": vocab_rows(w, r, tp)} for r in range(tp)],
                                     [x] * tp, monkeypatch)
    local = torch.cat([s[0] for s in seen], dim=1)[:, :V]
    torch.testing.assert_close(local, ref, msg=lambda m: (
        f"Exercise 2.5 (LM head, tp={tp}, {phase}): the ranks' local logits "
        "self._matmul(x, weight, self.bias), concatenated along the vocab and cut to V, must "
        "equal the tp = 1 logits\n" + m))
    for r, out in enumerate(replays):
        assert out.shape == ref.shape, (
            f"Exercise 2.5 (LM head, tp={tp}): rank {r} returns {tuple(out.shape)} after the "
            f"all-gather, expected {tuple(ref.shape)}: regroup the rank-major blocks per row and "
            "cut the padding columns beyond V")
        close(out, ref, f"Exercise 2.5 (LM head, tp={tp}): after the all-gather (rank-major "
              f"blocks) rank {r} must hold the full logits")


# ----------------------------------------------------------------------------- norms


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rmsnorm_matches_hf(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    ref = LlamaRMSNorm(32, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(randn(32, seed=60).abs() + 0.5)
    ref = ref.to(dtype)
    x = randn(2, 5, 32, seed=61, scale=3.0).to(dtype)
    norm = RMSNorm(32, 1e-5)
    norm.weight = ref.weight.detach().clone()
    with torch.no_grad():
        want = ref(x)
    got = norm.forward(x)
    assert got.dtype == dtype, (
        f"Exercise 2.6 (rms_norm): output dtype {got.dtype}, expected {dtype}")
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 0, "rtol": 0}
    # in half types HF's order (cast, then weight) is bit-exact; weight-then-cast rounds once less
    torch.testing.assert_close(got, want, **tol, msg=lambda m: (
        f"Exercise 2.6 (rms_norm) in {dtype} differs from HF's LlamaRMSNorm: normalise in "
        "float32, cast back to x's dtype, then multiply by the weight (in that order)\n" + m))


@pytest.mark.parametrize("eps", [1e-6, 0.3])  # the op's own eps (a model's config sets it)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rmsnorm(dtype, eps):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    ref = LlamaRMSNorm(16, eps=eps)
    with torch.no_grad():
        ref.weight.copy_(randn(16, seed=62) + 1)
    ref = ref.to(dtype)
    fused = RMSNormFused(16, eps)
    fused.weight = ref.weight.detach().clone()
    x = randn(4, 16, seed=63).to(dtype)
    out, res = fused.forward(x, None)
    with torch.no_grad():
        torch.testing.assert_close(out, ref(x))
    assert res is x, ("Exercise 2.7 (fused add + norm): with residual=None the input itself "
                      "becomes the residual stream (return it, do not copy it)")
    residual = randn(4, 16, seed=64).to(dtype)
    before = residual.clone()
    delta = randn(4, 16, seed=65).to(dtype)
    out, res = fused.forward(delta, residual)
    assert res is residual, ("Exercise 2.7 (fused add + norm): return the residual tensor you "
                             "were given, updated in place")
    torch.testing.assert_close(residual, before + delta, msg=lambda m: (
        "Exercise 2.7 (fused add + norm): the residual must be updated in place to "
        "residual + x\n" + m))
    with torch.no_grad():
        torch.testing.assert_close(out, ref(before + delta), msg=lambda m: (
            "Exercise 2.7 (fused add + norm): the output must be the norm of residual + x\n" + m))


# ----------------------------------------------------------------------------- rotary


ROPE_CASES = {
    "default": ({"rope_type": "default", "rope_theta": 10000.0}, 2048),
    "llama3": ({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}, 131072),
    "yarn": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
              "original_max_position_embeddings": 4096}, 16384),
    "yarn-mscale": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                     "original_max_position_embeddings": 4096, "mscale": 1.0,
                     "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2}, 16384),
    "yarn-no-truncate": ({"rope_type": "yarn", "rope_theta": 1e6, "factor": 40.0,
                          "original_max_position_embeddings": 4096, "truncate": False}, 163840),
}
D_ROPE, MAX_POS = 64, 4096


def hf_rope(case: str):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params, max_pos = ROPE_CASES[case]
    config = LlamaConfig(hidden_size=4 * D_ROPE, num_attention_heads=4,
                         max_position_embeddings=max_pos, rope_parameters=dict(params))
    return LlamaRotaryEmbedding(config)


def our_rope(case: str):
    params, _ = ROPE_CASES[case]
    scaling = None if params["rope_type"] == "default" else dict(params)
    return get_rope(D_ROPE, D_ROPE, MAX_POS, params["rope_theta"], scaling)


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_frequencies_match_hf(case):
    hf, ours = hf_rope(case), our_rope(case)
    half = D_ROPE // 2
    row = ours._cos_sin_cache[1]  # position 1: the angles are inv_freq themselves
    inv_freq = torch.atan2(row[half:], row[:half])
    factor = torch.hypot(row[half:], row[:half])
    torch.testing.assert_close(inv_freq, hf.inv_freq, atol=1e-7, rtol=1e-5, msg=lambda m: (
        f"rope {case}: inv_freq differs from HF's\n" + m))
    close(factor, torch.full_like(factor, hf.attention_scaling),
          f"rope {case}: cos/sin must be scaled by HF's attention factor "
          f"{hf.attention_scaling:.6f}")
    pos = torch.randint(0, MAX_POS, (64,), generator=torch.Generator().manual_seed(70))
    cos, sin = hf(torch.zeros(1, 1, 64, D_ROPE), pos[None])
    table = ours._cos_sin_cache[pos]
    torch.testing.assert_close(table[:, :half], cos[0, :, :half], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(table[:, half:], sin[0, :, :half], atol=1e-6, rtol=1e-6)


def _hf_rotate(q, k, pos, case, hq, hkv):
    """HF's apply_rotary_pos_emb on q [T, hq*D], k [T, hkv*D] at positions pos [T]."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    T = q.shape[0]
    cos, sin = hf_rope(case)(q, pos.long()[None])
    q4 = q.view(T, hq, D_ROPE).transpose(0, 1)[None]  # [1, H, T, D]
    k4 = k.view(T, hkv, D_ROPE).transpose(0, 1)[None]
    qr, kr = apply_rotary_pos_emb(q4, k4, cos, sin)
    return qr[0].transpose(0, 1).reshape(T, -1), kr[0].transpose(0, 1).reshape(T, -1)


@pytest.mark.parametrize("case", ["default", "llama3", "yarn"])
def test_rope_application_matches_hf_in_place(case):
    from transformers.models.llama.modeling_llama import rotate_half

    T, hq, hkv = 9, 4, 2
    pos = torch.randint(0, MAX_POS, (T,), generator=torch.Generator().manual_seed(71)).int()
    qkv = randn(T, (hq + 2 * hkv) * D_ROPE, seed=72)
    original = qkv.clone()
    q, k, v = qkv.split([hq * D_ROPE, hkv * D_ROPE, hkv * D_ROPE], dim=-1)  # strided views
    q_ref, k_ref = _hf_rotate(q.clone(), k.clone(), pos, case, hq, hkv)
    q_out, k_out = our_rope(case).forward(pos, q, k)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr(), (
        "Exercise 2.8 (rotary): return the query and key you were given (rotated in place)")
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5, msg=lambda m: (
        f"Exercise 2.8 (rotary, {case}): q inside the fused qkv tensor differs from HF's "
        "apply_rotary_pos_emb: pair i is (x[i], x[i + D/2]); out1 = x1 cos - x2 sin, "
        "out2 = x2 cos + x1 sin, written back in place\n" + m))
    torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5, msg=lambda m: (
        f"Exercise 2.8 (rotary, {case}): k inside the fused qkv tensor differs from HF's\n" + m))
    assert torch.equal(v, original[:, (hq + hkv) * D_ROPE:]), "rotary must not touch v"
    # the rotate_half formulation, spelled out for the first head of q at one position
    cos, sin = hf_rope(case)(q, pos.long()[None])
    x0 = original[0, :D_ROPE]
    torch.testing.assert_close(q[0, :D_ROPE], x0 * cos[0, 0] + rotate_half(x0) * sin[0, 0],
                               atol=1e-5, rtol=1e-5)


def test_get_rope_shares_one_table():
    a = get_rope(16, 16, 64, 10000.0, None)
    b = get_rope(16, 16, 64, 10000, None)
    c = get_rope(16, 16, 64, 500000.0, None)
    assert a is b and a is not c, "get_rope should return one shared object per configuration"
    with pytest.raises(ValueError):
        get_rope(16, 16, 64, 10000.0, {"rope_type": "dynamic", "factor": 2.0})


# ----------------------------------------------------------------------------- activations


def test_gated_activations_match_hf():
    from transformers.activations import ACT2FN

    x = randn(3, 7, 2 * 10, seed=80, scale=2.0)
    gate, up = x[..., :10], x[..., 10:]
    torch.testing.assert_close(silu_and_mul(x), ACT2FN["silu"](gate) * up, atol=0, rtol=0)
    torch.testing.assert_close(gelu_and_mul(x), ACT2FN["gelu"](gate) * up, atol=0, rtol=0)
    out = torch.empty(3, 7, 10)
    assert silu_and_mul(x, out=out) is out and torch.equal(out, ACT2FN["silu"](gate) * up)
    assert torch.equal(x[..., :10], gate), "silu_and_mul must not modify its input"


# ----------------------------------------------------------------------------- attention layer


class RecordingBackend:
    """A fake attention backend: keeps what it is given and returns 2 * q."""

    def forward(self, q, k, v, layer_id, batch):
        self.got = {"q": q.clone(), "k": k.clone(), "v": v.clone(), "layer_id": layer_id,
                    "batch": batch}
        return q * 2


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("hkv", [2, 1])
def test_attention_layer_norms_rotates_and_calls_backend(qk_norm, hkv):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    T, hq, D = 6, 4, D_ROPE
    params, _ = ROPE_CASES["llama3"]
    rotary = SimpleNamespace(rotary_dim=D, max_position=MAX_POS, base=params["rope_theta"],
                             scaling=dict(params))
    norms = {}
    if qk_norm:
        for name, seed in (("q_norm", 90), ("k_norm", 91)):
            norms[name] = RMSNorm(D, 1e-6)
            norms[name].weight = randn(D, seed=seed) + 1
    layer = build(0, 1, lambda: AttentionLayer(3, hq, hkv, D, rotary, **norms))
    qkv = randn(T, (hq + 2 * hkv) * D, seed=92)
    q0, k0, v0 = (t.clone() for t in qkv.split([hq * D, hkv * D, hkv * D], dim=-1))
    batch = make_batch([T], "prefill")
    batch.positions = torch.tensor([5, 900, 4000, 17, 2048, 333], dtype=torch.int32)
    backend = RecordingBackend()
    try:
        with active(batch, backend):
            out = layer.forward(qkv)
    except Exception as e:  # noqa: BLE001 (the learner's error, reported with the exercise)
        pytest.fail(f"Exercise 2.9 (AttentionLayer): forward raised {type(e).__name__}: {e} (Hq="
                    f"{hq}, Hkv={hkv}); split qkv by [Hq*D, Hkv*D, Hkv*D] (self.qo_attn_dim, "
                    "self.kv_attn_dim), not in three equal parts", pytrace=False)
    got = backend.got
    assert got["layer_id"] == 3, (
        f"Exercise 2.9 (AttentionLayer): layer 3 passed layer_id={got['layer_id']} to the "
        "backend; pass self.layer_id, so that each layer uses its own part of the KV cache")
    assert got["batch"] is batch, "Exercise 2.9 (AttentionLayer): pass ctx.batch to the backend"
    assert got["q"].shape == (T, hq, D), (
        f"Exercise 2.9 (AttentionLayer): the backend gets q as [T, Hq, D] = {(T, hq, D)}, got "
        f"{tuple(got['q'].shape)}")
    assert got["k"].shape == (T, hkv * D) and got["v"].shape == (T, hkv * D), (
        f"Exercise 2.9 (AttentionLayer): k and v go to the backend as [T, Hkv*D] = "
        f"{(T, hkv * D)}, got {tuple(got['k'].shape)}, {tuple(got['v'].shape)}")
    want_q, want_k = q0, k0
    if qk_norm:  # Qwen3: RMSNorm over each head, before the rotation
        hf_norms = {}
        for name in ("q_norm", "k_norm"):
            hf_norms[name] = Qwen3RMSNorm(D, eps=1e-6)
            with torch.no_grad():
                hf_norms[name].weight.copy_(norms[name].weight)
        with torch.no_grad():
            want_q = hf_norms["q_norm"](q0.view(T, hq, D)).reshape(T, -1)
            want_k = hf_norms["k_norm"](k0.view(T, hkv, D)).reshape(T, -1)
    want_q, want_k = _hf_rotate(want_q, want_k, batch.positions, "llama3", hq, hkv)
    what = "normed per head (Qwen3 q_norm / k_norm) and then rotated" if qk_norm else "rotated"
    torch.testing.assert_close(got["q"].reshape(T, -1), want_q, atol=1e-5, rtol=1e-5,
                               msg=lambda m: (
        f"Exercise 2.9 (AttentionLayer): q must be {what} before the backend\n" + m))
    torch.testing.assert_close(got["k"], want_k, atol=1e-5, rtol=1e-5, msg=lambda m: (
        f"Exercise 2.9 (AttentionLayer): k must be {what} before the backend\n" + m))
    assert torch.equal(got["v"], v0), (
        "Exercise 2.9 (AttentionLayer): v must reach the backend untouched")
    torch.testing.assert_close(out, (got["q"] * 2).reshape(T, -1), msg=lambda m: (
        "Exercise 2.9 (AttentionLayer): return the backend's output as [T, Hq*D]\n" + m))


def test_attention_layer_local_heads_under_tp():
    rotary = SimpleNamespace(rotary_dim=8, max_position=64, base=10000.0, scaling=None)
    layer = build(1, 2, lambda: AttentionLayer(0, 4, 1, 8, rotary))
    assert (layer.num_qo_heads, layer.num_kv_heads) == (2, 1), (
        "AttentionLayer at tp=2 with Hq=4, Hkv=1: 2 local query heads, 1 (replicated) KV head")


# ----------------------------------------------------------------------------- quick check


def quick_check() -> None:
    """Fast smoke test of minisgl.layers against plain-torch formulas (no HF model needed)."""
    reset_tp_info()
    reset_global_ctx()
    try:
        _quick_check()
    finally:
        reset_tp_info()
        reset_global_ctx()


def _quick_check() -> None:
    tree = _Tree(4)
    keys = list(tree.state_dict())
    if keys != ["scale", "norm.weight", "proj.weight", "proj.bias", "layers.0.weight",
                "layers.1.weight"]:
        raise AssertionError(f"BaseOP.state_dict keys are {keys} (Exercise 2.1)")
    tree.load_state_dict({k: torch.full(v.shape, 0.5) for k, v in tree.state_dict().items()})
    if not torch.equal(tree.proj.weight, torch.full((3, 4), 0.5)):
        raise AssertionError("BaseOP.load_state_dict did not swap the weights in (Exercise 2.2)")

    x = randn(3, 16, seed=1, scale=3.0)
    norm = RMSNorm(16, 1e-6)
    norm.weight = randn(16, seed=2).bfloat16()
    want = (x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()).bfloat16() * norm.weight
    got = norm.forward(x.bfloat16())
    if not torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2):
        raise AssertionError("RMSNorm in bfloat16 disagrees with the formula (Exercise 2.6)")
    fused = RMSNormFused(16, 1e-6)
    fused.weight = torch.ones(16)
    res = x.clone()
    fused.forward(torch.ones(3, 16), res)
    if not torch.allclose(res, x + 1):
        raise AssertionError("RMSNormFused must add x into the residual in place (Exercise 2.7)")

    D, T = 8, 5
    rope = get_rope(D, D, 32, 10000.0)
    pos = torch.tensor([0, 3, 31, 7, 1])
    q, k = randn(T, 2 * D, seed=3), randn(T, D, seed=4)
    angle = pos[:, None].float() * 10000.0 ** (-torch.arange(0, D, 2).float() / D)  # [T, D/2]
    rot = torch.polar(torch.ones_like(angle), angle)[:, None, :]  # [T, 1, D/2]
    want_q = q.view(T, 2, 2, D // 2).transpose(-1, -2).contiguous()  # [T, H, D/2, 2] (x1, x2)
    want_q = torch.view_as_real(torch.view_as_complex(want_q) * rot).transpose(-1, -2)
    rope.forward(pos, q, k)
    if not torch.allclose(q, want_q.reshape(T, -1), atol=1e-5):
        raise AssertionError("rotary embedding disagrees with the complex rotation (Exercise 2.8)")

    with active(make_batch([2, 3], "prefill")):
        head = loaded(build(0, 1, lambda: ParallelLMHead(6, 4)), {"weight": torch.eye(6, 4)})
        logits = head.forward(torch.arange(20.0).view(5, 4))
    if logits.shape != (2, 6) or not torch.equal(logits[:, :4], torch.tensor(
            [[4.0, 5, 6, 7], [16, 17, 18, 19]])):
        raise AssertionError("ParallelLMHead must keep rows 1 and 4 of a [2, 3] prefill "
                             "(Exercise 2.5)")

    qkv_layer = build(0, 2, lambda: LinearQKVMerged(8, 4, 4, 1, has_bias=False))
    if qkv_layer.weight.shape != (16, 8):
        raise AssertionError("LinearQKVMerged(Hq=4, Hkv=1, D=4) at tp=2 should hold 2 q heads "
                             "and 1 replicated k and v head: [16, 8] (Exercise 2.4)")
    mlp = build(0, 2, lambda: LinearColParallelMerged(8, [6, 6], has_bias=False))
    if mlp.weight.shape != (6, 8):
        raise AssertionError("LinearColParallelMerged(8, [6, 6]) at tp=2 should be [6, 8] "
                             "(Exercise 2.3)")

    backend = RecordingBackend()
    rotary = SimpleNamespace(rotary_dim=D, max_position=32, base=10000.0, scaling=None)
    attn = build(0, 1, lambda: AttentionLayer(0, 2, 1, D, rotary))
    batch = make_batch([T], "prefill")
    batch.positions = pos
    qkv = randn(T, 4 * D, seed=5)
    v = qkv[:, 3 * D:].clone()
    with active(batch, backend):
        out = attn.forward(qkv)
    if out.shape != (T, 2 * D) or not torch.equal(backend.got["v"], v):
        raise AssertionError("AttentionLayer must pass v untouched and return [T, Hq*D] "
                             "(Exercise 2.9)")


def test_quick_check():
    quick_check()
