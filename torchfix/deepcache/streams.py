"""Generations and guidance streams, shared by the UNet and the transformer DeepCache.

A *generation* is one pipeline call; within it each ``encoder_hidden_states`` object a
call passes is a *stream* (a prompt, or a guidance branch run as its own call), with its
own step count and cache. Pure Python bookkeeping: no tensor is read but for its shape,
dtype and device.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import weakref
from collections.abc import Iterator
from typing import Any, Protocol, TypeVar

import torch

from ..patches import instance
from .config import early_steps_move

__all__ = [
    "MAX_STREAMS",
    "engaged",
    "ensure_installed",
    "enter",
    "flow_euler_sigmas",
    "follow_scheduler",
    "generation_config",
    "generation_steps",
    "in_call_path",
    "keep_summary",
    "last_call",
    "scoped",
]

log = logging.getLogger("torchfix")

# The scope of the pipeline call in progress: a DeepCache applied by torchfix.wrap caches only
# while its own wrapped pipeline's call runs (any other pipeline sharing the UNet runs it untouched).
_SCOPE: contextvars.ContextVar[object | None] = contextvars.ContextVar("torchfix_deepcache_scope", default=None)


@contextlib.contextmanager
def scoped(token: object) -> Iterator[None]:
    """DeepCache states applied with ``scope=token`` cache inside this block (``torchfix.wrap``'s calls)."""
    reset = _SCOPE.set(token)
    try:
        yield
    finally:
        _SCOPE.reset(reset)


def engaged(state: Any) -> bool:
    """Whether this call caches: always for a model-wide ``apply``, only inside its scope for ``wrap``'s."""
    return state.scope is None or _SCOPE.get() is state.scope

# Streams kept per generation before it is treated as a new one.
MAX_STREAMS = 4


class _HasPrompt(Protocol):
    prompt: Any
    step: int
    full: int
    cached: int


S = TypeVar("S", bound=_HasPrompt)


def enter(state: Any, latents: torch.Tensor, prompt: Any, new_stream: type[S]) -> S:
    """The stream of this call, after starting a new generation where needed: the pipeline asked for
    one (``state.pending_new_call``), the latents changed shape, dtype or device, or a new stream would
    exceed :data:`MAX_STREAMS`. ``state`` has ``streams``, ``signature``, ``pending_new_call``,
    ``generations``, ``current`` and ``reset()``."""
    signature = (tuple(latents.shape), latents.dtype, latents.device)
    if state.pending_new_call or signature != state.signature or (id(prompt) not in state.streams and len(state.streams) >= MAX_STREAMS):
        state.reset()
        state.pending_new_call = False
        state.signature = signature
        state.generations += 1
    stream = state.streams.get(id(prompt))
    if stream is None or stream.prompt is not prompt:  # the id of a prompt that is gone may be reused
        stream = state.streams[id(prompt)] = new_stream(prompt)
    state.current = stream
    return stream


def last_call(state: Any) -> dict[str, Any]:
    """What the current (or last) generation did: full and cached steps, in all and per stream (after a reset
    freed the streams, as diffusers' pipelines do at the end of a call: what they did before it)."""
    if not state.streams and state.summary is not None:
        return state.summary
    per = [{"full_steps": st.full, "cached_steps": st.cached} for st in state.streams.values()]
    return {
        "full_steps": sum(p["full_steps"] for p in per),
        "cached_steps": sum(p["cached_steps"] for p in per),
        "streams": per,
    }


def keep_summary(state: Any) -> None:
    """Before a reset frees the streams: keep what the generation did for :func:`last_call`."""
    if state.streams:
        state.summary = last_call(state)


def in_call_path(state: Any) -> bool:
    """Whether every forward DeepCache installed is still reached when the model is called."""
    return all(h.in_path() for h in state.handles if isinstance(h, instance.ForwardHandle))


def ensure_installed(state: Any) -> int:
    """Put back each of DeepCache's forwards that a call no longer reaches (accelerate's offload hooks,
    re-installed by diffusers' ``maybe_free_model_hooks`` after every call, restore the forward they
    saved before DeepCache went in). Returns how many it put back."""
    n = sum(h.ensure() for h in state.handles if isinstance(h, instance.ForwardHandle))
    if n:
        state.reinstalls += n
        log.debug("torchfix.deepcache: %d forward(s) re-installed (another hook had replaced them)", n)
    return n


def generation_config(state: Any) -> Any:
    """The config this generation's steps follow: ``state.schedule`` where the scheduler decided the warm-up
    (:func:`_restart`), else the config applied."""
    return state.schedule or state.config


def generation_steps(state: Any) -> int | None:
    """Denoiser calls per stream in this generation: the timesteps the scheduler set, less those an img2img
    pipeline skips (``scheduler.set_begin_index(t_start)``, called after ``set_timesteps``), so the caching
    window's tail (``stop``) falls on the last steps that actually run. ``None``: unknown.

    >>> class S: total, scheduler = 20, None
    >>> generation_steps(S())
    20
    """
    if state.total is None:
        return None
    scheduler = state.scheduler() if state.scheduler is not None else None
    begin = getattr(scheduler, "begin_index", None)
    return state.total - begin if isinstance(begin, int) and 0 < begin < state.total else state.total


def flow_euler_sigmas(scheduler: Any) -> tuple[float, ...] | None:
    """The sigmas of a deterministic flow-matching Euler scheduler, whose step moves the latents by
    ``(σ[i+1] − σ[i])·output`` (diffusers' ``FlowMatchEulerDiscreteScheduler`` without stochastic sampling,
    as Flux's and SD3's pipelines use), else ``None``. Read once per generation (one host copy).

    >>> flow_euler_sigmas(object()) is None
    True
    """
    if type(scheduler).__name__ != "FlowMatchEulerDiscreteScheduler" or getattr(scheduler, "order", 1) != 1:
        return None  # a subclass may step differently
    config = getattr(scheduler, "config", None)
    if getattr(config, "stochastic_sampling", False) or getattr(config, "invert_sigmas", False):
        return None
    sigmas = getattr(scheduler, "sigmas", None)
    if sigmas is None:
        return None
    return tuple(float(v) for v in (sigmas.tolist() if hasattr(sigmas, "tolist") else sigmas))


def _restart(state: Any, scheduler: Any) -> None:
    """A new generation, with the step count ``scheduler`` has set (and, where ``warm_up`` is left to it, whether
    its timesteps call for a warm-up)."""
    state.reset()
    timesteps = getattr(scheduler, "timesteps", None)
    state.total = len(timesteps) if timesteps is not None else None
    config = state.config
    if config.warm_up is None and timesteps is not None:  # the schedule decides: an early second full step pays only
        values = timesteps.tolist() if hasattr(timesteps, "tolist") else list(timesteps)  # a tensor, an array, a list
        state.schedule = dataclasses.replace(config, warm_up=early_steps_move(values))  # where it moves early
    if hasattr(state, "sigmas"):  # a transformer that can revise its cached steps needs each step's size
        state.sigmas = flow_euler_sigmas(scheduler) if state.cannot_revise is None else None


def _hook_scheduler(state: Any, scheduler: Any) -> None:
    """Reset the state whenever ``scheduler`` sets its timesteps (a pipeline call starts), with the step
    count it set; re-install DeepCache's forwards if another hook replaced them since the last call."""
    if state.scheduler_hook is not None:
        state.scheduler_hook.restore()
        state.scheduler_hook = None
    set_timesteps = getattr(scheduler, "set_timesteps", None)
    state.scheduler = None if scheduler is None else weakref.ref(scheduler)
    if not callable(set_timesteps):
        return
    state_ref = weakref.ref(state)

    @functools.wraps(set_timesteps)
    def hooked(*args: Any, **kwargs: Any) -> Any:
        result = set_timesteps(*args, **kwargs)
        live = state_ref()
        if live is not None:
            ensure_installed(live)
            if engaged(live):  # another pipeline sharing this scheduler leaves a scoped state alone
                _restart(live, scheduler)
        return result

    state.scheduler_hook = instance.set_attr(scheduler, "set_timesteps", hooked)


def follow_scheduler(state: Any, pipe: Any = None) -> None:
    """Track the scheduler the pipeline uses *now*: hook it at ``apply``, and when the pipeline's
    scheduler was swapped since (``pipe.scheduler = DPMSolver...``), start a new generation with the
    new scheduler's step count and move the hook to it. Called at apply and at every denoiser call."""
    if pipe is not None:
        state.pipe = weakref.ref(pipe)
    live = None if state.pipe is None else state.pipe()
    if live is None:
        return
    scheduler = getattr(live, "scheduler", None)
    current = None if state.scheduler is None else state.scheduler()
    if scheduler is current and state.scheduler is not None:
        return
    swapped = state.scheduler is not None
    _hook_scheduler(state, scheduler)
    if swapped:  # this call's timesteps are already set on the new scheduler: a new generation
        _restart(state, scheduler)
