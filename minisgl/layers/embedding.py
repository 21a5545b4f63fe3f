# Chapter 02 (02_op_layer.ipynb): the vocab-parallel embedding and the LM head.
"""Token embedding and LM head, both split over the vocabulary for tensor parallelism.

Rank ``r`` owns vocabulary rows ``[r * ceil(V/tp), (r+1) * ceil(V/tp))``. The embedding zeroes
the rows it does not own and all-reduces; the LM head computes its slice of the logits and
all-gathers them. In prefill the LM head keeps only each request's last token: only that one
token's logits are needed to pick the next token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.core import get_global_ctx
from minisgl.distributed import DistributedCommunicator, get_tp_info
from minisgl.utils import div_ceil

from .base import BaseOP, StateDict
from .impls import current_ops


class VocabParallelEmbedding(BaseOP):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        tp_info = get_tp_info()
        self.tp_size = tp_info.size
        self.num_embeddings = num_embeddings
        self.num_embeddings_tp = div_ceil(num_embeddings, tp_info.size)
        start = tp_info.rank * self.num_embeddings_tp
        self.vocab_range = (start, max(0, min(self.num_embeddings_tp, num_embeddings - start)))
        self.weight = torch.empty(self.num_embeddings_tp, embedding_dim)
        self._comm = DistributedCommunicator()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` token ids -> ``[T, hidden]`` (a fresh tensor, never a view of the weight)."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        start, length = self.vocab_range
        local = input_ids - start
        owned = (local >= 0) & (local < length)  # [T] which ids this rank holds
        y = F.embedding(torch.where(owned, local, 0), self.weight)
        y = y * owned.unsqueeze(1).to(y.dtype)
        return self._comm.all_reduce(y)


class ParallelLMHead(BaseOP):
    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False,
                 tie_word_embeddings: bool = False,
                 tied_embedding: VocabParallelEmbedding | None = None) -> None:
        if (tied_embedding is not None) != tie_word_embeddings:
            raise ValueError("ParallelLMHead: pass tied_embedding exactly when "
                             "tie_word_embeddings=True")
        tp_info = get_tp_info()
        self.tp_size = tp_info.size
        self.num_embeddings = num_embeddings
        self.num_embeddings_tp = div_ceil(num_embeddings, tp_info.size)
        self.tie_word_embeddings = tie_word_embeddings
        self._tied_embedding = tied_embedding  # underscore: not part of this op's state dict
        if not tie_word_embeddings:
            self.weight = torch.empty(self.num_embeddings_tp, embedding_dim)
        self.bias = torch.empty(self.num_embeddings_tp) if bias else None
        self._comm = DistributedCommunicator()
        self._matmul = current_ops().matmul  # chosen when built (impls.py)

    def load_state_dict(self, state_dict: StateDict, *, prefix: str = "",
                        _internal: bool = False) -> None:
        key = f"{prefix}.weight" if prefix else "weight"
        if self.tie_word_embeddings and key in state_dict:  # the checkpoint has its own LM head
            own, table = state_dict[key], self._tied_embedding.weight
            if table.device.type != "meta" and own.shape == table.shape and torch.equal(own, table):
                state_dict.pop(key)  # a copy of the embedding table: stay tied
            else:  # as Hugging Face does, the checkpoint's LM head wins over the config's tying
                self.tie_word_embeddings = False
                self.weight = torch.empty(self.num_embeddings_tp, table.shape[1],
                                          dtype=table.dtype, device="meta")
        super().load_state_dict(state_dict, prefix=prefix, _internal=_internal)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` -> logits ``[B, V]`` in prefill (last token of each real request) or
        ``[Bp, V]`` in decode (every row, padding included)."""
        batch = get_global_ctx().batch
        weight = self._tied_embedding.weight if self.tie_word_embeddings else self.weight
        # BEGIN SOLUTION 2.5: last tokens in prefill; this rank's logits; gather the vocab slices
        if batch.is_prefill:
            x = x[batch.attn_metadata.get_last_indices(batch.size)]
        logits = self._matmul(x, weight, self.bias)  # [rows, V / tp]
        if self.tp_size > 1:
            rows = logits.shape[0]
            gathered = self._comm.all_gather(logits)  # [tp * rows, V / tp], rank-major
            logits = gathered.view(self.tp_size, rows, -1).transpose(0, 1).reshape(rows, -1)
            logits = logits[:, : self.num_embeddings]  # the padding columns of the last shard
        # END SOLUTION
        return logits
