"""The guarded torch callables and their wrappers.

Patch once, gate per call: each wrapper's first line asks which settings are
in force in this context (:func:`torchfix._context.current`); when torchfix is
off it calls straight through. When on, an inline *fast check* (one dtype, one
device, no known-issue row for this device type) also calls straight through
with the original arguments, so valid inputs give bit-identical results.
Anything else goes to :func:`torchfix.guards.engine.guarded_call`.

The fast checks are written out per argument shape rather than shared through
a helper: on torch 2.13 CPU a Python call costs ~80 ns and ``device.type``
~380 ns, against a budget of ~0.6 µs per guarded call. Each check only reads
attributes; an argument without them (not a tensor) raises AttributeError or
TypeError, which sends the call to the slow path, where torch reports it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .. import _context
from ..guards import engine
from ..guards import known_issues as ki
from ..guards.ops import SPECS, OpSpec
from .core import Patch

__all__ = ["PATCHES", "TARGETS"]

Wrapper = Callable[..., Any]
_NOT_TENSOR = (AttributeError, TypeError)


def _two(spec: OpSpec, orig: Wrapper) -> Wrapper:
    """matmul / mm / bmm and their Tensor methods: exactly two tensors."""
    current, slow, rows = _context.current, engine.guarded_call, ki.ACTIVE_HOLDER

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        settings = current()
        if settings.active:
            if kwargs or len(args) != 2:
                return slow(spec, orig, settings, args, kwargs)
            a, b = args
            try:
                dev = a.device
                if a.dtype is not b.dtype or dev != b.device or (rows[0] and dev.type in rows[0]):
                    return slow(spec, orig, settings, args, kwargs)
            except _NOT_TENSOR:
                return slow(spec, orig, settings, args, kwargs)
            return orig(a, b)
        return orig(*args, **kwargs)

    return wrapper


def _three(spec: OpSpec, orig: Wrapper) -> Wrapper:
    """linear / conv (input, weight[, bias], options...) and addmm / baddbmm (three tensors)."""
    current, slow, rows = _context.current, engine.guarded_call, ki.ACTIVE_HOLDER

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        settings = current()
        if settings.active:
            if kwargs or len(args) < 2:
                return slow(spec, orig, settings, args, kwargs)
            try:
                a, w = args[0], args[1]
                dt, dev = a.dtype, a.device
                if w.dtype is not dt or dev != w.device or (rows[0] and dev.type in rows[0]):
                    return slow(spec, orig, settings, args, kwargs)
                if len(args) > 2:
                    b = args[2]
                    if b is not None and (b.dtype is not dt or dev != b.device):
                        return slow(spec, orig, settings, args, kwargs)
            except _NOT_TENSOR:
                return slow(spec, orig, settings, args, kwargs)
        return orig(*args, **kwargs)

    return wrapper


def _attention(spec: OpSpec, orig: Wrapper) -> Wrapper:
    """scaled_dot_product_attention(q, k, v, attn_mask=None, ...): diffusers passes options by keyword."""
    current, slow, rows = _context.current, engine.guarded_call, ki.ACTIVE_HOLDER
    boolean = torch.bool

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        settings = current()
        if settings.active:
            try:
                q, k, v = args[0], args[1], args[2]
                dt, dev = q.dtype, q.device
                if k.dtype is not dt or v.dtype is not dt or dev != k.device or dev != v.device or (rows[0] and dev.type in rows[0]):
                    return slow(spec, orig, settings, args, kwargs)
                mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
                if mask is not None and ((mask.dtype is not dt and mask.dtype is not boolean) or dev != mask.device):
                    return slow(spec, orig, settings, args, kwargs)
            except (*_NOT_TENSOR, IndexError):
                return slow(spec, orig, settings, args, kwargs)
        return orig(*args, **kwargs)

    return wrapper


def _norm(spec: OpSpec, orig: Wrapper) -> Wrapper:
    """layer_norm / group_norm (input, shape-or-groups, weight, bias, eps)."""
    current, slow, rows = _context.current, engine.guarded_call, ki.ACTIVE_HOLDER

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        settings = current()
        if settings.active:
            try:
                x = args[0]
                dt, dev = x.dtype, x.device
                if rows[0] and dev.type in rows[0]:
                    return slow(spec, orig, settings, args, kwargs)
                w = args[2] if len(args) > 2 else kwargs.get("weight")
                b = args[3] if len(args) > 3 else kwargs.get("bias")
                if (w is not None and (w.dtype is not dt or dev != w.device)) or (b is not None and (b.dtype is not dt or dev != b.device)):
                    return slow(spec, orig, settings, args, kwargs)
            except (*_NOT_TENSOR, IndexError):
                return slow(spec, orig, settings, args, kwargs)
        return orig(*args, **kwargs)

    return wrapper


def _cat(spec: OpSpec, orig: Wrapper) -> Wrapper:
    """cat / concat / concatenate(tensors, dim)."""
    current, slow, rows = _context.current, engine.guarded_call, ki.ACTIVE_HOLDER

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        settings = current()
        if settings.active:
            try:
                seq = args[0] if args else kwargs["tensors"]
                if seq:
                    first = seq[0]
                    dt, dev = first.dtype, first.device
                    if rows[0] and dev.type in rows[0]:
                        return slow(spec, orig, settings, args, kwargs)
                    for t in seq:
                        if t.dtype is not dt or dev != t.device:
                            return slow(spec, orig, settings, args, kwargs)
            except (*_NOT_TENSOR, IndexError, KeyError):
                return slow(spec, orig, settings, args, kwargs)
        return orig(*args, **kwargs)

    return wrapper


def _template(spec: OpSpec) -> Callable[[OpSpec, Wrapper], Wrapper]:
    if spec.kind == "cat":
        return _cat
    if spec.kind == "attention":
        return _attention
    if spec.kind == "norm":
        return _norm
    return _two if len(spec.tensors) == 2 else _three


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
