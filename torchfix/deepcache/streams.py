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
    "clock",
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
    "order_for_parallel",
    "restart",
    "scoped",
    "signature_of",
    "stream_key",
    "unhook_scheduler",
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

# Streams kept per generation before it is treated as a new one (LTX runs four guidance passes a step).
MAX_STREAMS = 8


class _HasPrompt(Protocol):
    prompt: Any
    step: int
    full: int
    cached: int


S = TypeVar("S", bound=_HasPrompt)


def signature_of(latents: Any) -> tuple:
    """What a generation's latents look like: shape, dtype and device (of each, for a list of tensors)."""
    if isinstance(latents, torch.Tensor):
        return (tuple(latents.shape), latents.dtype, latents.device)
    if isinstance(latents, (list, tuple)):
        return tuple(signature_of(t) for t in latents)
    return (type(latents).__name__,)


def _sizes(signature: Any) -> Any:
    """A :func:`signature_of` without the dtypes: shapes and devices."""
    if isinstance(signature, tuple) and len(signature) == 3 and isinstance(signature[1], torch.dtype):
        return (signature[0], signature[2])
    return tuple(_sizes(s) for s in signature) if isinstance(signature, tuple) else signature


def stream_key(context: str | None, prompt: Any) -> tuple[str | None, Any]:
    """A stream's key: the ``cache_context`` name the pipeline set for this call (diffusers' "cond", "uncond",
    "uncond_stg", ...: passes that share a prompt stay apart), and the prompt object (a list of prompt tensors
    by its tensors: a pipeline may rebuild the list around the same tensors)."""
    if isinstance(prompt, (list, tuple)):
        return context, tuple(id(p) for p in prompt)
    return context, id(prompt)


def _same_prompt(held: Any, prompt: Any) -> bool:
    if isinstance(prompt, (list, tuple)) and isinstance(held, (list, tuple)):
        return len(held) == len(prompt) and all(a is b for a, b in zip(held, prompt))
    return held is prompt


def enter(state: Any, latents: Any, prompt: Any, new_stream: type[S], context: str | None = None) -> S:
    """The stream of this call, after starting a new generation where needed: the pipeline asked for
    one (``state.pending_new_call``), the latents changed shape, dtype or device, or a new stream would
    exceed :data:`MAX_STREAMS`. ``state`` has ``streams``, ``signature``, ``pending_new_call``,
    ``generations``, ``current`` and ``reset()``. A new stream notes the scheduler's step it starts at
    (:func:`clock`): Wan 2.2's second expert starts mid-generation."""
    signature = signature_of(latents)
    key = stream_key(context, prompt)
    # Within a pipeline call (its scheduler marks each new one) latents whose dtype alone changed are the same
    # generation: SD3 with an fp32 T5 hands a bf16 transformer fp32 latents at step 0 and bf16 ones after.
    same_call = state.scheduler is not None and bool(state.streams) and _sizes(signature) == _sizes(state.signature)
    if (
        state.pending_new_call
        or (signature != state.signature and not same_call)
        or (key not in state.streams and len(state.streams) >= MAX_STREAMS)
    ):
        state.reset()
        state.pending_new_call = False
        state.generations += 1
    state.signature = signature
    stream = state.streams.get(key)
    if stream is None or not _same_prompt(stream.prompt, prompt):  # the id of a prompt that is gone may be reused
        stream = state.streams[key] = new_stream(prompt)
        stream.start = clock(state)
    state.current = stream
    return stream


def clock(state: Any) -> int:
    """How many steps of this generation the scheduler has taken (its ``step_index`` less the steps an img2img
    pipeline skips), 0 where it does not say."""
    scheduler = state.scheduler() if state.scheduler is not None else None
    index = getattr(scheduler, "step_index", None)
    if not isinstance(index, int):
        return 0
    begin = getattr(scheduler, "begin_index", None)
    return max(index - begin, 0) if isinstance(begin, int) else index


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
    order_for_parallel(state)
    return n


def _context_parallel_hook(name: str) -> bool:
    return name.startswith(("cp_input---", "cp_output---"))  # diffusers' hooks/context_parallel.py names


def order_for_parallel(state: Any) -> tuple[bool, bool]:
    """Where diffusers' context parallelism hooks the model (``enable_parallelism``, before or after DeepCache):
    DeepCache's model forward goes outside its hooks (it sees the call's whole latents and the pipeline's own prompt
    tensors, which key the streams) and each block's forward inside them (it sees the shard the block computes on:
    Wan and Qwen-Image split the first block's input). Returns whether it moved (the model's, any block's)."""
    model = state.model() if state.model is not None else None
    if model is None or getattr(model, "_parallel_config", None) is None:
        return False, False
    moved_model = moved_block = False
    for h in state.handles:
        if isinstance(h, instance.ForwardHandle):
            outside = h.module is model
            if instance.place(h, _context_parallel_hook, outside=outside):
                moved_model |= outside
                moved_block |= not outside
    return moved_model, moved_block


def generation_config(state: Any) -> Any:
    """The config this generation's steps follow: ``state.schedule`` where the scheduler decided the warm-up
    (:func:`_restart`), else the config applied."""
    return state.schedule or state.config


def stream_steps(state: Any, stream: Any) -> int | None:
    """Denoiser calls ``stream`` gets in this generation, counted from its first: the generation's steps less
    those taken before it started (a second expert's share), ``None`` where unknown."""
    total = generation_steps(state)
    return None if total is None else max(total - getattr(stream, "start", 0), 1)


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
    """A new generation, with the step count ``scheduler`` has set."""
    restart(state, getattr(scheduler, "timesteps", None), flow_euler_sigmas(scheduler) if state.may_revise() else None)


def restart(state: Any, timesteps: Any, sigmas: tuple[float, ...] | None = None) -> None:
    """A new generation whose denoiser calls follow ``timesteps`` (a tensor, an array or a list; ``None``: unknown):
    its step count, and, where ``warm_up`` is left to the schedule, whether it calls for a warm-up. ``sigmas``: a
    flow-matching Euler schedule the cached steps may be revised on."""
    state.reset()
    values = None if timesteps is None else (timesteps.tolist() if hasattr(timesteps, "tolist") else list(timesteps))
    state.total = None if values is None else len(values)
    config = state.config
    if config.warm_up is None and values is not None:  # the schedule decides: an early second full step pays only
        state.schedule = dataclasses.replace(config, warm_up=early_steps_move(values))  # where it moves early
    state.sigmas = sigmas


@dataclasses.dataclass
class _SchedulerHook:
    """One ``set_timesteps`` hook per scheduler, shared by every state that follows it (Wan 2.2's two experts
    run on one scheduler): a new pipeline call restarts each of them. Gone with the last of them."""

    handle: Any
    states: weakref.WeakSet = dataclasses.field(default_factory=weakref.WeakSet)


_SCHEDULER_HOOKS: weakref.WeakKeyDictionary[Any, _SchedulerHook] = weakref.WeakKeyDictionary()


def _hooked_set_timesteps(scheduler_ref: weakref.ref, set_timesteps: Any) -> Any:
    @functools.wraps(set_timesteps)
    def hooked(*args: Any, **kwargs: Any) -> Any:
        result = set_timesteps(*args, **kwargs)
        scheduler = scheduler_ref()
        hook = _SCHEDULER_HOOKS.get(scheduler) if scheduler is not None else None
        for live in list(hook.states) if hook is not None else ():
            ensure_installed(live)
            if engaged(live):  # another pipeline sharing this scheduler leaves a scoped state alone
                _restart(live, scheduler)
        return result

    return hooked


def unhook_scheduler(state: Any) -> None:
    """Stop following the scheduler; its ``set_timesteps`` is put back once no state follows it."""
    scheduler = state.scheduler() if state.scheduler is not None else None
    hook = _SCHEDULER_HOOKS.get(scheduler) if scheduler is not None else None
    if hook is not None:
        hook.states.discard(state)
        if not hook.states:
            hook.handle.restore()
            del _SCHEDULER_HOOKS[scheduler]
    state.scheduler = None


def _hook_scheduler(state: Any, scheduler: Any) -> None:
    """Reset the state whenever ``scheduler`` sets its timesteps (a pipeline call starts), with the step
    count it set; re-install DeepCache's forwards if another hook replaced them since the last call."""
    unhook_scheduler(state)
    if scheduler is None:
        return
    state.scheduler = weakref.ref(scheduler)
    hook = _SCHEDULER_HOOKS.get(scheduler)
    if hook is None:
        set_timesteps = getattr(scheduler, "set_timesteps", None)
        if not callable(set_timesteps):
            return
        handle = instance.set_attr(scheduler, "set_timesteps", _hooked_set_timesteps(weakref.ref(scheduler), set_timesteps))
        hook = _SCHEDULER_HOOKS[scheduler] = _SchedulerHook(handle)
    hook.states.add(state)


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
