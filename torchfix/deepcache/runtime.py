"""DeepCache state per UNet and per generation, and the ``forward`` that uses it.

A *generation* (one pipeline call) starts when the pipeline's scheduler sets
its timesteps, when :func:`new_call` is called, or when the UNet is called with
a sample of another shape, dtype or device (resolution, batch, guidance).
Within it, each ``encoder_hidden_states`` object (a prompt, or one guidance
branch called separately) is a *stream* with its own step count and cached
feature; the first call of every stream is a full step, so a new prompt never
sees an old feature. UNet calls are counted, never looked up by
timestep value, so nothing synchronises with the device and repeated
timesteps (Heun) or keyword/int/1-D timesteps are all fine.
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from .._frames import uncompiled
from ..patches import instance
from . import streams
from ._graphs import forget_compiled
from ._graphs import outside_graphs as _outside_graphs
from .config import DeepCacheConfig, corrects, for_family, must_run_full, warms_up
from .forecast import for_this_step, keep_pending, moved
from .layout import Layout, analyse
from .shallow import shallow_forward
from .transformer import TransformerCacheState, TransformerLayout, apply_transformer, check_transformer, transformer_config

__all__ = ["DeepCacheState", "apply", "new_call", "remove", "state_of", "stats"]

log = logging.getLogger("torchfix")

# The name DeepCache's forward has in diffusers' HookRegistry (where the installed diffusers has one).
HOOK_NAME = "torchfix_deepcache"

# Arguments a cached step cannot honour: those calls run in full.
_FULL_ONLY = ("down_intrablock_additional_residuals",)


@dataclass
class _Stream:
    """One conditioning (the ``encoder_hidden_states`` object a call passes) within a generation."""

    prompt: Any  # held, so the id it is keyed by stays unique
    step: int = 0
    history: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (step, deep feature) of the last full steps
    reference: torch.Tensor | None = None  # with a threshold: the sample of the last full step
    cached_run: int = 0  # cached steps since the last full one
    full: int = 0
    cached: int = 0

    @property
    def feature(self) -> torch.Tensor | None:
        """The deep feature of the last full step."""
        return self.history[-1][1] if self.history else None


@dataclass
class DeepCacheState:
    """Everything DeepCache keeps for one UNet. Only the streams' ``feature`` holds activation memory.

    A pipeline that runs its guidance branches as separate UNet calls (modular guiders, PAG,
    low-memory samplers) passes a different ``encoder_hidden_states`` to each: each is a
    *stream* with its own step count and cached feature, so caching works as in the batched
    case and no branch sees another's feature.
    """

    config: DeepCacheConfig
    layout: Layout
    original_forward: Any
    handles: list[Any] = field(default_factory=list)
    streams: dict[int, _Stream] = field(default_factory=dict)
    current: _Stream | None = None  # the stream of the call in progress (or the last one)
    signature: tuple | None = None  # (shape, dtype, device) of the sample the streams belong to
    total: int | None = None
    # the config this generation's steps follow: ``config`` with ``warm_up`` decided from the scheduler's timesteps
    schedule: DeepCacheConfig | None = None
    pending_new_call: bool = True
    capturing: bool = False
    pending: torch.Tensor | None = None  # the deep feature of the full step in progress
    full_steps: int = 0
    cached_steps: int = 0
    generations: int = 0
    scope: object | None = None  # torchfix.wrap's token: cache only inside its pipeline's calls
    pipe: Any = None  # weakref to the pipeline applied to (its scheduler is followed)
    scheduler: Any = None  # weakref to the scheduler whose set_timesteps is hooked
    scheduler_hook: Any = None
    reinstalls: int = 0
    summary: dict[str, Any] | None = None  # last_call of the generation the last reset ended

    @property
    def feature(self) -> torch.Tensor | None:
        """The current stream's cached deep feature."""
        return None if self.current is None else self.current.feature

    @property
    def step(self) -> int:
        """UNet calls so far in the current stream of this generation."""
        return 0 if self.current is None else self.current.step

    @property
    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for st in self.streams.values() for _, t in st.history)

    def reset(self) -> None:
        """Forget every stream's feature and the current generation (what it did stays readable)."""
        streams.keep_summary(self)
        self.streams.clear()
        self.current = None
        self.signature = None
        self.pending_new_call = True
        self.pending = None


_STATES: weakref.WeakKeyDictionary[torch.nn.Module, DeepCacheState | TransformerCacheState] = weakref.WeakKeyDictionary()


def _resolve(target: Any) -> tuple[torch.nn.Module, Any]:
    """The denoiser (a pipeline's ``unet`` or ``transformer``, or the model itself; through
    ``torch.compile``'s wrapper, in either order) and the pipeline."""
    for attr in ("unet", "transformer"):
        model = getattr(target, attr, None)
        if isinstance(model, torch.nn.Module):
            return uncompiled(model), target
    if isinstance(target, torch.nn.Module):
        return uncompiled(target), None
    raise TypeError(f"torchfix.deepcache: expected a diffusers pipeline, its UNet or its transformer, got {type(target).__name__}.")


def _is_transformer(model: torch.nn.Module) -> bool:
    return hasattr(model, "transformer_blocks") and not hasattr(model, "up_blocks")


def check(target: Any, config: DeepCacheConfig) -> Layout | TransformerLayout:
    """The denoiser's layout, after checking that ``config`` fits it (``apply`` would succeed).

    Raises:
        UnsupportedUNetError: ``target`` has no UNet or transformer DeepCache can drive.
        ValueError: ``config.branch`` is not one of the UNet's skip connections, or a transformer's
            ``keep_first``/``keep_last`` leave no block to cache.
    """
    unet, _ = _resolve(target)
    if _is_transformer(unet) or getattr(target, "transformer", None) is unet:
        return check_transformer(unet, transformer_config(unet, config))
    layout = analyse(unet)
    if config.revise is True:
        raise ValueError(
            f"torchfix.deepcache: revise=True, but {type(unet).__name__} is a UNet; revising cached steps needs a transformer "
            "whose cached blocks end the chain (Flux) and a flow-matching Euler scheduler. Leave revise=None."
        )
    if config.branch >= layout.n_skips:
        raise ValueError(
            f"torchfix.deepcache: branch={config.branch} but {type(unet).__name__} has {layout.n_skips} skip connections "
            f"(branch 0..{layout.n_skips - 1})."
        )
    return layout


def state_of(target: Any) -> DeepCacheState | TransformerCacheState | None:
    """The DeepCache state of a UNet or transformer (or a pipeline's), or ``None`` when not applied."""
    unet, _ = _resolve(target)
    return _STATES.get(unet)


def new_call(target: Any) -> None:
    """Start a new generation: the next UNet call is a full step and the cache is dropped; DeepCache's
    forward is put back if another hook replaced it since.

    Pipelines do this themselves (through their scheduler); call it when you drive a bare UNet.
    """
    state = state_of(target)
    if state is not None:
        streams.ensure_installed(state)
        state.reset()


def stats(target: Any) -> dict[str, Any]:
    """What DeepCache is doing, as it is, not as it was installed.

    ``applied``: it runs on the next call (its forward is reached, or it is put back when the next
    pipeline call starts); ``in_call_path``: calling the model reaches it right now; ``last_call``:
    full and cached steps of the current (or last) generation, in all and per stream; totals since
    ``apply``; ``reinstalls``: how often another hook had replaced its forward; ``scoped``: it caches
    only inside ``torchfix.wrap``'s calls; bytes held; for a transformer the streams, the cached blocks and
    ``sensitivity`` (the share of an input change the cached blocks pass through: as set, or as last
    measured, ``None`` before the first measurement), ``revise`` ("revises", or why the cached steps are not
    revised: :attr:`DeepCacheConfig.revise`) and ``revised_steps`` (cached steps revised since ``apply``).

    >>> import torchfix
    >>> torchfix.deepcache.stats(torchfix.testing.tiny_sd15_unet())
    {'applied': False}
    """
    state = state_of(target)
    if state is None:
        return {"applied": False}
    reached = streams.in_call_path(state)
    out = {
        "applied": reached or state.pipe is not None or state.scope is not None,
        "in_call_path": reached,
        "scoped": state.scope is not None,
        "last_call": streams.last_call(state),
        "full_steps": state.full_steps,
        "cached_steps": state.cached_steps,
        "generations": state.generations,
        "reinstalls": state.reinstalls,
        "cache_bytes": state.cache_bytes,
        "forecast": state.config.forecast,
        "threshold": state.config.threshold,
        "warm_up": warms_up(streams.generation_config(state)),
    }
    if isinstance(state, TransformerCacheState):
        out["streams"] = state.last_streams
        out["blocks"] = state.layout.describe(state.config.keep_first, state.config.keep_last)
        fixed = state.config.sensitivity
        out["sensitivity"] = fixed if fixed is not None else (state.last_sensitivity if corrects(state.config) else 1.0)
        out["revise"] = state.cannot_revise or (
            "revises" if state.sigmas is not None else "waits for a flow-matching Euler scheduler (FlowMatchEulerDiscreteScheduler)"
        )
        out["revised_steps"] = state.revised_steps
    else:
        out["branch"] = state.layout.describe(state.config.branch)
    return out


@_outside_graphs
def _decide(state: DeepCacheState, sample: torch.Tensor, prompt: Any, kwargs: dict[str, Any]) -> bool | None:
    """True for a full step, False for a cached one, None to run the UNet untouched (outside the scope of
    ``torchfix.wrap``'s call). Kept out of compiled graphs: it is Python state, not tensor math."""
    if not streams.engaged(state):
        return None
    streams.follow_scheduler(state)
    stream = streams.enter(state, sample, prompt, _Stream)
    index = stream.step
    stream.step += 1
    config = streams.generation_config(state)
    if stream.feature is None or any(kwargs.get(name) is not None for name in _FULL_ONLY):
        full = True
    else:
        full = must_run_full(index, streams.generation_steps(state) or config.num_steps, config, stream.cached_run)
        if full is None:  # the features decide: a UNet's cached step recomputes from the sample, so it is the signal
            full = stream.reference is None or moved(sample, stream.reference) >= config.threshold
    if full:
        state.full_steps += 1
        stream.full += 1
        stream.cached_run = 0
        state.capturing = True
        if config.threshold is not None:
            stream.reference = sample.detach()
    else:
        state.cached_steps += 1
        stream.cached += 1
        stream.cached_run += 1
    return full


@_outside_graphs
def _done_full(state: DeepCacheState) -> None:
    """After a full step: its deep feature joins the stream's history (eager: the history is a Python list)."""
    state.capturing = False
    keep_pending(state)


def _keep(state: DeepCacheState, feature: torch.Tensor) -> None:
    state.pending = feature.detach()  # joins the stream's history after the call, outside any graph


def _capture_hook(state_ref: weakref.ref[DeepCacheState], pre: bool) -> Any:
    # Stores a reference (no copy) to the tensor entering the branch's consumer.
    if pre:

        def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            state = state_ref()
            if state is not None and state.capturing and state.current is not None:
                h = kwargs.get("hidden_states", args[0] if args else None)
                _keep(state, h)

        return hook

    def hook_out(module: torch.nn.Module, args: tuple, output: Any) -> None:
        state = state_ref()
        if state is not None and state.capturing and state.current is not None:
            h = output[0] if isinstance(output, tuple) else getattr(output, "sample", output)
            _keep(state, h)

    return hook_out


def _make_forward(unet: torch.nn.Module, state: DeepCacheState) -> Any:
    """The factory :func:`instance.wrap_forward` builds the UNet's forward with."""
    unet_ref = weakref.ref(unet)

    def make(original: Any, source: Any) -> Any:
        sig = inspect.signature(source)

        @functools.wraps(source)
        def forward(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            arguments = bound.arguments
            sample = arguments["sample"]
            full = _decide(state, sample, arguments.get("encoder_hidden_states"), arguments)
            if full is None:
                return original(*args, **kwargs)
            if full:
                try:
                    return original(*args, **kwargs)
                finally:
                    _done_full(state)
            extra = arguments.pop("kwargs", None) or {}
            feature = for_this_step(state) if state.config.forecast else state.feature
            return shallow_forward(unet_ref(), state.layout, state.config.branch, feature, **arguments, **extra)

        forward.__torchfix_deepcache__ = True  # type: ignore[attr-defined]
        return forward

    return make


def apply(target: Any, config: DeepCacheConfig | None = None, *, scope: object | None = None) -> DeepCacheState | TransformerCacheState:
    """Apply DeepCache to a diffusers pipeline, its ``UNet2DConditionModel`` or its SD3/Flux transformer.

    Applying again replaces the previous application (never a wrapper over a wrapper).

    The state follows the model through ``torch.compile`` (either order), is put back at each
    pipeline call if another hook (accelerate's offload) replaced its forward, and takes its step
    count from the scheduler the pipeline uses at call time (a swapped scheduler included).

    Args:
        target: a pipeline with a ``unet`` or a ``transformer``, or the model itself.
        config: a :class:`DeepCacheConfig` (default: interval 3, branch 0, uniform).
        scope: cache only while :func:`torchfix.deepcache.streams.scoped` with this token runs
            (``torchfix.wrap`` passes its own, so other pipelines sharing the model run it untouched);
            ``None`` (the default): model-wide.

    >>> import torchfix
    >>> from torchfix.testing import tiny_sd15_pipeline
    >>> pipe = tiny_sd15_pipeline()  # doctest: +SKIP
    >>> torchfix.deepcache.apply(pipe, torchfix.DeepCacheConfig(interval=3))  # doctest: +SKIP
    """
    config = DeepCacheConfig() if config is None else config
    if not isinstance(config, DeepCacheConfig):
        raise TypeError(f"torchfix.deepcache.apply: config must be a DeepCacheConfig, got {type(config).__name__}.")
    unet, pipe = _resolve(target)
    layout = check(unet, config)
    config = transformer_config(unet, config) if isinstance(layout, TransformerLayout) else for_family(config, "unet")
    if unet in _STATES:
        remove(unet)
    if isinstance(layout, TransformerLayout):
        tstate = apply_transformer(unet, config, layout)
        tstate.scope = scope
        streams.follow_scheduler(tstate, pipe)
        _STATES[unet] = tstate
        forget_compiled(f"applied to {type(unet).__name__}")
        return tstate
    state = DeepCacheState(config, layout, unet.forward, scope=scope)
    state_ref = weakref.ref(state)
    i, j = layout.consumers[config.branch]
    up = unet.up_blocks[i]
    if j == 0:
        state.handles.append(instance.add_hook(up, _capture_hook(state_ref, pre=True), pre=True, with_kwargs=True))
    else:
        producer = up.attentions[j - 1] if getattr(up, "attentions", None) is not None else up.resnets[j - 1]
        state.handles.append(instance.add_hook(producer, _capture_hook(state_ref, pre=False)))
    state.handles.append(instance.wrap_forward(unet, HOOK_NAME, _make_forward(unet, state), reset=state.reset))
    streams.follow_scheduler(state, pipe)
    _STATES[unet] = state
    forget_compiled(f"applied to {type(unet).__name__}")
    log.debug("torchfix.deepcache: applied to %s (%s, interval=%d)", type(unet).__name__, layout.describe(config.branch), config.interval)
    return state


def remove(target: Any) -> None:
    """Remove DeepCache: ``forward``, hooks and the cache go; the UNet is as it was. Harmless when not applied."""
    unet, _ = _resolve(target)
    state = _STATES.pop(unet, None)
    if state is None:
        return
    for handle in reversed(state.handles):
        handle.restore()
    state.handles.clear()
    if state.scheduler_hook is not None:
        state.scheduler_hook.restore()
        state.scheduler_hook = None
    state.reset()
    forget_compiled(f"removed from {type(unet).__name__}")
