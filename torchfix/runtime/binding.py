"""A guarded call's arguments by parameter name: read, replaced, rebuilt as (args, kwargs)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..config import Settings
from ..guards.ops import OpSpec

__all__ = ["Bound", "autocast_dtype", "requested_dtype", "take_out", "with_out"]


class Bound:
    """A call's arguments by parameter name, editable, rebuildable as (args, kwargs)."""

    __slots__ = ("args", "kwargs", "spec", "tensors")

    def __init__(self, spec: OpSpec, args: tuple, kwargs: dict) -> None:
        self.spec = spec
        self.args = list(args)
        self.kwargs = dict(kwargs)
        self.tensors: dict[str, torch.Tensor] = {}
        for pos, name in zip(spec.tensor_positions, spec.tensors):
            value = self.args[pos] if pos < len(self.args) else self.kwargs.get(name)
            if spec.sequence:
                if isinstance(value, (list, tuple)):
                    for i, t in enumerate(value):
                        if isinstance(t, torch.Tensor):
                            self.tensors[f"{name}[{i}]"] = t
            elif isinstance(value, torch.Tensor):
                self.tensors[name] = value

    def replace(self, name: str, tensor: torch.Tensor) -> None:
        base, _, index = name.partition("[")
        pos = self.spec.params.index(base)
        in_args = pos < len(self.args)
        current = self.args[pos] if in_args else self.kwargs[base]
        if index:
            seq = list(current)
            seq[int(index[:-1])] = tensor
            new: Any = type(current)(seq) if isinstance(current, tuple) else seq
        else:
            new = tensor
        if in_args:
            self.args[pos] = new
        else:
            self.kwargs[base] = new
        self.tensors[name] = tensor


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The active autocast dtype for ``device_type``, or ``None``."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except (RuntimeError, TypeError, AttributeError):  # device types without autocast: no autocast to read
        return None
    return None


def requested_dtype(spec: OpSpec, settings: Settings, kwargs: Mapping[str, Any]) -> torch.dtype | None:
    """The dtype the caller asked for: a matmul's ``out=`` tensor fixes the result's dtype, else ``dtype=``."""
    out = kwargs.get("out") if spec.kind == "matmul" else None
    if isinstance(out, torch.Tensor) and out.is_floating_point():
        return out.dtype
    return settings.dtype


def with_out(tensors: Mapping[str, torch.Tensor], kwargs: Mapping[str, Any]) -> Mapping[str, torch.Tensor]:
    """The operands, plus an ``out=`` tensor when one is given (known-issue rows can name it)."""
    out = kwargs.get("out")
    return {**tensors, "out": out} if isinstance(out, torch.Tensor) else tensors


def take_out(bound: Bound) -> Callable[[Any], Any]:
    """Run without the caller's ``out=`` and copy the result into it (a strided ``out=`` row)."""
    out = bound.kwargs.pop("out")
    bound.tensors.pop("out", None)
    return lambda result: out.copy_(result)
