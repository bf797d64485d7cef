"""A side component's whole call in the pipeline's dtype, as the maintainers' fix runs it
(:func:`torchfix.guards.dtype.whole_call` decides; this module applies).

Where a pipeline component that is not its denoiser (a ControlNet, a VAE) is left in another dtype than the pipeline
by a forgotten ``torch_dtype`` and is handed the pipeline's latents, plain torch rejects the call at its first layer.
Fixed op by op, such a call would mix dtypes where torch accepts it (a ControlNet adds its fp32 control image to its
fp16 latents and hands fp32 residuals on, huggingface/diffusers#4860; a VAE decoder casts to its fp32 up blocks,
#7572). Instead the call runs with the component's floating parameters and buffers cast to the pipeline's dtype and
its floating arguments with them: what ``component.to(pipe.dtype)`` runs, without changing the component (its own
tensors are back when the call ends, however it ends). Parameters kept in their precision on purpose
(``_keep_in_fp32_modules``, ``torchfix.keep_dtype``) keep it, as ``from_pretrained(torch_dtype=...)`` keeps them.
Under ``torchfix.wrap`` the cast tensors are handed to its one-time cast (downwards only), so later calls run natively.

>>> import torch
>>> from torchfix.runtime.component import weights_in
>>> lin = torch.nn.Linear(2, 2)
>>> with weights_in(lin, torch.float16):
...     lin.weight.dtype
torch.float16
>>> lin.weight.dtype
torch.float32
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .. import _context, _frames, _kept, _model, _warn
from .._report import FixEvent, report
from .._text import dtype_name
from ..families import DENOISERS
from ..guards import dtype as dtype_guard

__all__ = ["Plan", "plan", "run", "running", "weights_in"]

log = logging.getLogger("torchfix")

# Where a component's call hands its first layer the tensor it reads: ControlNets (sample / hidden_states), autoencoders
# (decode's z, encode's x); else the first positional argument.
_FIRST = ("sample", "hidden_states", "z", "x")


@dataclass(frozen=True)
class Plan:
    """One call of ``module`` to run in ``dtype`` instead of its own ``own``, handed its first layer's tensor in
    ``given``; ``name`` is its path for messages."""

    module: torch.nn.Module
    name: str
    own: torch.dtype
    dtype: torch.dtype
    given: torch.dtype


def _first(args: tuple, kwargs: dict[str, Any]) -> torch.Tensor | None:
    for key in _FIRST:
        if isinstance(value := kwargs.get(key), torch.Tensor):
            return value
    return args[0] if args and isinstance(args[0], torch.Tensor) else None


def plan(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> Plan | None:
    """The plan for a call of the side component ``module`` (its own ``forward``, ``decode`` or ``encode``), or
    ``None`` to leave the call as it is: outside a pipeline, for a denoiser, for a component kept higher on purpose,
    and wherever plain torch would not reject the call (:func:`torchfix.guards.dtype.whole_call`)."""
    first = _first(args, kwargs)
    if first is None or not first.is_floating_point():
        return None
    own = _model.model_dtype(module)
    if own is None or own == first.dtype:
        return None  # the fast path: nothing torch rejects at the first layer
    # the modules running around this call too: a net of a Multi-ControlNet belongs to the pipeline through it
    found = _frames.owner([module, *(m for m in _frames.module_chain(2) if m is not module)])
    if found is None:
        return None
    root, name, pipe = found
    if pipe is None or name in DENOISERS:
        return None
    kept = _model.kept_high(module) or (root is not module and _model.kept_high(root))
    runs = dtype_guard.component_dtype(own, _model.pipeline_dtype(pipe), kept_high=kept)
    autocast = torch.is_autocast_enabled(first.device.type)
    target = dtype_guard.whole_call(own, runs, first.dtype, autocast=autocast)
    if target is None:
        return None
    path = name if root is module else (_frames.module_path([module, root]) or name)
    return Plan(module, path, own, target, first.dtype)


def _cast(value: Any, dtype: torch.dtype, seen: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        seen.append(value)
        return value.to(dtype)
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_cast(v, dtype, seen) for v in value)
    return value


@contextlib.contextmanager
def weights_in(module: torch.nn.Module, dtype: torch.dtype) -> Iterator[dict[str, torch.Tensor]]:
    """``module`` runs with its floating parameters and buffers cast to ``dtype`` inside the block, except those kept
    in their precision on purpose; the module itself is never changed (its own tensors are back on exit). Yields the
    cast tensors by name."""
    kept = _kept.kept_parameters(module)
    named = [(n, t) for n, t in (*module.named_parameters(), *module.named_buffers())]
    cast = {n: t.to(dtype) for n, t in named if t.is_floating_point() and t.dtype != dtype and id(t) not in kept}
    with torch.nn.utils.stateless._reparametrize_module(module, cast, tie_weights=True):
        yield cast


def _learn(module: torch.nn.Module, names: list[str], dtype: torch.dtype) -> None:
    """Tell a listening ``torchfix.wrap`` which tensors this call cast, for its one-time cast after the first call."""
    sink = _context.param_casts.get()
    if sink is None:
        return
    for name in names:
        owner_path, _, attr = name.rpartition(".")
        sink.append((module.get_submodule(owner_path) if owner_path else module, attr, dtype))


@contextlib.contextmanager
def running(p: Plan, args: tuple, kwargs: dict[str, Any], mode: str, op: str) -> Iterator[tuple[tuple, dict[str, Any]]]:
    """Inside the block, ``p.module`` runs with its weights in ``p.dtype``; yields the call's arguments with the floating
    ones in ``p.dtype``. Recorded as one event (a warning in ``warn`` mode) as the block starts."""
    seen: list[torch.Tensor] = []
    args = tuple(_cast(a, p.dtype, seen) for a in args)
    kwargs = {k: _cast(v, p.dtype, seen) for k, v in kwargs.items()}
    with weights_in(p.module, p.dtype) as cast:
        _learn(p.module, list(cast), p.dtype)
        _record(p, cast, seen, mode, op)
        yield args, kwargs


def _record(p: Plan, cast: dict[str, torch.Tensor], seen: list[torch.Tensor], mode: str, op: str) -> None:
    own, to, given = dtype_name(p.own), dtype_name(p.dtype), dtype_name(p.given)
    site = _frames.call_site(4)
    detail = (
        f"{p.name} is {own} in a {to} pipeline (not kept in {own} on purpose) and was handed {given} input, which its "
        f"first layer rejects → the call runs with its weights {own}→{to} and its floating inputs in {to}, as the "
        f"component loaded with torch_dtype=torch.{to} runs (rule: {p.name} (pipeline dtype) runs in the pipeline's dtype "
        "as a whole, so no mix torch accepts inside it is left in another dtype)"
    )
    nbytes = sum(t.numel() * t.element_size() for t in cast.values()) + sum(t.numel() * p.dtype.itemsize for t in seen)
    report().add(FixEvent(op, "dtype", "cast", site, p.name, detail, change=f"{own}→{to}", nbytes=nbytes))
    log.info("%s: %s", op, detail)
    if mode == "warn":
        fix = f"load it with torch_dtype=torch.{to}, or pipe.{p.name.split('.')[0]}.to(torch.{to})"
        _warn.once(("whole-call", p.name, own, to), f"{op}: {detail}. To fix it for good: {fix}.", site=site)


def run(p: Plan, call: Any, args: tuple, kwargs: dict[str, Any], mode: str, op: str) -> Any:
    """``call(*args, **kwargs)`` (a call of ``p.module``) with the module's weights and the floating arguments in
    ``p.dtype`` (:func:`running`)."""
    with running(p, args, kwargs, mode, op) as (args, kwargs):
        return call(*args, **kwargs)
