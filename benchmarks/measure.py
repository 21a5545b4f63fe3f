"""Measurements shared by the benchmarks and the milestone notebook.

Definitions (the same as benchmarks/README.md states):

- decode step: wall time of one whole step on a decode batch — filling the batch's fields,
  ``prepare_metadata``, ``sampler.prepare`` and ``forward_batch`` (which samples) — median over
  at least 32 steps after a warm-up;
- HF per-token time: one decode-only forward of HF ``transformers`` with its own KV cache;
- roofline: the weights' bytes (tied embeddings counted once) / the read bandwidth of a
  read-only pass (``x.sum()``) over >= 1 GiB of float32, same thread count;
- every function returns raw per-step seconds; callers take medians and ratios.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["The capital of France is", "List three prime numbers:", "def fibonacci(n):",
           "Once upon a time,"]


def cpu_info() -> tuple[str, str]:
    """The CPU's model name and its widest vector instruction set ("AVX-512", "AVX2", "SSE",
    "NEON" or "unknown"): from /proc/cpuinfo, else from ``platform``."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "hardware", "cpu model") and not model:
                    model = value.strip()
                elif key in ("flags", "features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    machine = platform.machine().lower()
    model = model or platform.processor() or machine or "unknown CPU"
    if "avx512f" in flags:
        isa = "AVX-512"
    elif "avx2" in flags:
        isa = "AVX2"
    elif flags & {"sse2", "sse4_1", "sse4_2"}:
        isa = "SSE"
    elif "asimd" in flags or machine in ("aarch64", "arm64"):  # every 64-bit Arm core has NEON
        isa = "NEON"
    else:
        isa = "unknown"
    return model, isa


def machine_line(threads: int | None = None) -> str:
    """One line for a benchmark's header: CPU model, vector ISA, cores, threads, torch."""
    model, isa = cpu_info()
    threads = torch.get_num_threads() if threads is None else threads
    wait = os.environ.get("OMP_WAIT_POLICY")
    return (f"{model} ({isa}), {os.cpu_count()} CPUs, torch threads: {threads}"
            f"{f', OMP_WAIT_POLICY={wait}' if wait else ''}, torch {torch.__version__}")


def kernel_line() -> str:
    """The C++ kernels' build for a benchmark's header: the vector instructions it targets."""
    from minisgl import kernel

    module = kernel.load()
    if module is None:
        return f"C++ kernels unavailable ({kernel.unavailable_reason()})"
    hints = {0: "prefetchnta", 1: "prefetcht2"}
    tuned = [(r, module.prefetch_ahead(r), module.prefetch_locality(r)) for r in range(2, 8)]
    tuned = ", ".join(f"{r} rows {hints.get(h, h)} {a * 4} B" for r, a, h in tuned
                      if a >= 0) or "none tuned yet"
    return (f"kernels built for {module.vector_isa()} ({module.vector_lanes()} floats per "
            f"vector, MINISGL_KERNEL_ISA={os.environ.get('MINISGL_KERNEL_ISA') or 'native'}; "
            f"the 2-7-row loop's prefetch, tuned in the step: {tuned})")


def smaps(lo: int, hi: int) -> list[dict[str, str]] | None:
    """The mappings of this process that overlap the addresses ``[lo, hi)``, from Linux's
    ``/proc/self/smaps``: each a dict of its fields (``"AnonHugePages"``, ``"VmFlags"``, ...),
    with ``"start"`` and ``"end"`` in hex; None without that file."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    found, current = [], None
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):  # a mapping's first line
            start, end = head.split("-")
            current = {"start": start, "end": end} if int(start, 16) < hi and int(end, 16) > lo \
                else None
            if current is not None:
                found.append(current)
        elif current is not None:
            key, _, value = line.partition(":")
            current[key] = value.strip()
    return found


def huge_pages_line(engine) -> str:
    """Where an Engine's weights lie: the share in 2 MB pages (an Engine built with the kernels
    copies them into one buffer advised for huge pages, chapter 07's ``place_weights``; the OS
    may still give 4 KB pages), and the THP setting."""
    weights = list(engine.model.state_dict().values())
    lo = min(t.data_ptr() for t in weights)
    hi = max(t.data_ptr() + t.numel() * t.element_size() for t in weights)
    maps = smaps(lo, hi)
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
        mode = mode.split("[")[1].split("]")[0]
    except (OSError, IndexError):
        maps = None
    if maps is None:
        return "weights in 2 MB pages: unknown (no Linux transparent huge pages here)"
    huge = sum(int(m.get("AnonHugePages", "0 kB").split()[0]) * 1024 for m in maps)
    mapped = sum(int(m["end"], 16) - int(m["start"], 16) for m in maps)
    return (f"weights ({(hi - lo) / 1e6:.0f} MB, in {mapped / 1e6:.0f} MB of mappings) in 2 MB "
            f"pages: {huge / 1e6:.0f} MB (transparent huge pages: {mode})")


def header(model_path: Path, what: str, threads: int | None = None) -> str:
    """The start of a table's header: the model (relative to the repository), what ran, the
    machine, the kernels' build and today's date."""
    name = model_path.relative_to(ROOT) if model_path.is_relative_to(ROOT) else model_path
    return (f"Model `{name}`, {what}; {machine_line(threads)}; {kernel_line()}; "
            f"{datetime.date.today()}")


def bench_parser(doc: str | None):
    """The options every decode benchmark takes: model, rounds, steps, threads, --no-readme."""
    import argparse

    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None,
                    help="threads for every contender (default: the Engine's, every core)")
    ap.add_argument("--no-readme", action="store_true", help="print only")
    return ap


def run_and_record(args, run: Callable[..., str], marker: str, title: str) -> None:
    """The decode benchmarks' ending: ``run(model, rounds, steps, threads)`` offline, its table
    printed and (unless ``--no-readme``) put between ``marker``'s comments of the README."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    table = run(Path(os.path.abspath(args.model)), args.rounds, args.steps, args.threads)
    print(table)
    if not args.no_readme:
        update_readme(marker, title, table)


def median_ms(xs: Sequence[float]) -> float:
    return statistics.median(xs) * 1e3


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """The median of ``a[i] / b[i]``: two contenders timed in the same rounds. The host's drift
    between rounds moves it much less than it moves the ratio of the two medians."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def read_bandwidth(gib: float = 1.0, repeats: int = 9) -> float:
    """Bytes per second of a read-only pass (``x.sum()``) over ``gib`` GiB of float32."""
    rp = ReadPass(gib)
    return rp.bandwidth(rp.times(repeats))


class ReadPass:
    """The roofline's yardstick, to interleave with what it measures: a machine shared with
    other work reads at 30 GB/s one minute and 55 the next, so one reading at the start of a run
    can put the roofline far from the rounds it judges. ``times()`` is a job for
    ``interleave``: seconds of ``repeats`` read-only passes (``x.sum()``) over ``gib`` GiB."""

    def __init__(self, gib: float = 1.0):
        self.x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
        self.x.sum()  # touch every page once

    def times(self, repeats: int = 3) -> list[float]:
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.x.sum()
            out.append(time.perf_counter() - t0)
        return out

    def bandwidth(self, times: list[float]) -> float:
        """Bytes per second at the median of ``times``."""
        return self.x.numel() * 4 / statistics.median(times)


def c_compiler(who: str, cxx: bool = False) -> str:
    """The system's C compiler (``cxx``: its C++ compiler), for a benchmark (``who``) that builds
    a small program of its own."""
    import shutil

    names = ("g++", "c++", "clang++") if cxx else ("cc", "gcc", "clang")
    found = next((p for p in map(shutil.which, names) if p), None)
    if found is None:
        raise SystemExit(f"{who} needs a {'C++' if cxx else 'C'} compiler ({', '.join(names)}) "
                         "on PATH: install one (apt install g++), as the kernels of chapter 07 "
                         "need one too")
    return found


def weight_bytes(model_path: str | Path) -> int:
    """Bytes of every distinct weight in the checkpoint (tied embeddings counted once)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                if k == "lm_head.weight":
                    continue  # tied checkpoints omit it; untied ones are counted below
                sl = h.get_slice(k)
                n = 1
                for d in sl.get_shape():
                    n *= d
                total += n * 4  # float32
            if "lm_head.weight" in h.keys():  # noqa: SIM118
                shape = h.get_slice("lm_head.weight").get_shape()
                total += shape[0] * shape[1] * 4
    return total


def update_readme(marker: str, title: str, table: str) -> None:
    """Put ``table`` between the ``<!-- MARKER:BEGIN -->`` / ``END`` comments of
    benchmarks/README.md (a new section headed ``title`` when the markers are not there yet)."""
    import re

    readme = ROOT / "benchmarks" / "README.md"
    text = readme.read_text() if readme.exists() else ""
    begin, end = f"<!-- {marker}:BEGIN -->", f"<!-- {marker}:END -->"
    block = f"{begin}\n{table}\n{end}"
    if begin in text:
        text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, text,
                      flags=re.DOTALL)
    else:
        text += f"\n## {title}\n\n{block}\n"
    readme.write_text(text)


# ----------------------------------------------------------------------------- minisgl
def run_step(engine, reqs, phase: str) -> list[int]:
    """The milestone's step(): the batch's fields filled on the CPU (padding requests included,
    when CUDA graphs pad the batch), metadata, forward + sample, each token appended to its
    request. Returns the real requests' next tokens."""
    from minisgl.core import Batch

    batch = Batch(reqs=reqs, phase=phase)
    engine.graph_runner.pad_batch(batch)
    pr = batch.padded_reqs
    batch.positions = torch.cat([torch.arange(r.cached_len, r.device_len) for r in pr]).int()
    batch.input_ids = torch.cat([r.input_ids[r.cached_len: r.device_len] for r in pr])
    batch.out_loc = torch.cat([engine.page_table[r.table_idx, r.cached_len: r.device_len]
                               for r in pr])
    engine.attn_backend.prepare_metadata(batch)
    out = engine.forward_batch(batch, engine.sampler.prepare(batch))
    for i, r in enumerate(reqs):
        r.append_host(out.next_tokens_cpu[i: i + 1])
    return out.next_tokens_cpu.tolist()


def batch_prompts(n: int) -> list[str]:
    """``n`` prompts for a decode batch: ``PROMPTS`` over and over."""
    return [PROMPTS[i % len(PROMPTS)] for i in range(n)]


class MinisglRunner:
    """Drive an Engine by hand, exactly as the milestone's step() does."""

    def __init__(self, engine, tokenizer, max_len: int = 256) -> None:
        self.engine, self.tok, self.max_len = engine, tokenizer, max_len

    def make_reqs(self, prompts: Sequence[str], n: int):
        from minisgl.core import Req, SamplingParams

        reqs = []
        for row, p in enumerate(prompts):
            lo = row * self.max_len
            self.engine.page_table[row, : self.max_len] = torch.arange(lo, lo + self.max_len)
            ids = torch.tensor(self.tok(p).input_ids, dtype=torch.int32)
            reqs.append(Req(input_ids=ids, table_idx=row, cached_len=0, output_len=n, uid=row,
                            sampling_params=SamplingParams(max_tokens=n), cache_handle=None))
        return reqs

    def step(self, reqs, phase: str) -> list[int]:
        return run_step(self.engine, reqs, phase)

    def greedy_tokens(self, prompts: Sequence[str], n: int) -> list[list[int]]:
        """Each of ``n`` decode steps' tokens for ``prompts``, after their prefill: what two
        configurations of one Engine must agree on."""
        reqs = self.make_reqs(prompts, n + 1)
        self.step(reqs, "prefill")
        return [self.step(reqs, "decode") for _ in range(n)]

    def tune_prefetch(self, batch_size: int, limit: int = 64) -> None:
        """Decode steps until the kernels' 2-7-row loop has chosen its prefetch (hint and
        distance) for ``batch_size`` rows (``linear.h`` part 5 tunes it in the first steps of
        each row count: 8 candidates, two rounds of them for SmolLM2-135M), at most ``limit``
        steps; none where this Engine does not run that loop. Timed steps then all run with one
        choice."""
        from minisgl import kernel

        mod = kernel._MODULE
        if (mod is None or not hasattr(mod, "prefetch_tuning") or not 2 <= batch_size <= 7
                or not getattr(self.engine.config, "cpu_kernels", False)):
            return  # no kernels, a build without tuning, no such loop, or the torch path
        if mod.prefetch_ahead(batch_size) >= 0:
            return
        reqs = self.make_reqs(batch_prompts(batch_size), limit + 1)
        self.step(reqs, "prefill")
        for _ in range(limit):
            self.step(reqs, "decode")
            if mod.prefetch_ahead(batch_size) >= 0:
                return
        raise RuntimeError(f"the kernels' prefetch for {batch_size} rows was still "
                           f"tuning after {limit} decode steps: does a step call `linear` "
                           f"with {batch_size} rows for every weight?")

    def decode_times(self, batch_size: int, steps: int = 32, warmup: int = 4) -> list[float]:
        """Per-step seconds of ``steps`` decode steps of ``batch_size`` requests (after the
        kernels' prefetch for this batch size is tuned: ``tune_prefetch``)."""
        self.tune_prefetch(batch_size)
        reqs = self.make_reqs(batch_prompts(batch_size), steps + warmup + 1)
        self.step(reqs, "prefill")
        times = []
        for i in range(steps + warmup):
            t0 = time.perf_counter()
            self.step(reqs, "decode")
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        return times


# ----------------------------------------------------------------------------- HF transformers
def hf_decode_times(model, tokenizer, prompt: str, steps: int = 32,
                    warmup: int = 4) -> list[float]:
    """Per-token seconds of HF decode forwards with its own KV cache (greedy feedback)."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    times = []
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        for i in range(steps + warmup):
            t0 = time.perf_counter()
            out = model(nxt, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    return times


def hf_generate_tokens_per_s(model, tokenizer, prompts: Sequence[str], n: int = 16,
                             repeats: int = 3) -> float:
    """Throughput of HF ``generate`` on all prompts at once (left padding), greedy, n tokens."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    enc = tokenizer(list(prompts), return_tensors="pt", padding=True)
    best = []
    with torch.no_grad():
        model.generate(**enc, max_new_tokens=2, do_sample=False)  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            best.append(time.perf_counter() - t0)
    return len(prompts) * n / statistics.median(best)


# ----------------------------------------------------------------------------- step 0
def step0_decode_times(model_path: str | Path, tokenizer, prompt: str, steps: int = 32,
                       warmup: int = 4, model=None) -> list[float]:
    from minisgl import step0

    model = model or step0.load_model(model_path)
    ids = tokenizer(prompt).input_ids
    times: list[float] = []

    def on_step(i: int, seconds: float) -> None:
        if i > warmup:  # step 0 is the prefill
            times.append(seconds)

    step0.generate(model, ids, steps + warmup + 1, on_step=on_step)
    return times


def interleave(rounds: int, *jobs: Callable[[], list[float]]) -> list[list[float]]:
    """Run each job ``rounds`` times, alternating between jobs; concatenate each job's samples."""
    out: list[list[float]] = [[] for _ in jobs]
    for _ in range(rounds):
        for i, job in enumerate(jobs):
            out[i].extend(job())
    return out
