"""Modules whose output depends on the prompt alone (a text projection, a text refiner that takes no timestep),
named by a family's registry entry (:attr:`torchfix.families.Family.prompt_only`): a cached step (with a
``threshold``, a step the features decide) reuses what they returned when they last ran in its stream instead of
running them again.

Checked on every call, never assumed: a cached step reuses a module's output only where the module is called with
what it got when it ran (the very tensors, unchanged, or tensors of the same shape, dtype and values, and
equal other arguments), and where nothing changed that output in place since. Anything else runs the module, so
the reuse is exact: a cached step returns what it would have returned without it. Full steps always run the
modules (the first full call verifies the model as it is).

Under context or tensor parallelism (other ranks share each call) they always run: a rank that reused one while
another ran it would leave the other waiting in its collectives.

Where a pipeline passes the same prompt tensors every step (diffusers' pipelines do, per guidance pass) the check
reads no tensor; where the model builds a module's input anew each call (Z-Image concatenates its caption features)
it compares values, which on a GPU waits for the device once per such module and cached step.

>>> from torchfix.deepcache.prompt_only import same
>>> import torch
>>> a = torch.ones(2)
>>> same([(a, a._version)], [a]), same([(a, a._version)], [torch.ones(2)]), same([(a, a._version)], [torch.zeros(2)])
(True, True, False)
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from ..patches import instance
from . import engine
from .parallel import ranks

__all__ = ["install", "leaves", "modules", "same"]

HOOK = "torchfix_deepcache_prompt_only"
_OPAQUE = object()  # an argument that cannot be compared (reuse refused)


def modules(model: torch.nn.Module, paths: tuple[str, ...]) -> list[tuple[str, torch.nn.Module]]:
    """The modules ``paths`` name on ``model`` (a ``ModuleList`` or ``ModuleDict``: each of its modules), with their
    names; a path the model lacks names nothing (the modules then simply run)."""
    found = []
    for path in paths:
        try:
            module = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            found += [(f"{path}.{name}", m) for name, m in module.named_children()]
        else:
            found.append((path, module))
    return found


def leaves(value: Any) -> list[Any]:
    """The values a call's arguments are made of, in order: tensors, and plain values (``None``, numbers, strings,
    bools); lists, tuples and dicts are opened. Anything else is :data:`_OPAQUE`."""
    if isinstance(value, torch.Tensor) or value is None or isinstance(value, (bool, int, float, str)):
        return [value]
    if isinstance(value, (list, tuple)):
        return [type(value), len(value), *(x for v in value for x in leaves(v))]
    if isinstance(value, dict):
        return [dict, tuple(value), *(x for v in value.values() for x in leaves(v))]
    return [_OPAQUE]


def _marked(values: list[Any]) -> list[tuple[Any, Any]]:
    """Each value with what tells later whether it changed in place (tensors: :func:`engine.marker`)."""
    return [(v, engine.marker(v) if isinstance(v, torch.Tensor) else None) for v in values]


def same(held: list[tuple[Any, Any]], now: list[Any]) -> bool:
    """Whether ``now`` (a call's :func:`leaves`) is what ``held`` was when it was marked: the very tensors, unchanged
    since, or tensors of the same shape, dtype, device and values; other values equal."""
    if len(held) != len(now):
        return False
    for (was, mark), value in zip(held, now):
        if isinstance(was, torch.Tensor):
            if not isinstance(value, torch.Tensor) or engine.changed(was, mark):
                return False
            if value is was:
                continue
            if value.shape != was.shape or value.dtype != was.dtype or value.device != was.device or not torch.equal(value, was):
                return False
        elif was is _OPAQUE or value is _OPAQUE or isinstance(value, torch.Tensor) or type(value) is not type(was) or value != was:
            return False
    return True


def _outside_graphs(fn: Any) -> Any:
    """:func:`torchfix.deepcache._graphs.outside_graphs` with a wrapper of its own. Dynamo keys what it compiled on a
    function's code, and that wrapper's code is shared by every function it decorates: where a compiled forward breaks
    into one as a frame of its own (a prompt-only module's), each function is a recompile of that one code, and one
    more function took HunyuanVideo 1.5 past dynamo's limit of 8 (a warning; no recompile across steps either way)."""
    disabled: list[Any] = []

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return wrapper


@_outside_graphs
def _call(state: Any, key: tuple[str, int], original: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """One call of a prompt-only module in a full or a cached step, or one whose features decide (a ``threshold``'s
    probe: the module runs before the blocks are reached). Eager: it reads tensors to compare them. A step other than a
    full one reuses what the module returned when it last ran in this stream, where it is called with what it got
    then; wherever it runs, what it got and returned is held for the next step."""
    stream = state.generation.current
    now = leaves((args, kwargs))
    if state.step.mode != "full":  # cached, or a probe (the features decide once the blocks are reached)
        held = stream.prompt_only.get(key)
        if held is not None and same(held[0], now) and not any(engine.changed(t, mark) for t, mark in held[2]):
            state.prompt_only_reused += 1
            return held[1]
    given = _marked(now)  # as it comes in: a module that changes what it got in place is never reused
    out = original(*args, **kwargs)
    outputs = [t for t in leaves(out) if isinstance(t, torch.Tensor)]
    if _OPAQUE in now or _OPAQUE in leaves(out) or any(t.requires_grad for t in outputs):
        stream.prompt_only.pop(key, None)  # nothing it can be checked against, or autograd would see a stale graph
    else:
        stream.prompt_only[key] = (given, out, _marked(outputs))
    return out


def _forward(state_ref: weakref.ref, name: str) -> Any:
    def make(original: Any, source: Any) -> Any:
        @functools.wraps(source)
        def forward(*args: Any, **kwargs: Any) -> Any:
            state = state_ref()
            step = state.step if state is not None else None
            if step is None or step.mode not in ("full", "cached", "probe") or state.generation.current is None or ranks(state).shared:
                return original(*args, **kwargs)
            count = step.prompt_only_calls.get(name, 0)
            step.prompt_only_calls[name] = count + 1
            return _call(state, (name, count), original, args, kwargs)

        forward.__torchfix_deepcache__ = True  # type: ignore[attr-defined]
        return forward

    return make


def install(state: Any, model: torch.nn.Module, paths: tuple[str, ...]) -> list[str]:
    """Wrap the forwards of the modules ``paths`` name on ``model`` (handles into ``state.handles``); their names."""
    state_ref = weakref.ref(state)
    found = modules(model, paths)
    for name, module in found:
        state.handles.append(instance.wrap_forward(module, HOOK, _forward(state_ref, name)))
    return [name for name, _ in found]
