"""One guarded call, end to end: bind its arguments, ask the guards for a plan, then
run it untouched, fix it (cast / move / copy / route to a kernel) and record, or raise.

This is the checked path; the patched attributes (:mod:`torchfix.patches.torch_ops`)
call it only when their fast check cannot pass the call straight through.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import _frames, _kept, _model
from ..config import Settings
from ..errors import DeviceMismatchError, DtypeMismatchError, LayoutError, TorchfixError
from ..guards import decide as decide_mod
from ..guards import known_issues as ki
from ..guards import routing
from ..guards import stride as stride_guard
from ..guards.messages import compiled_error_message, error_message
from ..guards.ops import OpSpec
from ..guards.plan import Finding
from . import kernel
from .apply import apply, reuse_cast, stride_post
from .binding import Bound, autocast_dtype, requested_dtype, take_out, with_out
from .record import note, observe, record

__all__ = ["guarded_call"]

# pytest leaves out of a failure's traceback every frame whose globals hold this (as it does its own
# helpers): a strict-mode failure shows the user's call and torchfix's error, not torchfix's internals.
__tracebackhide__ = True

log = logging.getLogger("torchfix")

_ERRORS: dict[str, type[TorchfixError]] = {"dtype": DtypeMismatchError, "device": DeviceMismatchError, "stride": LayoutError}
_PARAM_KINDS = ("linear", "conv", "norm")
_OWNED_KINDS = (*_PARAM_KINDS, "matmul", "attention")


# Constant in its arguments: cached in eager, and evaluated once at trace time
# under torch.compile (dynamo would otherwise trace the policy code, and it sees
# through lru_cache). Settings reach it as arguments, so a settings change
# (which dynamo guards on: it traces the settings read) gives a new decision.
@kernel.constant
def _decide(*key: Any) -> tuple[Finding, ...]:
    return decide_mod.decide(*key)


@kernel.constant
def _traced_owner() -> tuple[torch.dtype | None, str]:
    """The model's dtype while torch.compile traces: called for real at trace time, when the frames
    of the modules that run the compiled code (an ``OptimizedModule`` holding the model, or the
    model's own ``__call__`` around a compiled submodule) are real frames. A change of the
    parameters' dtypes recompiles (dynamo guards on them), so the answer is never stale."""
    return _model.owner_dtype(_frames.module_chain(1))


@kernel.constant
def _compiled_error_text(index: int, mode: str, *key: Any) -> str:
    op, signature = key[0], key[2]
    return compiled_error_message(op, decide_mod.decide(*key)[index], [(s[0], s[1], s[2]) for s in signature], mode=mode)


def _raise(
    spec: OpSpec, settings: Settings, finding: Finding, bound: Bound, orig: Callable[..., Any], chain: list[torch.nn.Module] | None
) -> Any:
    """Strict mode, or a finding with no fix: raise torchfix's error, with torch's own as its cause."""
    site = _frames.call_site(1)
    module = _frames.module_path(chain if chain is not None else _frames.module_chain(1))
    text = error_message(spec.name, finding, with_out(bound.tensors, bound.kwargs), site=site, module=module, mode=settings.mode)
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


def _raise_compiled(spec: OpSpec, settings: Settings, index: int, findings: Sequence[Finding], bound: Bound, orig: Any, key: tuple) -> Any:
    """Strict mode inside torch.compile: the graph computes the fixed call and raises torchfix's
    error from it when it runs (dynamo cannot trace the frame walk or torch's own error)."""
    finding = findings[index]
    text = _compiled_error_text(index, settings.mode, *key)
    if not finding.actions:  # nothing to compute a stand-in result from: raise while tracing
        raise _ERRORS[finding.guard](text)
    for action in finding.actions:
        apply(bound, action)
    return torch.ops.torchfix.raise_error(orig(*bound.args, **bound.kwargs), text, finding.guard)


def guarded_call(spec: OpSpec, orig: Callable[..., Any], settings: Settings, args: tuple, kwargs: dict) -> Any:
    """The checked path of a guarded op: called when the fast check saw mixed
    dtypes or devices, a layout with a known-issue row, or unusual arguments.

    The rule: a call torch accepts runs exactly as torch computes it, in every
    mode; only a call torch rejects, one that computes garbage (meta or foreign
    device), a known-issue row in force, or what the caller asked for
    (``dtype=``, ``device_policy="align"``, ``keep_dtype``) is changed.
    """
    bound = Bound(spec, args, kwargs)
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
        requested_dtype(spec, settings, kwargs),
        autocast_dtype(first.device.type),
        False,
        None,
        "",
    )
    findings = list(_decide(*key))
    # Who owns the operands (the model, a kept module, parameters) matters only for a mix torch
    # rejects: the frame walk is paid only then, never for a mix torch accepts.
    if spec.kind in _OWNED_KINDS and any(f.guard == "dtype" and f.torch_raises for f in findings):
        if not compiling:
            chain = _frames.module_chain(1)
            # A stray activation this model's run already cast (the text embeddings at every
            # cross-attention after the first): the same decision, without asking again.
            if (
                chain
                and settings.mode != "strict"
                and all(f.guard == "dtype" for f in findings)
                and not (settings.stride_on and ki.in_force(spec.family, first.device.type))
                and reuse_cast(bound, chain[-1])
            ):
                return orig(*bound.args, **bound.kwargs)
        # Marks on the tensors (torchfix._kept) answer while compiling too; eagerly the frames are asked as well.
        keep = spec.kind in _PARAM_KINDS and _kept.is_kept(tensors.get("weight"), chain)
        params = frozenset(n for n, t in tensors.items() if _kept.is_owned(t, chain)) if spec.kind == "matmul" else frozenset()
        model = (None, "") if keep else _traced_owner() if compiling else _model.owner_dtype(chain or [])
        if keep or params or model[0] is not None or model[1]:
            signature = tuple((n, t.dtype, t.device, t.dim() == 0, n in params, *s[5:]) for (n, t), s in zip(tensors.items(), key[2]))
            key = (*key[:2], signature, *key[3:8], keep, *model)
            findings = list(_decide(*key))
    rows = ki.in_force(spec.family, first.device.type) if settings.stride_on else ()
    if rows:  # known-issue rows apply compiled as eagerly: their predicates are plain metadata reads
        f = stride_guard.decide(spec.family, with_out(tensors, kwargs), device_type=first.device.type, rows=rows)
        if f is not None:
            findings.append(f)
    notes = [f for f in findings if f.advisory]
    if notes:
        findings = [f for f in findings if not f.advisory]
    if not findings:
        result = orig(*args, **kwargs)
        if not compiling:
            for f in notes:
                note(spec, settings, f, tensors, result)
        return result

    if settings.mode == "strict":
        if compiling:
            return _raise_compiled(spec, settings, 0, findings, bound, orig, key)
        return _raise(spec, settings, findings[0], bound, orig, chain)
    failure: kernel.KernelFailure | None = None
    if spec.kind in routing.ROUTED_KINDS and all(f.actions for f in findings):
        routed = kernel.try_kernel(spec, settings, findings, bound, chain, compiling)
        if isinstance(routed, kernel.KernelFailure):
            failure = routed
        elif routed is not kernel.NOT_ROUTED:
            return routed
        bound = Bound(spec, args, kwargs)  # undo device moves made before a fallback

    post: list[Callable[[Any], Any]] = []
    for finding in findings:
        if not finding.actions:
            if compiling:
                return _raise_compiled(spec, settings, findings.index(finding), findings, bound, orig, key)
            return _raise(spec, settings, finding, bound, orig, chain)
        before = dict(with_out(bound.tensors, bound.kwargs) if finding.guard == "stride" else bound.tensors)
        if finding.guard == "stride" and len(findings) > 1:
            # Re-check on the already cast/moved tensors: a cast copy is contiguous now.
            rechecked = stride_guard.decide(spec.family, with_out(bound.tensors, bound.kwargs), device_type=first.device.type, rows=rows)
            if rechecked is None:
                continue
            finding = rechecked
        if finding.guard == "stride":
            fn = stride_post(finding, before)
            if fn is not None:
                post.append(fn)
        fresh = finding.guard != "dtype"
        for action in finding.actions:
            if action.operand == "out":
                post.append(take_out(bound))
                fresh = True
            else:
                fresh = apply(bound, action, None if compiling or not chain else chain[-1]) or fresh
        # A stray input that later layers meet again (encoder_hidden_states in every cross-attention)
        # was cast once: it is one event, not one per layer.
        if not compiling and fresh:
            if chain is None:
                chain = _frames.module_chain(1)
            record(spec, settings, finding, before, _frames.call_site(1), _frames.module_path(chain))
            if finding.guard == "dtype":
                observe(finding, before, chain)
    result = orig(*bound.args, **bound.kwargs)
    for fn in post:
        result = fn(result)
    if failure is not None:  # the call was valid: the kernel was at fault
        kernel.kernel_failed(failure.device_type, failure.exc)
    if not compiling:
        for f in notes:
            note(spec, settings, f, tensors, result)
    return result
