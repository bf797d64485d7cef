"""What DeepCache installed around a denoiser, kept in place at every call: whether this call is in its scope
(``torchfix.wrap``'s pipeline call, or any call for a model-wide ``apply``), where its forwards sit among diffusers'
context-parallel hooks, and the hook on the pipeline's scheduler whose ``set_timesteps`` starts each generation.
:func:`check` runs first in every denoiser call, before the generation and the schedule are consulted.

>>> with scoped("token"):
...     _SCOPE.get()
'token'
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..patches import instance
from .generation import restart_on

if TYPE_CHECKING:
    from .engine import CacheState

__all__ = ["check", "engaged", "ensure_installed", "follow_scheduler", "in_call_path", "order_hooks", "scoped", "unhook_scheduler"]

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


def engaged(state: CacheState) -> bool:
    """Whether this call caches: always for a model-wide ``apply``, only inside its scope for ``wrap``'s."""
    return state.scope is None or _SCOPE.get() is state.scope


def in_call_path(state: CacheState) -> bool:
    """Whether every forward DeepCache installed is still reached when the model is called."""
    return all(h.in_path() for h in state.handles if isinstance(h, instance.ForwardHandle))


def ensure_installed(state: CacheState) -> int:
    """Put back each of DeepCache's forwards that a call no longer reaches (accelerate's offload hooks,
    re-installed by diffusers' ``maybe_free_model_hooks`` after every call, restore the forward they
    saved before DeepCache went in). Returns how many it put back."""
    n = sum(h.ensure() for h in state.handles if isinstance(h, instance.ForwardHandle))
    if n:
        state.reinstalls += n
        log.debug("torchfix.deepcache: %d forward(s) re-installed (another hook had replaced them)", n)
    order_hooks(state)
    return n


def check(state: CacheState) -> tuple[bool, bool, Any]:
    """At the start of a denoiser call: ``(engaged, moved, swapped)``: whether this call caches (:func:`engaged`);
    whether DeepCache's model forward had to move outside diffusers' context-parallel hooks (:func:`order_hooks`: the
    call reached it already split); and, where engaged, the scheduler the pipeline swapped in since the last call,
    now followed (:func:`follow_scheduler`), whose timesteps start a new generation (``generation.enter`` restarts on
    it), else ``None``."""
    on = engaged(state)
    swapped = follow_scheduler(state) if on else None
    model = state.model() if state.model is not None else None
    if model is None or getattr(model, "_parallel_config", None) is None:
        return on, False, swapped
    return on, instance.place_all(state.handles, model, _context_parallel_hook)[0], swapped


def _context_parallel_hook(name: str) -> bool:
    return name.startswith(("cp_input---", "cp_output---"))  # diffusers' hooks/context_parallel.py names


def order_hooks(state: Any) -> tuple[bool, bool]:
    """Where diffusers' context parallelism hooks the model (``enable_parallelism``, before or after DeepCache):
    DeepCache's model forward goes outside its hooks (it sees the call's whole latents and the pipeline's own prompt
    tensors, which key the streams) and each block's forward inside them (it sees the shard the block computes on:
    Wan and Qwen-Image split the first block's input). Returns whether it moved (the model's, any block's)."""
    model = state.model() if state.model is not None else None
    if model is None or getattr(model, "_parallel_config", None) is None:
        return False, False
    return instance.place_all(state.handles, model, _context_parallel_hook)


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
                restart_on(live, scheduler)
        return result

    return hooked


def unhook_scheduler(state: CacheState) -> None:
    """Stop following the scheduler; its ``set_timesteps`` is put back once no state follows it."""
    scheduler = state.scheduler() if state.scheduler is not None else None
    hook = _SCHEDULER_HOOKS.get(scheduler) if scheduler is not None else None
    if hook is not None:
        hook.states.discard(state)
        if not hook.states:
            hook.handle.restore()
            del _SCHEDULER_HOOKS[scheduler]
    state.scheduler = None


def _hook_scheduler(state: CacheState, scheduler: Any) -> None:
    """Reset the state whenever ``scheduler`` sets its timesteps (a pipeline call starts), with the step
    count it set; re-install DeepCache's forwards if another hook replaced them since the last call."""
    unhook_scheduler(state)
    if scheduler is None:
        return
    state.scheduler = weakref.ref(scheduler)
    hook = _SCHEDULER_HOOKS.get(scheduler)
    set_timesteps = getattr(scheduler, "set_timesteps", None)
    if hook is None and callable(set_timesteps):
        hook = _SCHEDULER_HOOKS[scheduler] = _SchedulerHook(None)
        hook.states.add(state)
        hook.handle = instance.set_attr(scheduler, "set_timesteps", _hooked_set_timesteps(weakref.ref(scheduler), set_timesteps))
    elif hook is not None:
        hook.states.add(state)


def follow_scheduler(state: CacheState, pipe: Any = None) -> Any:
    """Track the scheduler the pipeline uses *now*: hook it at ``apply``, and when the pipeline's scheduler was
    swapped since (``pipe.scheduler = DPMSolver...``), move the hook to it and return it: this call's timesteps are
    already set on it, so the caller starts a new generation with its step count (``generation.enter(...,
    swapped=)``). Called at apply and at every denoiser call; ``None`` where nothing was swapped."""
    if pipe is not None:
        state.pipe = weakref.ref(pipe)
    live = None if state.pipe is None else state.pipe()
    if live is None:
        return None
    scheduler = getattr(live, "scheduler", None)
    current = None if state.scheduler is None else state.scheduler()
    if scheduler is current and state.scheduler is not None:
        return None
    swapped = state.scheduler is not None
    _hook_scheduler(state, scheduler)
    return scheduler if swapped else None
