"""Keeping DeepCache's Python decisions out of compiled graphs."""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

__all__ = ["forget_compiled", "outside_graphs"]


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


def forget_compiled(what: str) -> bool:
    """Drop the code torch.compile made in this process, if it made any, after DeepCache went in or out.

    Dynamo does not guard on module hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``, on by
    default): a graph compiled before DeepCache's capture hook was added, for this model or any other
    of its class, would be reused without it, and DeepCache would silently never cache (seen: 9 full
    steps of 9). Everything compiled recompiles once, on its next call. Returns whether it reset.
    """
    import sys

    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:  # nothing was ever compiled: never import dynamo for it
        return False
    stats = dynamo.utils.counters.get("stats", {})
    if not stats.get("unique_graphs"):
        return False
    dynamo.reset()
    logging.getLogger("torchfix").info(
        "torchfix.deepcache: %s: torch.compile's graphs were reset (dynamo does not guard on module hooks); "
        "compiled models recompile once on their next call",
        what,
    )
    return True
