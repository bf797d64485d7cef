"""The per-call question "which settings are in force here?", answered in ~0.1 µs.

A module of its own so that both the switch (:mod:`torchfix._state`) and the
wrappers (:mod:`torchfix.patches`) can import it.
"""

from __future__ import annotations

import contextvars

import torch

from .config import OFF, Settings

__all__ = ["current", "get_global", "scoped", "set_global"]

scoped: contextvars.ContextVar[Settings | None] = contextvars.ContextVar("torchfix_settings", default=None)
_global: Settings = OFF


def get_global() -> Settings:
    return _global


def set_global(settings: Settings) -> None:
    global _global
    _global = settings


# dynamo cannot trace ContextVar.get (a graph break); evaluating this once at
# trace time keeps compiled graphs whole.
@torch._dynamo.assume_constant_result
def current() -> Settings:
    """The settings in force in this thread / async context.

    Under ``torch.compile`` this is read once, at trace time: a compiled graph
    keeps the decisions of the settings active when it was traced.
    """
    s = scoped.get()
    return _global if s is None else s
