"""Plausible wrong versions of chapter 03's exercises, for the notebook's own check cells."""

_PAD = ("        if part.shape[0] < rows:  # the last rank's shard is shorter: pad it with zero rows\n"
        "            pad = t.new_zeros(rows - part.shape[0], *t.shape[1:])\n"
        "            part = torch.cat([part, pad])\n")

CASES = [
    # 3.1 ModelConfig.from_hf: head counts and head_dim
    ("3.1", "minisgl/models/config.py", "head_dim always hidden_size // Hq (ignores the config's)",
     (('        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_qo_heads',
       "        head_dim = text.hidden_size // num_qo_heads"),)),
    ("3.1", "minisgl/models/config.py", "num_key_value_heads read without a default",
     (('        num_kv_heads = getattr(text, "num_key_value_heads", None) or num_qo_heads',
       "        num_kv_heads = text.num_key_value_heads"),)),
    ("3.1", "minisgl/models/config.py", "getattr default only: a head_dim of None stays None",
     (('        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_qo_heads',
       '        head_dim = getattr(text, "head_dim", text.hidden_size // num_qo_heads)'),)),
    ("3.1", "minisgl/models/config.py", "a missing KV-head count defaults to 1 (MQA) instead of Hq",
     (('        num_kv_heads = getattr(text, "num_key_value_heads", None) or num_qo_heads',
       '        num_kv_heads = getattr(text, "num_key_value_heads", None) or 1'),)),
    # 3.2 DecoderLayer.forward
    ("3.2", "minisgl/models/decoder.py", "the post-attention norm starts a new residual (drops it)",
     (("        x, residual = self.post_attention_layernorm.forward(x, residual)",
       "        x, residual = self.post_attention_layernorm.forward(x)"),)),
    ("3.2", "minisgl/models/decoder.py", "the MLP reads the residual instead of the normed x",
     (("        x = self.mlp.forward(x)", "        x = self.mlp.forward(residual)"),)),
    ("3.2", "minisgl/models/decoder.py", "attention reads the layer input, not the normed x",
     (("        x, residual = self.input_layernorm.forward(x, residual)\n"
       "        x = self.self_attn.forward(x)\n",
       "        h, residual = self.input_layernorm.forward(x, residual)\n"
       "        x = self.self_attn.forward(x)\n"),)),
    # 3.3 _shard
    ("3.3", "minisgl/models/weight.py", "vocab shard without padding (V not divisible by tp)",
     ((_PAD, ""),)),
    ("3.3", "minisgl/models/weight.py", "vocab split with chunk (uneven shards, no padding)",
     (("        rows = div_ceil(config.vocab_size, tp.size)\n",
       "        return t.chunk(tp.size, dim=0)[tp.rank].clone()\n"
       "        rows = div_ceil(config.vocab_size, tp.size)\n"),)),
    ("3.3", "minisgl/models/weight.py", "row-parallel weights split by rows like column-parallel",
     (("        return t.chunk(tp.size, dim=1)[tp.rank].clone()",
       "        return t.chunk(tp.size, dim=0)[tp.rank].clone()"),)),
    ("3.3", "minisgl/models/weight.py", "KV heads chunked even when Hkv < tp (no replication)",
     (('    if any(s in name for s in (".k_proj", ".v_proj")) and config.num_kv_heads < tp.size:',
       '    if False:'),)),
    ("3.3", "minisgl/models/weight.py", "row-parallel shard not cloned (a view of the whole tensor)",
     (("        return t.chunk(tp.size, dim=1)[tp.rank].clone()",
       "        return t.chunk(tp.size, dim=1)[tp.rank]"),)),
    # 3.4 merging in load_weight
    ("3.4", "minisgl/models/weight.py", "merge in file order: q/k/v concatenated as k, q, v",
     (("torch.cat([parts[i] for i in range(expected)], dim=0)",
       "torch.cat(list(parts.values()), dim=0)"),)),
    ("3.4", "minisgl/models/weight.py", "parts concatenated along dim 1 (columns)",
     (("torch.cat([parts[i] for i in range(expected)], dim=0)",
       "torch.cat([parts[i] for i in range(expected)], dim=1)"),)),
    ("3.4", "minisgl/models/weight.py", "always waits for three parts (gate_up never completes)",
     (('                expected = len(_MERGES[fused_name.split(".")[-2]])',
       "                expected = 3"),)),
    ("3.4", "minisgl/models/weight.py", "merge before shard: the fused tensor goes through _shard",
     (("                tensor = _shard(name, tensor, config, tp)\n", ""),
      ("                    yield name, tensor\n",
       "                    yield name, _shard(name, tensor, config, tp)\n"),
      ("                    yield fused_name, torch.cat([parts[i] for i in range(expected)], dim=0)",
       "                    yield fused_name, _shard(fused_name, torch.cat([parts[i] for i in "
       "range(expected)], dim=0), config, tp)"))),
    ("3.4", "minisgl/models/weight.py", "never calls _shard (fine at tp=1, whole tensors at tp=2)",
     (("                tensor = _shard(name, tensor, config, tp)\n", ""),)),
    ("3.4", "minisgl/models/weight.py", "the completed entry stays in pending",
     (("                    del pending[fused_name]\n", ""),)),
]
