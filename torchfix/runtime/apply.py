"""Carry out one :class:`~torchfix.guards.plan.Action` on a bound call: cast, move or copy an operand."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..guards.plan import Action, Finding
from .binding import Bound

__all__ = ["apply", "stride_post"]


def apply(bound: Bound, action: Action) -> None:
    """Replace ``action.operand`` in ``bound`` with its cast, moved or copied version."""
    t = bound.tensors[action.operand]
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
        # aten._to_copy, not Tensor.to: the same result, and in an exported graph it marks
        # the casts torchfix inserted apart from the model's own .to() calls (torchfix.audit reads that).
        new = torch.ops.aten._to_copy.default(t, dtype=action.to)
    else:  # move to a device
        new = t.to(action.to)
    bound.replace(action.operand, new)


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
