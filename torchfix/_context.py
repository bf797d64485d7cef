"""The question "which settings are in force here?", answered in ~0.05 µs.

A module of its own so that both the switch (:mod:`torchfix._state`) and the
wrappers (:mod:`torchfix.patches`) can import it.
"""

from __future__ import annotations

import contextvars
import threading

import torch

from .config import OFF, Settings

__all__ = ["current", "get_global", "pop_scoped", "push_scoped", "scoped", "set_global"]

scoped: contextvars.ContextVar[Settings | None] = contextvars.ContextVar("torchfix_settings", default=None)
_global: Settings = OFF
# The same scoped settings, per thread, for compiled code: dynamo cannot trace
# ContextVar.get (a graph break) but traces a thread-local read and guards on it.
_compiled = threading.local()


# Set by torchfix.wrap around a call it learns from: the guards append
# (module, attribute name, target dtype) for every parameter or buffer they cast.
param_casts: contextvars.ContextVar[list[tuple[object, str, object]] | None] = contextvars.ContextVar("torchfix_param_casts", default=None)


def push_scoped(settings: Settings) -> tuple[contextvars.Token[Settings | None], Settings | None]:
    """Make ``settings`` current in this context; returns what :func:`pop_scoped` needs."""
    token = scoped.set(settings)
    previous = getattr(_compiled, "settings", None)
    _compiled.settings = settings
    return token, previous


def pop_scoped(state: tuple[contextvars.Token[Settings | None], Settings | None]) -> None:
    token, previous = state
    scoped.reset(token)
    _compiled.settings = previous


def get_global() -> Settings:
    return _global


def set_global(settings: Settings) -> None:
    global _global
    _global = settings


def current() -> Settings:
    """The settings in force in this thread / async context.

    Under ``torch.compile`` dynamo traces this read and guards on the values it
    returns: enabling, disabling or changing the mode, guards, dtype, device
    policy or kernels recompiles, and a compiled graph never keeps settings
    that are no longer in force. The global settings are a plain module global
    for the same reason.

    The patched wrappers' fast path reads no settings; they call this function on
    their general path (while tracing, or once torch has raised).
    """
    if torch.compiler.is_dynamo_compiling():  # folded to True while dynamo traces
        s = getattr(_compiled, "settings", None)
    else:
        s = scoped.get()
    return _global if s is None else s
