"""Chapter 06: the Engine, its config, the GraphRunner's padding and the sampler.

References: Hugging Face transformers (greedy tokens on SmolLM2, teacher-forced logits on the
tiny checkpoints) and plain torch (the distribution a sampler must draw from). Exercises:
6.1 top-k then top-p (sample_impl), 6.2 Sampler.prepare, 6.3 GraphRunner.pad_batch,
6.4 Engine._init, 6.5 Engine.forward_batch.

Only one Engine may be live per process: ``engine_for`` keeps the current one and builds a new
one (shutting the old one down) when a test needs another model or page size. SmolLM2's tests sit
together so that it is built once; the module fixture shuts the last Engine down at the end.
"""

from __future__ import annotations

import gc
import pathlib
import shutil

import pytest
import torch
from helpers import SMOL, TINY_MODELS, hf_greedy, hf_model, model_path, require_kernels, tokenizer

from minisgl import core
from minisgl.core import Batch, Req, SamplingParams
from minisgl.distributed import DistributedInfo, try_get_tp_info
from minisgl.engine import BatchSamplingArgs, Engine, EngineConfig, GraphRunner, Sampler
from minisgl.kvcache import pages_to_slots

TESTS = pathlib.Path(__file__).resolve().parent
EARLIER = ("01", "02", "03", "04", "05")
V = 20  # vocabulary of the sampler tests: small, so 20k draws pin every frequency down
DRAWS = 20_000
TV_LIMIT = 0.03  # total variation between observed frequencies and the exact distribution
LOGIT_TOL = {"atol": 1e-4, "rtol": 1e-4}  # float32; observed differences to HF are <= 5e-6


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module", autouse=True)
def _earlier_chapters_then_cleanup():
    """Earlier chapters' quick checks first (only those whose test file exists yet); at the
    end, shut down whichever Engine is still live."""
    from prereq import require

    require(*[c for c in EARLIER if any(TESTS.glob(f"test_ch{c}_*.py"))])
    yield
    _shutdown_live()


_LIVE: dict = {"key": None, "engine": None}


def _shutdown_live() -> None:
    if _LIVE["engine"] is not None:
        _LIVE["engine"].shutdown()
    _LIVE.update(key=None, engine=None)


def make_config(name: str, page_size: int = 1, **kw) -> EngineConfig:
    args = {"model_path": str(model_path(name)), "tp_info": DistributedInfo(0, 1),
            "dtype": torch.float32, "max_running_req": 4, "max_seq_len_override": 64,
            "num_page_override": 4 * 64 // page_size + 8, "page_size": page_size}
    args.update(kw)
    return EngineConfig(**args)


def engine_for(name: str, page_size: int = 1, **kw) -> Engine:
    """The live Engine for this model and page size (built, or rebuilt, when needed)."""
    key = (name, page_size, tuple(sorted(kw.items())))
    engine = _LIVE["engine"]
    if engine is None or engine._closed or _LIVE["key"] != key:
        _shutdown_live()
        engine = Engine(make_config(name, page_size, **kw))
        _LIVE.update(key=key, engine=engine)
    return engine


# ----------------------------------------------------------------------------- a tiny driver
def fixed_ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed),
                         dtype=torch.int32)


def make_req(ids, row: int, slots: torch.Tensor | None = None, *, engine: Engine,
             output_len: int = 16, cached_len: int = 0, params: SamplingParams | None = None,
             uid: int | None = None) -> Req:
    """A request in page-table row ``row``; ``slots`` (default: a contiguous block per row)
    become that row's entries."""
    width = engine.page_table.shape[1]
    if slots is None:
        slots = torch.arange(row * 64, row * 64 + 64)
    engine.page_table[row, : len(slots)] = slots.to(torch.int32)
    ids = torch.as_tensor(ids, dtype=torch.int32)
    assert len(ids) <= len(slots) <= width, "test set-up: not enough slots for the prompt"
    return Req(input_ids=ids, table_idx=row, cached_len=cached_len, output_len=output_len,
               uid=row if uid is None else uid,
               sampling_params=params or SamplingParams(max_tokens=output_len))


def fill(engine: Engine, batch: Batch) -> Batch:
    """What chapter 07's scheduler will do: pad, then the token-level tensors, then metadata."""
    engine.graph_runner.pad_batch(batch)
    reqs = batch.padded_reqs
    batch.positions = torch.cat([torch.arange(r.cached_len, r.device_len, dtype=torch.int32)
                                 for r in reqs])
    batch.input_ids = torch.cat([r.input_ids[r.cached_len:r.device_len] for r in reqs])
    batch.out_loc = torch.cat([engine.page_table[r.table_idx, r.cached_len:r.device_len]
                               for r in reqs])
    engine.attn_backend.prepare_metadata(batch)
    return batch


def step(engine: Engine, reqs, phase: str, feed=None) -> list[int]:
    """One forward + sample; append the sampled token (or ``feed[i]``, teacher forcing)."""
    batch = fill(engine, Batch(reqs=list(reqs), phase=phase))
    out = engine.forward_batch(batch, engine.sampler.prepare(batch))
    tokens = out.next_tokens_cpu
    assert tokens.device.type == "cpu" and tokens.shape == (len(reqs),), (
        f"Exercise 6.5 (forward_batch): next_tokens_cpu should be [B] = ({len(reqs)},) on the "
        f"CPU, got {tuple(tokens.shape)} on {tokens.device}; sample logits[:batch.size]")
    for i, r in enumerate(reqs):
        r.append_host(tokens[i:i + 1] if feed is None else torch.tensor([feed[i]]))
    return tokens.tolist()


def generate(engine: Engine, reqs, n: int) -> list[list[int]]:
    """Prefill, then n - 1 decode steps; every request's n sampled tokens."""
    outs = [[t] for t in step(engine, reqs, "prefill")]
    for _ in range(n - 1):
        for o, t in zip(outs, step(engine, reqs, "decode")):
            o.append(t)
    return outs


def capture_logits(engine: Engine, monkeypatch) -> list[torch.Tensor]:
    """Record the logits the Engine hands to its sampler, one [B, V] tensor per forward."""
    seen, real = [], engine.sampler.sample

    def spy(logits, args):
        seen.append(logits.detach().float().clone())
        return real(logits, args)

    monkeypatch.setattr(engine.sampler, "sample", spy)
    return seen


# ----------------------------------------------------------------------------- sampling
def exact_distribution(logits: torch.Tensor, t: float, k: int, p: float) -> torch.Tensor:
    """Plain float64 reference: softmax(logits / t), keep the k likeliest, renormalise, keep the
    smallest likeliest-first set whose mass reaches p, renormalise."""
    probs = torch.softmax(logits.double() / t, dim=-1)
    order = sorted(range(len(probs)), key=lambda i: -float(probs[i]))
    kept = order[:k] if k > 0 else order
    mass = sum(float(probs[i]) for i in kept)
    chosen, acc = [], 0.0
    for i in kept:
        chosen.append(i)
        acc += float(probs[i]) / mass
        if acc >= p:
            break
    out = torch.zeros_like(probs)
    out[chosen] = probs[chosen] / probs[chosen].sum()
    return out


def fixed_logits(seed: int = 3, rows: int = 1) -> torch.Tensor:
    return 2.0 * torch.randn(rows, V, generator=torch.Generator().manual_seed(seed))


def sampling_req(params: SamplingParams | None, uid: int = 0) -> Req:
    return Req(input_ids=torch.tensor([1, 2], dtype=torch.int32), table_idx=uid, cached_len=0,
               output_len=4, uid=uid, sampling_params=params)


def tile(args: BatchSamplingArgs, n: int) -> BatchSamplingArgs:
    t, k, p = args.temperatures, args.top_k, args.top_p
    return BatchSamplingArgs(*(None if a is None else a.repeat(n) for a in (t, k, p)))


@pytest.mark.parametrize("t,k,p", [(1.0, -1, 1.0), (0.7, 6, 1.0), (1.3, -1, 0.8),
                                   (1.5, 5, 0.7), (3.0, 8, 0.7), (2.0, 4, 0.9)])
def test_sampling_matches_the_exact_distribution(t, k, p):
    logits = fixed_logits()
    want = exact_distribution(logits[0], t, k, p)
    sampler = Sampler(torch.device("cpu"), V, seed=1234)
    args = sampler.prepare(Batch(reqs=[sampling_req(SamplingParams(t, k, p))], phase="decode"))
    assert args.temperatures is not None, (
        f"Exercise 6.2 (Sampler.prepare): temperature={t} is not greedy, so temperatures must be "
        "a tensor (None is only for an all-greedy batch)")
    draws = sampler.sample(logits.expand(DRAWS, V), tile(args, DRAWS))
    outside = sorted(set(draws.tolist()) - set(torch.nonzero(want).flatten().tolist()))
    assert not outside, (
        f"Exercise 6.1 (sample_impl): with temperature={t}, top_k={k}, top_p={p} token(s) "
        f"{outside} were drawn but lie outside the kept set {torch.nonzero(want).flatten().tolist()}"
        ": apply top-k first (rank >= k -> 0), then top-p on the renormalised survivors")
    freq = torch.bincount(draws, minlength=V).double() / DRAWS
    tv = 0.5 * float((freq - want).abs().sum())
    assert tv < TV_LIMIT, (
        f"Exercise 6.1/6.2: over {DRAWS} draws with temperature={t}, top_k={k}, top_p={p} the "
        f"frequencies are {tv:.3f} (total variation) away from softmax(logits / t) restricted "
        f"to the kept tokens and renormalised (limit {TV_LIMIT}); check the temperature division "
        "and the renormalisation")


def test_top_k_one_is_greedy():
    logits = fixed_logits(seed=8, rows=16)
    ones = torch.ones(16)
    from minisgl.engine.sample import sample_impl

    got = sample_impl(logits, ones, torch.ones(16, dtype=torch.int32), None,
                      torch.Generator().manual_seed(0))
    assert torch.equal(got, logits.argmax(-1)), (
        "Exercise 6.1 (sample_impl): top_k=1 must keep only the likeliest token of each row, "
        f"got {got.tolist()}, argmax is {logits.argmax(-1).tolist()}")
    got = sample_impl(logits, ones, None, torch.full((16,), 1e-6),
                      torch.Generator().manual_seed(0))
    assert torch.equal(got, logits.argmax(-1)), (
        "Exercise 6.1 (sample_impl): a tiny top_p must still keep the likeliest token")


def test_rows_keep_their_own_parameters():
    """One batch: a greedy row, a plain sampled row, a top-k row, a top_k=1 row."""
    sampler = Sampler(torch.device("cpu"), V, seed=7)
    params = [SamplingParams(), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=5.0, top_k=1)]
    batch = Batch(reqs=[sampling_req(p, i) for i, p in enumerate(params)], phase="decode")
    logits = fixed_logits(seed=4, rows=4)
    args = sampler.prepare(batch)
    n = 300
    draws = sampler.sample(logits.repeat(n, 1), tile(args, n)).view(n, 4)
    best = logits.argmax(-1)
    assert (draws[:, 0] == best[0]).all(), (
        "Exercise 6.2 (Sampler.prepare): a greedy row inside a sampled batch drew "
        f"{sorted(set(draws[:, 0].tolist()))}, not always its argmax {int(best[0])}; give greedy "
        "rows a tiny temperature and top_k=1")
    assert (draws[:, 3] == best[3]).all(), (
        "Exercise 6.2: a top_k=1 row (even at temperature 5) must always draw its argmax")
    assert len(set(draws[:, 1].tolist())) > 3, (
        "Exercise 6.1/6.2: a temperature-1 row drew only "
        f"{sorted(set(draws[:, 1].tolist()))} in {n} draws: it is not sampling")
    top3 = set(logits[2].topk(3).indices.tolist())
    got = set(draws[:, 2].tolist())
    assert got <= top3 and len(got) > 1, (
        f"Exercise 6.1/6.2: the top_k=3 row drew {sorted(got)}; it must draw from its own top 3 "
        f"{sorted(top3)} (and more than one of them)")


def test_prepare_fast_path_and_tensors():
    sampler = Sampler(torch.device("cpu"), V)
    greedy = [SamplingParams(), SamplingParams(temperature=0.9, top_k=1), None]
    args = sampler.prepare(Batch(reqs=[sampling_req(p, i) for i, p in enumerate(greedy)],
                                 phase="decode"))
    assert args.temperatures is None and args.top_k is None and args.top_p is None, (
        f"Exercise 6.2 (Sampler.prepare): an all-greedy batch must take the fast path "
        f"BatchSamplingArgs(None), got {args}")
    logits = fixed_logits(seed=5, rows=3)
    assert torch.equal(sampler.sample(logits, args), logits.argmax(-1)), (
        "Sampler.sample with temperatures None must be an argmax")
    free = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.2)]
    args = sampler.prepare(Batch(reqs=[sampling_req(p, i) for i, p in enumerate(free)],
                                 phase="decode"))
    assert args.temperatures is not None and torch.allclose(
        args.temperatures, torch.tensor([0.8, 1.2])), (
        f"Exercise 6.2: temperatures should be [0.8, 1.2], got {args.temperatures}")
    assert args.top_k is None and args.top_p is None, (
        "Exercise 6.2: no row cuts by top-k or top-p, so top_k and top_p must be None (the "
        f"sampler then skips the sort); got top_k={args.top_k}, top_p={args.top_p}")


def test_top_k_larger_than_vocab_is_refused():
    sampler = Sampler(torch.device("cpu"), V)
    batch = Batch(reqs=[sampling_req(SamplingParams(temperature=1.0, top_k=V + 1))],
                  phase="decode")
    with pytest.raises(ValueError, match="exceeds the vocabulary"):
        sampler.prepare(batch)


def test_seed_makes_draws_reproducible():
    logits = fixed_logits(seed=6).expand(500, V)
    args = BatchSamplingArgs(torch.ones(500), torch.full((500,), 10, dtype=torch.int32),
                             torch.full((500,), 0.9))

    def draws(seed):
        return Sampler(torch.device("cpu"), V, seed=seed).sample(logits, args)

    assert torch.equal(draws(5), draws(5)), (
        "two Samplers with the same seed drew different tokens: draw with the sampler's own "
        "generator (torch.multinomial(..., generator=generator))")
    assert not torch.equal(draws(5), draws(6)), "different seeds should give different draws"


# ----------------------------------------------------------------------------- GraphRunner
def test_pad_batch():
    dummy = Req(input_ids=torch.tensor([0], dtype=torch.int32), table_idx=4, cached_len=0,
                output_len=1, uid=-1, sampling_params=None)
    runner = GraphRunner(torch.device("cpu"), None, None, None, None, 64, V, dummy)
    assert runner.graph_bs_list == [] and runner.max_graph_bs == 0, (
        "on the CPU the GraphRunner captures no graphs")
    reqs = [sampling_req(SamplingParams(), i) for i in range(20)]
    batch = Batch(reqs=reqs[:3], phase="decode")
    runner.pad_batch(batch)
    assert batch.padded_reqs == reqs[:3], (
        f"Exercise 6.3 (pad_batch): on the CPU nothing is padded, got {len(batch.padded_reqs)} "
        "requests for 3")
    runner.graph_bs_list, runner.max_graph_bs = [1, 2, 4, 8, 16], 16  # as if on a GPU
    for b in range(1, 21):
        for phase in ("decode", "prefill"):
            batch = Batch(reqs=reqs[:b], phase=phase)
            runner.pad_batch(batch)
            want = b if phase == "prefill" or b > 16 else min(s for s in [1, 2, 4, 8, 16]
                                                              if s >= b)
            got = batch.padded_reqs
            assert got is not None and len(got) == want, (
                f"Exercise 6.3 (pad_batch): a {phase} batch of {b} with graphs for [1, 2, 4, 8, "
                f"16] should be padded to {want}, got {None if got is None else len(got)}")
            assert got[:b] == reqs[:b] and all(r is dummy for r in got[b:]), (
                "Exercise 6.3: padded_reqs must be the batch's requests, in order, then the "
                "dummy request")


# ----------------------------------------------------------------------------- config, lifecycle
@pytest.mark.parametrize("change,error", [
    ({"dtype": torch.int32}, TypeError),
    ({"page_size": 0}, ValueError),
    ({"model_path": "models/no-such-model"}, FileNotFoundError),
    ({"num_page_override": 10**12}, MemoryError),
    ({"num_threads": 0}, ValueError),
])
def test_config_errors_touch_no_global_state(change, error):
    _shutdown_live()
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    args = {"model_path": str(model_path("tiny-llama")), "tp_info": DistributedInfo(0, 1),
            "dtype": torch.float32, "max_running_req": 2, "num_page_override": 64}
    args.update(change)
    with pytest.raises(error):
        Engine(EngineConfig(**args))
    assert core._GLOBAL_CTX is None and try_get_tp_info() is None, (
        f"{error.__name__} for {change} must be raised by EngineConfig.validate(), before the "
        "Engine sets the global context or tp info")
    assert torch.get_num_threads() == threads and torch.equal(torch.get_rng_state(), rng), (
        f"a bad config ({change}) changed torch's thread count or RNG state: validate first")


def test_a_bad_config_leaves_the_live_engine_alone():
    live = engine_for("tiny-llama")
    with pytest.raises(MemoryError, match="num_page_override"):
        Engine(make_config("tiny-llama", num_page_override=10**12))
    assert not live._closed and core._GLOBAL_CTX is live.ctx, (
        "a config that can never work shut the live Engine down: validate before replacing it")


def _corrupt_copy(tmp_path, name: str = "tiny-llama") -> pathlib.Path:
    folder = tmp_path / name
    shutil.copytree(model_path(name), folder)
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return folder


def test_a_failed_build_leaves_the_live_engine_working(tmp_path, capsys):
    """A second Engine that fails while loading (a corrupt checkpoint) is built before the live
    one is replaced: the live Engine keeps its globals, its thread count and its results."""
    live = engine_for("tiny-llama", num_threads=1)
    prompts = [fixed_ids(5, seed=70), fixed_ids(3, seed=71)]

    def run():
        reqs = [make_req(ids, i, engine=live, output_len=4) for i, ids in enumerate(prompts)]
        return generate(live, reqs, 4)

    before = run()
    capsys.readouterr()
    with pytest.raises(RuntimeError, match="truncated or corrupt"):
        Engine(make_config("tiny-llama", model_path=str(_corrupt_copy(tmp_path)), num_threads=2))
    assert not capsys.readouterr().out, "a failed build must not announce a replacement"
    assert not live._closed, "a failed build shut the live Engine down: build first, then replace"
    assert core._GLOBAL_CTX is live.ctx and try_get_tp_info() == live.config.tp_info, (
        "after a failed build the global context and tp info must be the live Engine's again")
    assert torch.get_num_threads() == 1, (
        f"after a failed build the live Engine's thread count (1) must be back, got "
        f"{torch.get_num_threads()}")
    assert run() == before, "the live Engine computes other tokens after a failed build"


def test_a_pool_that_fits_only_without_the_old_engine_replaces_it_early(monkeypatch, capsys):
    """The new KV pool does not fit beside the live Engine: once the new weights have loaded,
    the live Engine is shut down to make room (its memory counts as available)."""
    import minisgl.engine.engine as engine_module

    old = engine_for("tiny-llama")
    monkeypatch.setattr(engine_module, "available_memory", lambda device: 0)
    capsys.readouterr()
    new = Engine(make_config("tiny-llama", num_page_override=300))
    try:
        notice = capsys.readouterr().out.strip().splitlines()
        assert old._closed and len(notice) == 1 and "to make room" in notice[0], notice
        assert core._GLOBAL_CTX is new.ctx and try_get_tp_info() == new.config.tp_info
        reqs = [make_req(fixed_ids(5, seed=72), 0, engine=new, output_len=3)]
        assert len(generate(new, reqs, 3)[0]) == 3
    finally:
        new.shutdown()


def test_building_twice_and_shutdown(capsys):
    _shutdown_live()
    saved = torch.get_num_threads()
    torch.set_num_threads(3)  # so that restoring is visible whatever the machine
    try:
        first = Engine(make_config("tiny-llama", num_threads=1))
        assert torch.get_num_threads() == 1, "Engine.__init__ sets torch's thread count"
        assert first.config.attention_backend == "torch", (
            f"Engine.__init__ should resolve engine.config.attention_backend to 'torch' on the "
            f"CPU, got {first.config.attention_backend!r}")
        capsys.readouterr()
        second = Engine(make_config("tiny-llama", num_threads=2))
        notice = capsys.readouterr().out.strip().splitlines()
        assert first._closed and len(notice) == 1 and "shutting down" in notice[0], (
            f"building a second Engine must shut the live one down with a one-line notice; "
            f"printed {notice}")
        assert core._GLOBAL_CTX is second.ctx and try_get_tp_info() == second.config.tp_info, (
            "after the second Engine is built, the global context and tp info must be its own")
        with pytest.raises(RuntimeError, match="shut down"):
            first.forward_batch(None, None)
        second.shutdown()
        assert core._GLOBAL_CTX is None and try_get_tp_info() is None, (
            "shutdown() must release the global context and the tp info")
        assert torch.get_num_threads() == 3, (
            f"shutdown() must restore torch's thread count (3 before the Engines), got "
            f"{torch.get_num_threads()}")
        third = Engine(make_config("tiny-llama"))
        del third  # nobody holds it any more, but it still owns the global state
        gc.collect()
        fourth = Engine(make_config("tiny-llama"))  # must shut the forgotten one down
        fourth.shutdown()
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(saved)


def test_engine_layout():
    engine = engine_for("tiny-llama", page_size=4)
    cfg, ps = engine.config, 4
    assert engine.kv_cache.num_slots == (engine.num_pages + 1) * ps, (
        f"Exercise 6.4: the KV pool should hold num_pages + 1 = {engine.num_pages + 1} pages (the "
        f"last one is the dummy page), it has {engine.kv_cache.num_slots // ps}")
    assert engine.page_table.shape[0] == cfg.max_running_req + 1, (
        "Exercise 6.4: the page table needs max_running_req + 1 rows (the last is the dummy's)")
    assert (engine.page_table[-1] == engine.num_pages * ps).all(), (
        "Exercise 6.4: every entry of the dummy row must point at the dummy page's first slot "
        f"num_pages * page_size = {engine.num_pages * ps}")
    assert engine.dummy_req.table_idx == cfg.max_running_req, (
        "Exercise 6.4: the dummy request's table_idx is max_running_req (the extra row)")
    ctx = engine.ctx
    assert core._GLOBAL_CTX is ctx and (ctx.kv_cache, ctx.page_table, ctx.attn_backend) == (
        engine.kv_cache, engine.page_table, engine.attn_backend), (
        "Exercise 6.4: the Engine's context must be the global one and hold its KV pool, page "
        "table and attention backend")
    assert engine.max_seq_len == min(cfg.max_seq_len, engine.num_pages * ps)


def test_kv_pool_budget_counts_the_weights(monkeypatch):
    """With no num_page_override the pool gets memory_ratio of the free memory minus the weights:
    each distinct state-dict tensor once (a tied LM head shares the embedding's)."""
    import minisgl.engine.engine as engine_module

    free = 256 << 20
    monkeypatch.setattr(engine_module, "available_memory", lambda device: free)
    _shutdown_live()
    engine = Engine(make_config("tiny-llama", num_page_override=None, memory_ratio=0.5,
                                max_running_req=256, max_seq_len_override=None))
    try:
        weights = sum(t.numel() * t.element_size() for t in
                      {id(t): t for t in engine.model.state_dict().values()}.values())
        per_page = engine.config.kv_cache_bytes_per_page
        want = int((0.5 * free - weights) // per_page)
        assert engine.num_pages == want, (
            f"Exercise 6.6 (determine_num_pages): the KV pool has {engine.num_pages} pages; 0.5 x "
            f"{free} bytes free minus {weights} bytes of weights leaves room for {want}")
    finally:
        engine.shutdown()


def test_padding_with_the_dummy_request_changes_nothing(monkeypatch):
    """Pretend a decode graph exists for batch size 4 (as on a GPU): decode batches of 3 are then
    padded with the dummy request and run eagerly; the real requests' tokens must not change."""
    engine = engine_for("tiny-llama")
    prompts = [fixed_ids(n, seed=60 + n) for n in (4, 7, 5)]

    def run():
        reqs = [make_req(ids, i, engine=engine, output_len=6) for i, ids in enumerate(prompts)]
        return generate(engine, reqs, 6)

    plain = run()
    monkeypatch.setattr(engine.graph_runner, "graph_bs_list", [4])
    monkeypatch.setattr(engine.graph_runner, "max_graph_bs", 4)
    padded = run()
    assert padded == plain, (
        f"with one dummy request padding each decode batch of 3 the tokens became {padded} "
        f"instead of {plain}: sample only logits[:batch.size] and advance only batch.reqs "
        "(Exercise 6.5)")
    dummy = engine.dummy_req
    assert (dummy.cached_len, dummy.device_len) == (0, 1), (
        "Exercise 6.5: forward_batch advanced the dummy request; call complete_one() on "
        "batch.reqs only, never on the padding")
    assert engine.kv_cache.k_cache(0)[engine.num_pages].abs().sum() > 0, (
        "the dummy request's K/V should land in the dummy page (the pool's last page)")


# ----------------------------------------------------------------------------- forward errors
def _bad_batch(engine, case):
    reqs = [make_req(fixed_ids(5, 1), 0, engine=engine, output_len=4)]
    phase = "prefill"
    if case == "duplicate table_idx":
        reqs.append(make_req(fixed_ids(3, 2), 0, engine=engine, output_len=4, uid=1))
    if case == "prompt + max tokens > max_seq_len":
        reqs = [make_req(fixed_ids(5, 1), 0, engine=engine, output_len=60)]
    if case == "too many requests":
        reqs = [make_req(fixed_ids(3, i), i % 4, engine=engine, output_len=4, uid=i)
                for i in range(5)]
    if case == "decode batch with a prompt":
        phase = "decode"
    batch = Batch(reqs=reqs, phase=phase)
    if case == "pad_batch not called":
        return batch
    if case == "fields never filled":
        engine.graph_runner.pad_batch(batch)
        return batch
    fill(engine, batch)
    if case == "metadata not prepared":
        batch.attn_metadata = None
    if case == "table_idx out of range":
        reqs[0].table_idx = engine.config.max_running_req  # the dummy's row
    if case == "out_loc outside the pool":
        batch.out_loc = batch.out_loc + engine.kv_cache.num_slots
    if case == "out_loc one past the pool":  # the first slot the pool does not have
        batch.out_loc = batch.out_loc.clone()
        batch.out_loc[-1] = engine.kv_cache.num_slots
    if case == "out_loc negative":
        batch.out_loc = batch.out_loc.clone()
        batch.out_loc[0] = -1
    return batch


@pytest.mark.parametrize("case,error,fragment", [
    ("pad_batch not called", RuntimeError, "pad_batch"),
    ("fields never filled", RuntimeError, "never set"),
    ("metadata not prepared", RuntimeError, "prepare_metadata"),
    ("table_idx out of range", IndexError, "outside the page table"),
    ("duplicate table_idx", ValueError, "used by two requests"),
    ("out_loc outside the pool", IndexError, "outside the KV pool"),
    ("out_loc one past the pool", IndexError, "outside the KV pool"),
    ("out_loc negative", IndexError, "holds slot -1, outside the KV pool"),
    ("prompt + max tokens > max_seq_len", ValueError, "max_seq_len"),
    ("too many requests", ValueError, "max_running_req"),
    ("decode batch with a prompt", ValueError, "decode"),
])
def test_forward_batch_errors(case, error, fragment):
    engine = engine_for("tiny-llama")
    batch = _bad_batch(engine, case)
    before = [(r.cached_len, r.device_len) for r in batch.reqs]
    with pytest.raises(error, match=fragment):
        engine.forward_batch(batch, engine.sampler.prepare(batch))
    assert [(r.cached_len, r.device_len) for r in batch.reqs] == before, (
        f"forward_batch changed the requests' lengths before refusing a bad batch ({case})")


def test_empty_batch_is_refused():
    with pytest.raises(ValueError, match="empty Batch"):
        Batch(reqs=[], phase="decode")


# ----------------------------------------------------------------------------- SmolLM2 vs HF
PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "List three prime numbers and explain why each one is prime:", "Once upon a time,"]
_SMOL_RESULTS: dict = {}


def _smol_batch_tokens(ops: str = "your-code") -> list[list[int]]:
    if ops not in _SMOL_RESULTS:
        engine = engine_for(SMOL, **({"cpu_kernels": True} if ops == "kernels" else {}))
        tok = tokenizer()
        reqs = [make_req(tok(p).input_ids, i, engine=engine) for i, p in enumerate(PROMPTS)]
        _SMOL_RESULTS[ops] = generate(engine, reqs, 16)
    return _SMOL_RESULTS[ops]


@pytest.mark.slow
@pytest.mark.parametrize("ops", ["your-code", "kernels"])
def test_smollm2_greedy_matches_hf_in_a_batch_of_four(ops):
    if ops == "kernels":
        require_kernels()
    tok = tokenizer()
    outs = _smol_batch_tokens(ops)
    for prompt, got in zip(PROMPTS, outs):
        want = hf_greedy(SMOL, tok(prompt).input_ids, 16)
        assert got == want, (
            f"SmolLM2 ({ops}), {prompt!r} in a batch of 4 prompts of different lengths: greedy tokens "
            f"{got} differ from HF's {want} (first difference at step "
            f"{next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)}); check "
            "Exercises 6.4 / 6.5")


def test_a_request_alone_equals_it_inside_the_batch():
    engine = engine_for(SMOL)
    tok = tokenizer()
    batch_outs = _smol_batch_tokens()
    alone = make_req(tok(PROMPTS[2]).input_ids, 3, slots=torch.arange(200, 264), engine=engine)
    [got] = generate(engine, [alone], 16)
    assert got == batch_outs[2], (
        f"SmolLM2, {PROMPTS[2]!r}: alone it gives {got}, inside the batch of four {batch_outs[2]}; "
        "a request's tokens must not depend on its neighbours")


# ----------------------------------------------------------------------------- tiny checkpoints
@pytest.mark.parametrize("ops", ["your-code", "kernels"])
@pytest.mark.parametrize("name", TINY_MODELS)
def test_teacher_forced_logits_match_hf(name, ops, monkeypatch):
    """Two sequences of 12 tokens: prefill 5 and 8 tokens, then decode steps that feed the known
    next token; every step's logits equal HF's full-sequence logits at that position within
    atol = rtol = 1e-4 (float32 throughout; the observed differences are <= 5e-6). Run with the
    Engine's default (your code of chapters 02-06) and with ``cpu_kernels=True`` (chapter 07's
    fused C++ kernels bound onto the ops, where they build)."""
    if ops == "kernels":
        require_kernels()
    engine = engine_for(name, **({"cpu_kernels": True} if ops == "kernels" else {}))
    assert engine.config.attention_backend == ("cpp" if ops == "kernels" else "torch")
    seqs = [fixed_ids(12, seed=10), fixed_ids(12, seed=11)]
    with torch.no_grad():
        ref = [hf_model(name)(s[None].long()).logits[0].float() for s in seqs]
    seen = capture_logits(engine, monkeypatch)
    reqs = [make_req(seqs[0][:5], 0, engine=engine, output_len=7),
            make_req(seqs[1][:8], 1, engine=engine, output_len=4, uid=1)]
    checks = []  # (logits row, request index, position)
    step(engine, reqs, "prefill", feed=[int(seqs[0][5]), int(seqs[1][8])])
    checks += [(seen[-1][0], 0, 4), (seen[-1][1], 1, 7)]
    while True:  # decode positions 5..10 of sequence 0 and 8..10 of sequence 1
        live = [i for i in (0, 1) if reqs[i].device_len <= 11]
        if not live:
            break
        positions = [reqs[i].device_len - 1 for i in live]
        step(engine, [reqs[i] for i in live], "decode",
             feed=[int(seqs[i][p + 1]) for i, p in zip(live, positions)])
        checks += [(seen[-1][j], i, p) for j, (i, p) in enumerate(zip(live, positions))]
    assert len(checks) == 2 + 6 + 3, f"expected 11 compared positions, got {len(checks)}"
    for row, i, pos in checks:
        where = (f"{name}: logits of sequence {i} at position {pos} "
                 f"({'prefill' if pos in (4, 7) else 'decode'})")
        torch.testing.assert_close(row, ref[i][pos], **LOGIT_TOL, msg=lambda m, where=where: (
            f"{where} differ from HF's full forward beyond atol=rtol=1e-4; check Exercises "
            f"6.4 / 6.5\n{m}"))


@pytest.mark.parametrize("ops", ["your-code", "kernels"])
def test_tied_config_with_its_own_lm_head_matches_hf(ops, tmp_path):
    """config.json says tie_word_embeddings, but the checkpoint ships a different lm_head.weight:
    Hugging Face then uses that tensor (it does not tie), and the Engine must give its tokens."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    if ops == "kernels":
        require_kernels()
    folder = tmp_path / "tied-with-own-head"
    shutil.copytree(model_path("tiny-llama3-rope"), folder)
    state = load_file(str(folder / "model.safetensors"))
    assert "lm_head.weight" not in state, "test set-up: tiny-llama3-rope should be tied"
    table = state["model.embed_tokens.weight"]
    state["lm_head.weight"] = 0.1 * torch.randn(table.shape, generator=torch.Generator()
                                                .manual_seed(73))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                              local_files_only=True).eval()
    assert hf.config.tie_word_embeddings and not torch.equal(
        hf.lm_head.weight, hf.model.embed_tokens.weight), (
        "test set-up: HF should keep the checkpoint's own lm_head.weight")
    ids, n = fixed_ids(6, seed=74), 6
    want, seq = [], ids[None].long()
    with torch.no_grad():
        first = hf(seq).logits[0, -1]
        for _ in range(n):  # greedy, recomputing the whole sequence each step
            want.append(int(hf(seq).logits[0, -1].argmax()))
            seq = torch.cat([seq, torch.tensor([[want[-1]]])], dim=1)
    engine = Engine(make_config("tiny-llama3-rope", model_path=str(folder),
                                **({"cpu_kernels": True} if ops == "kernels" else {})))
    try:
        seen = []
        real = engine.sampler.sample
        engine.sampler.sample = lambda logits, args: seen.append(logits.clone()) or real(logits,
                                                                                        args)
        [got] = generate(engine, [make_req(ids, 0, engine=engine, output_len=n)], n)
        torch.testing.assert_close(seen[0][0], first, **LOGIT_TOL, msg=lambda m: (
            "a tied config whose checkpoint has its own lm_head.weight: the prefill logits differ "
            f"from HF's, which uses that lm_head.weight\n{m}"))
        assert got == want, (f"tied config + its own lm_head.weight: the Engine gives {got}, HF "
                             f"{want}")
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def page_size_runs():
    """The same three requests on tiny-qwen3 with page_size 1 and 4, in scattered pages."""
    prompts = [fixed_ids(n, seed=20 + n) for n in (3, 6, 9)]
    runs = {}
    for ps in (1, 4):
        engine = engine_for("tiny-qwen3", page_size=ps)
        num_pages = engine.num_pages
        pages = torch.randperm(num_pages, generator=torch.Generator().manual_seed(ps))
        per_req = 24 // ps  # 24 slots per request
        reqs = []
        for i, ids in enumerate(prompts):
            slots = pages_to_slots(pages[i * per_req:(i + 1) * per_req], ps)
            reqs.append(make_req(ids, i, slots=slots, engine=engine, output_len=12))
        runs[ps] = generate(engine, reqs, 12)
    return runs


def test_page_size_does_not_change_tokens(page_size_runs):
    assert page_size_runs[1] == page_size_runs[4], (
        f"tiny-qwen3: page_size=1 gave {page_size_runs[1]}, page_size=4 gave "
        f"{page_size_runs[4]}; the page size only moves where K/V live, never what is computed")


@pytest.mark.parametrize("ps,k", [(1, 6), (4, 8)])
def test_cached_prefix_equals_full_prefill(ps, k, monkeypatch):
    """Request B reuses request A's first k slots (cached_len=k) and computes only the rest; a
    full prefill of B's prompt in fresh slots must give the same logits and tokens."""
    engine = engine_for("tiny-qwen2", page_size=ps)
    a_ids = fixed_ids(12, seed=30)
    b_ids = torch.cat([a_ids[:k], fixed_ids(4, seed=31)])
    seen = capture_logits(engine, monkeypatch)
    a = make_req(a_ids, 0, engine=engine, output_len=4)
    step(engine, [a], "prefill")
    shared = engine.page_table[0, :k].clone()
    b_slots = torch.cat([shared, torch.arange(64 + k, 128)])  # row 1's own block after the prefix
    b = make_req(b_ids, 1, slots=b_slots, engine=engine, output_len=6, cached_len=k)
    full = make_req(b_ids, 2, engine=engine, output_len=6)
    got = generate(engine, [b], 6)
    want = generate(engine, [full], 6)
    assert len(seen) == 13, f"expected 13 forwards, saw {len(seen)}"
    torch.testing.assert_close(torch.cat(seen[1:7]), torch.cat(seen[7:13]), **LOGIT_TOL,
                               msg=lambda m: (
        f"tiny-qwen2, page_size={ps}: with {k} cached tokens the logits (prefill of the rest, "
        f"then 5 decode steps) differ from a full prefill's\n{m}"))
    assert got == want, (
        f"tiny-qwen2, page_size={ps}: with a cached prefix of {k} tokens the request generated "
        f"{got}, a full prefill generated {want}")


def test_mixed_sampling_params_in_one_engine_batch(monkeypatch):
    engine = engine_for("tiny-llama")
    prompt = fixed_ids(6, seed=40)
    [greedy_alone] = generate(engine, [make_req(prompt, 0, engine=engine, output_len=8)], 8)

    def run(seed):
        monkeypatch.setattr(engine, "sampler", Sampler(engine.device, 49152, seed=seed))
        reqs = [make_req(prompt, 1, engine=engine, output_len=8),
                make_req(prompt, 2, engine=engine, output_len=8, uid=2,
                         params=SamplingParams(temperature=1.0, top_p=0.95, max_tokens=8))]
        return generate(engine, reqs, 8)

    greedy, sampled = run(seed=3)
    assert greedy == greedy_alone, (
        f"a greedy request next to a sampled one gave {greedy}, alone {greedy_alone}")
    assert sampled != greedy, "the temperature-1 request produced exactly the greedy tokens"
    assert run(seed=3)[1] == sampled, "the same sampler seed must reproduce the sampled tokens"


# ----------------------------------------------------------------------------- quick check
def quick_check() -> None:
    """Fast smoke check for later chapters: a tiny-llama Engine, one prefill and one decode
    step equal HF's greedy tokens. Shuts a live Engine down first and its own at the end."""
    ids = fixed_ids(5, seed=50)
    engine = Engine(make_config("tiny-llama", num_page_override=32, max_seq_len_override=16))
    try:
        req = make_req(ids, 0, slots=torch.arange(16), engine=engine, output_len=2)
        got = [step(engine, [req], "prefill")[0], step(engine, [req], "decode")[0]]
    finally:
        engine.shutdown()
    want = hf_greedy("tiny-llama", ids.tolist(), 2)
    if got != want:
        raise AssertionError(f"tiny-llama: the Engine's prefill + decode gave {got}, HF's greedy "
                             f"{want} (Exercises 6.4, 6.5)")


def test_quick_check():
    quick_check()


# ----------------------------------------------------------------------------- by class (issue 22)
def _prepare_by_hand(params, vocab):
    """Sampler.prepare's table, row by row: (temperatures, top_k, top_p) or None."""
    greedy = [p is None or p.is_greedy for p in params]
    if all(greedy):
        return None
    # temperature 0 is argmax even where top_p < 1 keeps the row out of the greedy ones
    temps = [1e-6 if g or p.temperature == 0 else p.temperature for p, g in zip(params, greedy)]
    ks = [1 if g else (vocab if p.top_k == -1 else p.top_k) for p, g in zip(params, greedy)]
    ps = [1.0 if p is None else p.top_p for p in params]
    return (temps, ks if any(k != vocab for k in ks) else None,
            ps if any(q < 1.0 for q in ps) else None)


@pytest.mark.parametrize("params", [
    [None, SamplingParams(temperature=0.9, top_k=3, top_p=0.5), SamplingParams(temperature=1.1)],
    [SamplingParams(temperature=0.6, top_k=V - 1), SamplingParams(temperature=0.6)],
    [SamplingParams(temperature=0.5, top_k=V), SamplingParams(temperature=2.0, top_p=1.0)],
    [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9)],
    [SamplingParams(temperature=0.0, top_p=0.5), SamplingParams(temperature=0.8)],
    [SamplingParams(temperature=1.5), SamplingParams(temperature=0.0, top_k=3, top_p=0.9)],
], ids=["none-and-cuts", "top-k-v-minus-1", "top-k-v-is-no-cut", "greedy-next-to-top-p",
        "temperature-0-with-top-p", "temperature-0-top-k-top-p"])
def test_prepare_matches_the_table(params):
    """Every row's tensors, their dtypes and the None shortcuts, against the table of 6.2."""
    args = Sampler(torch.device("cpu"), V).prepare(
        Batch(reqs=[sampling_req(p, i) for i, p in enumerate(params)], phase="decode"))
    want = _prepare_by_hand(params, V)
    dtypes = (torch.float32, torch.int32, torch.float32)
    for name, w, dtype in zip(("temperatures", "top_k", "top_p"), want, dtypes):
        got = getattr(args, name)
        if w is None:
            assert got is None, (f"Exercise 6.2 (Sampler.prepare): no row cuts by {name}, so it "
                                 f"stays None; got {got}")
            continue
        assert got is not None and got.dtype == dtype, (
            f"Exercise 6.2: {name} must be a {dtype} tensor (a row cuts by it), got "
            f"{None if got is None else got.dtype}")
        assert torch.allclose(got.double(), torch.tensor(w, dtype=torch.float64), rtol=1e-5,
                              atol=0), (
            f"Exercise 6.2: {name} should be {w}, got {got.tolist()} (a request without params "
            "is greedy: 1e-6 and top_k 1; top_k -1 is vocab_size; temperature 0 is 1e-6 also "
            "where top_p < 1 makes the row non-greedy, never read as 'unset')")


@pytest.mark.parametrize("params,pad", [
    ([SamplingParams(temperature=0.7), SamplingParams(temperature=1.3)], 1),
    ([SamplingParams(), SamplingParams(temperature=0.9, top_p=0.8), None], 5),
], ids=["sampled-padded-to-3", "mixed-padded-to-8"])
def test_prepare_on_a_padded_batch_has_one_row_per_request(params, pad):
    """On a GPU the batch is padded (pad_batch) before prepare: the dummies get no rows, since
    forward_batch samples logits[:B] only; the args equal those of the unpadded batch."""
    dummy = Req(input_ids=torch.tensor([0], dtype=torch.int32), table_idx=9, cached_len=0,
                output_len=1, uid=-1, sampling_params=None)
    batch = Batch(reqs=[sampling_req(p, i) for i, p in enumerate(params)], phase="decode")
    batch.padded_reqs = batch.reqs + [dummy] * pad
    args = Sampler(torch.device("cpu"), V).prepare(batch)
    want = _prepare_by_hand(params, V)
    for name, w in zip(("temperatures", "top_k", "top_p"), want):
        got = getattr(args, name)
        rows = None if got is None else tuple(got.shape)
        assert rows != (len(params) + pad,), (
            f"Exercise 6.2 (Sampler.prepare): on a batch of {len(params)} padded to "
            f"{len(params) + pad}, {name} has a row per request of batch.padded_reqs; build the "
            "rows from batch.reqs (the dummies' logits rows are dropped before sampling)")
        assert (got is None) == (w is None) and (w is None or torch.allclose(
            got.double(), torch.tensor(w, dtype=torch.float64), rtol=1e-5, atol=0)), (
            f"Exercise 6.2: on a padded batch {name} should be {w} (as without padding), got "
            f"{None if got is None else got.tolist()}")


def test_pad_batch_leaves_the_requests_alone():
    """Padding builds a new list; batch.reqs keeps exactly the batch's requests (any sizes)."""
    dummy = Req(input_ids=torch.tensor([0], dtype=torch.int32), table_idx=9, cached_len=0,
                output_len=1, uid=-1, sampling_params=None)
    runner = GraphRunner(torch.device("cpu"), None, None, None, None, 64, V, dummy)
    runner.graph_bs_list, runner.max_graph_bs = [3, 6], 6
    reqs = [sampling_req(SamplingParams(), i) for i in range(5)]
    for b, want in ((1, 3), (3, 3), (4, 6), (5, 6)):
        batch = Batch(reqs=reqs[:b], phase="decode")
        runner.pad_batch(batch)
        assert batch.reqs == reqs[:b], (
            f"Exercise 6.3 (pad_batch): batch.reqs changed to {len(batch.reqs)} requests; build "
            "padded_reqs as a new list, batch.reqs + dummies")
        assert len(batch.padded_reqs) == want, (
            f"Exercise 6.3: a decode batch of {b} with graphs for [3, 6] pads to {want}, got "
            f"{len(batch.padded_reqs)}")


def test_init_builds_in_order_in_the_engines_dtype(monkeypatch):
    """Watch the helpers _init calls: tp info and rope device before the model, the model on
    meta in the Engine's dtype, free memory read before the weights load; then the parts."""
    import dataclasses

    import minisgl.engine.engine as engine_module
    from minisgl.layers import get_rope_device, set_rope_device
    from minisgl.utils import align_ceil

    _shutdown_live()
    config = make_config("tiny-qwen3", page_size=4, dtype=torch.bfloat16, max_running_req=3,
                         num_page_override=None, memory_ratio=0.5, max_seq_len_override=256)
    probe = Engine(dataclasses.replace(config, num_page_override=8))
    weights = engine_module.nbytes(probe.model.state_dict().values())
    probe.shutdown()
    per_page = config.kv_cache_bytes_per_page
    free = int(2 * (weights + 20.5 * per_page))  # memory_ratio 0.5 leaves room for 20 pages
    events, loaded = [], {"bytes": 0}

    def wrap(name):
        real = getattr(engine_module, name)

        def spy(*args, **kwargs):
            if name == "available_memory":
                events.append((name, None))
                return free - loaded["bytes"]  # as a GPU reports it: loaded weights are not free
            seen = None
            if name == "create_model":
                seen = (torch.empty(0).device.type, torch.get_default_dtype(), try_get_tp_info(),
                        get_rope_device())
            events.append((name, seen))
            out = real(*args, **kwargs)
            if name == "weight_state_dict":
                loaded["bytes"] = sum(t.numel() * t.element_size() for t in out.values())
            return out
        monkeypatch.setattr(engine_module, name, spy)

    for name in ("available_memory", "create_model", "weight_state_dict"):
        wrap(name)
    set_rope_device("meta")  # stale: _init must set the Engine's device
    engine = Engine(config)
    try:
        names = [n for n, _ in events]
        device, dtype, tp, rope = next(seen for n, seen in events if n == "create_model")
        assert tp == config.tp_info, "Exercise 6.4 (_init): set_tp_info before create_model"
        assert rope == engine.device, (
            f"Exercise 6.4: the model was built with the rope device {rope}: call "
            "set_rope_device(self.device) before create_model")
        assert device == "meta", "Exercise 6.4: build the model under torch.device('meta')"
        assert dtype == torch.bfloat16, (
            f"Exercise 6.4: build the model under torch_dtype(config.dtype), got {dtype}")
        assert names.index("available_memory") < names.index("weight_state_dict"), (
            "Exercise 6.4: read available_memory before the weights load")
        P = min(int((0.5 * free - weights) // per_page), -(-3 * 256 // 4))
        assert engine.num_pages == P, f"Exercise 6.4/6.6: {engine.num_pages} pages, expected {P}"
        assert engine.ctx.page_size == 4, "Exercise 6.4: Context(page_size=config.page_size)"
        assert engine.kv_cache.dtype == torch.bfloat16, "Exercise 6.4: the pool in the dtype"
        msl = min(256, P * 4)
        assert engine.max_seq_len == msl and engine.page_table.shape == (4, align_ceil(msl, 32)), (
            f"Exercise 6.4: max_seq_len {engine.max_seq_len}, page table "
            f"{tuple(engine.page_table.shape)}; expected {msl} and (4, {align_ceil(msl, 32)}): "
            "the page table takes the capped self.max_seq_len")
        assert {t.dtype for t in engine.model.state_dict().values()} == {torch.bfloat16}, (
            "Exercise 6.4: the weights in the Engine's dtype")
    finally:
        engine.shutdown()
        set_rope_device("cpu")


def test_forward_batch_samples_the_real_rows_with_the_sampler(monkeypatch):
    """Padded to 4 as on a GPU, a sampled request next to a greedy one: the sampler gets the
    model's first B rows and its tokens come back as int32."""
    engine = engine_for("tiny-llama")
    seen, real_forward, real_sample = {}, engine.model.forward, engine.sampler.sample

    def forward():
        seen["logits"] = real_forward()
        return seen["logits"]

    def sample(logits, args):
        seen["sampled"] = logits
        seen["tokens"] = real_sample(logits, args)
        return seen["tokens"]

    monkeypatch.setattr(engine.model, "forward", forward, raising=False)
    monkeypatch.setattr(engine.sampler, "sample", sample)
    monkeypatch.setattr(engine.graph_runner, "graph_bs_list", [4])
    monkeypatch.setattr(engine.graph_runner, "max_graph_bs", 4)
    reqs = [make_req(fixed_ids(5, 70), 2, engine=engine, output_len=3),
            make_req(fixed_ids(3, 71), 0, engine=engine, output_len=3,
                     params=SamplingParams(temperature=1.5, max_tokens=3))]
    for phase in ("prefill", "decode"):
        seen.clear()
        batch = fill(engine, Batch(reqs=list(reqs), phase=phase))
        out = engine.forward_batch(batch, engine.sampler.prepare(batch))
        assert "sampled" in seen, ("Exercise 6.5 (forward_batch): sample with "
                                   "self.sampler.sample(logits[:batch.size], args)")
        assert torch.equal(seen["sampled"], seen["logits"][: len(reqs)]), (
            "Exercise 6.5: the sampler must get the real requests' rows, logits[:batch.size]")
        assert out.next_tokens_gpu.dtype == torch.int32 and torch.equal(
            out.next_tokens_gpu.long(), seen["tokens"].long()), (
            "Exercise 6.5: next_tokens are the sampler's tokens, as int32")
        assert seen["logits"].is_inference() and out.next_tokens_cpu.is_inference(), (
            "the model and the sampler run under torch.inference_mode(), as the official "
            "server does (forward_batch's given code)")
        for i, r in enumerate(reqs):
            r.append_host(out.next_tokens_cpu[i:i + 1])
        assert not any(r.input_ids.is_inference() for r in reqs), (
            "append_host keeps the request's own ids ordinary tensors")


@pytest.mark.parametrize("free,reqs,page_size,weights,ratio", [
    (1_000_000, 1000, 4, 40_000, 0.5), (1_000_000, 3, 4, 40_000, 0.5),
    (1_000_000, 7, 3, 0, 0.9), (400_000, 1000, 2, 150_000, 0.9)])
def test_pages_that_fit_formula(free, reqs, page_size, weights, ratio):
    """(memory_ratio x free - weights) // bytes per page, capped at ceil(reqs x max_seq_len /
    page_size): the cap binds in some rows, the budget in others."""
    from types import SimpleNamespace

    config = SimpleNamespace(kv_cache_bytes_per_page=1000, memory_ratio=ratio, max_seq_len=10,
                             max_running_req=reqs, page_size=page_size)
    budget = int((ratio * free - weights) // 1000)
    cap = -(-reqs * 10 // page_size)
    got = Engine.pages_that_fit(config, free, weights)
    assert got == min(budget, cap), (
        f"Exercise 6.6 (pages_that_fit): {free} bytes free, {weights} of weights, memory_ratio "
        f"{ratio}, {reqs} requests of 10 tokens in pages of {page_size}: expected min({budget} "
        f"budget pages, cap ceil({reqs * 10} / {page_size}) = {cap}) = {min(budget, cap)}, got "
        f"{got}")


@pytest.mark.parametrize("cut_k,cut_p", [(True, True), (True, False), (False, True),
                                         (False, False)])
def test_sampling_stays_on_the_devices_of_its_inputs(cut_k, cut_p):
    """On a GPU the logits, the sampling tensors and the tokens are device tensors: "meta"
    (shapes only, on any machine) stands in for one, so a tensor made on the CPU on the way
    (Exercise 6.1's ranks, Exercise 6.2's parameters) fails here."""
    from minisgl.engine.sample import sample_impl

    on = {"device": "meta"}
    try:
        tokens = sample_impl(torch.empty(3, 7, **on), torch.ones(3, **on),
                             torch.full((3,), 2, dtype=torch.int32, **on) if cut_k else None,
                             torch.full((3,), 0.5, **on) if cut_p else None, None)
    except Exception as e:
        raise AssertionError(f"Exercise 6.1: sample_impl on 'meta' (top_k given: {cut_k}, top_p "
                             f"given: {cut_p}) raised {type(e).__name__} ({e}): make every new "
                             "tensor on logits.device") from e
    assert tokens.device.type == "meta" and tuple(tokens.shape) == (3,), (
        f"Exercise 6.1: sample_impl returned {tuple(tokens.shape)} on {tokens.device}")
    sampler = Sampler(torch.device("cpu"), vocab_size=7)
    sampler.device = torch.device("meta")
    reqs = [Req(input_ids=torch.tensor([1, 2], dtype=torch.int32), table_idx=i, cached_len=1,
                output_len=3, uid=i, sampling_params=SamplingParams(
                    temperature=0.8, top_k=2 if cut_k else -1, top_p=0.5 if cut_p else 1.0))
            for i in range(2)]
    args = sampler.prepare(Batch(reqs, "decode"))
    for name in ("temperatures", "top_k", "top_p"):
        t = getattr(args, name)
        assert t is None or t.device.type == "meta", (
            f"Exercise 6.2: with the sampler on 'meta' {name} was made on {t.device}: "
            "torch.tensor(..., device=self.device)")


@pytest.mark.parametrize("cut_k,cut_p", [(True, True), (False, True), (False, False)])
def test_sampling_leaves_its_inputs_alone(cut_k, cut_p):
    """sample_impl (Exercise 6.1) reads the logits and the parameters and changes none of them:
    for float32 logits, logits.float() is the caller's tensor itself, so an in-place division
    by the temperature would rewrite the model's output."""
    from minisgl.engine.sample import sample_impl

    g = torch.Generator().manual_seed(3)
    given = {"logits": torch.randn(4, 9, generator=g),
             "temperatures": torch.tensor([0.5, 1.0, 2.0, 0.7]),
             "top_k": torch.tensor([3, 9, 1, 2], dtype=torch.int32) if cut_k else None,
             "top_p": torch.tensor([0.9, 0.5, 1.0, 0.3]) if cut_p else None}
    before = {k: v.clone() for k, v in given.items() if v is not None}
    sample_impl(*given.values(), torch.Generator().manual_seed(0))
    changed = [k for k, v in before.items() if not torch.equal(given[k], v)]
    assert not changed, (
        f"Exercise 6.1 (sample_impl) changed its input {changed} in place: work on new tensors "
        "(logits / t, not logits.div_(t))")


def test_forward_batch_samples_with_the_args_it_was_given():
    """forward_batch (Exercise 6.5) hands its caller's `args` to the sampler as they are: the
    caller may have built them by hand, so preparing them again from the batch is wrong."""
    engine = engine_for("tiny-llama")
    req = make_req(fixed_ids(5, seed=81), 0, engine=engine, output_len=3,
                   params=SamplingParams(temperature=1.5, max_tokens=3))
    batch = fill(engine, Batch(reqs=[req], phase="prefill"))
    given = engine.sampler.prepare(batch)
    seen = []
    real = engine.sampler.sample
    engine.sampler.sample = lambda logits, args: seen.append(args) or real(logits, args)
    try:
        engine.forward_batch(batch, given)
    finally:
        del engine.sampler.sample
    assert len(seen) == 1 and seen[0] is given, (
        "Exercise 6.5 (forward_batch): the sampler must get the args forward_batch was given, "
        "as they are (self.sampler.sample(logits[:batch.size], args)), not args prepared again")
