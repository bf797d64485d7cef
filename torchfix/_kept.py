"""Which tensors a model keeps in their precision on purpose, and which are its buffers:
marks on the tensors themselves.

The eager guards can also learn both from the Python stack (the module frames of
the call). Compiled code has no module frames, so the marks are what makes
``keep_dtype``, ``_keep_in_fp32_modules`` and "a buffer follows the activations"
behave the same under ``torch.compile`` as eagerly: dynamo folds an attribute read
on a parameter or buffer into the trace and guards on it (a mark added or removed
later recompiles).

Marks are set by :func:`keep_dtype`, by ``torchfix.wrap`` (every component, undone
by ``unwrap``) and by ``torch.compile`` / ``Module.compile`` while torchfix is on
(:func:`mark_model`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

import torch

from . import _frames
from .errors import InvalidArgumentTypeError
from .guards import dtype as dtype_guard

__all__ = ["KEEP", "OWNED", "Mark", "is_kept", "is_kept_module", "is_owned", "keep_dtype", "kept_parameters", "mark_model", "unmark"]

KEEP = "_torchfix_keep"  # "module": torchfix.keep_dtype; "fp32": listed in _keep_in_fp32_modules (kept while float32)
OWNED = "_torchfix_owned"  # a buffer of a model torchfix has seen (a parameter needs no mark)
_MISSING = object()

_kept_modules: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


class Mark(NamedTuple):
    """One mark set on a tensor, with the value it replaced (for :func:`unmark`)."""

    tensor: torch.Tensor
    attr: str
    previous: object


def _set(tensor: torch.Tensor, attr: str, value: object, marks: list[Mark]) -> None:
    previous = tensor.__dict__.get(attr, _MISSING)
    if previous == value or (attr == KEEP and previous == "module"):
        return  # already so; keep_dtype's mark outranks a listed name's
    setattr(tensor, attr, value)
    marks.append(Mark(tensor, attr, previous))


def keep_dtype(module: torch.nn.Module) -> torch.nn.Module:
    """Mark a module as kept in its precision on purpose (like diffusers'
    ``_keep_in_fp32_modules``): when dtypes meet in it, its *input* is cast
    to its weight's dtype instead of its weights to the input's. Eager and
    compiled alike.

    >>> import torch, torchfix
    >>> norm = torchfix.keep_dtype(torch.nn.LayerNorm(4))
    """
    if not isinstance(module, torch.nn.Module):
        raise InvalidArgumentTypeError(f"torchfix.keep_dtype takes an nn.Module, not {type(module).__name__}.")
    _kept_modules.add(module)
    for t in (*module.parameters(), *module.buffers()):
        setattr(t, KEEP, "module")
    return module


def _listed(root: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The submodules of ``root`` listed in a ``_keep_in_fp32_modules`` (of ``root`` or of a model nested in it)."""
    for model in root.modules():
        if getattr(model, "_keep_in_fp32_modules", None):
            for sub_path, sub in model.named_modules():
                if sub_path and dtype_guard.kept_in_fp32(model, sub_path):
                    yield sub


def mark_model(root: torch.nn.Module) -> list[Mark]:
    """Mark the parameters of ``root``'s submodules listed in a ``_keep_in_fp32_modules``
    (of ``root`` or of any model nested in it) and every buffer of ``root``.

    Returns the marks it set, for :func:`unmark`. Cheap enough to call once per
    compile or wrap (one walk of the module tree).

    >>> import torch
    >>> class M(torch.nn.Module):
    ...     _keep_in_fp32_modules = ["proj"]
    ...     def __init__(self):
    ...         super().__init__(); self.proj = torch.nn.Linear(2, 2)
    >>> m = M(); marks = mark_model(m); is_kept(m.proj.weight, ())
    True
    >>> unmark(marks); is_kept(m.proj.weight, ())
    False
    """
    marks: list[Mark] = []
    for sub in _listed(root):
        for p in sub.parameters():
            _set(p, KEEP, "fp32", marks)
    for b in root.buffers():
        _set(b, OWNED, True, marks)
    return marks


def is_kept_module(module: torch.nn.Module) -> bool:
    """``torchfix.keep_dtype`` was called on this very module."""
    return module in _kept_modules


def kept_parameters(root: torch.nn.Module) -> set[int]:
    """The ids of ``root``'s parameters kept in their precision on purpose: of a module given to
    :func:`keep_dtype`, or listed in a ``_keep_in_fp32_modules`` while float32. They keep their
    dtype and are not counted in the model's own (a T5 with its ``wo`` kept fp32 is a bf16 model)."""
    kept = {id(p) for p in root.parameters() if p.__dict__.get(KEEP) == "module"}
    for module in root.modules():
        if module in _kept_modules:
            kept.update(id(p) for p in module.parameters())
    for sub in _listed(root):
        kept.update(id(p) for p in sub.parameters() if p.dtype == torch.float32)
    return kept


def unmark(marks: Iterable[Mark]) -> None:
    """Undo :func:`mark_model`: each mark goes back to what it replaced."""
    for m in reversed(list(marks)):
        if m.previous is _MISSING:
            m.tensor.__dict__.pop(m.attr, None)
        else:
            setattr(m.tensor, m.attr, m.previous)


def is_kept(weight: torch.Tensor | None, chain: Sequence[torch.nn.Module] | None) -> bool:
    """Whether the op that uses ``weight`` runs in a module kept in its precision.

    The mark decides where there is one (also while torch.compile traces); eagerly,
    the running modules (``chain``, innermost first) are asked too.
    """
    if weight is None:
        return False
    mark = getattr(weight, KEEP, None)
    if mark == "module" or (mark == "fp32" and weight.dtype == torch.float32):
        return True
    if not chain:
        return False
    if any(m in _kept_modules for m in chain):
        return True
    if weight.dtype != torch.float32:
        return False
    # diffusers/transformers name fp32-kept submodules on the model class.
    return any(
        getattr(root, "_keep_in_fp32_modules", None) and dtype_guard.kept_in_fp32(root, _frames.module_path([chain[0], root]) or "")
        for root in reversed(chain)
    )


def is_owned(t: torch.Tensor, chain: Sequence[torch.nn.Module] | None) -> bool:
    """A parameter, or a buffer of a module being run (marked, or found in ``chain``):
    it follows the activations."""
    if isinstance(t, torch.nn.Parameter) or getattr(t, OWNED, False):
        return True
    return chain is not None and any(t is b for m in chain for b in m._buffers.values())
