"""Small helpers shared by the chapter tests (paths of the prepared models, HF references)."""

from __future__ import annotations

import functools
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMOL = "SmolLM2-135M-Instruct"
TINY_MODELS = ["tiny-llama", "tiny-llama3-rope", "tiny-qwen2", "tiny-qwen3"]


def model_path(name: str) -> pathlib.Path:
    """Path of a prepared model; fails with the command that prepares it when missing."""
    path = ROOT / "models" / name
    if not (path / "config.json").exists():
        pytest.fail(f"{path} is missing: run `make models` (or `python tools/prepare_models.py`)",
                    pytrace=False)
    return path


def copy_checkout(dst: pathlib.Path, models: bool = False) -> pathlib.Path:
    """Copy the files git sees (tracked and untracked, ignored ones left out) to `dst`, times
    kept; with `models`, link the prepared models/ folder (git-ignored) into it."""
    import shutil
    import subprocess

    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                         capture_output=True, check=True, timeout=60).stdout.decode()
    for rel in filter(None, out.split("\0")):
        if (ROOT / rel).is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dst / rel)
    if models:
        (dst / "models").symlink_to(ROOT / "models", target_is_directory=True)
    return dst


@functools.lru_cache(maxsize=None)
def hf_model(name: str):
    """The Hugging Face reference model (float32, eval mode), loaded once per test process."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path(name), dtype=torch.float32).eval()


@functools.lru_cache(maxsize=None)
def tokenizer(name: str = SMOL):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path(name))


def hf_greedy(name: str, prompt_ids: list[int], n: int) -> list[int]:
    """HF's greedy continuation of ``prompt_ids`` (n new tokens)."""
    import torch

    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf_model(name).generate(ids, max_new_tokens=n, do_sample=False,
                                      attention_mask=torch.ones_like(ids))
    return out[0, len(prompt_ids):].tolist()


def require_kernels():
    """Chapter 07's compiled module. Skips only where no C++ compiler exists at all; where one
    exists, a build that fails is a test failure (with the reason), not a skip."""
    import os
    import shutil

    from minisgl import kernel

    module = kernel.load()
    if module is None:
        if not shutil.which(os.environ.get("CXX", "c++")):
            pytest.skip(f"no C++ compiler here: {kernel.unavailable_reason()}")
        pytest.fail(f"the C++ kernels did not build: {kernel.unavailable_reason()}", pytrace=False)
    return module


def run_prepare_models(*argv: str) -> tuple[int, str]:
    """tools/prepare_models.py's command line, run in this process: (exit status, stderr)."""
    import contextlib
    import io
    import sys

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tools import prepare_models

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = prepare_models.main(list(argv))
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


def generated(n: int, suppress=()):
    """Hypothesis settings for ``n`` examples, the same on every run: derandomized, no example
    database, no deadline (a first call may build the kernels or load a model); ``suppress``:
    the health checks a test file knows to be harmless for it."""
    from hypothesis import settings

    return settings(max_examples=n, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(suppress))
