"""Run one guarded call: bind its arguments, ask each guard, then pass, fix
(cast / move / copy) and record, or raise.

This acts on the *arguments* of a call; it never touches torch attributes
(that is :mod:`torchfix.patches`).
"""

from __future__ import annotations

import functools
import logging
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .. import _frames, kernels
from .._report import FixEvent, report
from ..config import Settings, env_kernels_disabled
from ..errors import DeviceMismatchError, DtypeMismatchError, LayoutError, TorchfixError, TorchfixWarning
from ..kernels import routing as kernel_routing
from . import device as device_guard
from . import dtype as dtype_guard
from . import known_issues as ki
from . import routing
from . import stride as stride_guard
from .messages import action_text, error_message
from .ops import OpSpec
from .plan import Action, Finding, Operand

__all__ = ["guarded_call", "is_kept", "keep_dtype"]

log = logging.getLogger("torchfix")

_ERRORS: dict[str, type[TorchfixError]] = {"dtype": DtypeMismatchError, "device": DeviceMismatchError, "stride": LayoutError}
_PARAM_KINDS = ("linear", "conv", "norm")

# --- modules kept in their precision on purpose ------------------------------------------

_kept_modules: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
# id(param) -> weakref; a WeakSet would compare tensors with == on a hash collision.
_kept_params: dict[int, weakref.ref[torch.Tensor]] = {}


def keep_dtype(module: torch.nn.Module) -> torch.nn.Module:
    """Mark a module as kept in its precision on purpose (like diffusers'
    ``_keep_in_fp32_modules``): when dtypes meet in it, its *input* is cast
    to its weight's dtype instead of its weights to the input's.

    >>> import torch, torchfix
    >>> norm = torchfix.keep_dtype(torch.nn.LayerNorm(4))
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"torchfix.keep_dtype takes an nn.Module, not {type(module).__name__}.")
    _kept_modules.add(module)
    for p in module.parameters():
        _kept_params[id(p)] = weakref.ref(p, functools.partial(_forget_param, id(p)))
    return module


def _forget_param(key: int, _ref: object) -> None:
    _kept_params.pop(key, None)


def is_kept(weight: torch.Tensor | None, chain: Sequence[torch.nn.Module]) -> bool:
    """Whether the op that uses ``weight`` runs in a module kept in its precision."""
    if weight is None:
        return False
    ref = _kept_params.get(id(weight))
    if (ref is not None and ref() is weight) or any(m in _kept_modules for m in chain):
        return True
    if not chain or weight.dtype != torch.float32:
        return False
    # diffusers/transformers name fp32-kept submodules on the model class.
    return any(
        getattr(root, "_keep_in_fp32_modules", None) and dtype_guard.kept_in_fp32(root, _frames.module_path([chain[0], root]) or "")
        for root in reversed(chain)
    )


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


@functools.lru_cache(maxsize=4096)
def _decide_cached(
    kind: str,
    signature: tuple[tuple[str, torch.dtype, torch.device, bool], ...],
    device_on: bool,
    dtype_on: bool,
    device_policy: str,
    policy_dtype: torch.dtype | None,
    autocast_dtype: torch.dtype | None,
    keep: bool,
) -> tuple[Finding, ...]:
    operands = [Operand(*s) for s in signature]
    found = []
    if device_on:
        f = device_guard.decide(operands, device_policy)
        if f is not None:
            found.append(f)
            if f.actions:  # after the moves every operand shares the target device
                target = f.actions[0].to
                operands = [Operand(o.name, o.dtype, target, o.scalar) for o in operands]
    if dtype_on:
        f = dtype_guard.decide(kind, operands, policy_dtype=policy_dtype, autocast_dtype=autocast_dtype, keep=keep)
        if f is not None:
            found.append(f)
    return tuple(found)


# Constant in its arguments: cached in eager, and evaluated once at trace time
# under torch.compile (dynamo would otherwise trace the policy code, and it sees
# through lru_cache).
@torch._dynamo.assume_constant_result
def _decide_dtype_device(*key: Any) -> tuple[Finding, ...]:
    return _decide_cached(*key)


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
            new = t.contiguous()
    elif isinstance(action.to, torch.dtype):  # cast / upcast / promote
        # aten._to_copy, not Tensor.to: the same result, and in an exported graph it marks
        # the casts torchfix inserted apart from the model's own .to() calls (torchfix.audit reads that).
        new = torch.ops.aten._to_copy.default(t, dtype=action.to)
    else:  # move to a device
        new = t.to(action.to)
    bound.replace(action.operand, new)


def _stride_post(finding: Finding, before: Mapping[str, torch.Tensor]) -> Callable[[Any], Any] | None:
    kinds = {a.action for a in finding.actions}
    floats = [t for t in before.values() if t.is_floating_point()]
    if not floats:
        return None
    dtype, dev = floats[0].dtype, floats[0].device
    if "cpu" in kinds:
        return lambda out: out.to(dev) if isinstance(out, torch.Tensor) else out
    if "upcast" in kinds:
        return lambda out: out.to(dtype) if isinstance(out, torch.Tensor) and out.is_floating_point() else out
    return None


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
        _warn_once(site, spec.name, f"torchfix fixed {spec.name}{where}: {detail}. To fix it for good: {finding.fix}.")


def _raise(
    spec: OpSpec, settings: Settings, finding: Finding, bound: _Bound, orig: Callable[..., Any], chain: list[torch.nn.Module] | None
) -> Any:
    site = _frames.call_site(1)
    module = _frames.module_path(chain if chain is not None else _frames.module_chain(1))
    text = error_message(spec.name, finding, bound.tensors, site=site, module=module, mode=settings.mode)
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


@torch._dynamo.assume_constant_result
def _kernels_enabled() -> bool:
    return not env_kernels_disabled()


@torch._dynamo.assume_constant_result
def _kernel_available(device_type: str) -> bool:
    return kernels.available_for(device_type)


_missing_warned: set[str] = set()


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


def _try_kernel(
    spec: OpSpec, settings: Settings, findings: list[Finding], bound: _Bound, chain: list[torch.nn.Module] | None, compiling: bool
) -> Any:
    """Run the call through torch.ops.torchfix.matmul when the routing policy says so;
    :data:`kernels.routing.NOT_ROUTED` otherwise."""
    moves = next((f for f in findings if f.guard == "device"), None)
    device_type = moves.actions[0].to.type if moves is not None else next(iter(bound.tensors.values())).device.type
    decision = routing.decide(
        spec.kind, device_type, findings, enabled=_kernels_enabled(), available=_kernel_available(device_type)
    )
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
    result = kernel_routing.call(spec, tuple(bound.args), bound.kwargs, out_dtype)
    if result is kernel_routing.NOT_ROUTED or compiling:
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


def guarded_call(spec: OpSpec, orig: Callable[..., Any], settings: Settings, args: tuple, kwargs: dict) -> Any:
    """The slow path of a guarded op: called when the fast check saw mixed
    dtypes or devices, a layout with a known-issue row, or unusual arguments."""
    bound = _Bound(spec, args, kwargs)
    tensors = bound.tensors
    if not tensors:
        return orig(*args, **kwargs)
    compiling = torch.compiler.is_compiling()
    first = next(iter(tensors.values()))
    chain: list[torch.nn.Module] | None = None
    keep = False
    signature = tuple((n, t.dtype, t.device, t.dim() == 0) for n, t in tensors.items())
    mixed = len({t.dtype for t in tensors.values() if t.is_floating_point()}) > 1
    if mixed and spec.kind in _PARAM_KINDS and settings.dtype_on and not compiling:
        chain = _frames.module_chain(1)
        keep = is_kept(tensors.get("weight"), chain)
    findings = list(
        _decide_dtype_device(
            spec.kind,
            signature,
            settings.device_on,
            settings.dtype_on,
            settings.device_policy,
            settings.dtype,
            _autocast_dtype(first.device.type),
            keep,
        )
    )
    if settings.stride_on and not compiling and first.device.type in ki.ACTIVE_DEVICE_TYPES:
        f = stride_guard.decide(spec.family, tensors, device_type=first.device.type)
        if f is not None:
            findings.append(f)
    if not findings:
        return orig(*args, **kwargs)

    if settings.mode != "strict" and spec.kind in routing.ROUTED_KINDS and all(f.actions for f in findings):
        routed = _try_kernel(spec, settings, findings, bound, chain, compiling)
        if routed is not kernel_routing.NOT_ROUTED:
            return routed
        bound = _Bound(spec, args, kwargs)  # undo device moves made before a fallback

    post: list[Callable[[Any], Any]] = []
    for finding in findings:
        if settings.mode == "strict" or not finding.actions:
            return _raise(spec, settings, finding, bound, orig, chain)
        before = dict(bound.tensors)
        if finding.guard == "stride" and len(findings) > 1:
            # Re-check on the already cast/moved tensors: a cast copy is contiguous now.
            rechecked = stride_guard.decide(spec.family, bound.tensors, device_type=first.device.type)
            if rechecked is None:
                continue
            finding = rechecked
        if finding.guard == "stride":
            fn = _stride_post(finding, before)
            if fn is not None:
                post.append(fn)
        for action in finding.actions:
            _apply(bound, action)
        if not compiling:
            if chain is None:
                chain = _frames.module_chain(1)
            _record(spec, settings, finding, before, _frames.call_site(1), _frames.module_path(chain))
    result = orig(*bound.args, **bound.kwargs)
    for fn in post:
        result = fn(result)
    return result
