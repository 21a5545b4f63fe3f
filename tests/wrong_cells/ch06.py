"""Plausible wrong versions of chapter 06's exercises, for the notebook's own check cells."""

_NO_CUT_K = "ks = [self.vocab_size if (p is None or p.top_k < 1) else p.top_k for p in params]"
_FORWARD = """            with self.ctx.forward_batch(batch):
                if self.graph_runner.can_use_cuda_graph(batch):
                    logits = self.graph_runner.replay(batch)
                else:
                    logits = self.model.forward()
"""
_TP_INFO = "        set_tp_info(config.tp_info.rank, config.tp_info.size)\n"
_BUDGET = "budget = config.memory_ratio * free - model_bytes"
_MODEL = "        self.model.load_state_dict(weight_state_dict(self.model, config, self.device))\n"

CASES = [
    # 6.1: sample_impl (temperature, top-k, top-p, draw)
    ("6.1", "minisgl/engine/sample.py",
     "top-p on the raw probabilities: no renormalisation of the top-k survivors",
     (("kept = sorted_p / sorted_p.sum(-1, keepdim=True)", "kept = sorted_p"),)),
    ("6.1", "minisgl/engine/sample.py",
     "inclusive cumsum: the token that crosses p is cut too",
     (("mass_before = kept.cumsum(-1) - kept", "mass_before = kept.cumsum(-1)"),)),
    ("6.1", "minisgl/engine/sample.py",
     "top-k off by one: rank > k keeps k + 1 tokens",
     (("masked_fill(rank >= top_k[:, None], 0.0)", "masked_fill(rank > top_k[:, None], 0.0)"),)),
    ("6.1", "minisgl/engine/sample.py",
     "temperature multiplies the logits instead of dividing them",
     (("logits.float() / temperatures[:, None]", "logits.float() * temperatures[:, None]"),)),
    ("6.1", "minisgl/engine/sample.py",
     "returns the drawn rank, not the token id (order forgotten)",
     (("return order.gather(1, choice).squeeze(1)  # rank -> token id",
       "return choice.squeeze(1)"),)),
    # 6.2: Sampler.prepare
    ("6.2", "minisgl/engine/sample.py",
     "top_k = -1 ('off') copied into the tensor for a row that cuts nothing",
     ((_NO_CUT_K, "ks = [self.vocab_size if p is None else p.top_k for p in params]"),)),
    ("6.2", "minisgl/engine/sample.py",
     "a greedy row in a sampled batch is not limited to its argmax (top_k = 1 forgotten)",
     (("        ks = [1 if (p is None or p.is_greedy) else k for p, k in zip(params, ks)]\n",
       ""),)),
    ("6.2", "minisgl/engine/sample.py",
     "greedy rows get temperature 0 (logits / 0)",
     (("temps = [1e-6 if (p is None or p.is_greedy)",
       "temps = [0.0 if (p is None or p.is_greedy)"),)),
    ("6.2", "minisgl/engine/sample.py",
     "top_k / top_p tensors built even when no row cuts (no None shortcut)",
     (("if any(k != self.vocab_size for k in ks) else None)", "if True else None)"),
      ("if any(p < 1.0 for p in ps) else None)", "if True else None)"))),
    # 6.3: GraphRunner.pad_batch
    ("6.3", "minisgl/engine/graph.py",
     "prefill batches padded too",
     (("if batch.is_decode and 0 < batch.size <= self.max_graph_bs:",
       "if 0 < batch.size <= self.max_graph_bs:"),)),
    ("6.3", "minisgl/engine/graph.py",
     "the next larger graph (bs > B) instead of the smallest that fits (bs >= B)",
     (("if bs >= batch.size)", "if bs > batch.size)"),)),
    ("6.3", "minisgl/engine/graph.py",
     "dummies put in front of the real requests",
     (("batch.padded_reqs = batch.reqs + [self.dummy_req] * (padded_size - batch.size)",
       "batch.padded_reqs = [self.dummy_req] * (padded_size - batch.size) + batch.reqs"),)),
    ("6.3", "minisgl/engine/graph.py",
     "no upper bound: a batch larger than every graph looks for one",
     (("if batch.is_decode and 0 < batch.size <= self.max_graph_bs:",
       "if batch.is_decode and self.graph_bs_list:"),)),
    # 6.4: Engine._init
    ("6.4", "minisgl/engine/engine.py",
     "the KV pool without the dummy page",
     (("num_pages=self.num_pages + 1,", "num_pages=self.num_pages,"),)),
    ("6.4", "minisgl/engine/engine.py",
     "the dummy row points at slot 0 (a real request's slot)",
     (("dummy_slot=self.num_pages * config.page_size,", "dummy_slot=0,"),)),
    ("6.4", "minisgl/engine/engine.py",
     "the dummy request takes the last real row",
     (("table_idx=config.max_running_req, cached_len=0",
       "table_idx=config.max_running_req - 1, cached_len=0"),)),
    ("6.4", "minisgl/engine/engine.py",
     "the tp info set after the model is built",
     ((_TP_INFO, ""), (_MODEL, _MODEL + _TP_INFO))),
    # 6.5: Engine.forward_batch
    ("6.5", "minisgl/engine/engine.py",
     "samples the padded logits (logits instead of logits[:batch.size])",
     (("self.sampler.sample(logits[: batch.size], args)", "self.sampler.sample(logits, args)"),)),
    ("6.5", "minisgl/engine/engine.py",
     "complete_one on the padded requests: the dummy advances",
     (("            for req in batch.reqs:\n                req.complete_one()",
       "            for req in batch.padded_reqs:\n                req.complete_one()"),)),
    ("6.5", "minisgl/engine/engine.py",
     "complete_one forgotten",
     (("            for req in batch.reqs:\n                req.complete_one()\n", ""),)),
    ("6.5", "minisgl/engine/engine.py",
     "the model runs outside ctx.forward_batch",
     ((_FORWARD, """            if self.graph_runner.can_use_cuda_graph(batch):
                logits = self.graph_runner.replay(batch)
            else:
                logits = self.model.forward()
"""),)),
    # 6.6: Engine.pages_that_fit
    ("6.6", "minisgl/engine/engine.py",
     "the weights not subtracted from the budget",
     ((_BUDGET, "budget = config.memory_ratio * free"),)),
    ("6.6", "minisgl/engine/engine.py",
     "memory_ratio applied to what the weights leave",
     ((_BUDGET, "budget = config.memory_ratio * (free - model_bytes)"),)),
    ("6.6", "minisgl/engine/engine.py",
     "no cap: more pages than the requests could ever fill",
     (("num_pages = min(int(budget // per_page), useful)",
       "num_pages = int(budget // per_page)"),)),
    ("6.6", "minisgl/engine/engine.py",
     "the cap rounded down",
     (("useful = -(-config.max_running_req * config.max_seq_len // config.page_size)  # ceil",
       "useful = config.max_running_req * config.max_seq_len // config.page_size"),)),
    # 6.4, the steps issue 22 asked the prose and the check to cover
    ("6.4", "minisgl/engine/engine.py",
     "set_rope_device forgotten: the rope tables follow whatever device was set last",
     (("        set_rope_device(self.device)\n", ""),)),
    ("6.4", "minisgl/engine/engine.py",
     "the model built for real (no meta device): every weight allocated twice",
     (('        with torch.device("meta"), torch_dtype(config.dtype):',
       "        with torch_dtype(config.dtype):"),)),
    ("6.4", "minisgl/engine/engine.py",
     "the model built in the default dtype, not the Engine's",
     (('        with torch.device("meta"), torch_dtype(config.dtype):',
       '        with torch.device("meta"):'),)),
    ("6.4", "minisgl/engine/engine.py",
     "the page table sized from config.max_seq_len, not the capped length",
     (("create_page_table(config.max_running_req, self.max_seq_len,",
       "create_page_table(config.max_running_req, config.max_seq_len,"),)),
    ("6.4", "minisgl/engine/engine.py",
     "the context built without the page size",
     (("        self.ctx = Context(page_size=config.page_size)\n",
       "        self.ctx = Context(page_size=1)\n"),)),
    # 6.5: the sampler and the tokens
    ("6.5", "minisgl/engine/engine.py",
     "the sampler bypassed: argmax for every request",
     (("self.sampler.sample(logits[: batch.size], args).to(torch.int32)",
       "logits[: batch.size].argmax(-1).to(torch.int32)"),)),
    # 6.1: the generator
    ("6.1", "minisgl/engine/sample.py",
     "the cut path draws without the sampler's generator",
     (("choice = torch.multinomial(sorted_p, 1, generator=generator)",
       "choice = torch.multinomial(sorted_p, 1)"),)),
]
