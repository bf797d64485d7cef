"""Carry out one :class:`~torchfix.guards.plan.Action` on a bound call: cast, move or copy an operand."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..guards.plan import Action, Finding
from .binding import Bound

__all__ = ["apply", "stride_post"]

# An activation the guards cast -> (dtype, its version then, the cast, the cast's version then).
# Layers that meet the same stray tensor again (one encoder_hidden_states in every cross-attention)
# reuse the cast while neither tensor was written to since; the cast is also how a repeat is
# known, so it is reported once. Inference tensors have no version counter: they are cast again
# each time (never a stale cast), and reported once.
_CASTS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _cast(t: torch.Tensor, dtype: torch.dtype, memo: bool) -> tuple[torch.Tensor, bool]:
    """``t`` cast to ``dtype``, and whether this tensor is cast to it for the first time."""
    # aten._to_copy, not Tensor.to: the same result, and in an exported graph it marks
    # the casts torchfix inserted apart from the model's own .to() calls (torchfix.audit reads that).
    if not memo or isinstance(t, torch.nn.Parameter) or t.requires_grad:
        return torch.ops.aten._to_copy.default(t, dtype=dtype), True
    versioned = not t.is_inference()
    seen = _CASTS.get(t)
    if seen is not None and seen[0] == dtype:
        cast = seen[2]
        if cast is not None and seen[1] == t._version and seen[3] == cast._version:
            return cast, False
        if not versioned:
            return torch.ops.aten._to_copy.default(t, dtype=dtype), False
    new = torch.ops.aten._to_copy.default(t, dtype=dtype)
    _CASTS[t] = (dtype, t._version, new, new._version) if versioned else (dtype, None, None, None)
    return new, seen is None or seen[0] != dtype


def apply(bound: Bound, action: Action, memo: bool = False) -> bool:
    """Replace ``action.operand`` in ``bound`` with its cast, moved or copied version.

    Returns ``False`` where a dtype cast of an activation repeats one made before (``memo``,
    eager only): the caller reports it once. Parameters are cast afresh every call.
    """
    t = bound.tensors[action.operand]
    fresh = True
    kind = action.action
    if action.guard == "stride":
        if kind == "upcast":
            new = t.float()
        elif kind == "cpu":
            new = t.cpu()
        else:  # contiguous; a "kernel" row that could not be routed copies too
            # Fresh memory even where the operand counts as contiguous: a row slice with a
            # storage offset is contiguous, and it is the offset the backend gets wrong.
            new = t.contiguous()
            if new is t:
                new = t.clone(memory_format=torch.contiguous_format)
    elif isinstance(action.to, torch.dtype):  # cast / upcast / promote
        new, fresh = _cast(t, action.to, memo)
    else:  # move to a device
        new = t.to(action.to)
    bound.replace(action.operand, new)
    return fresh


def stride_post(finding: Finding, before: Mapping[str, torch.Tensor]) -> Callable[[Any], Any] | None:
    """What turns the result of a stride workaround back into what the caller expects:
    back to the operands' device (``cpu``) or dtype (``upcast``); ``None`` if nothing."""
    kinds = {a.action for a in finding.actions}
    operands = [t for n, t in before.items() if n != "out"]
    if not operands:
        return None
    if "cpu" in kinds:
        dev = operands[0].device
        return lambda out: out.to(dev) if isinstance(out, torch.Tensor) else out
    floats = [t for t in operands if t.is_floating_point()]
    if "upcast" in kinds and floats:
        dtype = floats[0].dtype
        return lambda out: out.to(dtype) if isinstance(out, torch.Tensor) and out.is_floating_point() else out
    return None
