"""Plausible wrong versions of chapter 02's exercises, for the notebook's own check cells."""

_WALK = ('            if name.startswith("_"):\n                continue\n'
         '            key = _concat_prefix(prefix, name)\n'
         '            if isinstance(value, torch.Tensor):\n                result[key] = value\n')
_ROTATE = ("            x1.copy_(o1)\n            x2.copy_(o2)\n")

CASES = [
    # 2.1 state_dict
    ("2.1", "minisgl/layers/base.py", "underscore attributes kept: the _scratch tensor gets a key",
     ((_WALK, _WALK.replace('            if name.startswith("_"):\n                continue\n',
                            "")),)),
    ("2.1", "minisgl/layers/base.py", "child ops recurse with their own name, not prefix.name",
     (("                value.state_dict(prefix=key, result=result)",
       "                value.state_dict(prefix=name, result=result)"),)),
    ("2.1", "minisgl/layers/base.py", "the child's keys are returned and dropped (no result=)",
     (("                value.state_dict(prefix=key, result=result)",
       "                value.state_dict(prefix=key)"),)),
    # 2.2 load_state_dict
    ("2.2", "minisgl/layers/base.py", "copies into the placeholder instead of swapping it",
     (("                setattr(self, name, tensor)", "                value.copy_(tensor)"),)),
    ("2.2", "minisgl/layers/base.py", "reads the key without popping it: every key is left over",
     (("                tensor = state_dict.pop(key)", "                tensor = state_dict[key]"),)),
    ("2.2", "minisgl/layers/base.py", "checks the shape but not the dtype",
     (("                if tensor.shape != value.shape or tensor.dtype != value.dtype:",
       "                if tensor.shape != value.shape:"),)),
    ("2.2", "minisgl/layers/base.py", "the ValueError names neither the key nor the sizes",
     (('                        f"{key}: the checkpoint tensor is {tuple(tensor.shape)} '
       '{tensor.dtype} but "',
       '                        "the checkpoint tensor does not fit: "'),)),
    # 2.3 LinearColParallelMerged
    ("2.3", "minisgl/layers/linear.py", "no split: every rank keeps the whole gate and up",
     (("        local_osize = sum(div_even(size, tp) for size in output_sizes)",
       "        local_osize = sum(output_sizes)"),)),
    ("2.3", "minisgl/layers/linear.py", "only the first component's share (the gate, not up)",
     (("        local_osize = sum(div_even(size, tp) for size in output_sizes)",
       "        local_osize = div_even(output_sizes[0], tp)"),)),
    # 2.4 LinearQKVMerged
    ("2.4", "minisgl/layers/linear.py", "KV heads split without replication (fails at tp > Hkv)",
     (("        local_kv = div_even(num_kv_heads, tp, allow_replicate=True)",
       "        local_kv = div_even(num_kv_heads, tp)"),)),
    ("2.4", "minisgl/layers/linear.py", "KV heads not split at all: every rank keeps all of them",
     (("        local_kv = div_even(num_kv_heads, tp, allow_replicate=True)",
       "        local_kv = num_kv_heads"),)),
    ("2.4", "minisgl/layers/linear.py", "query heads not split",
     (("        local_qo = div_even(num_qo_heads, tp)", "        local_qo = num_qo_heads"),)),
    # 2.5 ParallelLMHead.forward
    ("2.5", "minisgl/layers/embedding.py", "prefill keeps every row",
     (("        if batch.is_prefill:\n            x = x[batch.attn_metadata.get_last_indices"
       "(batch.size)]\n", ""),)),
    ("2.5", "minisgl/layers/embedding.py", "keeps the last B rows of x instead of each request's last",
     (("            x = x[batch.attn_metadata.get_last_indices(batch.size)]",
       "            x = x[-batch.size:]"),)),
    ("2.5", "minisgl/layers/embedding.py", "the phases swapped: selects in decode, not in prefill",
     (("        if batch.is_prefill:\n            x = x[batch.attn_metadata",
       "        if batch.is_decode:\n            x = x[batch.attn_metadata"),)),
    ("2.5", "minisgl/layers/embedding.py", "gathered blocks reshaped per row without regrouping",
     (("            logits = gathered.view(self.tp_size, rows, -1).transpose(0, 1).reshape(rows, -1)",
       "            logits = gathered.view(rows, -1)"),)),
    ("2.5", "minisgl/layers/embedding.py", "the padding columns of the last shard kept",
     (("            logits = logits[:, : self.num_embeddings]  # the padding columns of the last shard\n",
       ""),)),
    ("2.5", "minisgl/layers/embedding.py", "no all-gather: each rank returns only its own slice",
     (("            gathered = self._comm.all_gather(logits)  # [tp * rows, V / tp], rank-major\n",
       "            gathered = logits\n"),)),
    # 2.6 rms_norm
    ("2.6", "minisgl/layers/norm.py", "weight multiplied in float32, cast back afterwards",
     (("    return weight * xf.to(x.dtype)", "    return (weight * xf).to(x.dtype)"),)),
    ("2.6", "minisgl/layers/norm.py", "never cast back: a bfloat16 input gives float32",
     (("    return weight * xf.to(x.dtype)", "    return weight * xf"),)),
    ("2.6", "minisgl/layers/norm.py", "no float32: the maths in the input's dtype",
     (("    xf = x.float()\n", "    xf = x\n"),)),
    # 2.7 RMSNormFused.forward
    ("2.7", "minisgl/layers/norm.py", "out-of-place residual: residual = residual + x",
     (("        residual.add_(x)", "        residual = residual + x"),)),
    ("2.7", "minisgl/layers/norm.py", "normalises the block output x, not the updated residual",
     (("        return rms_norm(residual, self.weight, self.eps), residual",
       "        return rms_norm(x, self.weight, self.eps), residual"),)),
    ("2.7", "minisgl/layers/norm.py", "the first call returns x un-normalised",
     (("            return rms_norm(x, self.weight, self.eps), x", "            return x, x"),)),
    # 2.8 RotaryEmbedding.forward
    ("2.8", "minisgl/layers/rotary.py", "computes the rotation but never writes it back",
     ((_ROTATE, ""),)),
    ("2.8", "minisgl/layers/rotary.py", "rebinds x to a new tensor instead of writing in place",
     ((_ROTATE, "            x = torch.cat([o1, o2], dim=-1)\n"),)),
    ("2.8", "minisgl/layers/rotary.py", "sin signs swapped (rotates by -angle)",
     (("o1 = torch.addcmul(x1 * cos, x2, sin, value=-1)", "o1 = torch.addcmul(x1 * cos, x2, sin)"),
      ("o2 = torch.addcmul(x2 * cos, x1, sin)", "o2 = torch.addcmul(x2 * cos, x1, sin, value=-1)"))),
    ("2.8", "minisgl/layers/rotary.py", "interleaved pairs (x[2i], x[2i+1]) instead of rotate-half",
     (("            x1, x2 = x[..., :half], x[..., half:]",
       "            x1, x2 = x[..., 0::2], x[..., 1::2]"),)),
    ("2.8", "minisgl/layers/rotary.py", "x1 written back before x2 is computed from it",
     (("            o2 = torch.addcmul(x2 * cos, x1, sin)  # x2 * cos + x1 * sin\n"
       "            x1.copy_(o1)\n",
       "            x1.copy_(o1)\n"
       "            o2 = torch.addcmul(x2 * cos, x1, sin)  # x2 * cos + x1 * sin\n"),)),
    # 2.9 AttentionLayer.forward
    ("2.9", "minisgl/layers/attention.py", "q/k norm applied after the rotary",
     (("        if self.q_norm is not None:\n"
       "            self.q_norm.forward_inplace(q.view(-1, self.num_qo_heads, self.head_dim))\n"
       "        if self.k_norm is not None:\n"
       "            self.k_norm.forward_inplace(k.view(-1, self.num_kv_heads, self.head_dim))\n"
       "        q, k = self.rotary.forward(ctx.batch.positions, q, k)\n",
       "        q, k = self.rotary.forward(ctx.batch.positions, q, k)\n"
       "        if self.q_norm is not None:\n"
       "            self.q_norm.forward_inplace(q.view(-1, self.num_qo_heads, self.head_dim))\n"
       "        if self.k_norm is not None:\n"
       "            self.k_norm.forward_inplace(k.view(-1, self.num_kv_heads, self.head_dim))\n"),)),
    ("2.9", "minisgl/layers/attention.py", "qkv cut into three equal parts (ignores GQA)",
     (("        q, k, v = qkv.split_with_sizes([self.qo_attn_dim, self.kv_attn_dim, self.kv_attn_dim],\n"
       "                                       dim=-1)",
       "        q, k, v = qkv.chunk(3, dim=-1)"),)),
    ("2.9", "minisgl/layers/attention.py", "positions counted from 0 instead of ctx.batch.positions",
     (("        q, k = self.rotary.forward(ctx.batch.positions, q, k)",
       "        q, k = self.rotary.forward(torch.arange(qkv.shape[0]), q, k)"),)),
    ("2.9", "minisgl/layers/attention.py", "k normed with q_norm's weight (copy-paste)",
     (("            self.k_norm.forward_inplace(k.view(",
       "            self.q_norm.forward_inplace(k.view("),)),
]
