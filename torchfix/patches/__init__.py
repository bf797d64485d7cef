"""Installing and removing torchfix's wrappers: the only code that writes torch attributes."""

from .core import Patch
from .torch_ops import PATCHES, TARGETS

__all__ = ["PATCHES", "TARGETS", "Patch", "install", "installed", "remove"]

import threading

_lock = threading.RLock()


def install() -> None:
    """Install every wrapper (idempotent)."""
    with _lock:
        for p in PATCHES:
            p.install()


def remove() -> None:
    """Remove every wrapper; each attribute ``is`` its original again."""
    with _lock:
        for p in reversed(PATCHES):
            p.remove()


def installed() -> list[str]:
    """Labels of the wrappers in place."""
    return [p.label for p in PATCHES if p.installed]
