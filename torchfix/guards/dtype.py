"""The dtype guard: what to do when floating dtypes meet in one op.

Pure: it sees dtypes, never tensors, and patches nothing. Whether torch accepts
the mix is asked of torch itself (:mod:`torchfix.guards.accepts`) and passed in.

The rule (see :mod:`torchfix.guards`): a mix torch accepts is left alone, in
every mode. The one exception the caller asks for is ``dtype=``, which also
decides a silent ``cat`` promotion; without it such a promotion is only
reported (an *advisory* finding). Where torch raises:

- ``linear``/``conv``/``norm``: the activations win; weight and bias are cast
  to the input's dtype for the call. A module kept in another precision on
  purpose (``keep=True``) wins instead: its input is cast to the weight's dtype.
- ``matmul`` family: the configured ``dtype``, else an active autocast dtype,
  else, when some operands are parameters or buffers of a module being run,
  the activations' dtype (a stray fp16 layer never turns the rest of a bf16
  model into fp32), else ``torch.promote_types`` over the operands.
- ``cat`` (which raises only under autocast): the configured ``dtype``, else
  autocast's dtype.
- ``attention``: the query wins.

>>> import torch
>>> from torchfix.guards.plan import Operand
>>> cpu = torch.device("cpu")
>>> f = decide("linear", [Operand("input", torch.bfloat16, cpu), Operand("weight", torch.float16, cpu)], accepted=False)
>>> [(a.operand, a.to) for a in f.actions]
[('weight', torch.bfloat16)]
>>> decide("norm", [Operand("input", torch.bfloat16, cpu), Operand("weight", torch.float32, cpu)], accepted=True) is None
True
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import reduce

import torch

from .._text import dtype_name as _name
from .plan import Action, Finding, Operand

__all__ = ["decide", "kept_in_fp32"]


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
    accepted: bool,
    policy_dtype: torch.dtype | None = None,
    autocast_dtype: torch.dtype | None = None,
    keep: bool = False,
) -> Finding | None:
    """The dtype finding for one call, or ``None`` when there is nothing to fix or report.

    Args:
        kind: the op's kind (see :mod:`torchfix.guards.ops`).
        operands: the call's tensor arguments.
        accepted: plain torch runs this mix of dtypes (:func:`torchfix.guards.accepts.accepts`).
        policy_dtype: the ``dtype=`` given to enable/enabled/wrap.
        autocast_dtype: the active autocast dtype for the operands' device type.
        keep: the op belongs to a module kept in its precision on purpose.
    """
    floats = [o for o in operands if o.dtype.is_floating_point]
    if len({o.dtype for o in floats}) <= 1:
        return None
    mix = f"mixed floating dtypes: {_describe(floats)}"
    if accepted:
        if kind != "cat":
            return None
        if policy_dtype is not None:  # the caller chose the dtype of mixed cats
            fix = f"cast the tensors to one dtype before the call (torchfix casts to the configured dtype {_name(policy_dtype)})"
            return Finding("dtype", mix, fix, _cast_all(floats, policy_dtype), torch_raises=False)
        target = reduce(torch.promote_types, (o.dtype for o in floats))
        narrowest = min(o.dtype.itemsize for o in floats)
        if target.itemsize <= narrowest:
            return None
        note = f"torch promotes the result to {_name(target)}, {target.itemsize // narrowest}× the bytes of the narrowest input"
        fix = "cast the tensors to one dtype before the call, or pass dtype= to torchfix to choose the result's dtype"
        return Finding("dtype", mix, fix, (), torch_raises=False, note=note, advisory=True)
    if kind in ("matmul", "cat"):
        params = [o for o in floats if o.param]
        acts = {o.dtype for o in floats if not o.param}
        if policy_dtype is not None:
            target, why, action = policy_dtype, f"the requested dtype {_name(policy_dtype)} (dtype= or out=)", "cast"
        elif autocast_dtype is not None:
            target, why, action = autocast_dtype, f"the active autocast dtype {_name(autocast_dtype)}", "cast"
        elif kind == "matmul" and params and len(acts) == 1:
            target = next(iter(acts))
            names = ", ".join(o.name for o in params if o.dtype != target)
            fix = f"cast the module that owns {names} once with module.to(torch.{_name(target)}) (or use torchfix.wrap(pipe))"
            note = f"the activations' dtype wins over the parameters'; per-call cast of {names} until the module is cast once"
            return Finding("dtype", mix, fix, _cast_all(floats, target), True, note)
        else:
            target = reduce(torch.promote_types, (o.dtype for o in floats))
            why, action = f"torch.promote_types → {_name(target)}", "promote"
        fix = f"cast the operands to one dtype before the call, or pass dtype= to torchfix (now: {why})"
        return Finding("dtype", mix, fix, _cast_all(floats, target, action), True)
    if kind == "attention":
        query = next((o for o in floats if o.role == "query"), floats[0])
        actions = _cast_all(floats, query.dtype)
        return Finding("dtype", mix, f"make key/value/mask {_name(query.dtype)} like the query", actions, True)
    # linear, conv, norm: parameters against activations
    inp = next((o for o in floats if o.role == "input"), None)
    weight = next((o for o in floats if o.role == "weight"), None)
    if inp is None:
        return Finding("dtype", mix, "give weight and bias one dtype", (), True)
    if keep and weight is not None:
        target = weight.dtype
        actions = _cast_all(floats, target, "upcast" if target.itemsize > inp.dtype.itemsize else "cast")
        fix = f"this module is kept in {_name(target)} on purpose; its input is cast to {_name(target)}"
        return Finding("dtype", mix, fix, actions, True)
    target = inp.dtype
    actions = _cast_all(floats, target)
    params = ", ".join(a.operand for a in actions)
    fix = f"cast the module once with module.to(torch.{_name(target)}) (or use torchfix.wrap(pipe), which does it after the first call)"
    note = f"per-call cast of {params}: costs a copy every call until the module is cast once"
    return Finding("dtype", mix, fix, actions, True, note)
