# Chapter 03 (03_models_and_weights.ipynb): finding a checkpoint's files and config on disk.
"""The model folder, its ``*.safetensors`` files and its config: local files only, and an error
that says what to do when something is missing. Only safetensors files are read: no pickle, so
loading a checkpoint cannot run code."""

from __future__ import annotations

import copy
import functools
import pathlib
from typing import List


def resolve_model_path(model_path: str | pathlib.Path) -> pathlib.Path:
    """The local model folder, or a clear error (weights never come from a hub here)."""
    path = pathlib.Path(model_path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {str(path)!r} does not exist. Run `make models` "
                                "for the workbook's models, or pass the path of a local folder "
                                "holding config.json and *.safetensors.")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: pass the folder of a Hugging Face "
                                "checkpoint (config.json + *.safetensors + tokenizer files).")
    return path


def safetensors_files(path: pathlib.Path) -> List[pathlib.Path]:
    files = sorted(path.glob("*.safetensors"))
    if len(files) > 1:  # some repos ship a consolidated copy beside the shards
        files = [f for f in files if f.name != "consolidated.safetensors"]
    if not files:
        found = ", ".join(sorted(p.name for p in path.iterdir())[:10])
        raise FileNotFoundError(f"{path} has no *.safetensors file (found: {found}). minisgl "
                                "reads only safetensors (no pickle .bin files): convert the "
                                "checkpoint with transformers' save_pretrained(..., "
                                "safe_serialization=True).")
    return files


@functools.lru_cache(maxsize=8)
def _load_hf_config(path: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, local_files_only=True)


def load_hf_config(model_path: str | pathlib.Path):
    """The folder's HF config (read from disk, never from a hub), as a fresh copy."""
    return copy.deepcopy(_load_hf_config(str(resolve_model_path(model_path))))
