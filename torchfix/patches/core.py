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
* Never a wrapper over a wrapper: installing a patch that is already installed
  is a no-op.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

from ..errors import TorchfixWarning

__all__ = ["Patch"]

log = logging.getLogger("torchfix")
_MISSING = object()


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
        self.wrapper: Any = None
        self._raw: Any = _MISSING  # the owner's own __dict__ entry, if it had one

    @property
    def installed(self) -> bool:
        return self.wrapper is not None

    def install(self) -> None:
        if self.installed:
            return
        self._raw = vars(self.owner).get(self.name, _MISSING)
        self.original = getattr(self.owner, self.name)
        self.wrapper = self._make(self.original)
        setattr(self.owner, self.name, self.wrapper)
        log.debug("torchfix: patched %s", self.label)

    def remove(self) -> None:
        if not self.installed:
            return
        current = vars(self.owner).get(self.name, _MISSING)
        if current is not self.wrapper:
            warnings.warn(
                f"torchfix: {self.label} was replaced by someone else after torchfix patched it; "
                "leaving their wrapper in place (torchfix's own wrapper now calls straight through).",
                TorchfixWarning,
                stacklevel=3,
            )
        elif self._raw is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self._raw)
        log.debug("torchfix: restored %s", self.label)
        self.wrapper = None
        self._raw = _MISSING

    def __repr__(self) -> str:
        return f"<Patch {self.label} {'installed' if self.installed else 'removed'}>"
