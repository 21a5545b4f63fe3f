"""Chapter 05, GPU section, on the CPU: FlashInfer's paged-KV metadata (minisgl/attention/
fi_metadata.py) and the FlashInfer backend's control flow (minisgl/attention/fi.py).

1. The metadata against the torch backend's view of the same batches: expanding ``kv_indices``
   page by page and cutting the last page at ``last_page_len`` must give exactly the slots
   ``TorchBackend`` gathers for each request (``kv_slots``), and ``qo_indptr`` its
   ``cu_seqlens_q``; page sizes 1/4/16, cached prefixes, decode, dummy padding.
2. Attention computed from that metadata with a plain-torch paged kernel against the dense
   causal attention of tests/test_ch05_attention.py.
3. ``FlashInferBackend`` driven through a stand-in ``flashinfer`` module (written here, from
   FlashInfer's documented plan/run contract: CSR page lists, NHD pages, 16-bit inputs, static
   index buffers in CUDA-graph mode): store first, one plan per batch, the right wrapper per
   phase, capture/replay hooks. The real kernels are checked by tests/test_gpu.py on a GPU.
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import test_ch05_attention as ch05
import torch

from minisgl.core import Batch, reset_global_ctx
from minisgl.distributed import reset_tp_info

HINT = ("Exercise 5.4 (page_indices): page j of a request holds positions j*ps .. j*ps + ps - 1; "
        "its id is page_table[table_idx, j*ps] // ps, for j < ceil(device_len / ps), request "
        "after request.")


@pytest.fixture(scope="module", autouse=True)
def _earlier_chapters():
    from prereq import require

    require("01", "04", "05")


pytestmark = pytest.mark.usefixtures("clean_globals")  # tests/conftest.py


def torch_view(env, batch):
    """The torch backend's metadata of ``batch``: per request, the slots it gathers."""
    env.backend.prepare_metadata(batch)
    md = batch.attn_metadata
    slots = md.kv_slots.view(len(batch.padded_reqs), md.max_kv_len)
    return md, [slots[b, : r.device_len].long() for b, r in enumerate(batch.padded_reqs)]


BATCHES = {  # (cached_len, device_len) per request, phase, dummies
    "prefill": ([(0, 5), (0, 9), (0, 1)], "prefill", 0),
    "cached prefix": ([(4, 7), (17, 20), (1, 2), (16, 33)], "prefill", 0),
    "mixed + dummy": ([(0, 5), (4, 7), (6, 7), (16, 18)], "prefill", 2),
    "decode + dummies": ([(8, 9), (2, 3), (19, 20), (31, 32)], "decode", 3),
    "page boundaries": ([(3, 4), (4, 5), (15, 16), (16, 17)], "decode", 0),
}


@pytest.mark.parametrize("name", list(BATCHES))
@pytest.mark.parametrize("ps", [1, 4, 16])
def test_pages_expand_to_the_torch_backends_slots(name, ps):
    from minisgl.attention.fi_metadata import build_paged_metadata
    from minisgl.attention.paged_reference import expand_to_slots

    spec, phase, n_dummy = BATCHES[name]
    env = ch05.make_env(4, 2, 16, ps, seed=ps * 7 + len(name))
    reqs = [env.add_req(c, n) for c, n in spec]
    batch = env.make_batch(reqs, phase, n_dummy=n_dummy)
    tmd, want = torch_view(env, batch)
    md = build_paged_metadata(batch.padded_reqs, env.page_table, ps)
    where = f"{name}, page_size={ps}"
    bp = len(batch.padded_reqs)
    for field, t in (("qo_indptr", md.qo_indptr), ("kv_indptr", md.kv_indptr),
                     ("kv_indices", md.kv_indices), ("last_page_len", md.last_page_len)):
        assert t.dtype == torch.int32, \
            f"{field} must be int32 (FlashInfer's index type), got {t.dtype}"
    assert md.qo_indptr.tolist() == tmd.cu_seqlens_q.tolist(), (
        f"{where}: qo_indptr {md.qo_indptr.tolist()} should equal the torch backend's "
        f"cu_seqlens_q {tmd.cu_seqlens_q.tolist()} (cumulative extend_len)")
    lens = [r.device_len for r in batch.padded_reqs]
    pages = [math.ceil(n / ps) for n in lens]
    assert md.kv_indptr.tolist() == [0] + list(torch.tensor(pages).cumsum(0).tolist()), (
        f"{where}: kv_indptr should be the cumulative page counts ceil(device_len / ps) = "
        f"{pages}, got {md.kv_indptr.tolist()}")
    assert md.last_page_len.tolist() == [n - (p - 1) * ps for n, p in zip(lens, pages)], (
        f"{where}: last_page_len should be the keys in each last page (1..{ps}), got "
        f"{md.last_page_len.tolist()} for device_len {lens}")
    assert md.kv_indices.numel() == md.kv_indptr[-1], f"{where}: kv_indices has the wrong length"
    got = expand_to_slots(md, ps)
    assert len(got) == bp
    for b, r in enumerate(batch.padded_reqs):
        assert torch.equal(got[b], want[b]), (
            f"{where}: request {b} (table_idx={r.table_idx}, device_len={r.device_len}): the "
            f"pages {md.kv_indices[md.kv_indptr[b]:md.kv_indptr[b + 1]].tolist()} expand to "
            f"slots {got[b].tolist()}, but the torch backend gathers {want[b].tolist()}.\n{HINT}")
    for b in range(len(reqs), bp):  # dummies: one key, on the dummy page
        assert md.kv_indices[md.kv_indptr[b]].item() == env.num_pages and \
            md.last_page_len[b] == 1, f"{where}: a dummy request must list the dummy page only"


def test_page_alignment_is_checked():
    from minisgl.attention.paged_reference import check_page_aligned

    env = ch05.make_env(4, 2, 16, ps=4, seed=1)
    reqs = [env.add_req(0, 9), env.add_req(5, 6)]
    check_page_aligned(env.page_table, reqs, 4)  # the engine's layout: fine
    env.page_table[reqs[1].table_idx, 0] += 1  # position 0 moved to offset 1: not paged any more
    with pytest.raises(ValueError, match="offset"):
        check_page_aligned(env.page_table, reqs, 4)
    row = reqs[0].table_idx  # offsets right, but positions 4..7 spread over two pages
    env.page_table[row, 5] = env.page_table[reqs[1].table_idx, 1]
    with pytest.raises(ValueError, match="offset"):
        check_page_aligned(env.page_table, [reqs[0]], 4)


# every kind of batch once, each with another page size (the metadata tests above cover all)
SPREAD = [(name, ps) for name, ps in zip(BATCHES, [1, 16, 4, 1, 16])]


@pytest.mark.parametrize("name,ps", SPREAD)
def test_paged_reference_attention_matches_dense(name, ps):
    from minisgl.attention.fi_metadata import build_paged_metadata
    from minisgl.attention.paged_reference import paged_attention_reference

    spec, phase, n_dummy = BATCHES[name]
    env = ch05.make_env(8, 2, 16, ps, seed=ps + len(name))
    reqs = [env.add_req(c, n) for c, n in spec]
    batch = env.make_batch(reqs, phase, n_dummy=n_dummy)
    md = build_paged_metadata(batch.padded_reqs, env.page_table, ps)
    q, k, v = env.qkv(batch, 0)
    env.pool.store_kv(k, v, batch.out_loc, 0)
    o = paged_attention_reference(q, env.pool.k_cache(0), env.pool.v_cache(0), md, ps)
    start = 0
    for r in reqs:
        want = ch05.dense_reference(env, r, 0).float()
        torch.testing.assert_close(o[start:start + r.extend_len], want, atol=2e-5, rtol=1e-4,
                                   msg=lambda m: f"{name}, ps={ps}, {ch05.describe(r)}: {m}")
        start += r.extend_len


# ----------------------------------------------------------------------------- the backend
class _FakeWrapper:
    """FlashInfer's documented wrapper contract, in plain torch. ``plan`` takes CSR page lists
    (int32), ``run(q, (k_cache, v_cache))`` reads NHD pages ``[P, ps, Hkv, D]``; inputs must be
    16-bit. In CUDA-graph mode (``use_cuda_graph=True``) plan copies into the static buffers given
    to the constructor and run reads only those buffers, as a replayed graph would."""

    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, prefill=False):
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        self.prefill, self.graph = prefill, use_cuda_graph
        self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer,
                        paged_kv_last_page_len_buffer)
        if use_cuda_graph:
            assert all(b is not None for b in self.buffers), "graph mode needs static buffers"
        self.plans = 0
        self.planned = None

    def _plan(self, qo_indptr, indptr, indices, last, hq, hkv, d, ps, causal, q_data_type,
              kv_data_type, sm_scale):
        for t in (qo_indptr, indptr, indices, last):
            assert t.dtype == torch.int32, "FlashInfer's index tensors are int32"
        assert q_data_type in (torch.bfloat16, torch.float16), "FlashInfer takes 16-bit inputs only"
        assert len(indices) == int(indptr[-1]) and len(indptr) == len(last) + 1
        assert ((1 <= last) & (last <= ps)).all(), "last_page_len must be in 1..page_size"
        if self.graph:
            ip, ix, lp = self.buffers
            assert len(last) == len(lp), "graph mode: the batch size is fixed"
            ip.copy_(indptr)
            ix[: len(indices)].copy_(indices)
            lp.copy_(last)
        else:
            ip, ix, lp = indptr.clone(), indices.clone(), last.clone()
        self.planned = dict(qo=qo_indptr.clone(), ip=ip, ix=ix, lp=lp, hq=hq, hkv=hkv, d=d, ps=ps,
                            causal=causal, dtype=q_data_type, scale=sm_scale)
        self.plans += 1

    def plan(self, *args, causal=False, q_data_type="float16", kv_data_type=None, sm_scale=None):
        if self.prefill:
            self._plan(*args, causal, q_data_type, kv_data_type, sm_scale)
        else:
            bs = len(args[2])
            self._plan(torch.arange(bs + 1, dtype=torch.int32), *args, False, q_data_type,
                       kv_data_type, sm_scale)

    def run(self, q, paged_kv_cache):
        p = self.planned
        assert p is not None, "run before plan"
        k_cache, v_cache = paged_kv_cache
        assert q.dtype == p["dtype"] == k_cache.dtype, "q and the cache must have the planned dtype"
        assert tuple(k_cache.shape[1:]) == (p["ps"], p["hkv"], p["d"]), "expects NHD pages"
        assert q.shape[0] == int(p["qo"][-1]) and q.shape[1:] == (p["hq"], p["d"])
        out = torch.empty_like(q)
        g = p["hq"] // p["hkv"]
        for b in range(len(p["lp"])):
            pages = p["ix"][p["ip"][b]: p["ip"][b + 1]].long()
            n = (len(pages) - 1) * p["ps"] + int(p["lp"][b])
            k = k_cache[pages].reshape(-1, p["hkv"], p["d"])[:n].float()
            v = v_cache[pages].reshape(-1, p["hkv"], p["d"])[:n].float()
            lo, hi = int(p["qo"][b]), int(p["qo"][b + 1])
            qb = q[lo:hi].float().view(hi - lo, p["hkv"], g, p["d"])
            s = torch.einsum("tkgd,skd->kgts", qb, k) * p["scale"]
            if p["causal"]:
                s = s.masked_fill(torch.ones(hi - lo, n, dtype=torch.bool).triu(n - (hi - lo) + 1),
                                  float("-inf"))
            o = torch.einsum("kgts,skd->tkgd", s.softmax(-1), v)
            out[lo:hi] = o.reshape(hi - lo, p["hq"], p["d"]).to(q.dtype)
        return out


@pytest.fixture
def fake_flashinfer(monkeypatch):
    mod = types.ModuleType("flashinfer")
    mod.BatchPrefillWithPagedKVCacheWrapper = lambda *a, **kw: _FakeWrapper(*a, prefill=True, **kw)
    mod.BatchDecodeWithPagedKVCacheWrapper = _FakeWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    return mod


def to_bf16(env):
    """Switch a tests/test_ch05_attention.py set-up (requests already added) to a bfloat16
    pool holding the same values, with a TorchBackend on it."""
    from minisgl.attention import TorchBackend
    from minisgl.core import get_global_ctx
    from minisgl.kvcache import MHAKVCache

    old = env.pool
    pool = MHAKVCache(env.hkv, ch05.NUM_LAYERS, env.d, old.num_pages, env.ps, torch.bfloat16,
                      "cpu")
    pool._kv_buffer.copy_(old._kv_buffer)
    env.pool = get_global_ctx().kv_cache = pool
    env.backend = TorchBackend(ch05.model_config(env.hq, env.hkv, env.d))
    return env


def forward_all(backend, env, batch, inputs):
    backend.prepare_metadata(batch)
    return [backend.forward(q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16),
                            layer, batch) for layer, (q, k, v) in enumerate(inputs)]


@pytest.mark.parametrize("name,ps", SPREAD)
def test_flashinfer_backend_through_the_documented_contract(fake_flashinfer, name, ps):
    from minisgl.attention.fi import FlashInferBackend

    spec, phase, n_dummy = BATCHES[name]
    env = ch05.make_env(8, 2, 64, ps, seed=ps + 3 * len(name))
    reqs = [env.add_req(c, n) for c, n in spec]
    to_bf16(env)
    be = FlashInferBackend(ch05.model_config(8, 2, 64))
    batch = env.make_batch(reqs, phase, n_dummy=n_dummy)
    inputs = [env.qkv(batch, layer) for layer in range(ch05.NUM_LAYERS)]
    outs = forward_all(be, env, batch, inputs)
    used = be.prefill_wrapper if phase == "prefill" else be.decode_wrapper
    idle = be.decode_wrapper if phase == "prefill" else be.prefill_wrapper
    assert used.plans == 1 and idle.plans == 0, (
        f"a {phase} batch must plan the {phase} wrapper exactly once for all layers (planned "
        f"{used.plans}x, the other wrapper {idle.plans}x)")
    real = sum(r.extend_len for r in reqs)  # dummies all share the dummy slot
    loc = batch.out_loc[:real].long()
    for layer, (o, (_, k, v)) in enumerate(zip(outs, inputs)):
        kc = env.pool.k_cache(layer).view(-1, 2, 64)
        assert torch.equal(kc[loc], k[:real].reshape(-1, 2, 64).to(torch.bfloat16)), \
            "forward must store this layer's k at out_loc before attending"
        start = 0
        for r in reqs:
            want = ch05.dense_reference(env, r, layer).float()
            torch.testing.assert_close(o[start:start + r.extend_len].float(), want, atol=3e-2,
                                       rtol=2e-2, msg=lambda m: f"{name}, ps={ps}, layer "
                                       f"{layer}, {ch05.describe(r)}: {m}")
            start += r.extend_len
    torch_outs = forward_all(env.backend, env, batch, inputs)
    for o, t in zip(outs, torch_outs):  # bf16 against bf16: the same numbers up to rounding
        torch.testing.assert_close(o.float(), t.float(), atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("ps", [1, 4])
def test_flashinfer_graph_hooks_replay_the_eager_result(fake_flashinfer, ps):
    """Capture on a batch of dummies, then replay a real decode batch: the captured metadata
    object (what a graph's kernels keep pointing at) must now give the eager output."""
    from minisgl.attention.fi import FlashInferBackend

    env = ch05.make_env(8, 2, 64, ps, seed=40 + ps)
    reqs = [env.add_req(n - 1, n) for n in (9, 3, 17)]
    prefill_req = env.add_req(0, 3)
    to_bf16(env)
    be = FlashInferBackend(ch05.model_config(8, 2, 64))
    width = env.page_table.shape[1]
    be.init_capture_graph(width, [1, 2, 4])
    dummies = [env.dummy_req() for _ in range(4)]
    cap = Batch(reqs=dummies, phase="decode")
    cap.padded_reqs = dummies
    cap.out_loc = torch.full((4,), env.dummy_slot, dtype=torch.int32)
    be.prepare_for_capture(cap)
    assert cap.attn_metadata.planned, "prepare_for_capture must plan before the capture"
    batch = env.make_batch(reqs, "decode", n_dummy=1)
    inputs = [env.qkv(batch, layer) for layer in range(ch05.NUM_LAYERS)]
    eager = forward_all(be, env, batch, inputs)
    plans = be.decode_wrapper.plans
    loc = batch.out_loc.long()
    for layer in range(ch05.NUM_LAYERS):  # forget what the eager pass stored
        env.pool.k_cache(layer).view(-1, 2, 64)[loc] = 0.0
        env.pool.v_cache(layer).view(-1, 2, 64)[loc] = 0.0
    be.prepare_for_replay(batch)  # batch.attn_metadata: prepare_metadata's, as the Engine has it
    assert be.decode_wrapper.plans == plans, "a replay must not plan the eager decode wrapper"
    for layer, (q, k, v) in enumerate(inputs):  # what the captured kernels now compute
        o = be.forward(q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16), layer,
                       cap)
        torch.testing.assert_close(o[:3], eager[layer][:3], atol=0, rtol=0, msg=lambda m: (
            f"layer {layer}: the replayed graph's output differs from the eager forward: the "
            f"static buffers were not refreshed in place ({m})"))
    with pytest.raises(ValueError, match="graph"):
        pre = env.make_batch([prefill_req], "prefill")
        be.prepare_metadata(pre)
        be.prepare_for_replay(pre)


def test_flashinfer_backend_refuses_what_its_kernels_cannot_do(fake_flashinfer):
    from minisgl.attention.fi import FlashInferBackend

    ch05.make_env(8, 2, 64, ps=4)  # a float32 pool
    with pytest.raises(ValueError, match="16-bit"):
        FlashInferBackend(ch05.model_config(8, 2, 64))
    reset_global_ctx()
    reset_tp_info()
    to_bf16(ch05.make_env(4, 2, 16, ps=4))
    with pytest.raises(ValueError, match="head_dim"):
        FlashInferBackend(ch05.model_config(4, 2, 16))


def test_fi_module_imports_without_flashinfer(monkeypatch):
    """The metadata and the backend's module import on a CPU machine; only building the backend
    needs the package."""
    import importlib

    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` fail
    fi = importlib.import_module("minisgl.attention.fi")
    importlib.import_module("minisgl.attention.fi_metadata")
    to_bf16(ch05.make_env(8, 2, 64, ps=4))
    with pytest.raises(ImportError):
        fi.FlashInferBackend(ch05.model_config(8, 2, 64))


def test_auto_picks_torch_for_float32():
    from minisgl.attention import resolve_attn_backend

    assert resolve_attn_backend("auto", torch.device("cpu"), torch.bfloat16) == "torch"
    assert resolve_attn_backend("auto", torch.device("cuda"), torch.float32) == "torch", (
        "'auto' must not pick FlashInfer for a float32 engine: its kernels take 16-bit inputs")


# ----------------------------------------------------------------------------- quick check
def quick_check() -> None:
    from minisgl.attention.fi_metadata import build_paged_metadata
    from minisgl.attention.paged_reference import expand_to_slots

    env = ch05.make_env(4, 2, 16, ps=4, seed=2)
    try:
        reqs = [env.add_req(0, 5), env.add_req(6, 7)]
        md = build_paged_metadata(reqs, env.page_table, 4)
        for r, slots in zip(reqs, expand_to_slots(md, 4)):
            want = env.page_table[r.table_idx, : r.device_len].long()
            if not torch.equal(slots, want):
                raise AssertionError(f"fi_metadata: {slots.tolist()} != {want.tolist()}. {HINT}")
    finally:
        reset_global_ctx()
        reset_tp_info()


def test_quick_check():
    quick_check()
