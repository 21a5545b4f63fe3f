# Chapter 03 (03_models_and_weights.ipynb): streaming weight loading with merging and sharding.
"""Stream a checkpoint tensor by tensor: shard each for this rank, merge q/k/v into ``qkv_proj``
and gate/up into ``gate_up_proj`` (in that order), and yield ``(name, tensor)`` one at a time;
only the parts of a fused projection still waiting for their siblings are held back."""

from __future__ import annotations

import pathlib
from typing import Dict, Iterator, Tuple

import torch
from safetensors import SafetensorError, safe_open

from minisgl.distributed import DistributedInfo, get_tp_info
from minisgl.utils import div_ceil

from .checkpoint import load_hf_config, resolve_model_path, safetensors_files
from .config import ModelConfig

# fused name -> the parts it is made of, in order
_MERGES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_PART_TO_FUSED = {part: (fused, i) for fused, parts in _MERGES.items()
                  for i, part in enumerate(parts)}
_COLUMN_SPLIT = (".q_proj", ".k_proj", ".v_proj", ".gate_proj", ".up_proj")
_ROW_SPLIT = (".o_proj", ".down_proj")
_SKIP_PREFIXES = ("vision_tower.", "multi_modal_projector.")


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
                # BEGIN SOLUTION 3.4: shard, then yield it or buffer the parts of a fused tensor
                tensor = _shard(name, tensor, config, tp)
                fused = _fused_name(name)
                if fused is None:
                    yield name, tensor
                    continue
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
