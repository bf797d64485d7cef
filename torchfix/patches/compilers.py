"""Teach torch's compilers about the wrappers: dynamo traces them, TorchScript sees through them.

Dynamo: keep its table of torch functions pointing at torch's originals, never at our wrappers.

Dynamo builds its table of torch functions (``trace_rules.get_torch_obj_rule_map``) once,
from the attributes in place at that moment. Built while torchfix's wrappers are installed,
it lists a wrapper as "torch.cat" and not the original: dynamo then puts the wrapper in the
graph instead of tracing its checks, and once that wrapper is gone (``disable()``, or a new
one installed) it no longer knows torch's own ``torch.cat``: plain ``torch.compile``
graph-breaks on every guarded op. :func:`sync` swaps every wrapper key back to what it wraps.
Its set of Tensor methods (``trace_rules.get_tensor_method``) is built the same way, from the
builtin methods on ``torch.Tensor`` at that moment: built while a wrapper sat on ``Tensor.mm``,
it lacks ``TensorBase.mm``, and ``torch.Tensor.mm(x, y)`` under ``torch.compile(fullgraph=True)``
failed ("does not know how to trace the builtin TensorBase.mm"), with torchfix on and after
``disable()`` alike. That set is a frozenset behind ``functools.cache``: :func:`sync` rebuilds it
with the originals in place for the moment it takes. It never imports dynamo: where dynamo is
not loaded yet there is no table to fix.

TorchScript: ``torch.jit.script`` of any module that calls ``F.linear`` (``nn.Linear``) looks the
function up in its table of builtins by identity; our wrapper is not in it, TorchScript tries to
compile the wrapper's Python and fails. :func:`sync` registers each installed wrapper under its
original's aten name (a scripted graph calls the aten op directly, as it does without torchfix)
and drops wrappers no longer installed.
"""

from __future__ import annotations

import logging
import sys
import types
from typing import Any

import torch

from .torch_ops import PATCHES

__all__ = ["sync"]

# id(wrapper) -> wrapper, for every wrapper registered with TorchScript (the reference keeps the id
# from being reused while the entry stands).
_scripted: dict[int, Any] = {}

log = logging.getLogger("torchfix")


def _ours(key: Any) -> bool:
    try:
        return getattr(key, "__torchfix_spec__", None) is not None
    except Exception:  # a key with an odd __getattr__ is not ours
        return False


def sync() -> None:
    """Bring dynamo's and TorchScript's tables in line with the wrappers installed now.

    >>> sync()  # nothing to do, or the tables fixed; never raises
    """
    _sync_dynamo()
    _sync_tensor_methods()
    _sync_script()


def _table(module: str, getter: str, what: str) -> Any:
    """What ``module.getter()`` returns, where that module is loaded already; ``None`` where it is
    not, or where the table cannot be read on this torch (the compiler will say so itself)."""
    table_of = getattr(sys.modules.get(module), getter, None)
    if table_of is None:
        return None
    try:
        return table_of()
    except Exception as exc:
        log.debug("torchfix: %s not readable (%s); left alone", what, exc)
        return None


def _sync_script() -> None:
    table = _table("torch.jit._builtins", "_get_builtin_table", "TorchScript's builtin table")
    if table is None:
        return
    live = {id(p.wrapper): p for p in PATCHES if p.installed and p.wrapper is not None}
    for key in [k for k in _scripted if k not in live]:
        table.pop(key, None)
        del _scripted[key]
    for key, p in live.items():
        op = table.get(id(p.original))
        if op is not None and key not in _scripted:
            table[key] = op
            _scripted[key] = p.wrapper


# The rule table last made clean, held so that its id stays its own: dynamo builds the table once (a cached function)
# and never adds to it, so wrappers enter it only when it is built while they are installed. A table already made
# clean is not scanned again (~2,700 keys: most of the cost of entering and leaving `torchfix.enabled()`).
_clean: list[Any] = [None]


def _sync_dynamo() -> None:
    table = _table("torch._dynamo.trace_rules", "get_torch_obj_rule_map", "dynamo's rule table")
    if not isinstance(table, dict) or table is _clean[0]:
        return
    _clean[0] = table
    for key in [k for k in table if _ours(k)]:
        rule = table.pop(key)
        original = key
        while _ours(original):
            original = original.__wrapped__
        table.setdefault(original, rule)


# The kinds of Tensor attribute dynamo's set of Tensor methods holds (trace_rules.get_tensor_method).
_BUILTIN_METHODS = (types.MethodDescriptorType, types.WrapperDescriptorType, types.BuiltinFunctionType)


def _sync_tensor_methods() -> None:
    have = _table("torch._dynamo.trace_rules", "get_tensor_method", "dynamo's set of Tensor methods")
    ours = [p for p in PATCHES if p.owner is torch.Tensor and isinstance(p.original, _BUILTIN_METHODS)]
    if have is None or all(p.original in have for p in ours):
        return
    # Rebuild it with torch's own methods in place: ours step aside for the moment it takes
    # (only where ours is the attribute; a wrapper someone put over ours stays).
    methods = sys.modules["torch._dynamo.trace_rules"].get_tensor_method
    aside = [p for p in ours if p.installed and vars(torch.Tensor).get(p.name) is p.wrapper]
    try:
        for p in aside:
            setattr(torch.Tensor, p.name, p.original)
        methods.cache_clear()
        methods()
    except Exception as exc:  # a torch whose set cannot be rebuilt here: dynamo will say so itself
        log.debug("torchfix: dynamo's set of Tensor methods not rebuilt (%s); left alone", exc)
    finally:
        for p in aside:
            setattr(torch.Tensor, p.name, p.wrapper)
