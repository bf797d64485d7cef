"""Carry out one :class:`~torchfix.guards.plan.Action` on a bound call: cast, move or copy an operand."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..guards.plan import Action, Finding
from .binding import Bound

__all__ = ["apply", "reuse_cast", "stride_post"]

# pytest leaves out of a failure's traceback every frame whose globals hold this (as it does its own
# helpers): a strict-mode failure shows the user's call and torchfix's error, not torchfix's internals.
__tracebackhide__ = True


class _Cast(NamedTuple):
    dtype: torch.dtype
    version: int | None  # the source's version then (None: an inference tensor, which has none)
    cast: torch.Tensor | None
    cast_version: int | None
    outer: weakref.ref  # the outermost module running when the guards decided it


# An activation the guards cast -> how. Layers that meet the same stray tensor again (one
# encoder_hidden_states in every cross-attention) reuse the cast while neither tensor was
# written to since; the cast is also how a repeat is known, so it is reported once. Inference
# tensors have no version counter: they are cast again each time (never a stale cast), and
# reported once.
_CASTS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # aten._to_copy, not Tensor.to: the same result, and in an exported graph it marks
    # the casts torchfix inserted apart from the model's own .to() calls (torchfix.audit reads that).
    return torch.ops.aten._to_copy.default(t, dtype=dtype)


def _memoizable(t: torch.Tensor) -> bool:
    return not isinstance(t, torch.nn.Parameter) and not t.requires_grad


def _reused(t: torch.Tensor, seen: _Cast | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The memoized cast of ``t`` to ``dtype`` while neither tensor was written to, a fresh
    cast for an inference tensor seen before, else ``None``."""
    if seen is None or seen.dtype != dtype:
        return None
    if seen.cast is not None and seen.version == t._version and seen.cast_version == seen.cast._version:
        return seen.cast
    return _to(t, dtype) if seen.version is None else None


def _cast(t: torch.Tensor, dtype: torch.dtype, outer: torch.nn.Module | None) -> tuple[torch.Tensor, bool]:
    """``t`` cast to ``dtype``, and whether this tensor is cast to it for the first time."""
    if outer is None or not _memoizable(t):
        return _to(t, dtype), True
    seen = _CASTS.get(t)
    reused = _reused(t, seen, dtype)
    if reused is not None:
        return reused, False
    new = _to(t, dtype)
    if t.is_inference():
        _CASTS[t] = _Cast(dtype, None, None, None, weakref.ref(outer))
    else:
        _CASTS[t] = _Cast(dtype, t._version, new, new._version, weakref.ref(outer))
    return new, seen is None or seen.dtype != dtype


def reuse_cast(bound: Bound, outer: torch.nn.Module) -> bool:
    """Where one operand is an activation the guards already cast to ``D`` in this outermost module's
    run, and every other floating operand is already ``D``: use that cast and return ``True`` (the
    decision is the one the model's dtype gave before, without asking again). Else change nothing.
    """
    floats = [(n, t) for n, t in bound.tensors.items() if t.is_floating_point()]
    for name, t in floats:
        seen = _CASTS.get(t) if _memoizable(t) else None
        if seen is None or seen.outer() is not outer or any(o.dtype != seen.dtype for n, o in floats if n != name):
            continue
        cast = _reused(t, seen, seen.dtype)
        if cast is not None:
            bound.replace(name, cast)
            return True
    return False


def apply(bound: Bound, action: Action, outer: torch.nn.Module | None = None) -> bool:
    """Replace ``action.operand`` in ``bound`` with its cast, moved or copied version.

    ``outer`` (eager only: the outermost module running) lets a dtype cast of an activation be
    reused by later layers of that run. Returns ``False`` where such a cast repeats one made
    before: the caller reports it once. Parameters are cast afresh every call.
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
        new, fresh = _cast(t, action.to, outer)
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
