"""DeepCache for diffusers UNets (SD1.x/2.x/SDXL, AnimateDiff, Stable Video Diffusion): on a cached step, only
the shallow part of the UNet runs, around the deep feature of the last full steps (:mod:`torchfix.deepcache.shallow`),
at any latent size and frame count (a new shape of the latents, frames included, starts a new generation).

The deep feature is what enters skip connection ``branch``'s consumer; a full step keeps it (one *run*, in the
engine's terms), a cached step forecasts it. UNet calls are counted, never looked up by timestep value, so
nothing synchronises with the device and repeated timesteps (Heun) or keyword/int/1-D timesteps are all fine.
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from .._frames import hiding_frames
from ..families import Family
from ..patches import instance
from . import engine, forecast, generation, installed, schedule
from ._graphs import outside_graphs
from .config import DeepCacheConfig
from .layout import Layout
from .shallow import shallow_forward

__all__ = ["UNetState", "UNetStep", "apply_unet"]

log = logging.getLogger("torchfix")

# The name DeepCache's forward has in diffusers' HookRegistry (where the installed diffusers has one).
HOOK_NAME = "torchfix_deepcache"


@dataclass(eq=False)
class UNetStep(engine.Step):
    """One UNet call: whether the hook on the branch's consumer keeps the deep feature it sees."""

    capturing: bool = False


@dataclass(eq=False)
class UNetState(engine.CacheState):
    """The cache of one UNet: the engine's state and the skip layout.

    A pipeline that runs its guidance branches as separate UNet calls (modular guiders, PAG,
    low-memory samplers) passes a different ``encoder_hidden_states`` to each: each is a
    *stream* with its own step count and cached feature, so caching works as in the batched
    case and no branch sees another's feature.
    """

    layout: Layout | None = None
    step: UNetStep = field(default_factory=UNetStep)
    copy_feature: bool = False  # the host changes the feature in place after it is made (ComfyUI's FreeU): keep a copy
    check_feature: bool = False  # check that the kept feature is not changed after it was kept (ComfyUI's UNet)
    feature_marker: Any = None  # what tells whether the kept feature changed after it was kept (version, or a copy)

    @property
    def feature(self) -> torch.Tensor | None:
        """The current stream's cached deep feature."""
        current = self.generation.current
        return None if current is None else current.last()

    def idle(self) -> UNetStep:
        return UNetStep()

    def describe(self) -> str:
        return self.layout.describe(self.config.branch)


@outside_graphs
def _decide(state: UNetState, sample: torch.Tensor, prompt: Any, arguments: dict[str, Any]) -> bool | None:
    """True for a full step, False for a cached one, None to run the UNet untouched (outside the scope of
    ``torchfix.wrap``'s call). A UNet's cached step recomputes from the sample, so with a threshold the sample is
    what the features are judged by."""
    engaged, _, swapped = installed.check(state)
    if not engaged:
        state.step = UNetStep()
        return None
    context = state.family.context(arguments) if state.family.context is not None else state.context
    stream = generation.enter(state, sample, prompt, context, swapped=swapped)
    mode = schedule.decide(state, stream, arguments)
    if mode == "probe":
        mode = schedule.probe(state, sample)
    state.step = UNetStep(mode, capturing=mode == "full" or (mode == "plain" and state.config.interval > 1))
    full = mode != "cached"
    if full:
        generation.keep_reference(state, sample)
    return full


@outside_graphs
def _done_full(state: UNetState) -> None:
    """After a full step: its deep feature joins the stream's history (eager: the history is a Python list)."""
    state.step.capturing = False
    forecast.keep(state)


def _scales_in_place(block: torch.nn.Module | None) -> bool:
    """Whether diffusers' FreeU, enabled on up block ``block``, scales what enters its resnets in place (its
    ``apply_freeu`` does so at resolutions 0 and 1): the kept feature would change after it was kept."""
    if block is None or getattr(block, "resolution_idx", None) not in (0, 1):
        return False
    return all(getattr(block, k, None) for k in ("s1", "s2", "b1", "b2"))


def _capture_hook(state_ref: weakref.ref[UNetState], pre: bool, consumer: torch.nn.Module | None = None) -> Any:
    # Stores a reference to the tensor entering the branch's consumer; a copy where the consumer's up block changes it
    # in place (FreeU) or the host does.
    block_ref = weakref.ref(consumer) if consumer is not None else lambda: None

    def keep(state: UNetState | None, h: Any) -> None:
        if state is not None and state.step.capturing and state.generation.current is not None:
            copy = state.copy_feature or _scales_in_place(block_ref())
            kept = h.detach().clone() if copy else h.detach()
            state.step.pending[0] = kept  # joins the stream's history after the call, outside any graph
            if state.check_feature:  # eager only: a compiled graph keeps no Python state (and must not guard on versions)
                checkable = not copy and not torch.compiler.is_compiling()
                state.feature_marker = engine.marker(kept) if checkable else None

    if pre:

        def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            keep(state_ref(), kwargs.get("hidden_states", args[0] if args else None))

        return hook

    def hook_out(module: torch.nn.Module, args: tuple, output: Any) -> None:
        keep(state_ref(), output[0] if isinstance(output, tuple) else getattr(output, "sample", output))

    return hook_out


def _make_forward(unet: torch.nn.Module, state: UNetState) -> Any:
    """The factory :func:`instance.wrap_forward` builds the UNet's forward with."""
    unet_ref = weakref.ref(unet)

    def make(original: Any, source: Any) -> Any:
        sig = inspect.signature(source)

        @functools.wraps(source)
        def forward(*args: Any, **kwargs: Any) -> Any:
            arguments = sig.bind(*args, **kwargs).arguments
            full = _decide(state, arguments["sample"], arguments.get("encoder_hidden_states"), arguments)
            if full is None:
                return original(*args, **kwargs)
            if full:
                try:
                    return original(*args, **kwargs)
                finally:
                    _done_full(state)
            extra = arguments.pop("kwargs", None) or {}
            feature = forecast.for_this_step(state)
            return shallow_forward(unet_ref(), state.layout, state.config.branch, feature, **arguments, **extra)

        forward.__torchfix_deepcache__ = True  # type: ignore[attr-defined]
        return hiding_frames(forward)

    return make


def _last_of_layer(block: torch.nn.Module, j: int) -> torch.nn.Module:
    """The module whose output leaves layer ``j`` of an up block (what enters resnet ``j + 1``): its motion module
    (AnimateDiff), else its attention, else its resnet."""
    for part in ("motion_modules", "attentions"):
        modules = getattr(block, part, None)
        if modules is not None:
            return modules[j]
    return block.resnets[j]


def apply_unet(unet: torch.nn.Module, family: Family, config: DeepCacheConfig, layout: Layout) -> UNetState:
    """Install the capture hook and the forward on ``unet`` (the caller registers the state and follows the scheduler)."""
    state = UNetState(family, config, unet.forward, layout=layout)
    state.follow(unet)
    state_ref = weakref.ref(state)
    i, j = layout.consumers[config.branch]
    up = unet.up_blocks[i]
    if j == 0:
        state.handles.append(instance.add_hook(up, _capture_hook(state_ref, pre=True, consumer=up), pre=True, with_kwargs=True))
    else:
        producer = _last_of_layer(up, j - 1)
        state.handles.append(instance.add_hook(producer, _capture_hook(state_ref, pre=False, consumer=up)))
    state.handles.append(
        instance.wrap_forward(unet, HOOK_NAME, _make_forward(unet, state), reset=state.reset, on_context=engine.context_listener(state_ref))
    )
    log.debug("torchfix.deepcache: applied to %s (%s, interval=%d)", type(unet).__name__, layout.describe(config.branch), config.interval)
    return state
