"""Keeping DeepCache's Python decisions out of compiled graphs."""

from __future__ import annotations

import logging

from .._frames import outside_graphs

__all__ = ["forget_compiled", "outside_graphs"]


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
