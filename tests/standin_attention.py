"""Chapter 03's stand-in attention backend (the same code as in the chapter's notebook).

Chapter 05 writes the real attention backends over the paged KV cache. Until then this stand-in
lets a whole model run: it keeps no cache, so every forward must be a prefill over each request's
*whole* sequence (``cached_len == 0``, positions ``0 .. L-1``), and causal attention over those
tokens alone is then exact. It lives outside the package on purpose: the engine never uses it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class ContiguousMetadata:
    """Request i owns tokens ``cu_seqlens[i] : cu_seqlens[i+1]`` of the T axis."""

    def __init__(self, cu_seqlens: torch.Tensor) -> None:
        self.cu_seqlens = cu_seqlens  # [B + 1], starts at 0, ends at T

    def get_last_indices(self, bs: int) -> torch.Tensor:
        """Index of each of the first ``bs`` requests' last token (what the LM head keeps)."""
        return self.cu_seqlens[1:bs + 1] - 1


class ContiguousAttention:
    """A no-cache "backend": causal scaled-dot-product attention inside each request."""

    def prepare_metadata(self, batch) -> None:
        for req in batch.reqs:
            if req.cached_len != 0:
                raise ValueError(f"the stand-in attention keeps no KV cache, but {req} has "
                                 "cached_len > 0: feed each request's whole sequence "
                                 "(cached_len=0, positions 0..L-1) in a prefill batch.")
        lens = torch.tensor([req.extend_len for req in batch.reqs])
        cu_seqlens = torch.zeros(len(lens) + 1, dtype=torch.int64)
        cu_seqlens[1:] = lens.cumsum(0)
        if int(cu_seqlens[-1]) != batch.input_ids.shape[0]:
            raise ValueError(f"batch.input_ids has {batch.input_ids.shape[0]} tokens but the "
                             f"requests' extend_len add up to {int(cu_seqlens[-1])}.")
        batch.attn_metadata = ContiguousMetadata(cu_seqlens)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch) -> torch.Tensor:
        """``q [T, Hq, D]``, ``k, v [T, Hkv*D]`` (views into qkv) -> ``o [T, Hq, D]``."""
        D = q.shape[-1]
        out = torch.empty_like(q)
        cu = batch.attn_metadata.cu_seqlens.tolist()
        for start, end in zip(cu[:-1], cu[1:]):  # noqa: RUF007 (pairs of boundaries)
            L = end - start
            qi = q[start:end].transpose(0, 1)  # [Hq, L, D]
            ki = k[start:end].reshape(L, -1, D).transpose(0, 1)  # [Hkv, L, D]
            vi = v[start:end].reshape(L, -1, D).transpose(0, 1)
            # enable_gqa: query head h reads KV head h // (Hq / Hkv), like repeat_interleave
            oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)
            out[start:end] = oi.transpose(0, 1)
        return out


def prefill_logits(model, sequences) -> torch.Tensor:
    """One prefill over whole sequences (lists of token ids): ``[B, V]`` last-token logits."""
    from minisgl.core import Batch, Req, get_global_ctx

    ctx = get_global_ctx()
    reqs = [Req(input_ids=torch.tensor(seq, dtype=torch.int32), table_idx=i, cached_len=0,
                output_len=1, uid=i, sampling_params=None) for i, seq in enumerate(sequences)]
    batch = Batch(reqs=reqs, phase="prefill")
    batch.input_ids = torch.cat([req.input_ids for req in reqs])  # [T]
    batch.positions = torch.cat([torch.arange(len(req.input_ids), dtype=torch.int32)
                                 for req in reqs])  # [T]: every request starts at position 0
    ctx.attn_backend.prepare_metadata(batch)
    with ctx.forward_batch(batch), torch.no_grad():
        return model.forward()
