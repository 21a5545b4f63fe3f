# Chapter 03 (03_models_and_weights.ipynb): streaming weight loading with merging and sharding.
"""Read a checkpoint tensor by tensor, shard it for this rank, and merge fused projections.

``load_weight`` is a generator: it opens each ``*.safetensors`` file lazily and yields
``(name, tensor)`` pairs one at a time, so at any moment only one tensor (plus the parts of a
fused projection still waiting for their siblings) is held beyond what the caller keeps.

Two renames happen on the way:
- ``q_proj``, ``k_proj``, ``v_proj`` -> ``qkv_proj`` (concatenated in that order);
- ``gate_proj``, ``up_proj`` -> ``gate_up_proj``.
Only safetensors files are read: no pickle, so loading a checkpoint cannot run code.
"""

from __future__ import annotations

import functools
import pathlib
from typing import Dict, Iterator, List, Tuple

import torch
from safetensors import SafetensorError, safe_open

from minisgl.distributed import DistributedInfo, get_tp_info
from minisgl.utils import div_ceil

from .config import ModelConfig

# fused name -> the parts it is made of, in order
_MERGES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_PART_TO_FUSED = {part: (fused, i) for fused, parts in _MERGES.items()
                  for i, part in enumerate(parts)}
_COLUMN_SPLIT = (".q_proj", ".k_proj", ".v_proj", ".gate_proj", ".up_proj")
_ROW_SPLIT = (".o_proj", ".down_proj")
_SKIP_PREFIXES = ("vision_tower.", "multi_modal_projector.")


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
    import copy

    return copy.deepcopy(_load_hf_config(str(resolve_model_path(model_path))))


def _shard(name: str, t: torch.Tensor, config: ModelConfig, tp: DistributedInfo) -> torch.Tensor:
    """This rank's part of checkpoint tensor ``name`` (the whole tensor when tp.size == 1)."""
    if tp.size == 1:
        return t
    # BEGIN SOLUTION 3.3: column-parallel rows, row-parallel columns, vocab rows
    if any(s in name for s in (".k_proj", ".v_proj")) and config.num_kv_heads < tp.size:
        head = tp.rank * config.num_kv_heads // tp.size  # KV heads replicated over ranks
        return t.view(config.num_kv_heads, config.head_dim, *t.shape[1:])[head].clone()
    if any(s in name for s in _COLUMN_SPLIT):
        return t.chunk(tp.size, dim=0)[tp.rank].clone()
    if any(s in name for s in _ROW_SPLIT) and t.dim() == 2:
        return t.chunk(tp.size, dim=1)[tp.rank].clone()
    if "lm_head" in name or "embed_tokens" in name:
        rows = div_ceil(config.vocab_size, tp.size)
        part = t[tp.rank * rows: (tp.rank + 1) * rows]
        if part.shape[0] < rows:  # the last rank's shard is shorter: pad it with zero rows
            pad = t.new_zeros(rows - part.shape[0], *t.shape[1:])
            part = torch.cat([part, pad])
        return part.clone()
    return t
    # END SOLUTION


def _check_values(key: str, t: torch.Tensor, file: pathlib.Path) -> None:
    """Refuse a tensor the model cannot use: not floating point (an int8 quantized checkpoint, a
    bool mask), or holding NaN or inf (it would turn every logit into NaN)."""
    if not t.dtype.is_floating_point:
        raise TypeError(f"checkpoint tensor {key!r} in {file.name} has dtype {t.dtype}: minisgl "
                        "loads floating-point weights only (no quantized checkpoints); use a "
                        "float32, bfloat16 or float16 checkpoint.")
    if not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"checkpoint tensor {key!r} in {file.name} holds {bad} NaN or inf "
                         "value(s): the checkpoint is damaged; re-create or re-download it.")


def _fused_name(name: str) -> Tuple[str, int] | None:
    """``...self_attn.k_proj.weight`` -> (``...self_attn.qkv_proj.weight``, 1), else None."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in _PART_TO_FUSED:
            fused, slot = _PART_TO_FUSED[part]
            return ".".join(parts[:i] + [fused] + parts[i + 1:]), slot
    return None


def load_weight(model_path: str | pathlib.Path,
                device: torch.device | str = "cpu") -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every weight of the model, sharded for this rank and with
    fused projections merged. Tensors are read one at a time, straight onto ``device``."""
    path = resolve_model_path(model_path)
    config = ModelConfig.from_hf(load_hf_config(path))
    tp = get_tp_info()
    pending: Dict[str, Dict[int, torch.Tensor]] = {}  # fused name -> parts seen so far
    for file in safetensors_files(path):
        try:
            handle = safe_open(str(file), framework="pt", device=str(device))
        except (SafetensorError, OSError, ValueError) as e:
            raise RuntimeError(f"cannot read {file}: {e}. The file is truncated or corrupt: "
                               "delete the model folder and run `make models` again (or "
                               "re-download it).") from e
        with handle as f:
            for key in f.keys():
                if key.startswith(_SKIP_PREFIXES):
                    continue
                name = key.removeprefix("language_model.")
                try:
                    tensor = f.get_tensor(key)
                except (SafetensorError, OSError, RuntimeError) as e:
                    raise RuntimeError(f"cannot read tensor {key!r} from {file}: {e}. The file "
                                       "is truncated or corrupt: re-create it.") from e
                _check_values(key, tensor, file)
                tensor = _shard(name, tensor, config, tp)
                fused = _fused_name(name)
                if fused is None:
                    yield name, tensor
                    continue
                # BEGIN SOLUTION 3.4: buffer the parts; yield the fused tensor once complete
                fused_name, slot = fused
                parts = pending.setdefault(fused_name, {})
                parts[slot] = tensor
                expected = len(_MERGES[fused_name.split(".")[-2]])
                if len(parts) == expected:
                    del pending[fused_name]
                    yield fused_name, torch.cat([parts[i] for i in range(expected)], dim=0)
                # END SOLUTION
    if pending:
        incomplete = {name: sorted(parts) for name, parts in pending.items()}
        raise KeyError(f"checkpoint ends with incomplete fused projections (name -> parts "
                       f"found): {incomplete}; a q/k/v or gate/up tensor is missing.")
