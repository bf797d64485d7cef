"""Install and remove attributes, by handle, reversibly.

The only module (with :mod:`torchfix.patches.torch_ops`) that writes attributes
on torch. The rules, learned from wrapt's ``patches.py``:

* A :class:`Patch` remembers whether the owner held the attribute in its own
  ``__dict__`` or inherited it (``Tensor.mm`` lives on ``torch._C.TensorBase``).
  Removal restores the exact raw value, or deletes the override so inheritance
  shows through again; either way ``getattr(owner, name) is original`` afterwards.
* Removal is by handle: if someone patched the attribute again after us, we do
  not tear their wrapper out from under them; ours goes passive (it calls
  straight through once torchfix is off) and a warning says so.
* A wrapper is built once per original: installing again over the same original reuses it (entering
  and leaving ``torchfix.enabled()`` costs a ``setattr`` per attribute, not a build of every wrapper).
* Never a wrapper over a wrapper: installing a patch that is already installed
  is a no-op, and so is installing it again while a wrapper someone put over
  ours (left in place by a removal) still calls ours: ours is active again
  inside theirs, instead of a second torchfix wrapper on top that would guard
  and record every call twice. (A foreign wrapper that hides what it wraps,
  without ``__wrapped__``, cannot be seen through.)
* Every restore path (:class:`Patch`, and the per-object handles in
  :mod:`torchfix.patches.instance`) treats "someone replaced what torchfix set"
  the same way: theirs stays, and :func:`leave_theirs` says so once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .. import _warn

__all__ = ["Patch", "leave_theirs"]

log = logging.getLogger("torchfix")
_MISSING = object()


def leave_theirs(label: str, what: str = "") -> None:
    """What every torchfix restore does when its value was replaced since: leave theirs in place, and
    say so once per ``label`` (a ``TorchfixWarning``), with ``what`` became of torchfix's own value."""
    text = f"torchfix: {label} was replaced by someone else after torchfix set it; leaving theirs in place{what}."
    _warn.once(("replaced", label), text, stacklevel=3)


def _ours_inside(value: Any, patch: Patch) -> bool:
    """Whether ``value`` is ``patch``'s wrapper or wraps it (following ``__wrapped__``)."""
    for _ in range(32):
        if value is None:
            return False
        if getattr(value, "__torchfix_patch__", None) is patch:
            return True
        value = getattr(value, "__wrapped__", None)
    return False


class Patch:
    """One attribute replaced by a wrapper built from the original.

    Args:
        owner: the module or class holding the attribute.
        name: the attribute name.
        label: display name, e.g. ``torch.matmul``.
        make: builds the wrapper from the original callable.

    >>> import types
    >>> ns = types.SimpleNamespace(f=len)
    >>> p = Patch(ns, "f", "ns.f", lambda orig: (lambda x: orig(x) + 1))
    >>> p.install(); ns.f("ab")
    3
    >>> p.remove(); ns.f is len
    True
    """

    def __init__(self, owner: Any, name: str, label: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        self.owner = owner
        self.name = name
        self.label = label
        self._make = make
        self.original: Any = None
        self.wrapper: Any = None  # ours; kept while it lives on inside someone else's wrapper
        self._raw: Any = _MISSING  # the owner's own __dict__ entry, if it had one
        self._on = False
        self._built: tuple[Any, Any] | None = None  # (original, the wrapper made from it), reused by the next install

    @property
    def installed(self) -> bool:
        return self._on

    def install(self) -> None:
        if self._on:
            return
        current = getattr(self.owner, self.name)
        if self.wrapper is not None and _ours_inside(current, self):
            self._on = True  # ours still runs inside theirs: active again, never a second one on top
            log.debug("torchfix: %s still wraps torchfix's wrapper; not stacking another", self.label)
            return
        self._raw = vars(self.owner).get(self.name, _MISSING)
        self.original = current
        if self._built is not None and self._built[0] is current:
            wrapper = self._built[1]  # the same original as last time: the same wrapper (an install costs a setattr)
        else:
            wrapper = self._make(self.original)
            wrapper.__torchfix_patch__ = self
            self._built = (current, wrapper)
        setattr(self.owner, self.name, wrapper)
        self.wrapper, self._on = wrapper, True
        log.debug("torchfix: patched %s", self.label)

    def remove(self) -> None:
        if not self._on:
            return
        self._on = False
        current = vars(self.owner).get(self.name, _MISSING)
        if current is not self.wrapper:
            leave_theirs(self.label, " (torchfix's own wrapper inside it calls straight through while torchfix is off)")
            return  # ours stays reachable inside theirs; a later install adopts it
        if self._raw is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self._raw)
        self.wrapper, self._raw = None, _MISSING
        log.debug("torchfix: restored %s", self.label)

    def __repr__(self) -> str:
        return f"<Patch {self.label} {'installed' if self._on else 'removed'}>"
