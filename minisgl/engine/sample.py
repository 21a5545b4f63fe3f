# Chapter 06 (06_engine_and_sampler.ipynb): batched sampling with per-request parameters.
"""Pick each request's next token from its logits row, all rows in one batched call.

``prepare(batch)`` turns the requests' SamplingParams into a few tensors once per batch (or
``None`` when the whole batch is greedy: the fast path is one ``argmax``). ``sample(logits,
args)`` then applies temperature, top-k and top-p per row and draws one token per row. The args
remember the requests they were prepared for, row by row, so that ``Engine.forward_batch``
refuses them for any other batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Tuple

import torch

from minisgl.core import Batch, Req
from minisgl.layers.impls import current_ops
from minisgl.sampling_params import check_sampling_params


class BatchSamplingArgs(NamedTuple):
    temperatures: torch.Tensor | None  # [B] float32; None: the whole batch is greedy
    top_k: torch.Tensor | None = None  # [B] int32; None: no row cuts by top-k
    top_p: torch.Tensor | None = None  # [B] float32; None: no row cuts by top-p
    reqs: Tuple[Req, ...] | None = None  # row b is reqs[b] (set by Sampler.prepare)


def _for_these_requests(prepare):
    """Stamp ``prepare``'s result with the batch's requests, in order: the args are only right
    for those rows (``Engine.forward_batch`` checks it, a loop over the requests)."""

    @functools.wraps(prepare)
    def prepare_for_batch(self, batch: Batch) -> BatchSamplingArgs:
        return prepare(self, batch)._replace(reqs=tuple(batch.reqs))

    return prepare_for_batch


def sample_impl(logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor | None,
                top_p: torch.Tensor | None, generator: torch.Generator | None) -> torch.Tensor:
    """``logits [B, V]`` -> token ids ``[B]``: softmax(logits / t), keep the top-k, then the
    smallest set of the survivors whose mass reaches top-p (always the likeliest token), renormalise,
    draw."""
    # BEGIN SOLUTION 6.1: temperature, top-k, then top-p on the renormalised survivors, draw
    probs = torch.softmax(logits.float() / temperatures[:, None], dim=-1)  # [B, V]
    if top_k is None and top_p is None:
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)
    sorted_p, order = probs.sort(dim=-1, descending=True)  # [B, V] likeliest first
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    if top_k is not None:
        sorted_p = sorted_p.masked_fill(rank >= top_k[:, None], 0.0)
    if top_p is not None:
        kept = sorted_p / sorted_p.sum(-1, keepdim=True)
        mass_before = kept.cumsum(-1) - kept  # mass of the likelier tokens
        sorted_p = sorted_p.masked_fill((mass_before >= top_p[:, None]) & (rank > 0), 0.0)
    choice = torch.multinomial(sorted_p, 1, generator=generator)  # renormalises implicitly
    return order.gather(1, choice).squeeze(1)  # rank -> token id
    # END SOLUTION


def _argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    return torch.argmax(logits, dim=-1)


@dataclass
class Sampler:
    device: torch.device
    vocab_size: int
    seed: int = 42
    _generator: torch.Generator = field(init=False, repr=False)
    _argmax: Callable = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(self.seed)
        # the greedy path's argmax, chosen when the Sampler is built (chapter 02's impls.py): the
        # Engine builds it inside build_ops, so chapter 07's kernel when it runs those
        self._argmax = current_ops().argmax or _argmax_rows

    @_for_these_requests
    def prepare(self, batch: Batch) -> BatchSamplingArgs:
        """Per-request parameters as tensors (reads ``batch.reqs`` only: dummies have none)."""
        params = [r.sampling_params for r in batch.reqs]
        for r, p in zip(batch.reqs, params):
            if p is None:
                continue
            check_sampling_params(p, f"Req(uid={r.uid}).sampling_params")  # changed since?
            if p.top_k > self.vocab_size:
                raise ValueError(f"Req(uid={r.uid}): top_k={p.top_k} exceeds the vocabulary "
                                 f"({self.vocab_size} tokens); use -1 for no top-k cut.")
        if all(p is None or p.is_greedy for p in params):
            return BatchSamplingArgs(None)
        # BEGIN SOLUTION 6.2: temperature, top_k, top_p per row (no cut: vocab_size, 1.0)
        temps = [1e-6 if (p is None or p.is_greedy) else max(p.temperature, 1e-6) for p in params]
        ks = [self.vocab_size if (p is None or p.top_k < 1) else p.top_k for p in params]
        ps = [1.0 if p is None else min(max(p.top_p, 1e-6), 1.0) for p in params]
        # a greedy row (temperature ~0) still goes through sampling: keep only its top token
        ks = [1 if (p is None or p.is_greedy) else k for p, k in zip(params, ks)]
        return BatchSamplingArgs(
            temperatures=torch.tensor(temps, dtype=torch.float32, device=self.device),
            top_k=(torch.tensor(ks, dtype=torch.int32, device=self.device)
                   if any(k != self.vocab_size for k in ks) else None),
            top_p=(torch.tensor(ps, dtype=torch.float32, device=self.device)
                   if any(p < 1.0 for p in ps) else None))
        # END SOLUTION

    def sample(self, logits: torch.Tensor, args: BatchSamplingArgs) -> torch.Tensor:
        """``logits [B, V]`` -> next token ids ``[B]`` (int64)."""
        if args.temperatures is not None and args.temperatures.shape[0] != logits.shape[0]:
            raise ValueError(f"sampling args for {args.temperatures.shape[0]} rows but "
                             f"{logits.shape[0]} rows of logits: prepare the args for this batch "
                             "(sampler.prepare(batch)).")
        if args.temperatures is None:
            return self._argmax(logits)
        return sample_impl(logits, args.temperatures, args.top_k, args.top_p, self._generator)
