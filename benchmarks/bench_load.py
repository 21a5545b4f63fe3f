"""Chapter 03 benchmark: how much memory and time loading a checkpoint costs.

    .venv/bin/python benchmarks/bench_load.py                      # SmolLM2-135M-Instruct
    .venv/bin/python benchmarks/bench_load.py --model models/tiny-qwen3 --reps 5

Two loaders, each run in a fresh Python process so that none inherits another's memory:

- **minisgl**: build the model on the ``meta`` device, then
  ``model.load_state_dict({n: t for n, t in load_weight(path)})`` (chapter 03's streaming loader;
  an Engine loads the same way with or without chapter 07's kernels: one weight layout);
- **HF**: ``AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)``.

Definitions (what the table reports):

- *load memory*: the peak of the child's ``RssAnon`` (anonymous resident memory, from
  ``/proc/<pid>/status``) while it loads, minus its ``RssAnon`` just before. The parent samples it
  from outside every ~2 ms, so the child's own threads and GIL do not hide a short peak.
  File-backed pages (a memory-mapped ``.safetensors`` file) are not anonymous and do not count:
  they belong to the page cache and the kernel can drop them at any time.
- *weights*: the bytes of every tensor stored in the checkpoint.
- *time*: wall time of the load alone, reading ``config.json`` included (imports — torch,
  transformers, the model code — and interpreter start-up happen before the clock starts, in
  both loaders). The checkpoint is read once before the first run, so every run finds it in the
  page cache.
- *then read every weight once*: not part of the load. HF's tensors still point into the
  memory-mapped file after ``from_pretrained``, so HF pays for reading the file here (as it would
  in its first forward); minisgl already copied most of it while loading.

The two loaders alternate (minisgl, HF, HF, minisgl, ...) for ``--reps`` repetitions; the table
gives medians and ratios. The goal for minisgl is load memory <= 1.15x the weights' bytes and time
<= HF's; it is reported, never asserted. Timings on a shared machine are noisy.
Linux only (``/proc``). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
LOADERS = ("minisgl", "hf")
SAMPLE_EVERY_S = 0.002
GOAL_MEMORY = 1.15


def rss_anon(pid: int | str = "self") -> int:
    """Anonymous resident memory of a process, in bytes (``RssAnon`` in /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon line in /proc/PID/status (needs Linux >= 4.5)")


def weights_bytes(path: pathlib.Path) -> int:
    """Bytes of every tensor in the folder's safetensors files (read from their headers)."""
    from safetensors import safe_open

    total = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                sl = f.get_slice(key)
                n = 1
                for d in sl.get_shape():
                    n *= d
                total += n * _ITEMSIZE[sl.get_dtype()]
    return total


_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


# ----------------------------------------------------------------------------- child process


def child(loader: str, path: str, threads: int | None) -> None:
    """Import everything, say READY, wait for GO, load once, say DONE, wait for EXIT."""
    import torch
    from transformers import AutoConfig  # both loaders read config.json with it: import it first

    if threads:
        torch.set_num_threads(threads)
    config = AutoConfig.from_pretrained(path)  # imports the config classes (not timed, for both)
    if loader == "minisgl":
        import minisgl.utils
        from minisgl.distributed import set_tp_info
        from minisgl.models import ModelConfig, create_model, load_weight
        from minisgl.models.weight import load_hf_config

        set_tp_info(0, 1)

        def load():
            cfg = ModelConfig.from_hf(load_hf_config(path))
            with torch.device("meta"), minisgl.utils.torch_dtype(torch.float32):
                model = create_model(cfg)
            model.load_state_dict({n: t for n, t in load_weight(path)})
            return model
    else:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        AutoModelForCausalLM._model_mapping[type(config)]  # import the modeling module up front

        def load():
            return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    print("READY", flush=True)
    if sys.stdin.readline().strip() != "GO":
        return
    t0 = time.perf_counter()
    model = load()
    seconds = time.perf_counter() - t0
    after = rss_anon()
    print("DONE " + json.dumps({"seconds": seconds, "after": after}), flush=True)
    sys.stdin.readline()  # SAMPLED: the parent has stopped sampling
    # Not part of the load: read every weight once. A loader whose tensors still point into the
    # memory-mapped file pays for reading the file here (as it would in its first forward).
    weights = {t.data_ptr(): t for t in model.state_dict().values()}.values()  # tied: once
    t0 = time.perf_counter()
    with torch.no_grad():
        for t in weights:
            t.sum()
    print("READ " + json.dumps({"seconds": time.perf_counter() - t0}), flush=True)
    sys.stdin.readline()  # EXIT
    del model


# ----------------------------------------------------------------------------- parent process


def run_once(loader: str, path: pathlib.Path, threads: int | None) -> dict:
    """One load in a fresh process; returns seconds, peak anonymous bytes added, bytes kept."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    extra = ["--threads", str(threads)] if threads else []
    proc = subprocess.Popen([sys.executable, __file__, "--child", loader, "--model", str(path),
                             *extra],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                            cwd=ROOT)
    try:
        line = proc.stdout.readline()
        if line.strip() != "READY":
            raise RuntimeError(f"{loader} child did not start (said {line!r}); run it alone: "
                               f"{sys.executable} {__file__} --child {loader} --model {path}")
        base = rss_anon(proc.pid)
        peak = [base]
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                try:
                    peak[0] = max(peak[0], rss_anon(proc.pid))
                except (FileNotFoundError, ProcessLookupError):
                    return
                time.sleep(SAMPLE_EVERY_S)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        proc.stdin.write("GO\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        stop.set()
        sampler.join()
        if not line.startswith("DONE "):
            raise RuntimeError(f"{loader} child failed while loading (said {line!r})")
        result = json.loads(line[5:])
        proc.stdin.write("SAMPLED\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        if not line.startswith("READ "):
            raise RuntimeError(f"{loader} child failed while reading its weights (said {line!r})")
        result["read"] = json.loads(line[5:])["seconds"]
        proc.stdin.write("EXIT\n")
        proc.stdin.flush()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    peak[0] = max(peak[0], result["after"])
    return {"seconds": result["seconds"], "peak": peak[0] - base, "kept": result["after"] - base,
            "read": result["read"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct"))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads in each loader (default: torch's own choice)")
    parser.add_argument("--child", choices=LOADERS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.model, args.threads)
        return 0
    sys.path.insert(0, str(ROOT))
    from benchmarks.measure import cpu_info

    path = pathlib.Path(args.model).resolve()
    if not (path / "config.json").is_file():
        print(f"{path} is missing: run `make models`", file=sys.stderr)
        return 2
    for file in path.glob("*.safetensors"):  # warm the page cache so both loaders find it there
        with open(file, "rb") as f:
            while f.read(1 << 24):
                pass
    wbytes = weights_bytes(path)
    runs: dict[str, list[dict]] = {name: [] for name in LOADERS}
    for rep in range(args.reps):
        order = LOADERS if rep % 2 == 0 else LOADERS[::-1]
        for loader in order:
            r = run_once(loader, path, args.threads)
            runs[loader].append(r)
            print(f"rep {rep + 1}/{args.reps} {loader:8s} {r['seconds']:7.3f} s  peak +"
                  f"{r['peak'] / 2**20:7.1f} MiB  kept +{r['kept'] / 2**20:7.1f} MiB  "
                  f"first read {r['read']:6.3f} s",
                  file=sys.stderr, flush=True)

    keys = ("seconds", "peak", "kept", "read")
    med = {name: {k: statistics.median(r[k] for r in rs) for k in keys}
           for name, rs in runs.items()}
    h = med["hf"]
    cpu, isa = cpu_info()
    print(f"\nLoading `{path.name}` (weights: {wbytes / 2**20:.1f} MiB float32), medians of "
          f"{args.reps} runs per loader, each in a fresh process, interleaved; {cpu} ({isa}), "
          f"{os.cpu_count()} CPUs, torch threads {args.threads or 'default'}.\n")
    print("| loader | load time (s) | peak load memory (MiB) | memory / weights | "
          "anon memory kept (MiB) | then read every weight once (s) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, label in (("minisgl", "minisgl: meta + load_weight + load_state_dict"),
                        ("hf", "HF from_pretrained(dtype=float32)")):
        r = med[name]
        print(f"| {label} | {r['seconds']:.3f} | {r['peak'] / 2**20:.1f} | "
              f"{r['peak'] / wbytes:.2f}x | {r['kept'] / 2**20:.1f} | {r['read']:.3f} |")
    for name in ("minisgl",):
        r = med[name]
        print(f"| **{name} / HF** | {r['seconds'] / h['seconds']:.2f}x | "
              f"{r['peak'] / max(h['peak'], 1):.2f}x | | | |")
    for name in ("minisgl",):
        r = med[name]
        mem_ok = r["peak"] <= GOAL_MEMORY * wbytes
        time_ok = r["seconds"] <= h["seconds"]
        print(f"\nGoal, {name}: load memory <= {GOAL_MEMORY}x weights: "
              f"{'met' if mem_ok else 'MISSED'} ({r['peak'] / wbytes:.2f}x); time <= HF's: "
              f"{'met' if time_ok else 'MISSED'} ({r['seconds']:.3f} s vs {h['seconds']:.3f} s).")
    print("Timings on a shared machine are noisy.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
