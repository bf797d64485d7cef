"""The fixes for :mod:`torchfix.guards.library_issues`: one :class:`~torchfix.patches.core.Patch` per row in force,
installed with the other patches (``import torchfix``) where the library is loaded already, or the moment it is
imported later (a finder on ``sys.meta_path``, wrapt's post-import hook idea: a script imports torchfix first, then
diffusers). Removed with the others: every patched attribute ``is`` the original again, and the finder is gone.
Beside the rows, ``DiffusionPipeline.progress_bar`` (every pipeline opens it before its first step) is where plain
``import torchfix`` runs the conditioning preflight (:mod:`torchfix.preflight`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import logging
import sys
import weakref
from typing import Any

import torch

from .. import _context, _frames, _warn, preflight
from .._report import FixEvent, report
from ..errors import ModelMismatchError
from ..families import DENOISERS
from ..guards import library_issues as li
from ..runtime import component, finite
from .core import Patch
from .instance import HookHandle, add_hook

__all__ = [
    "foreign_cache_hooks",
    "has_cache_state",
    "install",
    "installed",
    "remove",
    "reset_cache_state",
    "reset_unfinished",
    "side_components",
    "stale_refusal",
    "watch_cache",
]

log = logging.getLogger("torchfix")

_MODULE = "diffusers.models.modeling_utils"


def _resolve_on_cpu(original: Any) -> Any:
    """diffusers' ``_resolve_parallel_config`` with the CPU as every rank's device where torch sees no accelerator
    (its own takes ``rank % torch.accelerator.device_count()``: 0). The rest as diffusers does it."""

    def _resolve_parallel_config(self: Any, config: Any) -> Any:
        if not li.cpu_build():
            return original(self, config)
        from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig, TensorParallelConfig

        if not torch.distributed.is_available() or not torch.distributed.is_initialized():
            return original(self, config)  # diffusers' own error
        if isinstance(config, ContextParallelConfig):
            config = ParallelConfig(context_parallel_config=config)
        elif isinstance(config, TensorParallelConfig):
            config = ParallelConfig(tensor_parallel_config=config)
        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        mesh = None
        if config.context_parallel_config is not None:
            cp = config.context_parallel_config
            shape, names = cp.mesh_shape, cp.mesh_dim_names
            mesh = cp.mesh or torch.distributed.device_mesh.init_device_mesh("cpu", mesh_shape=shape, mesh_dim_names=names)
        elif config.tensor_parallel_config is not None:
            tp = config.tensor_parallel_config
            mesh = tp.mesh or torch.distributed.device_mesh.init_device_mesh("cpu", mesh_shape=(tp.tp_degree,), mesh_dim_names=("tp",))
        config.setup(rank, world_size, torch.device("cpu"), mesh=mesh)
        self._parallel_config = config
        return config

    return _resolve_parallel_config


def _sample(out: Any) -> Any:
    """The image in what a diffusers ``decode`` returns (``return_dict=False``: a tuple; else ``DecoderOutput``)."""
    return out[0] if isinstance(out, tuple) and out else getattr(out, "sample", out)


def _rescue_decode(original: Any) -> Any:
    """An autoencoder's ``decode`` whose non-finite fp16/bf16 result from finite latents is re-run in float32
    (:mod:`torchfix.runtime.finite`); where torchfix is off or its dtype guard is, exactly the original."""

    @functools.wraps(original)
    def decode(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        settings = _context.current()
        if not settings.active or not settings.dtype_on or torch.compiler.is_compiling():
            return out
        sample = _sample(out)
        if not finite.needs_rescue(sample, (*args, *kwargs.values())):
            return out

        path = f"{_frames.owner([self])[1]}.decode"  # "vae" when a pipeline holds it, else its class
        call = functools.partial(original, self)
        result = finite.rescued(path, sample.dtype, settings.mode, "torchfix", self, call, args, kwargs, pick=_sample)
        if isinstance(out, tuple):
            return (result, *out[1:])
        out.sample = result
        return out

    return decode


def _in_pipeline_dtype(original: Any) -> Any:
    """An autoencoder's ``decode`` or ``encode``: a call that plain torch rejects because the VAE was left in another
    dtype than its pipeline runs whole in the pipeline's dtype, as the maintainers' fix runs it
    (:mod:`torchfix.runtime.component`; a ControlNet's calls get the same through :func:`side_components`); every other
    call, every call where torchfix is off or its dtype guard is, and every call in ``strict`` mode (the guards raise
    at the first layer), exactly the original."""

    @functools.wraps(original)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        settings = _context.current()
        if not settings.active or not settings.dtype_on or settings.mode == "strict" or torch.compiler.is_compiling():
            return original(self, *args, **kwargs)
        p = component.plan(self, args, kwargs)
        if p is None:
            return original(self, *args, **kwargs)
        return component.run(p, functools.partial(original, self), args, kwargs, settings.mode, "torchfix")

    return call


# side component -> (its pre-hook, its forward hook); side component -> the calls in progress (an ExitStack each, or None)
_SIDES: weakref.WeakKeyDictionary[torch.nn.Module, tuple[HookHandle, HookHandle]] = weakref.WeakKeyDictionary()
_IN_CALL: weakref.WeakKeyDictionary[torch.nn.Module, list[contextlib.ExitStack | None]] = weakref.WeakKeyDictionary()


def _side_call_starts(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
    """A ControlNet's forward pre-hook: a call plain torch rejects because the ControlNet was left in another dtype
    than its pipeline starts running whole in the pipeline's dtype (:mod:`torchfix.runtime.component`), its arguments
    cast; every other call as it is."""
    calls = _IN_CALL.setdefault(module, [])
    _end_calls(calls)  # a ControlNet never calls itself: what is left is a call that a KeyboardInterrupt ended
    settings = _context.current()
    p = None
    if settings.active and settings.dtype_on and settings.mode != "strict" and not torch.compiler.is_compiling():
        p = component.plan(module, args, kwargs)
    if p is None:
        calls.append(None)
        return None
    stack = contextlib.ExitStack()
    args, kwargs = stack.enter_context(component.running(p, args, kwargs, settings.mode, "torchfix"))
    calls.append(stack)
    return args, kwargs


def _end_calls(calls: list[contextlib.ExitStack | None]) -> None:
    """End the calls in ``calls`` (each ControlNet's own weights back) and forget them. torch runs an ``always_call``
    hook after an ``Exception`` only: a ``KeyboardInterrupt`` leaves its call to be ended here, at the next call or
    when torchfix is removed."""
    while calls:
        stack = calls.pop()
        if stack is not None:
            stack.close()


def _side_call_ends(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
    """The matching forward hook (run however the call ends): the ControlNet's own weights back."""
    calls = _IN_CALL.get(module)
    stack = calls.pop() if calls else None
    if stack is not None:
        stack.close()
    return None


def side_components(pipe: Any) -> None:
    """Put the whole-call hooks on ``pipe``'s ControlNets (each net of a Multi-ControlNet), once per ControlNet while
    torchfix is installed. Hooks, not a patched ``forward``: they run whatever ``forward`` accelerate's or diffusers'
    hooks put on the ControlNet before torchfix was on."""
    for _, net in preflight.side_models(pipe):
        if net not in _SIDES:
            _SIDES[net] = (
                add_hook(net, _side_call_starts, pre=True, with_kwargs=True),
                add_hook(net, _side_call_ends, with_kwargs=True, always_call=True),
            )


def _decoding_in_pipeline_dtype_rescued(original: Any) -> Any:
    """An autoencoder's ``decode`` in its pipeline's dtype where it was left in another (:func:`_in_pipeline_dtype`),
    then re-run in float32 where that gave NaN/inf (:func:`_rescue_decode`)."""
    return _rescue_decode(_in_pipeline_dtype(original))


def _latents(args: tuple, kwargs: dict[str, Any]) -> torch.Tensor | None:
    for key in ("hidden_states", "sample", "x"):
        if isinstance(value := kwargs.get(key), torch.Tensor):
            return value
    return args[0] if args and isinstance(args[0], torch.Tensor) else None


def foreign_cache_hooks(model: torch.nn.Module) -> list[tuple[torch.nn.Module, Any]]:
    """The diffusers hooks that hold state (caches) on ``model`` and its submodules, torchfix's own left out (its
    DeepCache is fresh per call and resolution-tolerant), with the module each sits on."""
    found = []
    for module in model.modules():
        registry = module.__dict__.get("_diffusers_hook")
        for hook in (getattr(registry, "hooks", None) or {}).values():
            if getattr(hook, "_is_stateful", False) and not getattr(hook, "_torchfix", False):
                found.append((module, hook))
    return found


def has_cache_state(model: torch.nn.Module) -> bool:
    """Whether a diffusers hook that holds state (a cache, not torchfix's) sits on ``model`` or a submodule."""
    return bool(foreign_cache_hooks(model))


def _reset(hooks: list[tuple[torch.nn.Module, Any]]) -> None:
    """What diffusers' ``_reset_stateful_cache`` does, for these hooks only, from inside a call: each state manager
    keeps the ``cache_context`` the pipeline set around this call (diffusers' reset clears it, meant for between calls)."""
    managers = [(v, attr) for _, hook in hooks for v in vars(hook).values() if (attr := _context_attr(v)) is not None]
    contexts = [getattr(m, attr) for m, attr in managers]
    for owner, hook in hooks:
        hook.reset_state(owner)
    for (manager, _), context in zip(managers, contexts):
        manager.set_context(context)


def _context_attr(value: Any) -> str | None:
    """Where a diffusers ``StateManager`` keeps the current ``cache_context``: ``_context`` (a ``CacheContext``,
    diffusers 0.41+), ``_current_context`` (its name, before 0.41); ``None`` for anything else."""
    if not hasattr(value, "set_context"):
        return None
    return next((attr for attr in ("_context", "_current_context") if hasattr(value, attr)), None)


def _cache_reset(
    name: str, hooks: list[tuple[torch.nn.Module, Any]], why: str, site: str, *, change: str = "", op: str = "torchfix", refuse: bool = True
) -> None:
    """Reset ``hooks`` (the diffusers caches on the denoiser ``name``) and record it: an event, a log line, a warning in
    ``warn`` mode; in ``strict`` (where ``refuse``) a :class:`torchfix.ModelMismatchError` instead, naming the fix."""
    settings = _context.current()
    problem = f"{name}'s diffusers cache ({', '.join(sorted({type(h).__name__ for _, h in hooks}))}) {why}"
    if refuse and settings.mode == "strict":
        raise ModelMismatchError(f"torchfix: {problem}. To fix: {name}._reset_stateful_cache() before this call, or let calls finish.")
    _reset(hooks)
    detail = f"{problem} → reset first, as maybe_free_model_hooks() does at the end of a call: this call runs as a fresh one"
    report().add(FixEvent(op, "cache", "reset", site, name, detail, change=change))
    log.info("%s: %s", op, detail)
    if settings.mode == "warn":
        _warn.once(("cache-reset", name, why[:12]), f"{op}: {detail}.", site=site)


def reset_cache_state(model: torch.nn.Module, name: str, why: str, site: str) -> None:
    """Reset the state of every diffusers cache hook on ``model`` (torchfix's own left out), as diffusers'
    ``maybe_free_model_hooks`` does at the end of a pipeline call, and record it for ``torchfix.wrap``."""
    hooks = foreign_cache_hooks(model)
    if hooks:
        _SIGNATURES.pop(model, None)
        _cache_reset(name, hooks, why, site, op="torchfix.wrap", refuse=False)


# denoiser -> the latent signature of its previous call; denoiser -> the watch enable_cache put on it
_SIGNATURES: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()
_WATCHES: weakref.WeakKeyDictionary[torch.nn.Module, HookHandle] = weakref.WeakKeyDictionary()


def _reset_if_stale(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """A forward pre-hook: latents of another shape, dtype or device than the previous call's reset the diffusers
    cache state on ``module`` first (:data:`torchfix.guards.library_issues.CACHE_STATE`)."""
    settings = _context.current()
    latents = _latents(args, kwargs)
    if not settings.active or latents is None or torch.compiler.is_compiling():
        return None
    now = (tuple(latents.shape), str(latents.dtype), str(latents.device))
    change = li.stale(_SIGNATURES.get(module), now)
    _SIGNATURES[module] = now
    hooks = foreign_cache_hooks(module) if change is not None else []
    if not hooks:
        return None
    why = f"holds state from a call with other latents ({change})"
    _cache_reset(_frames.owner([module])[1], hooks, why, _frames.call_site(2), change=change)
    return None


def watch_cache(model: torch.nn.Module) -> HookHandle | None:
    """The stale-state check on ``model`` (a forward pre-hook); ``None`` where one is on it already."""
    if model in _WATCHES:
        return None
    return add_hook(model, _reset_if_stale, pre=True, with_kwargs=True)


# denoiser -> the latent signatures of its last two calls inside a cache_context, for a cache torchfix does not watch
_UNWATCHED: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()


# denoiser -> the pre-hook that notes its latents (put on at its first cache_context while torchfix is on; one per
# model for as long as torchfix is installed, so that a compiled model sees one hook, not one per step)
_NOTES: weakref.WeakKeyDictionary[torch.nn.Module, HookHandle] = weakref.WeakKeyDictionary()


def _note_latents(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """A forward pre-hook: the latent signature of this call, beside the previous one's."""
    latents = _latents(args, kwargs)
    if latents is not None and _context.current().active and not torch.compiler.is_compiling():
        before = _UNWATCHED.get(module)
        _UNWATCHED[module] = (None if before is None else before[1], (tuple(latents.shape), str(latents.dtype), str(latents.device)))
    return None


def _shapes(label: str, value: Any, depth: int = 0) -> list[str]:
    """``label (shape)`` for each tensor (or recorded shape) in ``value``, looking into tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        return [f"{label} {tuple(value.shape)}"]
    if isinstance(value, torch.Size):
        return [f"{label} {tuple(value)}"]
    if depth >= 3:
        return []
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in _shapes(f"{label}[{k!r}]", v, depth + 1)]
    if isinstance(value, (tuple, list)):
        return [s for i, v in enumerate(value) for s in _shapes(f"{label}[{i}]", v, depth + 1)]
    return []


def _held(hooks: list[tuple[torch.nn.Module, Any]]) -> list[str]:
    """What the state of ``hooks`` holds in the current ``cache_context``: its tensors and recorded shapes, as
    ``State.field (shape)``."""
    held: list[str] = []
    managers: dict[int, Any] = {}
    for _, hook in hooks:
        managers.update((id(v), v) for v in vars(hook).values() if _context_attr(v) is not None and hasattr(v, "get_state"))
    for manager in managers.values():
        try:
            state = manager.get_state()
        except Exception:  # no context set, or another diffusers' bookkeeping: nothing to name
            continue
        for field, value in vars(state).items():
            held.extend(_shapes(f"{type(state).__name__}.{field}", value))
    return list(dict.fromkeys(held))  # one hook per block holds alike: each entry once


_NAMED = 6  # the held tensors an error names; the rest are counted


def stale_refusal(model: torch.nn.Module, error: BaseException) -> str | None:
    """The error text for ``error``, raised inside a call of ``model`` whose latents differ from its previous call's
    while a diffusers cache torchfix does not watch holds the previous call's state (the
    :data:`torchfix.guards.library_issues.STALE_UNWATCHED` row); ``None`` where that is not what happened."""
    if not isinstance(error, RuntimeError):
        return None
    before, now = _UNWATCHED.get(model, (None, None))
    change = None if now is None else li.stale(before, now)
    hooks = foreign_cache_hooks(model) if change is not None else []
    held = _held(hooks)
    if not held:
        return None
    _, name, pipe = _frames.owner([model]) or (None, type(model).__name__, None)
    who = f"pipe.{name}" if pipe is not None else "model"
    kinds = ", ".join(sorted({type(h).__name__ for _, h in hooks}))
    reset = (
        f"{who}._reset_stateful_cache()"
        if callable(getattr(model, "_reset_stateful_cache", None))
        else f"diffusers.hooks.HookRegistry.check_if_exists_or_initialize({who}).reset_stateful_hooks()"
    )
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    return (
        f"torchfix: {name}'s diffusers cache ({kinds}) still holds the state of a call with other latents ({change}): "
        f"{', '.join(held[:_NAMED])}{f' and {len(held) - _NAMED} more' if len(held) > _NAMED else ''}; it failed on that "
        f"state ({first}). diffusers resets a cache's state only at the end of a "
        "pipeline call (maybe_free_model_hooks), never between generations of a loop of your own, and torchfix resets it "
        "only for a cache enabled while torchfix is on. To fix: call "
        f"{reset} before each new generation, or enable the cache after torchfix is on (it then resets the state when "
        "the latents change)."
    )


def _refusing_stale(original: Any) -> Any:
    """``CacheMixin.cache_context`` (every step of a pipeline, and of a loop of one's own, runs the model inside one):
    for a model whose cache torchfix does not watch, a call that fails on the state of a call with other latents
    raises :class:`torchfix.ModelMismatchError` saying so (:func:`stale_refusal`) instead of torch's size mismatch;
    every call that runs, and every call where torchfix is off, as diffusers runs it."""

    @functools.wraps(original)
    @contextlib.contextmanager
    def cache_context(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _context.current().active or self in _WATCHES or torch.compiler.is_compiling():
            with original(self, *args, **kwargs):
                yield
            return
        if self not in _NOTES:
            _NOTES[self] = add_hook(self, _note_latents, pre=True, with_kwargs=True)
        with original(self, *args, **kwargs):
            try:
                yield
            except RuntimeError as exc:
                refused = stale_refusal(self, exc)  # inside the context: the state it names is the context's
                if refused is None:
                    raise
                raise ModelMismatchError(refused) from exc

    return cache_context


def _marking_clean(original: Any) -> Any:
    @functools.wraps(original)
    def _reset_stateful_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        _SIGNATURES.pop(self, None)  # diffusers' own reset (the end of a pipeline call): the state is clean
        _UNWATCHED.pop(self, None)
        return result

    return _reset_stateful_cache


# Called with the pipeline when a pipeline opens its denoising loop, after the preflight: filled by the parts that
# act there (torchfix.deepcache registers its auto cache), so that this module imports none of them.
LOOP_STARTS: list[Any] = []


def _fresh_loop(original: Any) -> Any:
    """``DiffusionPipeline.progress_bar``, which every pipeline opens around its denoising loop (its encoders have run,
    no step has): the conditioning preflight (:func:`torchfix.preflight.refusal`, once per set of components) refuses
    components that do not fit, and a denoiser whose diffusers cache ran since diffusers last reset it (the call
    before did not finish) is reset first."""

    @functools.wraps(original)
    def progress_bar(self: Any, *args: Any, **kwargs: Any) -> Any:
        bar = original(self, *args, **kwargs)
        if _context.current().active:
            refused = preflight.refusal(self)  # before step 0: a side model for another base fails inside it
            if refused is not None:
                bar.close()
                raise ModelMismatchError(refused)
            reset_unfinished(self)
            side_components(self)
        try:
            for hook in LOOP_STARTS:  # deepcache.auto's: the cache torchfix run --deepcache asked for
                hook(self)
        except BaseException:
            bar.close()
            raise
        return bar

    return progress_bar


def reset_unfinished(pipe: Any) -> None:
    """Reset the diffusers cache state of each denoiser of ``pipe`` that ran since diffusers' last end-of-call reset
    (so the call before this one did not finish: an exception, Ctrl-C, a callback that stopped it)."""
    components = getattr(pipe, "components", None)
    if not isinstance(components, dict):
        return
    for name in DENOISERS:
        model = components.get(name)
        if not isinstance(model, torch.nn.Module) or model not in _SIGNATURES:
            continue
        hooks = foreign_cache_hooks(model)
        _SIGNATURES.pop(model, None)
        if not hooks:
            continue
        why = "still held the state of a call that did not finish (no end-of-call reset since its last step)"
        _cache_reset(name, hooks, why, _frames.call_site(3))


def _watching_enable(original: Any) -> Any:
    @functools.wraps(original)
    def enable_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        handle = watch_cache(self)
        if handle is not None:
            _WATCHES[self] = handle
        return result

    return enable_cache


def _watching_disable(original: Any) -> Any:
    @functools.wraps(original)
    def disable_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        handle = _WATCHES.pop(self, None)
        if handle is not None:
            handle.restore()
        _SIGNATURES.pop(self, None)
        return result

    return disable_cache


def _handing_over(original: Any) -> Any:
    """A pipeline's ``encode_prompt``: what it returns, with the prompt embeddings in the dtype the denoiser reads them in
    where torch would reject theirs, before the pipeline draws its noise in their dtype
    (:func:`torchfix.preflight.embeddings_for_denoiser`; a no-op where torchfix is off or the dtypes agree)."""

    @functools.wraps(original)
    def encode_prompt(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if not _context.current().active:
            return result
        return preflight.embeddings_for_denoiser(self, result, op="torchfix")

    return encode_prompt


@_frames.outside_graphs  # not torch.compiler.disable at import: that imports torch._dynamo (and Triton) with torchfix
def _restart(state: Any, changed: list[tuple[int, Any, Any]]) -> None:
    """Drop the Taylor factors of the outputs whose shape changed (diffusers' ``update`` then starts them at order 0,
    as its own check does from 0.41 on) and record it: an event, a log line, a warning in ``warn`` mode."""
    for i, _, _ in changed:
        state.taylor_factors.pop(i, None)
    chain = _frames.module_chain(2)
    module = _frames.module_path(chain) if chain else None
    where = module or "a module"
    shapes = "; ".join(f"output {i}: {tuple(a)} → {tuple(b)}" for i, a, b in changed)
    detail = (
        f"diffusers' TaylorSeer cache on {where} met features of another shape than it holds ({shapes}): the Taylor "
        "expansion starts again at order 0 there, as diffusers 0.41+ does (huggingface/diffusers#14831), instead of "
        "differencing across the two shapes (huggingface/diffusers#14829: 'The size of tensor a ... must match')"
    )
    change = "; ".join(f"{tuple(a)}→{tuple(b)}" for _, a, b in changed)
    site = _frames.call_site(2)
    report().add(FixEvent("torchfix", "cache", "restart", site, module, detail, change=change))
    log.info("torchfix: %s", detail)
    if _context.current().mode == "warn":
        _warn.once(("taylorseer-shape", module, change), f"torchfix: {detail}.", site=site)


def _restarting_on_new_shapes(original: Any) -> Any:
    """``TaylorSeerState.update`` of a diffusers without huggingface/diffusers#14831: an output whose shape differs
    from the factors the state holds for it starts a new expansion (its factors dropped first, so diffusers' own
    update computes order 0 alone: what the fix's ``prev.shape != new_factors[j].shape`` break computes); every
    other call, and every call where torchfix is off, is diffusers' own update untouched."""

    @functools.wraps(original)
    def update(self: Any, outputs: Any, *args: Any, **kwargs: Any) -> Any:
        factors = getattr(self, "taylor_factors", None)
        # as diffusers' own check: only after a first update, and never where it raises (a repeated step) first
        if (
            factors
            and not getattr(self, "is_inactive", False)
            and self.last_update_step is not None
            and self.current_step != self.last_update_step
            and _context.current().active
        ):
            changed = [
                (i, held.shape, features.shape)
                for i, features in enumerate(outputs)
                if (held := factors.get(i, {}).get(0)) is not None and held.shape != features.shape
            ]
            if changed:
                _restart(self, changed)
        return original(self, outputs, *args, **kwargs)

    return update


# patch label -> Patch, for the rows in force
_PATCHES: dict[str, Patch] = {}
_AUTOENCODERS = "diffusers.models.autoencoders."
_CACHES = "diffusers.models.cache_utils"
_PIPELINES = "diffusers.pipelines.pipeline_utils"
_PIPELINE_MODULES = "diffusers.pipelines."
_TAYLORSEER = "diffusers.hooks.taylorseer_cache"


def _version() -> str | None:
    return getattr(sys.modules.get("diffusers"), "__version__", None)


_FORCE: dict[str, bool] = {}


def _in_force(row: li.LibraryIssue) -> bool:
    """Whether ``row`` is in force with the loaded diffusers (asked once it is known: neither changes in a process)."""
    if row.issue not in _FORCE:
        version = _version()
        if version is None:
            return False
        _FORCE[row.issue] = li.explain(row, version)[0]
    return _FORCE[row.issue]


def _patch(owner: Any, name: str, label: str, make: Any) -> None:
    if label in _PATCHES:
        _PATCHES[label].install()  # kept from an earlier install: the same Patch again
        return
    if not callable(getattr(owner, name, None)):
        return
    patch = Patch(owner, name, label, make)
    patch.install()
    _PATCHES[label] = patch


def _patch_module(name: str) -> None:
    """Patch what the rows in force need in the loaded module ``name``."""
    module = sys.modules.get(name)
    if module is None:
        return
    if name == _MODULE and _in_force(li.CP_ON_CPU):
        owner = getattr(module, "ModelMixin", None)
        _patch(owner, "_resolve_parallel_config", "diffusers ModelMixin._resolve_parallel_config", _resolve_on_cpu)
    if name == _CACHES and _in_force(li.CACHE_STATE):
        owner = getattr(module, "CacheMixin", None)
        _patch(owner, "enable_cache", "diffusers CacheMixin.enable_cache", _watching_enable)
        _patch(owner, "disable_cache", "diffusers CacheMixin.disable_cache", _watching_disable)
        _patch(owner, "_reset_stateful_cache", "diffusers CacheMixin._reset_stateful_cache", _marking_clean)
    if name == _CACHES and _in_force(li.STALE_UNWATCHED):
        _patch(getattr(module, "CacheMixin", None), "cache_context", "diffusers CacheMixin.cache_context", _refusing_stale)
    if name == _TAYLORSEER and _in_force(li.TAYLORSEER_SHAPES):
        owner = getattr(module, "TaylorSeerState", None)
        _patch(owner, "update", "diffusers TaylorSeerState.update", _restarting_on_new_shapes)
    if name == _PIPELINES:  # the import-mode preflight, and the cache row's loop-start reset (a no-op without its watch)
        _patch(getattr(module, "DiffusionPipeline", None), "progress_bar", "diffusers DiffusionPipeline.progress_bar", _fresh_loop)
    if name.startswith(_PIPELINE_MODULES):  # each pipeline class that defines encode_prompt (its noise follows its output)
        for cls in list(vars(module).values()):
            if isinstance(cls, type) and cls.__module__ == name and callable(vars(cls).get("encode_prompt")):
                _patch(cls, "encode_prompt", f"diffusers {cls.__name__}.encode_prompt", _handing_over)
    if name.startswith(_AUTOENCODERS):  # a VAE left in another dtype runs in its pipeline's; a NaN decode re-runs in fp32
        rescue = _in_force(li.VAE_OVERFLOW)
        for cls in list(vars(module).values()):
            if isinstance(cls, type) and cls.__module__ == name and callable(vars(cls).get("decode")):
                decode = _decoding_in_pipeline_dtype_rescued if rescue else _in_pipeline_dtype
                _patch(cls, "decode", f"diffusers {cls.__name__}.decode", decode)
            if isinstance(cls, type) and cls.__module__ == name and callable(vars(cls).get("encode")):
                _patch(cls, "encode", f"diffusers {cls.__name__}.encode", _in_pipeline_dtype)


def _watched(name: str) -> bool:
    return name in (_MODULE, _CACHES, _PIPELINES, _TAYLORSEER) or name.startswith((_AUTOENCODERS, _PIPELINE_MODULES))


# the watched modules seen loaded, and how many modules were loaded at the last look (a look is a scan of
# sys.modules: ~5,000 names with diffusers, so it is made only when that number changed)
_SEEN: list[str] = []
_LOOKED = [0]


def _patch_loaded() -> None:
    if len(sys.modules) != _LOOKED[0]:
        seen = set(_SEEN)
        _SEEN.extend(n for n in list(sys.modules) if n not in seen and _watched(n))
        _LOOKED[0] = len(sys.modules)
    for name in _SEEN:
        _patch_module(name)


class _Finder(importlib.abc.MetaPathFinder):
    """Patches diffusers' modules right after each is first imported (torchfix enabled before diffusers)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if not _watched(name) or name in sys.modules:
            return None
        sys.meta_path.remove(self)  # find the real spec without us, then wrap its loader
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                if _FINDER in sys.meta_path:
                    if name not in _SEEN:
                        _SEEN.append(name)
                    _patch_module(name)

        spec.loader = _Loader()
        return spec


_FINDER = _Finder()


def install() -> None:
    """Patch each library row in force whose library is loaded; watch for the import of those that are not yet."""
    _patch_loaded()
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def remove() -> None:
    """Every patched attribute back to its original; the import watch gone."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for patch in _PATCHES.values():
        patch.remove()  # kept (removed) for the next install
    for handles in (_WATCHES, _NOTES):
        for handle in list(handles.values()):
            handle.restore()
        handles.clear()
    for pair in list(_SIDES.values()):
        for handle in pair:
            handle.restore()
    _SIDES.clear()
    for calls in list(_IN_CALL.values()):
        _end_calls(calls)
    _UNWATCHED.clear()


def installed() -> list[str]:
    """Labels of the library patches in place (the autoencoders' ``decode`` patches as one)."""
    labels = [p.label for p in _PATCHES.values() if p.installed]
    groups = (
        (".decode", "diffusers <autoencoder>.decode"),
        (".encode", "diffusers <autoencoder>.encode"),
        (".encode_prompt", "diffusers <pipeline>.encode_prompt"),
    )
    grouped = {title: [label for label in labels if label.endswith(end)] for end, title in groups}
    rest = [label for label in labels if not any(label in g for g in grouped.values())]
    return rest + [f"{title} ({len(g)} classes)" for title, g in grouped.items() if g]
