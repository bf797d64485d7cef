"""The state of one cached denoiser, by lifetime: the model's (:class:`CacheState`: what was installed, what it
counts across generations), the generation's (:class:`~torchfix.deepcache.generation.Generation`, owned by
:mod:`torchfix.deepcache.generation`) and the call's (:class:`Step`, made anew by each call's mechanism and handed
to the forwards it installed).

A *generation* is one pipeline call; within it each guidance pass is a *stream* with its own step count and
history of full steps. What a full step keeps per stream depends on the family's mechanism: the deep feature of a
UNet (:mod:`torchfix.deepcache.unet`), the residual of each run of transformer blocks
(:mod:`torchfix.deepcache.blocks`). Both keep it per *run* (a UNet has one), so the forecast, the sensitivity
measurement and the revision are written once (:mod:`torchfix.deepcache.forecast`).

>>> from torchfix.deepcache.engine import Step
>>> Step().mode
'off'
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ..families import Family
from .config import DeepCacheConfig
from .generation import MODES, Generation, Stream, Value, end, last_call

__all__ = ["MODES", "CacheState", "Step", "Stream", "changed", "context_listener", "marker"]

log = logging.getLogger("torchfix")


@dataclass(eq=False)
class Step:
    """One denoiser call: what it does (:data:`MODES`) and what its full step produced per run, until the call
    ends and it joins the stream's history. A mechanism's step adds what its forwards share within the call."""

    mode: str = "off"
    pending: dict[int, Value] = field(default_factory=dict)  # per run: what the full step in progress produced


@dataclass(eq=False)
class CacheState:
    """What the cache keeps for one denoiser over its lifetime: what was installed, whom it follows, and what it
    counts; the generation in progress and the call in progress are objects of their own (``generation``,
    ``step``). Only the generation's streams hold activation memory."""

    family: Family
    config: DeepCacheConfig
    original_forward: Any
    generation: Generation = None  # type: ignore[assignment]  # set in __post_init__
    step: Step = field(default_factory=Step)
    handles: list[Any] = field(default_factory=list)
    revises: bool = False  # whether the cached steps may be revised where the scheduler allows (a UNet never does)
    full_steps: int = 0
    cached_steps: int = 0
    generations: int = 0
    last_streams: int = 0  # streams of the current (or last) generation; kept when the cache is freed
    summary: dict[str, Any] | None = None  # last_call of the generation the last reset ended
    last_sensitivity: float | None = None  # the image stream's, as last measured (kept when the cache is freed)
    scope: object | None = None  # torchfix.wrap's token: cache only inside its pipeline's calls
    pipe: Any = None  # weakref to the pipeline applied to (its scheduler is followed)
    scheduler: Any = None  # weakref to the scheduler whose set_timesteps is hooked
    reinstalls: int = 0
    model: Any = None  # weakref to the denoiser
    context: str | None = None  # the cache_context name the pipeline set for the call in progress
    options: Any = None  # the options only its mechanism reads, as applied (mechanisms.UNetOptions / BlocksOptions)

    def __post_init__(self) -> None:
        if self.generation is None:
            self.generation = Generation(self.config)

    @property
    def cache_bytes(self) -> int:
        return self.generation.nbytes

    def idle(self) -> Step:
        """The step between calls: nothing in progress (a mechanism's own kind of step)."""
        return Step()

    def reset(self) -> None:
        """End the current generation (what it did stays readable: ``last_call``)."""
        end(self)

    def last_call(self) -> dict[str, Any]:
        """What the current (or last) generation did, in all and per stream."""
        return last_call(self)

    def follow(self, model: torch.nn.Module) -> None:
        self.model = weakref.ref(model)



def marker(tensor: torch.Tensor) -> int | torch.Tensor:
    """What tells later whether ``tensor`` was changed in place (:func:`changed`): its version counter, or, for an
    inference tensor (ComfyUI runs every node under ``torch.inference_mode``: no version counter), a copy of it."""
    return tensor.detach().clone() if tensor.is_inference() else tensor._version


def changed(tensor: torch.Tensor, mark: int | torch.Tensor | None) -> bool:
    """Whether ``tensor`` changed since :func:`marker` gave ``mark`` (``None``: nothing to tell, unchanged)."""
    if mark is None:
        return False
    return not torch.equal(tensor, mark) if isinstance(mark, torch.Tensor) else tensor._version != mark


def context_listener(state_ref: weakref.ref[CacheState]) -> Any:
    """Keeps the ``cache_context`` name diffusers' pipelines set around each denoiser call (``None`` outside): a
    ``CacheContext`` whose ``name`` it is (diffusers 0.41+), or the name itself (before 0.41)."""

    def on_context(context: Any) -> None:
        state = state_ref()
        if state is not None:
            state.context = context if context is None or isinstance(context, str) else getattr(context, "name", None)

    return on_context
