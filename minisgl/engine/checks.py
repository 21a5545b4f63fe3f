# Chapter 06 (06_engine_and_sampler.ipynb): what forward_batch checks before it computes.
"""Clear errors for a batch that cannot be computed, or sampling args that belong to another
batch: a loop over the requests and one pass over the token ids, before the model runs.
"""

from __future__ import annotations

import torch

from minisgl.core import Batch

from .sample import BatchSamplingArgs


def check_batch(engine, batch: Batch) -> None:
    """The batch is padded, filled and prepared, and fits this Engine."""
    if batch.padded_reqs is None:
        raise RuntimeError("batch.padded_reqs is not set: call "
                           "engine.graph_runner.pad_batch(batch) first.")
    for name in ("input_ids", "positions", "out_loc"):
        if getattr(batch, name) is None:
            raise RuntimeError(f"batch.{name} was never set: fill input_ids, positions and "
                               "out_loc before engine.forward_batch (see step() in chapter 07).")
    if batch.attn_metadata is None:
        raise RuntimeError("batch.attn_metadata is not set: call "
                           "engine.attn_backend.prepare_metadata(batch) first.")
    max_req = engine.config.max_running_req
    if batch.size > max_req:
        raise ValueError(f"the batch has {batch.size} requests but the Engine was built with "
                         f"max_running_req={max_req}: split the batch or raise it.")
    seen = set()
    width = engine.page_table.shape[1]
    for r in batch.reqs:
        if not 0 <= r.table_idx < max_req:
            raise IndexError(f"Req(uid={r.uid}).table_idx={r.table_idx} is outside the page "
                             f"table's rows 0..{max_req - 1} (row {max_req} is the dummy's).")
        if r.table_idx in seen:
            raise ValueError(f"table_idx={r.table_idx} is used by two requests in one batch: "
                             "each request needs its own page-table row.")
        seen.add(r.table_idx)
        if r.remain_len < 1:
            raise ValueError(f"Req(uid={r.uid}) is finished: it holds all max_device_len="
                             f"{r.max_device_len} tokens (prompt + output_len={r.output_len}) "
                             "and another forward would sample one token more; take it out "
                             "of the batch.")
        if r.max_device_len > engine.max_seq_len:
            raise ValueError(f"Req(uid={r.uid}): prompt + max tokens = {r.max_device_len} > "
                             f"max_seq_len={engine.max_seq_len}: shorten the prompt or lower "
                             f"output_len{_longer_requests_advice(engine)}.")
        if r.device_len > width:
            raise ValueError(f"Req(uid={r.uid}) has {r.device_len} tokens but page-table rows "
                             f"hold {width}.")
        if batch.is_decode and r.extend_len != 1:
            raise ValueError(f"Req(uid={r.uid}) computes {r.extend_len} tokens in a decode "
                             "batch: a decode step computes exactly one token per request "
                             "(the LM head keeps every row); put it in a prefill batch.")
    total = sum(r.extend_len for r in batch.padded_reqs)
    for name in ("input_ids", "positions", "out_loc"):
        t = getattr(batch, name)
        if t.dim() != 1 or t.shape[0] != total:
            raise ValueError(f"batch.{name} has shape {tuple(t.shape)} but the requests "
                             f"compute {total} tokens (sum of extend_len): rebuild it.")
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"batch.{name} has dtype {t.dtype}: it must hold integers "
                            "(torch.int32).")
    slots = engine.kv_cache.num_slots
    lo, hi = int(batch.out_loc.min()), int(batch.out_loc.max())
    if lo < 0 or hi >= slots:
        raise IndexError(f"batch.out_loc holds slot {lo if lo < 0 else hi}, outside the KV "
                         f"pool's slots 0..{slots - 1}: fill the page table with slots below "
                         f"{slots - engine.config.page_size} (the last page is the dummy's).")
    vocab = engine.config.model_config.vocab_size
    ids = batch.input_ids
    lo, hi = torch.aminmax(ids)  # one pass over the ids
    if int(lo) < 0 or int(hi) >= vocab:
        at = int(((ids < 0) | (ids >= vocab)).nonzero()[0])  # the first bad token
        ends = torch.tensor([r.extend_len for r in batch.padded_reqs]).cumsum(0)
        r = batch.padded_reqs[int((ends <= at).sum())]
        raise ValueError(f"batch.input_ids holds token id {int(ids[at])} (Req(uid={r.uid})), "
                         f"outside the vocabulary 0..{vocab - 1}: token ids come from this "
                         "model's tokenizer; check the prompt's ids.")


def _longer_requests_advice(engine) -> str:
    """How a longer request could fit, in terms of the options that limit it."""
    config = engine.config
    positions = config.model_config.rotary_config.max_position
    if engine.max_seq_len < config.max_seq_len:  # the KV pool is the limit
        return (f", or give the Engine a larger KV pool (it holds {engine.num_pages} pages of "
                f"{config.page_size} tokens): raise num_page_override or memory_ratio")
    if config.max_seq_len < positions:
        return (", or build the Engine with a larger max_seq_len_override (at most the "
                f"model's {positions} positions)")
    return f" (the model has {positions} positions, no more)"


def check_args(batch: Batch, args: BatchSamplingArgs) -> None:
    """The sampling args must be this batch's: row b of the args is request b's."""
    if not hasattr(args, "temperatures"):
        raise TypeError(f"args must be the BatchSamplingArgs of engine.sampler.prepare(batch), "
                        f"got {type(args).__name__}.")
    reqs = getattr(args, "reqs", None)
    if reqs is not None:
        same = len(reqs) == batch.size and all(a is b for a, b in zip(reqs, batch.reqs))
    else:  # built by hand: at least the number of rows must match
        same = args.temperatures is None or args.temperatures.shape[0] == batch.size
    if not same:
        prepared = (f"requests {[r.uid for r in reqs]}" if reqs is not None
                    else f"{args.temperatures.shape[0]} requests")
        raise ValueError(f"these sampling args were prepared for another batch ({prepared}), "
                         f"not for this one (requests "
                         f"{[r.uid for r in batch.reqs]}): call engine.sampler.prepare(batch) "
                         "for each batch you forward.")
