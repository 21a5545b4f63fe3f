# Chapter 05 (05_attention_backends.ipynb): the bottom-right causal mask of a padded batch.
"""Which keys each query row of a padded batch may see, for the torch backend.

The batch is padded into a rectangle of ``Bp`` requests x ``Qmax`` query rows x ``Kmax`` key
columns (``Qmax`` = the longest ``extend_len``, ``Kmax`` = the longest ``device_len``). Query
``i`` of request ``b`` is the token at absolute position ``cached_len + i``: it sees the keys
``0 .. cached_len + i`` (the causal diagonal ends in the bottom-right corner, because the last
query is the last key), never a key at or past ``device_len``.
"""

from __future__ import annotations

import torch


def build_mask(cached_lens: torch.Tensor, extend_lens: torch.Tensor, seq_lens: torch.Tensor,
               max_q_len: int, max_kv_len: int) -> torch.Tensor:
    """``[Bp, Qmax, Kmax]`` bool: query ``i`` of request ``b`` may attend to key ``j``.

    Query ``i`` is absolute position ``cached_len + i``; it sees keys ``0 .. cached_len + i``
    (bottom-right causal). Rows past a request's ``extend_len`` are padding: they see key 0 only,
    so softmax stays finite, and their output is discarded.
    """
    # BEGIN SOLUTION 5.1: bottom-right causal mask, padded rows and columns handled
    i = torch.arange(max_q_len)[None, :, None]  # [1, Qmax, 1]
    j = torch.arange(max_kv_len)[None, None, :]  # [1, 1, Kmax]
    query_pos = cached_lens[:, None, None] + i  # [Bp, Qmax, 1]
    allowed = (j <= query_pos) & (j < seq_lens[:, None, None])
    is_pad_row = i >= extend_lens[:, None, None]
    return torch.where(is_pad_row, j == 0, allowed)
    # END SOLUTION
