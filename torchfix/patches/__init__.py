"""Installing and removing torchfix's wrappers: the only code that writes torch attributes."""

import threading

from . import compilers, libraries
from .compile import PATCH as COMPILE
from .core import Patch
from .torch_ops import PATCHES, TARGETS

__all__ = ["ALL", "PATCHES", "TARGETS", "Patch", "install", "installed", "remove"]

# The guarded ops, then torch.compile (which marks a model's kept tensors before dynamo traces it).
ALL: tuple[Patch, ...] = (*PATCHES, COMPILE)

_lock = threading.RLock()


def install() -> None:
    """Install every wrapper (idempotent)."""
    with _lock:
        for p in ALL:
            p.install()
        libraries.install()
        compilers.sync()


def remove() -> None:
    """Remove every wrapper; each attribute ``is`` its original again."""
    with _lock:
        libraries.remove()
        for p in reversed(ALL):
            p.remove()
        compilers.sync()


def installed() -> list[str]:
    """Labels of the wrappers in place."""
    return [p.label for p in ALL if p.installed] + libraries.installed()
