"""The dtype guard: what to do when floating dtypes meet in one op.

Pure: it sees dtypes, never tensors, and patches nothing.

Rules (``dtype=None``, "auto"):
- ``linear``/``conv``/``norm``: the activations win; weight and bias are cast
  to the input's dtype for the call. A module kept in another precision on
  purpose (``keep=True``) wins instead: its input is cast to the weight's dtype.
  Norms accept low-precision input with float32 parameters natively; that is
  left alone.
- ``attention``: the query wins.
- ``matmul`` family and ``cat``: an active autocast dtype, else the configured
  ``dtype``, else ``torch.promote_types`` over the operands.
- Under autocast, linear/conv/norm/attention are left to autocast (casting first
  could round twice); the matmul family and ``cat`` go to autocast's dtype.

>>> import torch
>>> from torchfix.guards.plan import Operand
>>> cpu = torch.device("cpu")
>>> f = decide("linear", [Operand("input", torch.bfloat16, cpu), Operand("weight", torch.float16, cpu)])
>>> [(a.operand, a.to) for a in f.actions]
[('weight', torch.bfloat16)]
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import reduce

import torch

from .ops import PARAM_ROLES
from .plan import Action, Finding, Operand

__all__ = ["decide", "kept_in_fp32", "torch_accepts"]

_LOW = (torch.float16, torch.bfloat16)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_accepts(kind: str, operands: Sequence[Operand]) -> bool:
    """Whether plain torch runs this mix of floating dtypes without raising."""
    floats = [o for o in operands if o.dtype.is_floating_point]
    if len({o.dtype for o in floats}) <= 1:
        return True
    if kind == "cat":
        return True  # it promotes, silently
    if kind == "norm":
        inputs = [o for o in floats if o.role == "input"]
        params = [o for o in floats if o.role in PARAM_ROLES]
        return bool(inputs) and inputs[0].dtype in _LOW and all(p.dtype == torch.float32 for p in params)
    if kind == "attention":
        # A boolean mask is fine; a float mask must match the query like key and value.
        return len({o.dtype for o in floats}) <= 1
    return False


def kept_in_fp32(model: object, path: str) -> bool:
    """Whether the submodule at dotted ``path`` of ``model`` is listed in the model's
    ``_keep_in_fp32_modules`` (the diffusers/transformers rule: a listed name is one
    component of the path).

    >>> class M: _keep_in_fp32_modules = ["proj"]
    >>> kept_in_fp32(M(), "encoder.proj"), kept_in_fp32(M(), "encoder.projection")
    (True, False)
    """
    names = getattr(model, "_keep_in_fp32_modules", None) or ()
    parts = path.split(".")
    return any(n in parts for n in names)


def _describe(floats: Sequence[Operand]) -> str:
    by_dtype: dict[torch.dtype, list[str]] = {}
    for o in floats:
        by_dtype.setdefault(o.dtype, []).append(o.name)
    return "; ".join(f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} {_name(dt)}" for dt, names in by_dtype.items())


def _cast_all(floats: Sequence[Operand], target: torch.dtype, action: str = "cast") -> tuple[Action, ...]:
    return tuple(Action("dtype", action, o.name, target) for o in floats if o.dtype != target)


def decide(
    kind: str,
    operands: Sequence[Operand],
    *,
    policy_dtype: torch.dtype | None = None,
    autocast_dtype: torch.dtype | None = None,
    keep: bool = False,
) -> Finding | None:
    """The dtype finding for one call, or ``None`` when there is nothing to fix.

    Args:
        kind: the op's kind (see :mod:`torchfix.guards.ops`).
        operands: the call's tensor arguments.
        policy_dtype: the ``dtype=`` given to enable/enabled/wrap.
        autocast_dtype: the active autocast dtype for the operands' device type.
        keep: the op belongs to a module kept in its precision on purpose.
    """
    floats = [o for o in operands if o.dtype.is_floating_point]
    if len({o.dtype for o in floats}) <= 1 or (kind in ("norm", "attention") and torch_accepts(kind, operands)):
        return None
    mix = _describe(floats)
    raises = True
    if autocast_dtype is not None and kind not in ("matmul", "cat"):
        return None  # autocast casts these ops itself; casting first could round twice
    if kind in ("matmul", "cat"):
        raises = kind != "cat"
        if autocast_dtype is not None:
            target, why = autocast_dtype, f"the active autocast dtype {_name(autocast_dtype)}"
        elif policy_dtype is not None:
            target, why = policy_dtype, f"the configured dtype {_name(policy_dtype)}"
        else:
            target = reduce(torch.promote_types, (o.dtype for o in floats))
            why = f"torch.promote_types → {_name(target)}"
        action = "promote" if autocast_dtype is None and policy_dtype is None else "cast"
        actions = _cast_all(floats, target, action)
        fix = f"cast the operands to one dtype before the call, or pass dtype= to torchfix (now: {why})"
        note = ""
        if kind == "cat" and action == "promote" and target.itemsize > min(o.dtype.itemsize for o in floats):
            note = f"torch would silently promote to {_name(target)} (more memory); pass dtype= to choose"
        return Finding("dtype", f"mixed floating dtypes: {mix}", fix, actions, raises, note)
    if kind == "attention":
        query = next((o for o in floats if o.role == "query"), floats[0])
        actions = _cast_all(floats, query.dtype)
        return Finding("dtype", f"mixed floating dtypes: {mix}", f"make key/value/mask {_name(query.dtype)} like the query", actions, True)
    # linear, conv, norm: parameters against activations
    inp = next((o for o in floats if o.role == "input"), None)
    weight = next((o for o in floats if o.role == "weight"), None)
    if inp is None:
        return Finding("dtype", f"mixed floating dtypes: {mix}", "give weight and bias one dtype", (), True)
    if keep and weight is not None:
        target = weight.dtype
        actions = _cast_all(floats, target, "upcast" if target.itemsize > inp.dtype.itemsize else "cast")
        fix = f"this module is kept in {_name(target)} on purpose; its input is cast to {_name(target)}"
        return Finding("dtype", f"mixed floating dtypes: {mix}", fix, actions, True)
    target = inp.dtype
    actions = _cast_all(floats, target)
    params = ", ".join(a.operand for a in actions)
    fix = f"cast the module once with module.to(torch.{_name(target)}) (or use torchfix.wrap(pipe), which does it up front)"
    note = f"per-call cast of {params}: costs a copy every call until the module is cast once"
    return Finding("dtype", f"mixed floating dtypes: {mix}", fix, actions, True, note)
