"""Stage 1 milestone: the same prompt and the same 16 tokens, but the skeleton has become the real structure.

Two comparisons with step 0: tokens/s for a single request (where the real structure gains nothing),
and what the skeleton could not do at all: four requests in one batch, computed in one step.
"""

import os
import time

import torch
from minisgl.core import Batch, Req, SamplingParams
from minisgl.distributed import DistributedInfo
from minisgl.engine import Engine, EngineConfig
from transformers import AutoModelForCausalLM, AutoTokenizer

path = "models/Qwen3-0.6B"
if not os.path.isdir(path):  # the only change to the chapter's script: fall back to the offline model
    path = "models/SmolLM2-135M-Instruct"
engine = Engine(EngineConfig(model_path=path, tp_info=DistributedInfo(0, 1), dtype=torch.float32,
                             max_running_req=4, num_page_override=1024, max_seq_len_override=256))
tok = AutoTokenizer.from_pretrained(path)
print(f"the real structure: {engine.device}, attention backend {engine.config.attention_backend}, "
      f"KV pool {engine.num_pages} pages, {torch.get_num_threads()} threads (set by the Engine itself)")


def make_reqs(prompts, n):
    reqs = []
    for row, p in enumerate(prompts):
        engine.page_table[row, :256] = torch.arange(row * 256, row * 256 + 256)   # "allocate" the KV locations by hand
        reqs.append(Req(input_ids=torch.tensor(tok(p).input_ids, dtype=torch.int32), table_idx=row,
                        cached_len=0, output_len=n, uid=row, sampling_params=SamplingParams(max_tokens=n),
                        cache_handle=None))
    return reqs


def step(reqs, phase):
    """No scheduler: fill the batch's fields yourself, forward + sample, then write the new token back to each request."""
    batch = Batch(reqs=reqs, phase=phase)
    engine.graph_runner.pad_batch(batch)
    batch.positions = torch.cat([torch.arange(r.cached_len, r.device_len) for r in reqs]).int()
    batch.input_ids = torch.cat([r.input_ids[r.cached_len:r.device_len] for r in reqs])
    batch.out_loc = torch.cat([engine.page_table[r.table_idx, r.cached_len:r.device_len] for r in reqs])
    engine.attn_backend.prepare_metadata(batch)
    out = engine.forward_batch(batch, engine.sampler.prepare(batch))
    for i, r in enumerate(reqs):
        r.append_host(out.next_tokens_cpu[i:i + 1])
    return out.next_tokens_cpu.tolist()


def generate(prompts, n=16):
    reqs = make_reqs(prompts, n)
    outs = [[] for _ in reqs]
    t0 = time.perf_counter()
    for i, t in enumerate(step(reqs, "prefill")):
        outs[i].append(t)
    t1 = time.perf_counter()
    steps = []
    for _ in range(n - 1):
        t2 = time.perf_counter()
        for i, t in enumerate(step(reqs, "decode")):
            outs[i].append(t)
        steps.append(time.perf_counter() - t2)
    return outs, t1 - t0, min(steps)   # the fastest decode step: other programs can only add time


# ------------------------------------------------------------------ 1. the same request as step 0
prompt = "The capital of France is"
[out], t_prefill, t_step = generate([prompt])
print(f"single request: {tok.decode(out)!r}")
print(f"  prefill {t_prefill * 1000:.0f} ms, decode {t_step * 1000:.0f} ms per step ({1 / t_step:.1f} tokens/s)")

# ------------------------------------------------------------------ 2. what the skeleton could not do: 4 requests in one batch
prompts = [prompt, "List three prime numbers:", "def fibonacci(n):", "Once upon a time,"]
outs, t_prefill, t_step4 = generate(prompts)
print(f"4 requests in one batch: prefill {t_prefill * 1000:.0f} ms, decode {t_step4 * 1000:.0f} ms per step"
      f" (4 tokens per step, {4 / t_step4:.1f} tokens/s in total; a step is only {(t_step4 / t_step - 1) * 100:.0f}% slower than a single request)")
slots = torch.cat([engine.page_table[row, :len(tok(p).input_ids) + 15]   # per request: the prompt + the 15 new tokens fed back in
                   for row, p in enumerate(prompts)])
written = len(torch.unique(slots // engine.config.page_size))           # the pages those slots lie in (page_size=1: one per slot)
print(f"KV pool: {written} / {engine.num_pages} pages written; each token writes only its own page, no copies at all")

hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
for p, o in zip(prompts, outs):
    ids = tok(p, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = hf.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
    print(f"  {p!r:30} -> {tok.decode(o)[:32]!r:36} matches HF: {o == ref}")
print(f"run alone or inside the 4-request batch, the first request's 16 tokens are identical: {outs[0] == out}")
engine.shutdown()
