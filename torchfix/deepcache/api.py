"""``apply``, ``remove``, ``check``, ``stats``: DeepCache on a pipeline's denoiser(s) or on a bare denoiser.

A pipeline's denoisers are its ``unet``, ``transformer`` and ``transformer_2`` (Wan 2.2 runs a high-noise and a
low-noise expert on one scheduler: each gets its own cache, on the scheduler's clock). Which mechanism caches a
denoiser, and what it may skip, comes from its family's registry entry (:mod:`torchfix.families`).

A *generation* (one pipeline call) starts when the pipeline's scheduler sets its timesteps, when
:func:`new_call` is called, or when the denoiser is called with latents of another shape, dtype or device
(resolution, frames, batch, guidance). Within it, each guidance pass is a *stream* with its own step count and
cache; the first call of every stream is a full step, so a new prompt never sees an old feature.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from .. import _warn, families
from .._frames import uncompiled
from ..errors import InvalidArgumentTypeError, UnsupportedModelError
from ..families import DENOISERS
from ..patches import libraries
from . import comfy_unet, generation, installed, mechanisms, parallel
from ._graphs import forget_compiled
from .blocks import BlockState, TransformerLayout
from .config import DeepCacheConfig, corrects, for_family
from .engine import CacheState
from .layout import Layout, analyse
from .schedule import warms_up
from .unet import UNetState

__all__ = [
    "DENOISERS",
    "apply",
    "at_loop_start",
    "auto",
    "auto_applied",
    "check",
    "denoisers",
    "new_call",
    "remove",
    "state_of",
    "states_of",
    "stats",
]

log = logging.getLogger("torchfix")


class _StateTable:
    """Each denoiser's cache state, kept on the denoiser itself (in its ``__dict__``). Not a WeakKeyDictionary: a
    state holds its model strongly (the hooks it put back at ``remove``), and a WeakKeyDictionary whose value reaches
    its key keeps both alive for good, so a pipeline dropped with its cache still on (model switching without
    ``remove``) was never freed. On the model, state and model are one cycle the garbage collector frees."""

    _ATTR = "_torchfix_deepcache_state"

    def get(self, model: torch.nn.Module, default: CacheState | None = None) -> CacheState | None:
        return vars(model).get(self._ATTR, default)

    def __contains__(self, model: torch.nn.Module) -> bool:
        return self._ATTR in vars(model)

    def __getitem__(self, model: torch.nn.Module) -> CacheState:
        return vars(model)[self._ATTR]

    def __setitem__(self, model: torch.nn.Module, state: CacheState) -> None:
        vars(model)[self._ATTR] = state

    def pop(self, model: torch.nn.Module, default: CacheState | None = None) -> CacheState | None:
        return vars(model).pop(self._ATTR, default)


_STATES = _StateTable()


def denoisers(target: Any) -> tuple[list[tuple[str, torch.nn.Module]], Any]:
    """``([(name, denoiser), ...], pipeline)``: a pipeline's denoisers (through ``torch.compile``'s wrapper, in
    either order), or the model itself (named ``"model"``, no pipeline)."""
    found = [(name, uncompiled(m)) for name in DENOISERS if isinstance(m := getattr(target, name, None), torch.nn.Module)]
    if found:
        return found, target
    if isinstance(target, torch.nn.Module):
        return [("model", uncompiled(target))], None
    raise InvalidArgumentTypeError(
        f"torchfix.deepcache: expected a diffusers pipeline, its UNet or "
        f"its transformer, got {type(target).__name__}."
    )


def _family(model: torch.nn.Module) -> families.Family:
    family = families.find(model)
    if family is not None:
        return family
    if hasattr(model, "down_blocks") or hasattr(model, "up_blocks"):
        analyse(model)  # names what a UNet-like model lacks
        raise UnsupportedModelError(
            f"torchfix.deepcache: {type(model).__name__} is not a model family torchfix knows, so it cannot tell which blocks "
            f"to cache or what they return. Supported: {families.supported()}. To add a family: docs/families.md."
        )
    return families.resolve(model)  # a transformer's entry read off its code, or a clear refusal


def _check_one(model: torch.nn.Module, config: DeepCacheConfig) -> Layout | TransformerLayout | comfy_unet.ComfyLayout:
    """What ``model``'s mechanism needs, checked before anything is installed; an option of another mechanism
    refused."""
    family = _family(model)
    mechanisms.refuse_foreign(model, family, config)
    return mechanisms.of(family).check(model, config, family)


def check(target: Any, config: DeepCacheConfig) -> Layout | TransformerLayout:
    """The (first) denoiser's layout, after checking that ``config`` fits every denoiser (``apply`` would succeed;
    the first call still checks a transformer's blocks against its family's entry).

    Raises:
        UnsupportedModelError: a denoiser is of no family torchfix knows, or lacks what its family's entry names.
        ValueError: ``config.branch`` is not one of the UNet's skip connections, or a transformer's
            ``keep_first``/``keep_last`` leave no block to cache.
    """
    found, _ = denoisers(target)
    layouts = [_check_one(model, config) for _, model in found]
    return layouts[0]


def state_of(target: Any) -> CacheState | None:
    """The DeepCache state of a denoiser (or a pipeline's first one), or ``None`` when not applied."""
    found, _ = denoisers(target)
    return _STATES.get(found[0][1])


def states_of(target: Any) -> dict[str, CacheState]:
    """The DeepCache state of each of a pipeline's denoisers that has one, by component name."""
    found, _ = denoisers(target)
    return {name: _STATES[model] for name, model in found if model in _STATES}


def new_call(target: Any, timesteps: Any = None) -> None:
    """Start a new generation: the next denoiser call is a full step and the cache is dropped; DeepCache's
    forward is put back if another hook replaced it since.

    Pipelines do this themselves (through their scheduler); call it when you drive a bare denoiser.
    ``timesteps``: the schedule the generation's denoiser calls follow, one value per call per stream (ComfyUI's
    sigmas less the last): it sets the step count and whether the schedule warms up, as a scheduler's would.
    """
    for state in states_of(target).values():
        installed.ensure_installed(state)
        if timesteps is None:
            state.reset()
        else:
            generation.restart(state, timesteps)


def _stats_one(state: CacheState) -> dict[str, Any]:
    reached = installed.in_call_path(state)
    out = {
        "applied": reached or state.pipe is not None or state.scope is not None,
        "family": state.family.name,
        "in_call_path": reached,
        "scoped": state.scope is not None,
        "last_call": generation.last_call(state),
        "full_steps": state.full_steps,
        "cached_steps": state.cached_steps,
        "generations": state.generations,
        "reinstalls": state.reinstalls,
        "cache_bytes": state.cache_bytes,
        "forecast": state.config.forecast,
        "threshold": state.config.threshold,
        "warm_up": warms_up(state.generation.config),
        "ranks": parallel.ranks(state).describe,
    }
    if isinstance(state, BlockState):
        out["streams"] = state.last_streams
        out["blocks"] = state.describe()
        fixed = state.config.sensitivity
        out["sensitivity"] = fixed if fixed is not None else (state.last_sensitivity if corrects(state.config) else 1.0)
        chain_off = next((c.revise for c in state.plan.chains.values() if c.revise is not None), None)
        out["revise"] = (
            state.plan.cannot_revise
            or chain_off
            or ("revises" if state.generation.sigmas is not None else f"waits for a flow-matching Euler scheduler ({_FLOW_EULER})")
        )
        out["revised_steps"] = state.revised_steps
    else:
        out["branch"] = state.describe()
    return out


def stats(target: Any) -> dict[str, Any]:
    """What DeepCache is doing, as it is, not as it was installed.

    ``applied``: it runs on the next call (its forward is reached, or it is put back when the next
    pipeline call starts); ``family``: the registry entry that drives it; ``in_call_path``: calling the model
    reaches it right now; ``last_call``: full and cached steps of the current (or last) generation, in all and
    per stream; totals since ``apply``; ``reinstalls``: how often another hook had replaced its forward;
    ``ranks``: who shares each call, whose sums every decision adds (docs/scaling.md);
    ``scoped``: it caches only inside ``torchfix.wrap``'s calls; bytes held; for a transformer the streams, the
    cached blocks (in runs, once the first call has checked them), ``sensitivity`` (the share of an input change
    the cached blocks pass through: as set, or as last measured, ``None`` before the first measurement),
    ``revise`` ("revises", or why the cached steps are not revised: :attr:`DeepCacheConfig.revise`) and
    ``revised_steps``. A pipeline with two denoisers (Wan 2.2) reports the totals and each under ``denoisers``.

    >>> import torchfix
    >>> torchfix.deepcache.stats(torchfix.testing.tiny_sd15_unet())
    {'applied': False}
    """
    states = states_of(target)
    if not states:
        return {"applied": False}
    if len(states) == 1:
        return _stats_one(next(iter(states.values())))
    each = {name: _stats_one(state) for name, state in states.items()}
    total = {key: sum(s[key] for s in each.values()) for key in ("full_steps", "cached_steps", "cache_bytes")}
    calls = [s["last_call"] for s in each.values()]
    last = {k: sum(c[k] for c in calls) for k in ("full_steps", "cached_steps")} | {"streams": [p for c in calls for p in c["streams"]]}
    return {"applied": any(s["applied"] for s in each.values()), **total, "last_call": last, "denoisers": each}


def apply(target: Any, config: DeepCacheConfig | None = None, *, scope: object | None = None) -> CacheState:
    """Apply DeepCache to a diffusers pipeline's denoiser(s), or to a denoiser of any family torchfix knows
    (:func:`torchfix.families.supported`). Returns the (first) denoiser's state.

    Applying again replaces the previous application (never a wrapper over a wrapper).

    The state follows the model through ``torch.compile`` (either order), is put back at each
    pipeline call if another hook (accelerate's offload) replaced its forward, and takes its step
    count from the scheduler the pipeline uses at call time (a swapped scheduler included).

    Args:
        target: a pipeline with a ``unet``, a ``transformer`` (and a ``transformer_2``), or the model itself.
        config: a :class:`DeepCacheConfig` (default: interval 3; the rest per family).
        scope: cache only while :func:`torchfix.deepcache.installed.scoped` with this token runs
            (``torchfix.wrap`` passes its own, so other pipelines sharing the model run it untouched);
            ``None`` (the default): model-wide.

    Raises:
        UnsupportedModelError: a denoiser of no family torchfix knows (at the first call: one whose blocks do not
            behave as its family's entry says; nothing is cached then).

    >>> import torchfix
    >>> from torchfix.testing import tiny_sd15_pipeline
    >>> pipe = tiny_sd15_pipeline()  # doctest: +SKIP
    >>> torchfix.deepcache.apply(pipe, torchfix.DeepCacheConfig(interval=3))  # doctest: +SKIP
    """
    config = DeepCacheConfig() if config is None else config
    if not isinstance(config, DeepCacheConfig):
        raise InvalidArgumentTypeError(f"torchfix.deepcache.apply: config must be a DeepCacheConfig, got {type(config).__name__}.")
    found, pipe = denoisers(target)
    layouts = [_check_one(model, config) for _, model in found]  # all or nothing
    applied = []
    for (_, model), layout in zip(found, layouts):
        if model in _STATES:
            remove(model)
        family = _family(model)
        filled = for_family(config, family)
        if families.is_inferred(family):
            log.info(
                "torchfix.deepcache: %s has no registry entry; its blocks were read off its code (%s) and are checked on "
                "its first call",
                type(model).__name__,
                family.describe(),
            )
        mechanism = mechanisms.of(family)
        state: CacheState = mechanism.install(model, family, filled, layout)
        state.scope, state.options = scope, mechanism.options.of(filled)
        installed.follow_scheduler(state, pipe)
        _STATES[model] = state
        applied.append(state)
    forget_compiled(f"applied to {', '.join(type(m).__name__ for _, m in found)}")
    return applied[0]


def remove(target: Any) -> None:
    """Remove DeepCache: forwards, hooks and the cache go; every denoiser is as it was. Harmless when not applied."""
    found, _ = denoisers(target)
    removed = []
    for _, model in found:
        state = _STATES.pop(model, None)
        if state is None:
            continue
        for handle in reversed(state.handles):
            handle.restore()
        state.handles.clear()
        installed.unhook_scheduler(state)
        state.reset()
        removed.append(type(model).__name__)
    if removed:
        forget_compiled(f"removed from {', '.join(removed)}")


_FLOW_EULER = "FlowMatchEulerDiscreteScheduler"

# The names the states had before every family shared one engine.
DeepCacheState = UNetState
TransformerCacheState = BlockState


# --- every pipeline (torchfix run --deepcache) ---------------------------------------------------------------------

_AUTO: list[DeepCacheConfig | None] = [None]
# what auto() did, one row per pipeline it put the cache on: [class name, states while the pipeline lives, full, cached]
_AUTO_APPLIED: list[list[Any]] = []


def auto(config: DeepCacheConfig | None) -> DeepCacheConfig | None:
    """Cache every diffusers pipeline this process runs, from its next denoising loop on, with ``config``
    (``None``: stop applying it to new pipelines; those applied keep it). Returns the previous setting. A pipeline
    whose denoiser already has the cache (``apply``, ``wrap(deepcache=...)``) keeps its own; one of no family torchfix
    knows is refused at its loop start with :class:`~torchfix.UnsupportedModelError`, as ``apply`` would. What
    ``torchfix run --deepcache`` uses for a script it does not change; needs torchfix enabled (the loop-start patch).

    >>> import torchfix
    >>> torchfix.deepcache.auto(None) is None
    True
    """
    if config is not None and not isinstance(config, DeepCacheConfig):
        raise InvalidArgumentTypeError(f"torchfix.deepcache.auto: config must be a DeepCacheConfig or None, got {type(config).__name__}.")
    previous, _AUTO[0] = _AUTO[0], config
    return previous


def at_loop_start(pipe: Any) -> None:
    """A pipeline opened its denoising loop (its scheduler's timesteps are set, no step has run): apply the
    :func:`auto` cache to its denoisers where it has none, so the first step of this call is the generation's first."""
    config = _AUTO[0]
    if config is None:
        return
    try:
        found, _ = denoisers(pipe)
    except InvalidArgumentTypeError:  # a pipeline without a denoiser: nothing to cache
        return
    if all(model in _STATES for _, model in found):
        return
    config, dropped = mechanisms.without_foreign(config, _family(found[0][1]))
    if dropped:  # one process-wide config meets every pipeline: an option of another mechanism is left out, loudly
        _warn.once(
            ("auto-foreign", type(pipe).__name__, tuple(dropped)),
            f"torchfix.deepcache.auto: {', '.join(dropped)} left out for {type(pipe).__name__}: its denoiser's cache has no "
            "such option (torchfix.deepcache.mechanisms).",
            stacklevel=3,
        )
    apply(pipe, config)
    new_call(pipe)
    row: list[Any] = [type(pipe).__name__, list(states_of(pipe).values()), 0, 0]
    _AUTO_APPLIED.append(row)
    weakref.finalize(pipe, _settle, row)  # the counts outlive the pipeline; the states do not


def _settle(row: list[Any]) -> None:
    row[2], row[3] = _counts(row[1])
    row[1] = []


def _counts(states: list[CacheState]) -> tuple[int, int]:
    return sum(s.full_steps for s in states), sum(s.cached_steps for s in states)


libraries.LOOP_STARTS.append(at_loop_start)  # the pipelines' loop-start patch calls it (it imports no deepcache)


def auto_applied() -> list[tuple[str, int, int]]:
    """What :func:`auto` did: ``(pipeline class, full steps, cached steps)`` for each pipeline it put the cache on,
    alive or not, in the order they first ran."""
    return [(name, *(_counts(states) if states else (full, cached))) for name, states, full, cached in _AUTO_APPLIED]
