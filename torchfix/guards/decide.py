"""The guards together: one call's findings from what its operands are and the settings.

Pure: dtypes, devices, ranks and layouts in (an :class:`~torchfix.guards.plan.Operand`
signature), findings out. The device guard answers first; where it moves operands,
the dtype question is asked on the target device. Whether torch accepts a dtype mix
is asked of torch (:mod:`torchfix.guards.accepts`), and of a fix, only the casts torch
needs are kept (an fp32 sdpa mask beside a cast key stays fp32).

>>> import torch
>>> cpu = torch.device("cpu")
>>> sig = (("input", torch.bfloat16, cpu, False, False, 2, True), ("weight", torch.float16, cpu, False, True, 2, True))
>>> [(a.operand, a.to) for f in decide("F.linear", "linear", sig, True, True, "error", None, None, False) for a in f.actions]
[('weight', torch.bfloat16)]
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch

from . import accepts as accepts_guard
from . import device as device_guard
from . import dtype as dtype_guard
from .plan import Finding, Operand

__all__ = ["Signature", "decide"]

# One (name, dtype, device, scalar, param, rank, contiguous) per tensor argument: Operand's fields.
Signature = tuple[tuple[str, torch.dtype, torch.device, bool, bool, int, bool], ...]


def _accepted(op: str, operands: Sequence[Operand], device: torch.device, autocast_dtype: torch.dtype | None) -> bool:
    return accepts_guard.accepts(op, [dataclasses.replace(o, device=device) for o in operands], autocast_dtype)


def _minimal(op: str, operands: list[Operand], finding: Finding, device: torch.device, autocast_dtype: torch.dtype | None) -> Finding:
    """Drop each cast that torch does not need (a float32 sdpa mask beside a cast key stays float32)."""
    kept = list(finding.actions)
    for action in finding.actions:
        trial = [a for a in kept if a is not action]
        to = {a.operand: a.to for a in trial}
        cast = [dataclasses.replace(o, dtype=to.get(o.name, o.dtype)) for o in operands]
        if _accepted(op, cast, device, autocast_dtype):
            kept = trial
    return finding if len(kept) == len(finding.actions) else dataclasses.replace(finding, actions=tuple(kept))


@functools.lru_cache(maxsize=4096)
def decide(
    op: str,
    kind: str,
    signature: Signature,
    device_on: bool,
    dtype_on: bool,
    device_policy: str,
    policy_dtype: torch.dtype | None,
    autocast_dtype: torch.dtype | None,
    keep: bool,
    model_dtype: torch.dtype | None = None,
    model: str = "",
) -> tuple[Finding, ...]:
    """The device and dtype findings for one call (cached per argument tuple).

    Args:
        op: the guarded callable's display name (``F.linear``).
        kind: its dtype rule (:attr:`torchfix.guards.ops.OpSpec.kind`).
        signature: one :class:`Operand`'s fields per tensor argument.
        device_on, dtype_on: which guards are on.
        device_policy: ``"error"`` or ``"align"``.
        policy_dtype: the dtype the caller asked for (``dtype=``, or a matmul's ``out=``).
        autocast_dtype: the active autocast dtype for the operands' device type.
        keep: the op runs in a module kept in its precision on purpose.
        model_dtype, model: the dtype and name of the model running the call (``None``: a bare call).
    """
    operands = [Operand(*s) for s in signature]
    found = []
    device = next((o.device for o in operands if not o.scalar), operands[0].device)
    if device_on:
        f = device_guard.decide(operands, device_policy)
        if f is not None:
            found.append(f)
            if not f.actions:  # the call stops here: no dtype question to ask
                return tuple(found)
            device = f.actions[0].to  # after the moves every operand shares the target device
            operands = [dataclasses.replace(o, device=device) for o in operands]
    if dtype_on and len({o.dtype for o in operands if o.dtype.is_floating_point}) > 1:
        accepted = _accepted(op, operands, device, autocast_dtype)
        f = dtype_guard.decide(
            kind, operands, accepted=accepted, policy_dtype=policy_dtype, autocast_dtype=autocast_dtype, keep=keep,
            model_dtype=model_dtype, model=model,
        )
        if f is not None:
            if f.actions and f.torch_raises:
                f = _minimal(op, operands, f, device, autocast_dtype)
            found.append(f)
    return tuple(found)
