"""torchfix's one warn-once registry: every ``TorchfixWarning`` that is said once per
key (a call site and op in ``warn`` mode, a device type whose kernel is missing,
failed or fell back) goes through :func:`once`.

>>> import warnings
>>> reset()
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     [once(("doc", "example"), "said once") for _ in range(3)]
[True, False, False]
>>> len(caught)
1
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Hashable

from .errors import TorchfixWarning

__all__ = ["once", "reset"]

_seen: set[Hashable] = set()
_lock = threading.Lock()


def once(key: Hashable, text: str, *, site: str | None = None, stacklevel: int = 2) -> bool:
    """Warn ``text`` as a :class:`TorchfixWarning` unless ``key`` was warned about already.

    ``site`` (``file:line``) attributes the warning to the user's call site; without
    it, ``stacklevel`` counts from the caller of :func:`once`. Returns whether it warned.
    """
    with _lock:
        if key in _seen:
            return False
        _seen.add(key)
    if site is not None:
        filename, _, line = site.rpartition(":")
        warnings.warn_explicit(text, TorchfixWarning, filename or site, int(line) if line.isdigit() else 0, module="torchfix")
    else:
        warnings.warn(text, TorchfixWarning, stacklevel=stacklevel + 1)
    return True


def reset() -> None:
    """Forget every key: each warning may be said once again (``warn`` mode warns once per call site)."""
    with _lock:
        _seen.clear()
