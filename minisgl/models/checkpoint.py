# Chapter 03 (03_models_and_weights.ipynb): finding a checkpoint's files and config on disk.
"""The model folder, its ``*.safetensors`` files and its config: local files only, and an error
that says what to do when something is missing. Only safetensors files are read: no pickle, so
loading a checkpoint cannot run code. Every tensor must sit in exactly one file."""

from __future__ import annotations

import copy
import functools
import json
import pathlib
from typing import List


def resolve_model_path(model_path: str | pathlib.Path) -> pathlib.Path:
    """The local model folder, or a clear error (weights never come from a hub here)."""
    path = pathlib.Path(model_path).expanduser()
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"model path {str(path)!r} is a file, not a folder: pass the "
                                 "folder that holds config.json and *.safetensors (e.g. "
                                 "models/SmolLM2-135M-Instruct), not a file inside it.")
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {str(path)!r} does not exist. Run `make models` "
                                "for the workbook's models, or pass the path of a local folder "
                                "holding config.json and *.safetensors.")
    if not (path / "config.json").is_file():
        what = " (config.json there is a folder)" if (path / "config.json").exists() else ""
        raise FileNotFoundError(f"{path} has no config.json{what}: pass the folder of a Hugging "
                                "Face checkpoint (config.json + *.safetensors + tokenizer files).")
    return path


def _corrupt(file: pathlib.Path, why: str) -> RuntimeError:
    return RuntimeError(f"cannot read {file}: {why}. The file is truncated or corrupt: delete the "
                        "model folder and run `make models` again (or re-download it).")


def _tensor_names(file: pathlib.Path) -> List[str]:
    """The tensor names in a safetensors header (8-byte length, then JSON): no tensor data read."""
    try:
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= 100_000_000:
                raise ValueError(f"its header claims {size} bytes")
            header = json.loads(f.read(size))
    except (OSError, ValueError) as e:
        raise _corrupt(file, f"its header is unreadable ({e})") from None
    if not isinstance(header, dict):
        raise _corrupt(file, "its header is not a table of tensors")
    return [k for k in header if k != "__metadata__"]


def check_unique_names(files: List[pathlib.Path]) -> None:
    """Each tensor in one file only: with a name in two shards, the last one read would win."""
    seen: dict[str, pathlib.Path] = {}
    for file in files:
        for key in _tensor_names(file):
            name = key.removeprefix("language_model.")  # the name the loader gives it
            if name in seen:
                raise ValueError(f"checkpoint tensor {name!r} is in two files: "
                                 f"{seen[name].name} and {file.name} (in {file.parent}); a "
                                 "checkpoint holds each tensor once. Remove the stale shard, or "
                                 "re-create the checkpoint with save_pretrained.")
            seen[name] = file


def safetensors_files(path: pathlib.Path) -> List[pathlib.Path]:
    """The checkpoint's ``*.safetensors`` files (checked: each tensor in exactly one of them)."""
    files = sorted(f for f in path.glob("*.safetensors") if f.is_file())
    if len(files) > 1:  # some repos ship a consolidated copy beside the shards
        files = [f for f in files if f.name != "consolidated.safetensors"]
    if not files:
        found = ", ".join(sorted(p.name for p in path.iterdir())[:10])
        raise FileNotFoundError(f"{path} has no *.safetensors file (found: {found}). minisgl "
                                "reads only safetensors (no pickle .bin files): convert the "
                                "checkpoint with transformers' save_pretrained(..., "
                                "safe_serialization=True).")
    if len(files) > 1:
        check_unique_names(files)
    return files


@functools.lru_cache(maxsize=8)
def _load_hf_config(path: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, local_files_only=True)


def load_hf_config(model_path: str | pathlib.Path):
    """The folder's HF config (read from disk, never from a hub), as a fresh copy."""
    return copy.deepcopy(_load_hf_config(str(resolve_model_path(model_path))))
