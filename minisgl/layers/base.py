# Chapter 02 (02_op_layer.ipynb): BaseOP, StateLessOP and OPList.
"""Ops are plain objects whose tensor attributes are their weights.

The state-dict key of a weight is its attribute path (``layers.0.mlp.down_proj.weight``), so
naming attributes like Hugging Face's modules makes checkpoint keys line up with no mapping
table. ``load_state_dict`` swaps each placeholder (usually a ``meta`` tensor) for the
checkpoint's tensor after checking shape and dtype.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Dict, Generic, Iterable, List, TypeVar

import torch

StateDict = Dict[str, torch.Tensor]


def _concat_prefix(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _short_list(keys: Iterable[str], limit: int = 8) -> str:
    keys = sorted(keys)
    more = f" ... and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


class BaseOP(ABC):
    @abstractmethod
    def forward(self, *args: Any, **kwargs: Any) -> Any: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def state_dict(self, *, prefix: str = "", result: StateDict | None = None) -> StateDict:
        """Every weight of this op and its children, keyed by attribute path."""
        result = {} if result is None else result
        # BEGIN SOLUTION 2.1: walk self.__dict__; tensors become keys, BaseOPs recurse
        for name, value in self.__dict__.items():
            if name.startswith("_"):
                continue
            key = _concat_prefix(prefix, name)
            if isinstance(value, torch.Tensor):
                result[key] = value
            elif isinstance(value, BaseOP):
                value.state_dict(prefix=key, result=result)
        # END SOLUTION
        return result

    def load_state_dict(self, state_dict: StateDict, *, prefix: str = "",
                        _internal: bool = False) -> None:
        """Swap in the checkpoint's tensors. Pops the keys it uses from ``state_dict``.

        Raises KeyError naming missing keys, ValueError naming a tensor whose shape or dtype
        differs from the layer's, and RuntimeError naming keys the model does not have.
        """
        if not _internal:
            missing = set(self.state_dict(prefix=prefix)) - set(state_dict)
            if missing:
                raise KeyError(f"the checkpoint lacks {len(missing)} weight(s) this model needs: "
                               f"{_short_list(missing)}. Is the checkpoint for this architecture "
                               "and config (layers, bias, q/k norm)?")
        for name, value in self.__dict__.items():
            if name.startswith("_"):
                continue
            key = _concat_prefix(prefix, name)
            if isinstance(value, torch.Tensor):
                # BEGIN SOLUTION 2.2: pop the tensor, check shape and dtype, then swap it in
                tensor = state_dict.pop(key)
                if tensor.shape != value.shape or tensor.dtype != value.dtype:
                    raise ValueError(
                        f"{key}: the checkpoint tensor is {tuple(tensor.shape)} {tensor.dtype} but "
                        f"the layer expects {tuple(value.shape)} {value.dtype}. Check the model "
                        "config (sizes, tensor-parallel size) and convert weights to the "
                        "engine's dtype before loading.")
                setattr(self, name, tensor)
                # END SOLUTION
            elif isinstance(value, BaseOP):
                value.load_state_dict(state_dict, prefix=key, _internal=True)
        if not _internal and state_dict:
            raise RuntimeError(f"unexpected keys in the checkpoint (the model has no such "
                               f"weights): {_short_list(state_dict)}. Drop them before loading, "
                               "or check that the architecture matches.")


class StateLessOP(BaseOP):
    """An op that owns no weights (rotary embedding, attention)."""

    def state_dict(self, *, prefix: str = "", result: StateDict | None = None) -> StateDict:
        return {} if result is None else result

    def load_state_dict(self, state_dict: StateDict, *, prefix: str = "",
                        _internal: bool = False) -> None:
        if not _internal and state_dict:
            raise RuntimeError(f"unexpected keys for a weightless op: {_short_list(state_dict)}")


T = TypeVar("T", bound=BaseOP)


class OPList(BaseOP, Generic[T]):
    """A list of ops whose keys are ``prefix.<index>.<...>`` (like HF's ``model.layers.0``)."""

    def __init__(self, ops: List[T]) -> None:
        self.op_list = ops  # a list: the walk skips it ...
        for i, op in enumerate(ops):
            setattr(self, str(i), op)  # ... and finds each op under its index instead

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("OPList has no forward of its own: loop over .op_list")
