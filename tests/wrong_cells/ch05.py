"""Plausible wrong versions of chapter 05's exercises, for the notebook's own check cells."""

_STORE = "        self.kv_cache.store_kv(k, v, md.out_loc, layer_id)\n"
_GATHER_V = ("        v_all = self.kv_cache.v_cache(layer_id).view(-1, hkv, d)"
             ".index_select(0, md.kv_slots)\n")

CASES = [
    # 5.1 build_mask
    ("5.1", "minisgl/attention/mask.py",
     "top-left causal: the cached prefix is forgotten (query i sees keys 0..i)",
     (("query_pos = cached_lens[:, None, None] + i  # [Bp, Qmax, 1]",
       "query_pos = i  # [1, Qmax, 1]"),)),
    ("5.1", "minisgl/attention/mask.py", "strict inequality: a token does not see itself",
     (("allowed = (j <= query_pos) & (j < seq_lens[:, None, None])",
       "allowed = (j < query_pos) & (j < seq_lens[:, None, None])"),)),
    ("5.1", "minisgl/attention/mask.py", "padding rows see nothing (softmax of all -inf is NaN)",
     (("return torch.where(is_pad_row, j == 0, allowed)", "return allowed & ~is_pad_row"),)),
    ("5.1", "minisgl/attention/mask.py", "padding rows not handled at all",
     (("return torch.where(is_pad_row, j == 0, allowed)", "return allowed"),)),
    # 5.2 kv slots
    ("5.2", "minisgl/attention/torch_backend.py",
     "page-table rows by position in the batch instead of table_idx",
     (("rows = torch.tensor([r.table_idx for r in reqs], dtype=torch.int64, device=device)",
       "rows = torch.arange(len(reqs), device=device)"),)),
    ("5.2", "minisgl/attention/torch_backend.py", "sliced to Qmax columns instead of Kmax",
     (("kv_slots = self.page_table[rows, :max_kv].long()",
       "kv_slots = self.page_table[rows, :max_q].long()"),)),
    ("5.2", "minisgl/attention/torch_backend.py",
     "ragged: each request's own device_len slots concatenated, not padded to [Bp, Kmax]",
     (("kv_slots = self.page_table[rows, :max_kv].long()",
       "kv_slots = torch.cat([self.page_table[r.table_idx, :r.device_len] for r in reqs]).long()"),)),
    # 5.3 forward
    ("5.3", "minisgl/attention/torch_backend.py",
     "gather before store: the new tokens' keys are read before store_kv writes them",
     ((_STORE, ""), (_GATHER_V, _GATHER_V + _STORE))),
    ("5.3", "minisgl/attention/torch_backend.py", "prefill without the mask",
     (("o = F.scaled_dot_product_attention(qb, k_all, v_all, attn_mask=md.mask)",
       "o = F.scaled_dot_product_attention(qb, k_all, v_all)"),)),
    ("5.3", "minisgl/attention/torch_backend.py",
     "decode GQA interleaved: query head h paired with KV head h % Hkv",
     (("o = F.scaled_dot_product_attention(q.view(bp, hkv, g, d), k_all, v_all,",
       "o = F.scaled_dot_product_attention(q.view(bp, g, hkv, d).transpose(1, 2), k_all, v_all,"),
      ("return o.reshape(bp, hkv * g, d)", "return o.transpose(1, 2).reshape(bp, hkv * g, d)"))),
    ("5.3", "minisgl/attention/torch_backend.py",
     "decode without the length mask: short requests attend to padding columns",
     (("v_all,\n                                               attn_mask=md.mask)",
       "v_all)"),)),
    # 5.4 page_indices (optional, CPU)
    ("5.4", "minisgl/attention/fi_metadata.py",
     "page j read at column j instead of j * page_size",
     (("first_slot = page_table[row_of_page.to(dev), (j * page_size).to(dev)]",
       "first_slot = page_table[row_of_page.to(dev), j.to(dev)]"),)),
    ("5.4", "minisgl/attention/fi_metadata.py", "slot returned as is, not divided by page_size",
     (("return (first_slot // page_size).to(torch.int32)", "return first_slot.to(torch.int32)"),)),
    ("5.4", "minisgl/attention/fi_metadata.py",
     "page number not restarted at 0 for each request",
     (("j = torch.arange(int(counts.sum())) - first_of_req",
       "j = torch.arange(int(counts.sum()))"),)),
    ("5.4", "minisgl/attention/fi_metadata.py",
     "rows by position in the batch instead of table_idx",
     (("row_of_page = rows.long().repeat_interleave(counts)",
       "row_of_page = torch.arange(len(rows)).repeat_interleave(counts)"),)),
]
