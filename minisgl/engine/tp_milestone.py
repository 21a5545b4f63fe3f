# Chapter 06 (06_engine_and_sampler.ipynb, optional tp section): the milestone's batch on one rank.
"""What each rank of ``python -m minisgl.engine.launch`` runs: an Engine with the milestone's
settings (one thread, KV slots placed by hand), driven as the milestone's ``step()`` does:
the four prompts in one batch, prefill + greedy decode steps. ``tests/test_tp.py`` uses the same
pieces to compare tp=2's logits with tp=1's at every step.
"""

from __future__ import annotations

import os
from typing import List, Sequence

import torch

PROMPTS = ["The capital of France is", "List three prime numbers:", "def fibonacci(n):",
           "Once upon a time,"]
FAIL_ENV = "MINISGL_TP_FAIL_RANK"  # testing hook: that rank raises after its prefill
MAX_LEN = 256  # token slots per request in the page table (placed by hand, as in the milestone)


def engine_config(model: str, rank: int, tp_size: int, page_size: int = 1, n_reqs: int = 4,
                  **overrides):
    """The milestone's Engine settings (one thread, KV slots placed by hand)."""
    from minisgl.distributed import DistributedInfo
    from minisgl.engine import EngineConfig

    kw = dict(model_path=str(model), tp_info=DistributedInfo(rank, tp_size), dtype=torch.float32,
              max_running_req=n_reqs, page_size=page_size,
              num_page_override=n_reqs * MAX_LEN // page_size, max_seq_len_override=MAX_LEN,
              num_threads=1)
    kw.update(overrides)
    return EngineConfig(**kw)


class Runner:
    """Drive an Engine by hand, as the milestone's ``step()`` does."""

    def __init__(self, engine, prompt_ids: Sequence[Sequence[int]], n: int) -> None:
        from minisgl.core import Req, SamplingParams

        self.engine = engine
        self.reqs = []
        for row, ids in enumerate(prompt_ids):
            engine.page_table[row, :MAX_LEN] = torch.arange(row * MAX_LEN, (row + 1) * MAX_LEN)
            self.reqs.append(Req(input_ids=torch.tensor(ids, dtype=torch.int32), table_idx=row,
                                 cached_len=0, output_len=n, uid=row, cache_handle=None,
                                 sampling_params=SamplingParams(max_tokens=n)))

    def batch(self, phase: str):
        """The next batch with its fields filled in (input ids, positions, out_loc, metadata)."""
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
        return batch

    def step(self, phase: str, feed: Sequence[int] | None = None) -> List[int]:
        """One forward + greedy sample; appends the sampled tokens (or ``feed``) to the requests."""
        batch = self.batch(phase)
        out = self.engine.forward_batch(batch, self.engine.sampler.prepare(batch))
        tokens = out.next_tokens_cpu.tolist()
        for i, r in enumerate(self.reqs):
            t = tokens[i] if feed is None else feed[i]
            r.append_host(torch.tensor([t], dtype=torch.int32))
        return tokens


def generate(engine, prompt_ids: Sequence[Sequence[int]], n: int = 16,
             fail_rank: int | None = None) -> List[List[int]]:
    """Prefill + ``n - 1`` decode steps for all prompts in one batch; the tokens per prompt."""
    runner = Runner(engine, prompt_ids, n)
    outs = [[t] for t in runner.step("prefill")]
    if fail_rank is not None and engine.config.tp_info.rank == fail_rank:
        raise RuntimeError(f"rank {fail_rank}: failure injected by {FAIL_ENV}={fail_rank}")
    for _ in range(n - 1):
        for i, t in enumerate(runner.step("decode")):
            outs[i].append(t)
    return outs


def prompt_ids(model: str, prompts: Sequence[str] = PROMPTS) -> List[List[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return [tok(p).input_ids for p in prompts]


def milestone_rank(rank: int, tp_size: int, model: str, ids, n: int, page_size: int,
                   expected) -> List[List[int]]:
    """One rank of the tp run: build the Engine (it joins the process group), generate, report."""
    from minisgl.engine import Engine

    fail = os.environ.get(FAIL_ENV)
    engine = Engine(engine_config(model, rank, tp_size, page_size, len(ids)))
    try:
        outs = generate(engine, ids, n, fail_rank=int(fail) if fail else None)
    finally:
        engine.shutdown()
    if rank == 0:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        for p, o, e in zip(PROMPTS, outs, expected):
            print(f"  {p!r:30} -> {tok.decode(o)[:32]!r:36} matches tp=1: {o == e}")
    return outs
