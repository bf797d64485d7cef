"""The guarded torch callables and their wrappers.

Patch once, gate per call. Each wrapper reads which settings are in force in
this context (``scoped.get() or GLOBAL[0]``, ~0.05 µs); when torchfix is off it
calls straight through. When on, eager calls take the *optimistic* path:

1. A call with an operand on the meta device goes to the checked path: torch
   silently computes garbage for ``F.linear(cpu, meta_weight)`` and the like,
   and the device guard must see it first. Only the positions where torch
   computes with a meta operand are read (``is_meta``, ~0.03 µs each); where
   torch raises (sdpa's q/k/v, every norm operand, addmm's input and mat1,
   linear's bias), step 3 hands the call to the device guard.
   tests/patches/test_torch_ops.py puts a meta tensor in every position of
   every op and checks that the device guard names it.
2. Otherwise the original runs with the caller's own arguments. What torch
   accepts comes back exactly as torch computes it: that is the rule
   (docs/guide.md), and it costs no dtype or device reads at all.
3. Only if torch raises does torchfix look: inputs of one dtype and one device
   mean the error is not torchfix's to fix, and torch's own exception
   propagates untouched; anything else goes to
   :func:`torchfix.guards.runtime.guarded_call`, which casts, moves, routes or
   raises a clear error.

The *checked* path asks first, for every call: inputs of one dtype (bool
masks aside) and one device, and no known-issue row for the device type,
call straight through; anything else goes to ``guarded_call``. It runs
while dynamo or torch.export trace (the checks cost nothing in the compiled
graph) and where known-issue rows are in force (they match calls that torch
runs without an error). ``cat`` always reads its dtypes: a promotion torch
accepts is still reported, or cast where ``dtype=`` asks for it. (A ``dtype=``
policy changes no other mix that torch accepts, so it needs no check first.)

Where each tensor sits (position or keyword) is read per argument shape by a
``pick`` function; the common positional layout is also written out inline in
the wrapper, because on torch 2.13 CPU a Python call costs ~0.08 µs against a
budget of 0.5 µs per guarded call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .. import _context, runtime
from ..guards import known_issues as ki
from ..guards.ops import SPECS, OpSpec
from .core import Patch

__all__ = ["PATCHES", "TARGETS"]

Wrapper = Callable[..., Any]
Picker = Callable[[tuple, dict], tuple]
# Anything that is not a tensor where one is expected, a missing argument, or
# too few of them: the slow path binds the call properly and lets torch report.
_ODD = (AttributeError, TypeError, ValueError, IndexError, KeyError)
# Re-running a call after these would only repeat them.
_OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def _uniform(tensors: tuple, rows: frozenset[str]) -> bool:
    """One dtype (bool masks aside) and one device among ``tensors`` (``None`` skipped),
    and no known-issue row in force for that device type."""
    dt = dev = None
    for t in tensors:
        if t is None:
            continue
        if dev is None:
            dt, dev = t.dtype, t.device
            if rows and dev.type in rows:
                return False
        elif t.device != dev or (t.dtype is not dt and t.dtype is not torch.bool):
            return False
    return True


def _paths(spec: OpSpec, orig: Wrapper, pick: Picker) -> tuple[Callable[..., Any], Callable[[tuple, dict], bool]]:
    """The checked path and the "is this call uniform?" question for one op."""
    slow, rows = runtime.guarded_call, ki.holder(spec.family)

    def uniform(args: tuple, kwargs: dict) -> bool:
        try:
            return _uniform(pick(args, kwargs), rows[0])
        except _ODD:
            return False

    def checked(settings: Any, args: tuple, kwargs: dict) -> Any:
        if settings.active and not uniform(args, kwargs):
            return slow(spec, orig, settings, args, kwargs)
        return orig(*args, **kwargs)

    return checked, uniform


class _CompilingFlag:
    """Stands in for ``torch.compiler`` on a torch without ``_is_compiling_flag``."""

    @property
    def _is_compiling_flag(self) -> bool:
        return torch.compiler.is_compiling()


def _prologue(spec: OpSpec) -> tuple[Any, ...]:
    """What every wrapper holds in its closure (closure cells are the cheapest reads); the
    last item holds the device types with a known-issue row in force for ``spec``'s family."""
    return (
        # ``dynamo() or compiler._is_compiling_flag`` is torch.compiler.is_compiling() without
        # its torch.jit.is_scripting() call (~0.04 µs; scripted code never reaches a Python
        # wrapper): True while dynamo traces (folded to a constant, so dynamo never reads the
        # flag or guards on it) and while torch.export traces non-strict. There, fake tensors
        # accept dtype mixes that real kernels reject, so "run it and see" would not see, and
        # the checked path runs instead.
        torch.compiler.is_dynamo_compiling,
        torch.compiler if hasattr(torch.compiler, "_is_compiling_flag") else _CompilingFlag(),
        _context.current,
        _context.scoped.get,
        _context.GLOBAL,
        runtime.guarded_call,
        ki.holder(spec.family),
    )


def _by_name(args: tuple, kwargs: dict, names: tuple[str, ...]) -> tuple:
    return tuple(args[i] if i < len(args) else kwargs[name] for i, name in enumerate(names))


def _matmul(spec: OpSpec, orig: Wrapper) -> Wrapper:
    """matmul / mm / bmm and their Tensor methods: two tensors (``out=`` passes through)."""
    dynamo, compiler, current, scoped, glob, slow, rows = _prologue(spec)
    names = spec.params[:2]

    def pick(args: tuple, kwargs: dict) -> tuple:
        return _by_name(args, kwargs, names)

    checked, uniform = _paths(spec, orig, pick)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if dynamo() or compiler._is_compiling_flag:
            return checked(current(), args, kwargs)
        settings = scoped() or glob[0]
        if not settings.active or rows[0]:
            return checked(settings, args, kwargs)
        try:
            if args[0].is_meta or args[1].is_meta:
                return checked(settings, args, kwargs)
        except _ODD:
            return checked(settings, args, kwargs)
        try:
            return orig(*args, **kwargs)
        except Exception as exc:
            if isinstance(exc, _OUT_OF_MEMORY) or uniform(args, kwargs):
                raise
        return slow(spec, orig, settings, args, kwargs)

    return wrapper


def _addmm(spec: OpSpec, orig: Wrapper) -> Wrapper:
    """addmm / baddbmm and their Tensor methods: three tensors (``beta=``, ``alpha=``, ``out=`` pass through)."""
    dynamo, compiler, current, scoped, glob, slow, rows = _prologue(spec)
    names = spec.params[:3]

    def pick(args: tuple, kwargs: dict) -> tuple:
        return _by_name(args, kwargs, names)

    checked, uniform = _paths(spec, orig, pick)
    batched = spec.family == "bmm"  # addmm raises for a meta input or mat1; baddbmm computes

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if dynamo() or compiler._is_compiling_flag:
            return checked(current(), args, kwargs)
        settings = scoped() or glob[0]
        if not settings.active or rows[0]:
            return checked(settings, args, kwargs)
        try:
            if args[2].is_meta or (batched and (args[0].is_meta or args[1].is_meta)):
                return checked(settings, args, kwargs)
        except _ODD:
            return checked(settings, args, kwargs)
        try:
            return orig(*args, **kwargs)
        except Exception as exc:
            if isinstance(exc, _OUT_OF_MEMORY) or uniform(args, kwargs):
                raise
        return slow(spec, orig, settings, args, kwargs)

    return wrapper


def _weighted(spec: OpSpec, orig: Wrapper) -> Wrapper:
    """linear / conv: (input, weight, bias=None, options...), any of them by keyword."""
    dynamo, compiler, current, scoped, glob, slow, rows = _prologue(spec)

    def pick(args: tuple, kwargs: dict) -> tuple:
        n = len(args)
        if n > 2:
            return args[0], args[1], args[2]
        x = args[0] if n else kwargs["input"]
        return x, args[1] if n > 1 else kwargs["weight"], kwargs.get("bias")

    checked, uniform = _paths(spec, orig, pick)
    conv = spec.kind == "conv"  # F.linear raises for a meta bias; conv computes

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if dynamo() or compiler._is_compiling_flag:
            return checked(current(), args, kwargs)
        settings = scoped() or glob[0]
        if not settings.active or rows[0]:
            return checked(settings, args, kwargs)
        try:
            if args[0].is_meta or args[1].is_meta:
                return checked(settings, args, kwargs)
            if conv:
                bias = args[2] if len(args) > 2 else kwargs.get("bias") if kwargs else None
                if bias is not None and bias.is_meta:
                    return checked(settings, args, kwargs)
        except _ODD:
            return checked(settings, args, kwargs)
        try:
            return orig(*args, **kwargs)
        except Exception as exc:
            if isinstance(exc, _OUT_OF_MEMORY) or uniform(args, kwargs):
                raise
        return slow(spec, orig, settings, args, kwargs)

    return wrapper


def _attention(spec: OpSpec, orig: Wrapper) -> Wrapper:
    """scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, ...)."""
    dynamo, compiler, current, scoped, glob, slow, rows = _prologue(spec)
    names = ("query", "key", "value")

    def pick(args: tuple, kwargs: dict) -> tuple:
        q, k, v = args[:3] if len(args) >= 3 else _by_name(args, kwargs, names)
        return q, k, v, args[3] if len(args) > 3 else kwargs.get("attn_mask")

    checked, uniform = _paths(spec, orig, pick)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if dynamo() or compiler._is_compiling_flag:
            return checked(current(), args, kwargs)
        settings = scoped() or glob[0]
        if not settings.active or rows[0]:
            return checked(settings, args, kwargs)
        try:  # q, k or v on meta raise in torch; a meta mask computes
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask") if kwargs else None
            if mask is not None and mask.is_meta:
                return checked(settings, args, kwargs)
        except _ODD:
            return checked(settings, args, kwargs)
        try:
            return orig(*args, **kwargs)
        except Exception as exc:
            if isinstance(exc, _OUT_OF_MEMORY) or uniform(args, kwargs):
                raise
        return slow(spec, orig, settings, args, kwargs)

    return wrapper


def _norm(spec: OpSpec, orig: Wrapper) -> Wrapper:
    """layer_norm / group_norm: (input, shape-or-groups, weight=None, bias=None, eps=...)."""
    dynamo, compiler, current, scoped, glob, slow, rows = _prologue(spec)

    def pick(args: tuple, kwargs: dict) -> tuple:
        n = len(args)
        x = args[0] if n else kwargs["input"]
        return x, args[2] if n > 2 else kwargs.get("weight"), args[3] if n > 3 else kwargs.get("bias")

    checked, uniform = _paths(spec, orig, pick)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if dynamo() or compiler._is_compiling_flag:
            return checked(current(), args, kwargs)
        settings = scoped() or glob[0]
        if not settings.active or rows[0]:
            return checked(settings, args, kwargs)
        # A meta input, weight or bias raises in torch: nothing to read before the call.
        try:
            return orig(*args, **kwargs)
        except Exception as exc:
            if isinstance(exc, _OUT_OF_MEMORY) or uniform(args, kwargs):
                raise
        return slow(spec, orig, settings, args, kwargs)

    return wrapper


def _cat(spec: OpSpec, orig: Wrapper) -> Wrapper:
    """cat / concat / concatenate(tensors, dim=0, *, out=None): every dtype is read, since a
    promotion torch accepts is still reported; devices are left to torch, which raises."""
    dynamo, compiler, current, scoped, glob, slow, rows = _prologue(spec)

    def pick(args: tuple, kwargs: dict) -> tuple:
        seq = args[0] if args else kwargs["tensors"]
        if not isinstance(seq, (list, tuple)):  # never consume an iterator torch would reject
            raise TypeError(type(seq).__name__)
        return tuple(seq)

    checked, uniform = _paths(spec, orig, pick)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if dynamo() or compiler._is_compiling_flag:
            return checked(current(), args, kwargs)
        settings = scoped() or glob[0]
        if not settings.active or rows[0]:
            return checked(settings, args, kwargs)
        try:
            seq = args[0] if args else kwargs["tensors"]
            dt = seq[0].dtype
            for t in seq:
                if t.dtype is not dt:
                    return slow(spec, orig, settings, args, kwargs)
        except _ODD:
            return checked(settings, args, kwargs)
        try:
            return orig(*args, **kwargs)
        except Exception as exc:
            if isinstance(exc, _OUT_OF_MEMORY) or uniform(args, kwargs):
                raise
        return slow(spec, orig, settings, args, kwargs)

    return wrapper


def _template(spec: OpSpec) -> Callable[[OpSpec, Wrapper], Wrapper]:
    if spec.kind == "cat":
        return _cat
    if spec.kind == "attention":
        return _attention
    if spec.kind == "norm":
        return _norm
    if spec.kind in ("linear", "conv"):
        return _weighted
    return _matmul if len(spec.tensors) == 2 else _addmm


def _maker(spec: OpSpec) -> Callable[[Wrapper], Wrapper]:
    template = _template(spec)

    def make(orig: Wrapper) -> Wrapper:
        wrapper = template(spec, orig)
        # Keep name, docs and signature (torch.export and inspect follow __wrapped__).
        try:
            functools.update_wrapper(wrapper, orig)
        except AttributeError:  # some builtins lack attributes; keep what exists
            wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
        wrapper.__torchfix_spec__ = spec  # type: ignore[attr-defined]
        return wrapper

    return make


# (owner, attribute, spec name)
TARGETS: tuple[tuple[Any, str, str], ...] = (
    (torch, "matmul", "torch.matmul"),
    (torch, "mm", "torch.mm"),
    (torch, "bmm", "torch.bmm"),
    (torch, "addmm", "torch.addmm"),
    (torch, "baddbmm", "torch.baddbmm"),
    (torch.Tensor, "matmul", "Tensor.matmul"),
    (torch.Tensor, "__matmul__", "Tensor.__matmul__"),
    (torch.Tensor, "__rmatmul__", "Tensor.__rmatmul__"),
    (torch.Tensor, "mm", "Tensor.mm"),
    (torch.Tensor, "bmm", "Tensor.bmm"),
    (torch.Tensor, "addmm", "Tensor.addmm"),
    (torch.Tensor, "baddbmm", "Tensor.baddbmm"),
    (F, "linear", "F.linear"),
    (F, "conv1d", "F.conv1d"),
    (F, "conv2d", "F.conv2d"),
    (F, "conv3d", "F.conv3d"),
    (F, "scaled_dot_product_attention", "F.scaled_dot_product_attention"),
    (F, "layer_norm", "F.layer_norm"),
    (F, "group_norm", "F.group_norm"),
    (torch, "cat", "torch.cat"),
    (torch, "concat", "torch.concat"),
    (torch, "concatenate", "torch.concatenate"),
)

PATCHES: tuple[Patch, ...] = tuple(
    Patch(owner, attr, name if not name.startswith("F.") else f"torch.nn.functional.{attr}", _maker(SPECS[name]))
    for owner, attr, name in TARGETS
)
