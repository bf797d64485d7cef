"""Reversible changes to *one object* (a UNet's ``forward``, a scheduler's
``set_timesteps``, a module hook), never to its class.

Patching a class to change one instance would change every pipeline in the
process; these helpers set instance attributes and remember exactly what was
there, so that removal leaves the object as it was (an attribute that was
inherited from the class is deleted again, not left as a copy).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["AttrHandle", "HookHandle", "add_hook", "set_attr"]

_MISSING = object()


@dataclass
class AttrHandle:
    """What :func:`set_attr` replaced; ``restore()`` puts it back (once)."""

    obj: Any
    name: str
    value: Any
    previous: Any = _MISSING
    active: bool = True

    def restore(self) -> None:
        if not self.active:
            return
        self.active = False
        if vars(self.obj).get(self.name, _MISSING) is not self.value:
            return  # replaced again by someone else since: theirs stays
        if self.previous is _MISSING:
            delattr(self.obj, self.name)
        else:
            setattr(self.obj, self.name, self.previous)


def set_attr(obj: Any, name: str, value: Any) -> AttrHandle:
    """Set ``obj.name = value`` on the instance, remembering what its ``__dict__`` held.

    >>> import types
    >>> ns = types.SimpleNamespace()
    >>> h = set_attr(ns, "x", 1); h.restore(); hasattr(ns, "x")
    False
    """
    previous = vars(obj).get(name, _MISSING)
    setattr(obj, name, value)
    return AttrHandle(obj, name, value, previous)


@dataclass
class HookHandle:
    """A forward (pre-)hook added by :func:`add_hook`; ``restore()`` removes it."""

    handle: Any = field(repr=False)

    def restore(self) -> None:
        self.handle.remove()


def add_hook(module: torch.nn.Module, fn: Callable[..., Any], *, pre: bool = False, with_kwargs: bool = False) -> HookHandle:
    """Register a forward hook (or pre-hook) on one module; remove it with ``restore()``."""
    if pre:
        return HookHandle(module.register_forward_pre_hook(fn, with_kwargs=with_kwargs))
    return HookHandle(module.register_forward_hook(fn, with_kwargs=with_kwargs))
