"""Keeping DeepCache's Python decisions out of compiled graphs."""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["outside_graphs"]


def outside_graphs(fn: Any) -> Any:
    """``torch.compiler.disable(fn)``, made when dynamo first traces a call to ``fn``: decorating
    at import time would import torch._dynamo (and Triton) with torchfix, ~1.3 s. In eager
    ``fn`` runs directly; while dynamo traces, the call to ``torch.compiler.disable`` itself is
    a graph break that runs eagerly once, and every trace after that calls the disabled function."""
    disabled: list[Any] = []

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return wrapper
