"""Run one guarded call: bind its arguments, ask each guard, then pass, fix
(cast / move / copy) and record, or raise.

This acts on the *arguments* of a call; it never touches torch attributes
(that is :mod:`torchfix.patches`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import torch

from .. import _context, _frames, _kept
from .. import kernels as kernels_mod
from .._report import FixEvent, report
from ..config import Settings
from ..errors import DeviceMismatchError, DtypeMismatchError, LayoutError, TorchfixError, TorchfixWarning
from ..kernels import routing as kernel_routing
from . import accepts as accepts_guard
from . import device as device_guard
from . import dtype as dtype_guard
from . import known_issues as ki
from . import routing
from . import stride as stride_guard
from .messages import action_text, compiled_error_message, error_message
from .ops import OpSpec
from .plan import Action, Finding, Operand

__all__ = ["guarded_call"]

log = logging.getLogger("torchfix")

_ERRORS: dict[str, type[TorchfixError]] = {"dtype": DtypeMismatchError, "device": DeviceMismatchError, "stride": LayoutError}
_PARAM_KINDS = ("linear", "conv", "norm")

_F = TypeVar("_F", bound=Callable[..., Any])


def _constant(fn: _F) -> _F:
    """Mark ``fn`` as constant in its arguments for torch.compile: dynamo calls it once at
    trace time instead of tracing it (what ``torch._dynamo.assume_constant_result`` does,
    without importing dynamo when torchfix is imported)."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


# --- binding -----------------------------------------------------------------------------


class _Bound:
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


def _operands(tensors: Mapping[str, torch.Tensor]) -> list[Operand]:
    return [Operand(n, t.dtype, t.device, t.dim() == 0) for n, t in tensors.items()]


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except (RuntimeError, TypeError, AttributeError):  # device types without autocast
        return None
    return None


def _requested_dtype(spec: OpSpec, settings: Settings, kwargs: Mapping[str, Any]) -> torch.dtype | None:
    """The dtype the caller asked for: a matmul's ``out=`` tensor fixes the result's dtype, else ``dtype=``."""
    out = kwargs.get("out") if spec.kind == "matmul" else None
    if isinstance(out, torch.Tensor) and out.is_floating_point():
        return out.dtype
    return settings.dtype


def _with_out(tensors: Mapping[str, torch.Tensor], kwargs: Mapping[str, Any]) -> Mapping[str, torch.Tensor]:
    """The operands, plus an ``out=`` tensor when one is given (known-issue rows can name it)."""
    out = kwargs.get("out")
    return {**tensors, "out": out} if isinstance(out, torch.Tensor) else tensors


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
def _decide_cached(
    op: str,
    kind: str,
    signature: tuple[tuple[str, torch.dtype, torch.device, bool, bool, int, bool], ...],
    device_on: bool,
    dtype_on: bool,
    device_policy: str,
    policy_dtype: torch.dtype | None,
    autocast_dtype: torch.dtype | None,
    keep: bool,
) -> tuple[Finding, ...]:
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
        f = dtype_guard.decide(kind, operands, accepted=accepted, policy_dtype=policy_dtype, autocast_dtype=autocast_dtype, keep=keep)
        if f is not None:
            if f.actions and f.torch_raises:
                f = _minimal(op, operands, f, device, autocast_dtype)
            found.append(f)
    return tuple(found)


# Constant in its arguments: cached in eager, and evaluated once at trace time
# under torch.compile (dynamo would otherwise trace the policy code, and it sees
# through lru_cache). Settings reach it as arguments, so a settings change
# (which dynamo guards on: it traces the ContextVar read) gives a new decision.
@_constant
def _decide_dtype_device(*key: Any) -> tuple[Finding, ...]:
    return _decide_cached(*key)


@_constant
def _compiled_error_text(index: int, mode: str, *key: Any) -> str:
    op, signature = key[0], key[2]
    return compiled_error_message(op, _decide_cached(*key)[index], [(s[0], s[1], s[2]) for s in signature], mode=mode)


# --- warn mode: once per call site -------------------------------------------------------

_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def _warn_once(site: str, op: str, text: str) -> None:
    with _warned_lock:
        if (site, op) in _warned:
            return
        _warned.add((site, op))
    filename, _, line = site.rpartition(":")
    warnings.warn_explicit(text, TorchfixWarning, filename or site, int(line) if line.isdigit() else 0, module="torchfix")


def reset_warnings() -> None:
    """Forget which call sites were warned about (``warn`` mode warns once per site)."""
    with _warned_lock:
        _warned.clear()


# --- the call ----------------------------------------------------------------------------


def _apply(bound: _Bound, action: Action) -> None:
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


def _stride_post(finding: Finding, before: Mapping[str, torch.Tensor]) -> Callable[[Any], Any] | None:
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


def _take_out(bound: _Bound) -> Callable[[Any], Any]:
    """Run without the caller's ``out=`` and copy the result into it (a strided ``out=`` row)."""
    out = bound.kwargs.pop("out")
    bound.tensors.pop("out", None)
    return lambda result: out.copy_(result)


def _record(
    spec: OpSpec,
    settings: Settings,
    finding: Finding,
    before: Mapping[str, torch.Tensor],
    site: str,
    module: str | None,
    changes: str | None = None,
) -> None:
    if changes is None:
        changes = ", ".join(action_text(a, before) for a in finding.actions)
    detail = f"{finding.problem} → {changes}" + (f" ({finding.note})" if finding.note else "")
    action = finding.actions[0].action
    report().add(FixEvent(spec.name, finding.guard, action, site, module, detail))
    log.debug("torchfix %s at %s%s: %s", spec.name, site, f" [{module}]" if module else "", detail)
    if settings.mode == "warn":
        where = f" in {module}" if module else ""
        verb = "noticed" if action == "noted" else "fixed"
        _warn_once(site, spec.name, f"torchfix {verb} {spec.name}{where}: {detail}. To fix it for good: {finding.fix}.")


def _raise(
    spec: OpSpec, settings: Settings, finding: Finding, bound: _Bound, orig: Callable[..., Any], chain: list[torch.nn.Module] | None
) -> Any:
    site = _frames.call_site(1)
    module = _frames.module_path(chain if chain is not None else _frames.module_chain(1))
    text = error_message(spec.name, finding, _with_out(bound.tensors, bound.kwargs), site=site, module=module, mode=settings.mode)
    err = _ERRORS[finding.guard](text)
    if finding.torch_raises:
        try:
            result = orig(*bound.args, **bound.kwargs)
        except Exception as exc:  # torch's own error becomes the cause
            raise err from exc
        # torch accepted the call after all: it is valid, so its result stands.
        log.debug("torchfix: %s predicted a torch error that did not happen; returning torch's result", spec.name)
        return result
    raise err


# --- routing to torch.ops.torchfix.matmul -----------------------------------------------


@_constant
def _kernel_allowed(kernels: bool | None, device_type: str) -> bool:
    return kernels if kernels is not None else kernels_mod.verified(device_type)


@_constant
def _kernel_available(device_type: str) -> bool:
    return kernels_mod.available_for(device_type)


_missing_warned: set[str] = set()
_failed: dict[str, str] = {}  # device type -> why its kernel is off for this process


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _warn_missing(device_type: str) -> None:
    with _warned_lock:
        if device_type in _missing_warned:
            return
        _missing_warned.add(device_type)
    what = "Triton is not installed (pip install 'torchfix[triton]')" if device_type == "cuda" else "the Metal kernel is unavailable"
    warnings.warn(
        f"torchfix: {what}; mixed-dtype and strided matmuls on {device_type} are cast/copied instead of read in place.",
        TorchfixWarning,
        stacklevel=4,
    )


def _kernel_failed(device_type: str, exc: BaseException) -> None:
    """The kernel raised on a call that the cast/copy path then ran: off for this device type, said once."""
    why = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    with _warned_lock:
        if device_type in _failed:
            return
        _failed[device_type] = why
    warnings.warn(
        f"torchfix: the {device_type} kernel torch.ops.torchfix.matmul failed ({why}); the call ran on the cast/copy path, "
        f"and so will every {device_type} call from now on. Please report this with `torchfix doctor`'s output.",
        TorchfixWarning,
        stacklevel=4,
    )


class _KernelFailure(NamedTuple):
    """Internal, returned (never raised) by :func:`_try_kernel`: the kernel raised this error."""

    device_type: str
    exc: BaseException


def _try_kernel(
    spec: OpSpec, settings: Settings, findings: list[Finding], bound: _Bound, chain: list[torch.nn.Module] | None, compiling: bool
) -> Any:
    """Run the call through torch.ops.torchfix.matmul when the routing policy says so;
    :data:`kernels.routing.NOT_ROUTED` otherwise. Eager kernel errors come back as
    :class:`_KernelFailure` for the caller to fall back on."""
    moves = next((f for f in findings if f.guard == "device"), None)
    device_type = moves.actions[0].to.type if moves is not None else next(iter(bound.tensors.values())).device.type
    allowed = _kernel_allowed(settings.kernels, device_type) and device_type not in _failed
    decision = routing.decide(spec.kind, device_type, findings, enabled=allowed, available=_kernel_available(device_type))
    if decision.missing and not compiling:
        _warn_missing(device_type)
    if not decision.route:
        return kernel_routing.NOT_ROUTED
    before = dict(bound.tensors)
    if moves is not None:
        for action in moves.actions:
            _apply(bound, action)
    casts = next((f for f in findings if f.guard == "dtype"), None)
    if casts is not None:
        out_dtype = casts.actions[0].to
    else:
        out_dtype = next(t.dtype for t in bound.tensors.values() if t.is_floating_point())
    if compiling:
        return kernel_routing.call(spec, tuple(bound.args), bound.kwargs, out_dtype)
    try:
        result = kernel_routing.call(spec, tuple(bound.args), bound.kwargs, out_dtype)
    except Exception as exc:  # a kernel never fails a call: the caller falls back, and re-raises torch's own error if any
        return _KernelFailure(device_type, exc)
    if result is kernel_routing.NOT_ROUTED:
        return result
    if chain is None:
        chain = _frames.module_chain(2)
    site, module = _frames.call_site(2), _frames.module_path(chain)
    for f in findings:
        if f.guard == "device":
            _record(spec, settings, f, before, site, module)
            continue
        reads = ", ".join(f"{n} {_dtype_name(t.dtype)}{'' if t.is_contiguous() else ' (strided)'}" for n, t in before.items())
        kernel = Finding(f.guard, f.problem, f.fix, (Action(f.guard, "kernel", "", out_dtype),), f.torch_raises, f.note)
        detail = f"torch.ops.torchfix.matmul reads {reads} in place, out {_dtype_name(out_dtype)}"
        _record(spec, settings, kernel, before, site, module, detail)
    return result


def _observe(finding: Finding, before: Mapping[str, torch.Tensor], chain: Sequence[torch.nn.Module] | None) -> None:
    """Tell a listening ``torchfix.wrap`` which parameters or buffers this dtype fix cast per call."""
    sink = _context.param_casts.get()
    if sink is None or not chain:
        return
    for action in finding.actions:
        t = before.get(action.operand)
        if t is None or not isinstance(action.to, torch.dtype):
            continue
        owner = next(((m, n) for m in chain for n, v in (*m._parameters.items(), *m._buffers.items()) if v is t), None)
        if owner is not None:
            sink.append((owner[0], owner[1], action.to))


def _note(spec: OpSpec, settings: Settings, finding: Finding, before: Mapping[str, torch.Tensor], result: Any) -> None:
    """Record an advisory finding (the call ran as torch computes it), with the bytes it costs."""
    extra = ""
    if isinstance(result, torch.Tensor) and result.is_floating_point():
        narrowest = min(t.element_size() for t in before.values() if t.is_floating_point())
        size = result.numel() * result.element_size()
        extra = f"; result {size:,} B in {_dtype_name(result.dtype)}, +{size - result.numel() * narrowest:,} B over the narrowest input"
    noted = dataclasses.replace(finding, actions=(Action(finding.guard, "noted", ""),), note=finding.note + extra)
    chain = _frames.module_chain(2)
    _record(spec, settings, noted, before, _frames.call_site(2), _frames.module_path(chain), "left as torch computes it")


def _raise_compiled(spec: OpSpec, settings: Settings, index: int, findings: Sequence[Finding], bound: _Bound, orig: Any, key: tuple) -> Any:
    """Strict mode inside torch.compile: the graph computes the fixed call and raises torchfix's
    error from it when it runs (dynamo cannot trace the frame walk or torch's own error)."""
    finding = findings[index]
    text = _compiled_error_text(index, settings.mode, *key)
    if not finding.actions:  # nothing to compute a stand-in result from: raise while tracing
        raise _ERRORS[finding.guard](text)
    for action in finding.actions:
        _apply(bound, action)
    return torch.ops.torchfix.raise_error(orig(*bound.args, **bound.kwargs), text, finding.guard)


def guarded_call(spec: OpSpec, orig: Callable[..., Any], settings: Settings, args: tuple, kwargs: dict) -> Any:
    """The slow path of a guarded op: called when the fast check saw mixed
    dtypes or devices, a layout with a known-issue row, or unusual arguments.

    The rule: a call torch accepts runs exactly as torch computes it, in every
    mode; only a call torch rejects, one that computes garbage (meta or foreign
    device), a known-issue row in force, or what the caller asked for
    (``dtype=``, ``device_policy="align"``, ``keep_dtype``) is changed.
    """
    bound = _Bound(spec, args, kwargs)
    tensors = bound.tensors
    if not tensors:
        return orig(*args, **kwargs)
    compiling = torch.compiler.is_compiling()
    first = next(iter(tensors.values()))
    chain: list[torch.nn.Module] | None = None
    key = (
        spec.name,
        spec.kind,
        tuple((n, t.dtype, t.device, t.dim() == 0, False, t.dim(), t.is_contiguous()) for n, t in tensors.items()),
        settings.device_on,
        settings.dtype_on,
        settings.device_policy,
        _requested_dtype(spec, settings, kwargs),
        _autocast_dtype(first.device.type),
        False,
    )
    findings = list(_decide_dtype_device(*key))
    # Who owns the operands (a kept module, parameters) matters only for a mix torch rejects:
    # the frame walk is paid only then, never for a mix torch accepts.
    if spec.kind in (*_PARAM_KINDS, "matmul") and any(f.guard == "dtype" and f.torch_raises for f in findings):
        if not compiling:
            chain = _frames.module_chain(1)
        # Marks on the tensors (torchfix._kept) answer while compiling too; eagerly the frames are asked as well.
        keep = spec.kind != "matmul" and _kept.is_kept(tensors.get("weight"), chain)
        params = frozenset(n for n, t in tensors.items() if _kept.is_owned(t, chain)) if spec.kind == "matmul" else frozenset()
        if keep or params:
            signature = tuple((n, t.dtype, t.device, t.dim() == 0, n in params, *s[5:]) for (n, t), s in zip(tensors.items(), key[2]))
            key = (*key[:2], signature, *key[3:8], keep)
            findings = list(_decide_dtype_device(*key))
    rows = ki.in_force(spec.family, first.device.type) if settings.stride_on else ()
    if rows:  # known-issue rows apply compiled as eagerly: their predicates are plain metadata reads
        f = stride_guard.decide(spec.family, _with_out(tensors, kwargs), device_type=first.device.type, rows=rows)
        if f is not None:
            findings.append(f)
    notes = [f for f in findings if f.advisory]
    if notes:
        findings = [f for f in findings if not f.advisory]
    if not findings:
        result = orig(*args, **kwargs)
        if not compiling:
            for f in notes:
                _note(spec, settings, f, tensors, result)
        return result

    if settings.mode == "strict":
        if compiling:
            return _raise_compiled(spec, settings, 0, findings, bound, orig, key)
        return _raise(spec, settings, findings[0], bound, orig, chain)
    failure: _KernelFailure | None = None
    if spec.kind in routing.ROUTED_KINDS and all(f.actions for f in findings):
        routed = _try_kernel(spec, settings, findings, bound, chain, compiling)
        if isinstance(routed, _KernelFailure):
            failure = routed
        elif routed is not kernel_routing.NOT_ROUTED:
            return routed
        bound = _Bound(spec, args, kwargs)  # undo device moves made before a fallback

    post: list[Callable[[Any], Any]] = []
    for finding in findings:
        if not finding.actions:
            if compiling:
                return _raise_compiled(spec, settings, findings.index(finding), findings, bound, orig, key)
            return _raise(spec, settings, finding, bound, orig, chain)
        before = dict(_with_out(bound.tensors, bound.kwargs) if finding.guard == "stride" else bound.tensors)
        if finding.guard == "stride" and len(findings) > 1:
            # Re-check on the already cast/moved tensors: a cast copy is contiguous now.
            rechecked = stride_guard.decide(spec.family, _with_out(bound.tensors, bound.kwargs), device_type=first.device.type, rows=rows)
            if rechecked is None:
                continue
            finding = rechecked
        if finding.guard == "stride":
            fn = _stride_post(finding, before)
            if fn is not None:
                post.append(fn)
        for action in finding.actions:
            if action.operand == "out":
                post.append(_take_out(bound))
            else:
                _apply(bound, action)
        if not compiling:
            if chain is None:
                chain = _frames.module_chain(1)
            _record(spec, settings, finding, before, _frames.call_site(1), _frames.module_path(chain))
            if finding.guard == "dtype":
                _observe(finding, before, chain)
    result = orig(*bound.args, **bound.kwargs)
    for fn in post:
        result = fn(result)
    if failure is not None:  # the call was valid: the kernel was at fault
        _kernel_failed(failure.device_type, failure.exc)
    if not compiling:
        for f in notes:
            _note(spec, settings, f, tensors, result)
    return result
