"""Tensor parallelism on the CPU: tp=2 in two processes (gloo) gives tp=1's logits and tokens.

What is checked (chapter 06's optional tp section: examples/tp_milestone.py and
minisgl/distributed/group.py, the Engine's process group; chapter 02's collectives and chapter 03's
sharding):
- loading shards each checkpoint tensor as the layers expect, including tiny-qwen3's single KV
  head, which every rank keeps a whole copy of;
- on tiny-llama (4/2 heads), tiny-qwen2 (8/2, q/k/v bias, tied) and tiny-qwen3 (4/1, q/k norm),
  two ranks reproduce tp=1: teacher-forced logits at every step (prefill and 15 decode steps of a
  batch of four) within atol = 2e-5, rtol = 1e-5, and the same greedy tokens on both ranks. The
  float32 sums are taken in another order (each rank sums half the heads or half the MLP width,
  then the all-reduce adds the halves): the logits differ by up to ~5e-6 here, not bitwise;
- every socket a rank listens on (the rendezvous store, gloo's pairs) is bound to 127.0.0.1;
- a tp size that does not divide the heads is refused before any process starts;
- a rank that raises, or one that never joins, makes the whole run fail (with that rank's error,
  or a TimeoutError) within the timeout, and no rank process is left behind.
The reference is tp=1 in this process: chapter 06's tests compare it with Hugging Face.
"""

from __future__ import annotations

import os
import pathlib
import socket
import sys
import time

import pytest
import torch
from helpers import SMOL, model_path

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))
from tp_milestone import (FAIL_ENV, MAX_LEN, PROMPTS, RankFailed, engine_config,  # noqa: E402
                          launch, main, milestone_rank)

TESTS = pathlib.Path(__file__).resolve().parent
TP_MODELS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3"]  # head counts that split over 2 ranks
N = 16  # tokens per prompt: the prefill's, then 15 decode steps
TOL = {"atol": 2e-5, "rtol": 1e-5}  # observed differences: <= 5e-6 on logits up to ~6


@pytest.fixture(scope="module", autouse=True)
def _earlier_chapters():
    from prereq import require

    require("01", "02", "03", "04", "05", "06")


# ----------------------------------------------------------------------------- helpers
def rank_processes_left(pids) -> list[int]:
    """Those of ``pids`` still present in /proc (a joined child is gone, not even a zombie)."""
    return [p for p in pids if os.path.exists(f"/proc/{p}")]


def children_left() -> list[str]:
    """This process's child processes, except multiprocessing's resource tracker (it belongs to
    this process, lives as long as it does, and is shared by every spawn)."""
    me, found = os.getpid(), []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == me and "resource_tracker" not in cmd:
            found.append(f"{entry.name}: {cmd[:120]}")
    return found


def distinct_ports(n: int) -> list[int]:
    """``n`` different free local ports (all held open while choosing, so none repeats)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def listening_sockets() -> list[str]:
    """``address:port`` of every TCP socket this process listens on (from /proc/net/tcp{,6}:
    local addresses in hex; IPv4 in little-endian byte order)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in pathlib.Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                addr, port = fields[1].split(":")
                if table == "tcp":
                    host = ".".join(str(b) for b in reversed(bytes.fromhex(addr)))
                else:
                    host = {"0000000000000000FFFF00000100007F": "::ffff:127.0.0.1",
                            "00000000000000000000000001000000": "::1",
                            "0" * 32: "[::]"}.get(addr, f"[{addr}]")
                found.append(f"{host}:{int(port, 16)}")
    return found


def prompt_ids(model: str, prompts=PROMPTS) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return [tok(p).input_ids for p in prompts]


class Runner:
    """Drive an Engine by hand as the milestone's ``step()`` does, optionally feeding tokens."""

    def __init__(self, engine, prompt_ids, n: int) -> None:
        from minisgl.core import Req, SamplingParams

        self.engine, self.reqs = engine, []
        for row, ids in enumerate(prompt_ids):
            engine.page_table[row, :MAX_LEN] = torch.arange(row * MAX_LEN, (row + 1) * MAX_LEN)
            self.reqs.append(Req(input_ids=torch.tensor(ids, dtype=torch.int32), table_idx=row,
                                 cached_len=0, output_len=n, uid=row, cache_handle=None,
                                 sampling_params=SamplingParams(max_tokens=n)))

    def step(self, phase: str, feed=None) -> list[int]:
        from minisgl.core import Batch

        engine, reqs = self.engine, self.reqs
        batch = Batch(reqs=reqs, phase=phase)
        engine.graph_runner.pad_batch(batch)
        batch.positions = torch.cat([torch.arange(r.cached_len, r.device_len)
                                     for r in reqs]).int()
        batch.input_ids = torch.cat([r.input_ids[r.cached_len: r.device_len] for r in reqs])
        batch.out_loc = torch.cat([engine.page_table[r.table_idx, r.cached_len: r.device_len]
                                   for r in reqs])
        engine.attn_backend.prepare_metadata(batch)
        out = engine.forward_batch(batch, engine.sampler.prepare(batch))
        tokens = out.next_tokens_cpu.tolist()
        for i, r in enumerate(reqs):
            r.append_host(torch.tensor([tokens[i] if feed is None else feed[i]], dtype=torch.int32))
        return tokens


def forced_run(engine, ids, forced):
    """Teacher forcing: every request is fed ``forced[i]``; returns the sampled tokens per step
    ([N][B]) and the logits handed to the sampler ([N, B, V])."""
    seen, real = [], engine.sampler.sample

    def spy(logits, args):
        seen.append(logits.detach().clone())
        return real(logits, args)

    engine.sampler.sample = spy
    runner = Runner(engine, ids, N)
    sampled = [runner.step("prefill", feed=[f[0] for f in forced])]
    for k in range(1, N):
        sampled.append(runner.step("decode", feed=[f[k] for f in forced]))
    return sampled, torch.stack(seen)


def tp_rank(rank: int, tp_size: int, runs) -> list[dict]:
    """One rank: for each (model, prompt ids, forced tokens, address), a tp Engine and a forced
    run. Only rank 0 returns the logits (they are the same on every rank after the all-gather).

    Each Engine gets its own address: with the same one, a rank that finished the previous model
    early could meet the previous process group's store (still open on the slower rank) and read
    its stale entries."""
    from minisgl.engine import Engine

    out = []
    for model, ids, forced, addr in runs:
        os.environ["MINISGL_DIST_ADDR"] = addr  # a fresh process group needs a fresh address
        engine = Engine(engine_config(model, rank, tp_size))
        try:
            sampled, logits = forced_run(engine, ids, forced)
            shapes = {k: tuple(v.shape) for k, v in engine.model.state_dict().items()
                      if k.startswith("model.layers.0.self_attn.")}
            listening = listening_sockets()  # the group is up: its store and gloo's pairs
        finally:
            engine.shutdown()
        out.append({"sampled": sampled, "logits": logits if rank == 0 else None,
                    "shapes": shapes, "listening": listening, "addr": addr})
    return out


def hang_on_rank_1(rank: int, tp_size: int, model: str) -> None:
    """Rank 1 never joins; rank 0's Engine waits for it in init_process_group."""
    if rank == 1:
        time.sleep(600)
    from minisgl.engine import Engine

    Engine(engine_config(model, rank, tp_size)).shutdown()


# ----------------------------------------------------------------------------- loading
@pytest.mark.parametrize("name", TP_MODELS)
def test_each_rank_loads_its_shard(name):
    """load_weight with tp info (r, 2) gives rank r's rows of q and the MLP's gate/up, its columns
    of o_proj / down_proj, its half of the vocabulary, and a copy of the KV head when the model
    has fewer KV heads than ranks (tiny-qwen3: one)."""
    from safetensors import safe_open

    from minisgl.distributed import reset_tp_info, set_tp_info
    from minisgl.models import ModelConfig, load_weight
    from minisgl.models.weight import load_hf_config

    path = model_path(name)
    mc = ModelConfig.from_hf(load_hf_config(path))
    with safe_open(str(next(path.glob("*.safetensors"))), framework="pt") as f:
        full = {k: f.get_tensor(k) for k in f.keys() if k.startswith(("model.layers.0.",
                                                                       "model.embed_tokens"))}
    attn, d = "model.layers.0.self_attn.", mc.head_dim
    for rank in range(2):
        reset_tp_info()
        set_tp_info(rank, 2)
        try:
            got = {k: v for k, v in load_weight(path) if k in {
                attn + "qkv_proj.weight", attn + "o_proj.weight", "model.embed_tokens.weight"}}
        finally:
            reset_tp_info()
        hq = mc.num_qo_heads // 2
        q = full[attn + "q_proj.weight"][rank * hq * d:(rank + 1) * hq * d]
        if mc.num_kv_heads >= 2:
            hkv = mc.num_kv_heads // 2
            k = full[attn + "k_proj.weight"][rank * hkv * d:(rank + 1) * hkv * d]
            v = full[attn + "v_proj.weight"][rank * hkv * d:(rank + 1) * hkv * d]
        else:  # one KV head: each rank keeps the whole of it
            k, v = full[attn + "k_proj.weight"], full[attn + "v_proj.weight"]
        expect_qkv = torch.cat([q, k, v])
        assert torch.equal(got[attn + "qkv_proj.weight"], expect_qkv), (
            f"{name} rank {rank}: qkv_proj should be this rank's {hq} query heads then "
            f"{'its half of' if mc.num_kv_heads >= 2 else 'a full copy of'} the "
            f"{mc.num_kv_heads} KV head(s) (k, then v): shape {tuple(expect_qkv.shape)}, got "
            f"{tuple(got[attn + 'qkv_proj.weight'].shape)} with other values (chapter 03 _shard)")
        o = full[attn + "o_proj.weight"]
        assert torch.equal(got[attn + "o_proj.weight"], o.chunk(2, dim=1)[rank]), (
            f"{name} rank {rank}: o_proj should keep input columns of this rank's heads")
        emb = full["model.embed_tokens.weight"]
        rows = -(-mc.vocab_size // 2)
        assert torch.equal(got["model.embed_tokens.weight"], emb[rank * rows:(rank + 1) * rows]), (
            f"{name} rank {rank}: embed_tokens should keep vocabulary rows "
            f"[{rank * rows}, {(rank + 1) * rows})")


# ----------------------------------------------------------------------------- tp=2 == tp=1
@pytest.fixture(scope="module")
def tp_runs():
    """tp=1 here (free greedy run: its tokens, and its logits at every step), then one launch
    of two ranks that feed the tp=1 tokens (teacher forcing) for all three models."""
    from minisgl.engine import Engine

    ref, runs = {}, []
    for name in TP_MODELS:
        ids = prompt_ids(str(model_path(name)))
        engine = Engine(engine_config(str(model_path(name)), 0, 1))
        try:
            seen, real = [], engine.sampler.sample
            engine.sampler.sample = lambda lg, a: (seen.append(lg.detach().clone()), real(lg, a))[1]
            runner = Runner(engine, ids, N)
            tokens = [runner.step("prefill")] + [runner.step("decode") for _ in range(N - 1)]
        finally:
            engine.shutdown()
        forced = [[tokens[k][i] for k in range(N)] for i in range(len(ids))]  # per request
        ref[name] = {"tokens": tokens, "logits": torch.stack(seen)}
        runs.append((str(model_path(name)), ids, forced))
    runs = [run + (f"tcp://127.0.0.1:{port}",) for run, port in zip(runs, distinct_ports(3))]
    pids: list[int] = []
    t0 = time.perf_counter()
    results = launch(tp_rank, 2, (runs,), timeout=120, on_start=pids.extend)
    took = time.perf_counter() - t0
    return ref, results, pids, took


@pytest.mark.parametrize("name", TP_MODELS)
def test_tp2_logits_and_tokens_equal_tp1(name, tp_runs):
    ref, results, _, _ = tp_runs
    i = TP_MODELS.index(name)
    r0, r1 = results[0][i], results[1][i]
    logits, want = r0["logits"], ref[name]["logits"]
    assert logits.shape == want.shape, (
        f"{name}: tp=2 logits have shape {tuple(logits.shape)}, tp=1's {tuple(want.shape)} "
        "([steps, B, V]): the LM head's all-gather should rebuild the whole vocabulary")
    diff = (logits - want).abs().amax(dim=(1, 2))  # [N] worst difference per step
    print(f"{name}: max |tp=2 - tp=1| logit difference {diff.max().item():.2e} "
          f"(logits up to {want.abs().max().item():.2f})")
    bad = ((logits - want).abs() > TOL["atol"] + TOL["rtol"] * want.abs()).flatten(1).any(1)
    if bad.any():  # assert_close on the first step that differs, for its detailed message
        k = int(bad.nonzero()[0])
        torch.testing.assert_close(logits[k], want[k], **TOL, msg=lambda m: (
            f"{name}: tp=2 logits at step {k} ({'prefill' if k == 0 else 'decode'}) differ from "
            f"tp=1's beyond atol={TOL['atol']}, rtol={TOL['rtol']} (teacher-forced on tp=1's "
            f"tokens). Check the row-parallel all-reduce and the LM head's all-gather.\n{m}"))
    assert r0["sampled"] == ref[name]["tokens"], (
        f"{name}: rank 0's greedy tokens differ from tp=1's")
    assert r1["sampled"] == r0["sampled"], (
        f"{name}: the two ranks sampled different tokens; after the all-gather every rank must "
        "hold the same logits")


def test_each_rank_holds_half_the_heads(tp_runs):
    _, results, _, _ = tp_runs
    for i, name in enumerate(TP_MODELS):
        from minisgl.models import ModelConfig
        from minisgl.models.weight import load_hf_config

        mc = ModelConfig.from_hf(load_hf_config(model_path(name)))
        kv = max(1, mc.num_kv_heads // 2)
        rows = (mc.num_qo_heads // 2 + 2 * kv) * mc.head_dim
        for rank in (0, 1):
            shape = results[rank][i]["shapes"]["model.layers.0.self_attn.qkv_proj.weight"]
            assert shape == (rows, mc.hidden_size), (
                f"{name} rank {rank}: qkv_proj is {shape}, expected ({rows}, {mc.hidden_size}): "
                f"{mc.num_qo_heads // 2} query heads + 2 x {kv} KV head(s) of {mc.head_dim}")


def test_ranks_listen_on_loopback_only(tp_runs):
    """The rendezvous store (rank 0) and gloo's connections listen on 127.0.0.1, never on every
    interface (0.0.0.0 / ::) or on the machine's network address."""
    _, results, _, _ = tp_runs
    for rank in (0, 1):
        for i, name in enumerate(TP_MODELS):
            got = results[rank][i]["listening"]
            assert got, f"{name} rank {rank}: no listening socket found (/proc/net/tcp)"
            outside = [a for a in got if not a.startswith(("127.", "::1:", "::ffff:127."))]
            assert not outside, (
                f"{name} rank {rank} listens beyond loopback: {outside} (all: {got})")
            if rank == 0:
                port = results[rank][i]["addr"].rsplit(":", 1)[1]
                assert f"127.0.0.1:{port}" in got, (
                    f"{name}: rank 0's store should listen on 127.0.0.1:{port}; it has {got}")


def test_no_rank_left_after_a_run(tp_runs):
    *_, pids, took = tp_runs
    print(f"tp=2 launch of three models: {took:.1f} s")
    assert len(pids) == 2 and not rank_processes_left(pids), (
        f"rank processes {rank_processes_left(pids)} still exist after launch() returned")
    assert not children_left(), f"processes left behind: {children_left()}"


# ----------------------------------------------------------------------------- refusals, failures
def test_tp2_on_smollm2_is_refused_before_any_process_starts(capsys):
    rc = main(["--tp", "2", "--model", str(model_path(SMOL))])
    err = capsys.readouterr().err
    assert rc == 2, f"main() should refuse tp=2 on SmolLM2 with exit status 2, got {rc}"
    for part in ("9 query heads", "3 KV heads", "[1, 3, 9]"):
        assert part in err, f"the refusal should name {part!r}; it says: {err.strip()}"
    assert not children_left(), "a refused launch started processes"


def test_a_failing_rank_fails_the_run(monkeypatch):
    """Rank 1 raises after its prefill while rank 0 waits in the next step's all-reduce."""
    monkeypatch.setenv(FAIL_ENV, "1")
    name = str(model_path("tiny-llama"))
    pids: list[int] = []
    t0 = time.perf_counter()
    with pytest.raises(RankFailed) as info:
        launch(milestone_rank, 2, (name, 4, 1, [[0] * 4] * 2, PROMPTS[:2]), timeout=60,
               on_start=pids.extend)
    took = time.perf_counter() - t0
    msg = str(info.value)
    assert "rank 1" in msg and f"failure injected by {FAIL_ENV}=1" in msg, (
        f"the launcher should re-raise rank 1's own error (with its traceback); got: {msg[:500]}")
    assert took < 60, f"the failed run took {took:.0f} s; the timeout is 60 s"
    assert not rank_processes_left(pids), f"ranks {rank_processes_left(pids)} survived"
    assert not children_left(), f"processes left behind: {children_left()}"


def test_a_rank_that_never_joins_times_out():
    pids: list[int] = []
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match="did not finish within 10 s"):
        launch(hang_on_rank_1, 2, (str(model_path("tiny-llama")),), timeout=10,
               on_start=pids.extend)
    took = time.perf_counter() - t0
    assert took < 10 + 10, f"the launcher gave up after {took:.0f} s, not ~10 s"
    assert not rank_processes_left(pids), f"ranks {rank_processes_left(pids)} survived"
    assert not children_left(), f"processes left behind: {children_left()}"
