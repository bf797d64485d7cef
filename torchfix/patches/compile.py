"""``torch.compile``, wrapped while torchfix is on, so that the guards decide compiled as eagerly.

Compiled code has no module frames, so before dynamo traces a model the model's
kept-precision parameters and its buffers are marked (:func:`torchfix._kept.mark_model`).
``Module.compile`` goes through ``torch.compile`` too. The call itself is torch's,
with the caller's arguments, unchanged; a model compiled before torchfix was
switched on can be marked with ``torchfix.wrap`` or ``torchfix.keep_dtype``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .. import _kept
from . import compilers
from .core import Patch

__all__ = ["PATCH"]


def _mark(model: Any) -> None:
    root = model if isinstance(model, torch.nn.Module) else getattr(model, "__self__", None)
    if isinstance(root, torch.nn.Module):  # a module, or a module's bound method (Module.compile)
        _kept.mark_model(root)


def _make(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def compile(*args: Any, **kwargs: Any) -> Any:
        model = args[0] if args else kwargs.get("model")
        if model is None:  # @torch.compile(...) : torch returns a decorator
            decorator = orig(*args, **kwargs)

            @functools.wraps(decorator)
            def decorate(fn: Any) -> Any:
                _mark(fn)
                compiled = decorator(fn)
                compilers.sync()
                return compiled

            return decorate
        _mark(model)
        compiled = orig(*args, **kwargs)
        compilers.sync()  # dynamo is loaded now: its table must name torch's originals before it traces
        return compiled

    return compile


PATCH = Patch(torch, "compile", "torch.compile", _make)
