"""Run a guarded call through ``torch.ops.torchfix.matmul`` where the routing policy
(:mod:`torchfix.guards.routing`) says so: the call written with the kernel, the
fallback when a kernel fails, and the warnings that say so once per device type.

>>> import torch
>>> from torchfix.guards.ops import spec
>>> x, w = torch.randn(2, 3, dtype=torch.bfloat16), torch.randn(4, 3, dtype=torch.float16)
>>> express(spec("F.linear"), (x, w), {}, torch.bfloat16).shape
torch.Size([2, 4])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

import torch

from .. import _frames, _warn
from .. import kernels as kernels_mod
from .._text import dtype_name
from ..config import Settings
from ..guards import routing
from ..guards.ops import OpSpec
from ..guards.plan import Action, Finding
from .apply import apply
from .binding import Bound
from .record import record

__all__ = ["NOT_ROUTED", "KernelFailure", "constant", "express", "failed", "try_kernel"]

NOT_ROUTED: Any = object()
"""Returned when a call is not routed, or its arguments have no kernel form (``out=``, wrong ranks): the caller falls back."""

_F = TypeVar("_F", bound=Callable[..., Any])


def constant(fn: _F) -> _F:
    """Mark ``fn`` as constant in its arguments for torch.compile: dynamo calls it once at
    trace time instead of tracing it (what ``torch._dynamo.assume_constant_result`` does,
    without importing dynamo when torchfix is imported)."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


# --- the call, written with the kernel ---------------------------------------------------


def _named(spec: OpSpec, args: tuple, kwargs: dict) -> dict[str, Any]:
    named = dict(zip(spec.params, args))
    named.update({k: v for k, v in kwargs.items() if k in spec.params})
    return named


def _times(t: torch.Tensor, factor: Any) -> torch.Tensor:
    """``t * factor``, skipping the multiply for a factor of 1 (``alpha=`` / ``beta=``)."""
    return t if factor == 1 else t * factor


def express(spec: OpSpec, args: tuple, kwargs: dict, out_dtype: torch.dtype) -> Any:
    """Compute ``spec``'s call with the kernel, or return :data:`NOT_ROUTED`."""
    mm = torch.ops.torchfix.matmul
    extra = set(kwargs) - set(spec.params)
    if "out" in extra or len(args) > len(spec.params):
        return NOT_ROUTED
    a = _named(spec, args, kwargs)
    p = spec.params
    if spec.kind == "linear":
        x, w, bias = a.get("input"), a.get("weight"), a.get("bias")
        if x is None or w is None or w.dim() != 2 or x.dim() < 1:
            return NOT_ROUTED
        y = mm(x, w.t(), out_dtype=out_dtype)
        return y if bias is None else y + bias.to(out_dtype)
    if spec.family == "matmul":
        lhs, rhs = a.get(p[0]), a.get(p[1])
        if spec.name == "Tensor.__rmatmul__":
            lhs, rhs = rhs, lhs
        return mm(lhs, rhs, out_dtype=out_dtype)
    rank = 2 if spec.family == "mm" else 3
    if len(p) == 2:
        lhs, rhs = a.get(p[0]), a.get(p[1])
        if lhs.dim() != rank or rhs.dim() != rank or (rank == 3 and lhs.shape[0] != rhs.shape[0]):
            return NOT_ROUTED  # let torch raise its own shape error
        return mm(lhs, rhs, out_dtype=out_dtype)
    # addmm / baddbmm: beta * input + alpha * (m1 @ m2); beta=0 ignores input (even NaN), as torch does
    inp, lhs, rhs = a.get(p[0]), a.get(p[1]), a.get(p[2])
    if lhs.dim() != rank or rhs.dim() != rank or (rank == 3 and lhs.shape[0] != rhs.shape[0]):
        return NOT_ROUTED
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    prod = _times(mm(lhs, rhs, out_dtype=out_dtype), alpha)
    if beta == 0:
        return prod
    return prod + _times(inp.to(out_dtype), beta)


# --- routing ----------------------------------------------------------------------------

failed: dict[str, str] = {}  # device type -> why its kernel is off for this process


@constant
def _allowed(kernels: bool | None, device_type: str) -> bool:
    return kernels if kernels is not None else kernels_mod.verified(device_type)


@constant
def _available(device_type: str) -> bool:
    return kernels_mod.available_for(device_type)


def _warn_missing(device_type: str) -> None:
    triton = "Triton is not installed (pip install 'torchfix-diffusion[triton]')"
    what = triton if device_type == "cuda" else "the Metal kernel is unavailable"
    text = f"torchfix: {what}; mixed-dtype and strided matmuls on {device_type} are cast/copied instead of read in place."
    _warn.once(("kernel-missing", device_type), text, stacklevel=4)


def kernel_failed(device_type: str, exc: BaseException) -> None:
    """The kernel raised on a call that the cast/copy path then ran: off for this device type, said once."""
    why = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    failed.setdefault(device_type, why)
    text = (
        f"torchfix: the {device_type} kernel torch.ops.torchfix.matmul failed ({why}); the call ran on the cast/copy path, "
        f"and so will every {device_type} call from now on. Please report this with `torchfix doctor`'s output."
    )
    _warn.once(("kernel-failed", device_type), text, stacklevel=4)


class KernelFailure(NamedTuple):
    """Returned (never raised) by :func:`try_kernel`: the kernel raised this error."""

    device_type: str
    exc: BaseException


def try_kernel(
    spec: OpSpec, settings: Settings, findings: list[Finding], bound: Bound, chain: list[torch.nn.Module] | None, compiling: bool
) -> Any:
    """Run the call through torch.ops.torchfix.matmul when the routing policy says so;
    :data:`NOT_ROUTED` otherwise. Eager kernel errors come back as :class:`KernelFailure`
    for the caller to fall back on."""
    # plain loops, not next(genexpr, None): torch 2.8's dynamo cannot trace the two-argument next() (a graph break)
    moves = casts = None
    for f in findings:
        if f.guard == "device" and moves is None:
            moves = f
        elif f.guard == "dtype" and casts is None:
            casts = f
    device_type = moves.actions[0].to.type if moves is not None else next(iter(bound.tensors.values())).device.type
    allowed = _allowed(settings.kernels, device_type) and device_type not in failed
    decision = routing.decide(spec.kind, device_type, findings, enabled=allowed, available=_available(device_type))
    if decision.missing and not compiling:
        _warn_missing(device_type)
    if not decision.route:
        return NOT_ROUTED
    before = dict(bound.tensors)
    if moves is not None:
        for action in moves.actions:
            apply(bound, action)
    if casts is not None:
        out_dtype = casts.actions[0].to
    else:
        out_dtype = next(t.dtype for t in bound.tensors.values() if t.is_floating_point())
    if compiling:
        return express(spec, tuple(bound.args), bound.kwargs, out_dtype)
    try:
        result = express(spec, tuple(bound.args), bound.kwargs, out_dtype)
    except Exception as exc:  # a kernel never fails a call: the caller falls back, and re-raises torch's own error if any
        return KernelFailure(device_type, exc)
    if result is NOT_ROUTED:
        return result
    if chain is None:
        chain = _frames.module_chain(2)
    site, module = _frames.call_site(2), _frames.module_path(chain)
    for f in findings:
        if f.guard == "device":
            record(spec, settings, f, before, site, module)
            continue
        reads = ", ".join(f"{n} {dtype_name(t.dtype)}{'' if t.is_contiguous() else ' (strided)'}" for n, t in before.items())
        kernel = Finding(f.guard, f.problem, f.fix, (Action(f.guard, "kernel", "", out_dtype),), f.torch_raises, f.note)
        record(
            spec, settings, kernel, before, site, module, f"torch.ops.torchfix.matmul reads {reads} in place, out {dtype_name(out_dtype)}"
        )
    return result
