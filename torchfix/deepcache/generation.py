"""The generation: one pipeline call of one denoiser, its guidance streams and the schedule it follows, shared by
every mechanism (UNet, ComfyUI UNet, transformer blocks).

A *generation* is one pipeline call (:class:`Generation`, owned by this module: nothing else replaces it); within it
each ``encoder_hidden_states`` object a call passes, or each ``cache_context`` name the pipeline sets, is a
*stream* (:class:`Stream`: a prompt, or a guidance branch run as its own call) with its own step count and the
history of its full steps. :func:`enter` starts a new generation where needed (the scheduler set new timesteps,
the latents changed shape) and picks the call's stream; :func:`restart` starts one on the schedule a scheduler
set; :func:`end` ends one. Pure Python bookkeeping: no tensor is read but for its shape, dtype and device.

>>> MODES
('off', 'plain', 'full', 'cached', 'probe')
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .config import DeepCacheConfig
from .schedule import early_steps_move, warms_up

if TYPE_CHECKING:
    from .engine import CacheState

__all__ = [
    "MAX_STREAMS",
    "MODES",
    "Generation",
    "Stream",
    "clock",
    "end",
    "enter",
    "flow_euler_sigmas",
    "keep_reference",
    "last_call",
    "restart",
    "restart_on",
    "signature_of",
    "stream_key",
]

log = logging.getLogger("torchfix")

# What a denoiser call does: "off" (caching not engaged: the model runs untouched), "plain" (runs in full and
# keeps nothing: a call with ControlNet residuals, or interval 1), "full" (runs and keeps what the cached steps
# reuse), "cached" (reuses it), "probe" (the features decide between full and cached, once they are seen).
MODES = ("off", "plain", "full", "cached", "probe")

# Streams kept per generation before it is treated as a new one (LTX runs four guidance passes a step).
MAX_STREAMS = 8

Value = Any  # what a run keeps per full step: a tensor, or a tuple of tensors and None


@dataclass(eq=False)
class Stream:
    """One guidance pass (a prompt, or a ``cache_context`` name) within a generation."""

    prompt: Any  # held, so the id it is keyed by stays unique
    start: int = 0  # the scheduler's step at this stream's first call (a second expert starts mid-generation)
    step: int = 0
    # per run: (step, value) of the last full steps, oldest first
    histories: dict[int, list[tuple[int, Value]]] = field(default_factory=dict)
    # per (run, part): the measured share of an input's forecast error the cached blocks pass through, one per sample
    sensitivity: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    reference: torch.Tensor | None = None  # with a threshold: what the probe compares with, from the last full step
    cached_run: int = 0  # cached steps since the last full one
    full: int = 0
    cached: int = 0
    # where cached steps are revised: per cached step since the last full one, (step, the image stream entering the
    # cached blocks, the conditioning the output layers got, the model's output, the sensitivity used)
    since_full: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, Any]] = field(default_factory=list)
    # per (prompt-only module, call of the step): what it got and returned when it last ran, and the output's tensors
    # with their markers (:mod:`torchfix.deepcache.prompt_only`)
    prompt_only: dict[tuple[str, int], tuple[list, Any, list]] = field(default_factory=dict)

    def run_history(self, run: int = 0) -> list[tuple[int, Value]]:
        """``(step, value)`` of run ``run``'s last full steps, oldest first."""
        return self.histories.setdefault(run, [])

    @property
    def history(self) -> list[tuple[int, Value]]:
        """The first run's history (a UNet has one run)."""
        return self.run_history(0)

    @property
    def residual(self) -> Value | None:
        """What the first run kept at the last full step."""
        return self.last(0)

    def last(self, run: int = 0) -> Value | None:
        """What run ``run`` kept at the last full step (``None``: nothing yet)."""
        history = self.histories.get(run)
        return history[-1][1] if history else None

    @property
    def nbytes(self) -> int:
        held = [t for h in self.histories.values() for _, v in h for t in (v if isinstance(v, tuple) else (v,)) if t is not None]
        held += [self.reference] if self.reference is not None else []
        held += [t for record in self.since_full for t in record[1:4]]
        held += [t for given, _, outputs in self.prompt_only.values() for t, _ in given + outputs if isinstance(t, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in held)


@dataclass(eq=False)
class Generation:
    """One pipeline call of one denoiser: its streams, and the schedule its steps follow. Owned by this module;
    a new one replaces it when a generation ends (:func:`end`), keeping the schedule the scheduler set for it.

    >>> from torchfix.deepcache import DeepCacheConfig
    >>> g = Generation(DeepCacheConfig())
    >>> g.started, g.total, g.streams
    (False, None, {})
    """

    config: DeepCacheConfig  # what its steps follow: the config applied, ``warm_up`` decided from the scheduler's timesteps
    total: int | None = None  # the timesteps the scheduler set (denoiser calls per stream), ``None``: unknown
    sigmas: tuple[float, ...] | None = None  # its flow-matching Euler sigmas, where the cached steps may be revised
    started: bool = False  # a denoiser call entered it (until then the next call starts it)
    streams: dict[Any, Stream] = field(default_factory=dict)
    current: Stream | None = None  # the stream of the call in progress (or the last one)
    signature: tuple | None = None  # what the latents the streams belong to look like
    warms_up: bool = field(init=False)  # its steps warm up (schedule.warms_up): its step 0 is off the later steps' curve

    def __post_init__(self) -> None:
        self.warms_up = self.config is not None and warms_up(self.config)

    def after(self) -> Generation:
        """The next generation: nothing of this one's streams, the same schedule."""
        return Generation(self.config, self.total, self.sigmas)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.streams.values())

    def summary(self) -> dict[str, Any]:
        """Full and cached steps, in all and per stream."""
        per = [{"full_steps": st.full, "cached_steps": st.cached} for st in self.streams.values()]
        return {"full_steps": sum(p["full_steps"] for p in per), "cached_steps": sum(p["cached_steps"] for p in per), "streams": per}


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


def end(state: CacheState) -> None:
    """End the current generation (what it did stays readable: :func:`last_call`); the next call starts a new one
    on the same schedule. Also what diffusers' ``reset_stateful_hooks`` and ``torchfix.deepcache.new_call`` do."""
    gen = state.generation
    if gen.streams:
        state.summary = gen.summary()
    state.generation = gen.after()
    state.step = state.idle()


def enter(state: CacheState, latents: Any, prompt: Any, context: str | None = None, *, swapped: Any = None) -> Stream:
    """The stream of this call, after starting a new generation where needed: none started yet (the scheduler set
    new timesteps), a scheduler ``swapped`` in since the last call (its timesteps set: :func:`restart_on`), the
    latents changed shape, dtype or device, or a new stream would exceed :data:`MAX_STREAMS`. A new stream notes the
    scheduler's step it starts at (:func:`clock`): Wan 2.2's second expert starts mid-generation."""
    if swapped is not None:
        restart_on(state, swapped)
    gen = state.generation
    signature = signature_of(latents)
    key = stream_key(context, prompt)
    # Within a pipeline call (its scheduler marks each new one) latents whose dtype alone changed are the same
    # generation: SD3 with an fp32 T5 hands a bf16 transformer fp32 latents at step 0 and bf16 ones after.
    same_call = state.scheduler is not None and bool(gen.streams) and _sizes(signature) == _sizes(gen.signature)
    if (
        not gen.started
        or (signature != gen.signature and not same_call)
        or (key not in gen.streams and len(gen.streams) >= MAX_STREAMS)
    ):
        end(state)
        gen = state.generation
        gen.started = True
        state.generations += 1
    gen.signature = signature
    stream = gen.streams.get(key)
    if stream is None or not _same_prompt(stream.prompt, prompt):  # the id of a prompt that is gone may be reused
        stream = gen.streams[key] = Stream(prompt)
        stream.start = clock(state)
    gen.current = stream
    state.last_streams = len(gen.streams)
    return stream


def keep_reference(state: CacheState, signal: torch.Tensor) -> None:
    """On a full step with a threshold: what the next probes compare with."""
    if state.config.threshold is not None and state.generation.current is not None:
        state.generation.current.reference = signal.detach()


def clock(state: CacheState) -> int:
    """How many steps of this generation the scheduler has taken (its ``step_index`` less the steps an img2img
    pipeline skips), 0 where it does not say."""
    scheduler = state.scheduler() if state.scheduler is not None else None
    index = getattr(scheduler, "step_index", None)
    if not isinstance(index, int):
        return 0
    begin = getattr(scheduler, "begin_index", None)
    return max(index - begin, 0) if isinstance(begin, int) else index


def last_call(state: CacheState) -> dict[str, Any]:
    """What the current (or last) generation did: full and cached steps, in all and per stream (after a reset
    freed the streams, as diffusers' pipelines do at the end of a call: what they did before it)."""
    gen = state.generation
    if not gen.streams and state.summary is not None:
        return state.summary
    return gen.summary()


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


def restart_on(state: CacheState, scheduler: Any) -> None:
    """A new generation on the timesteps ``scheduler`` has set (and its sigmas, where the cache may revise)."""
    restart(state, getattr(scheduler, "timesteps", None), flow_euler_sigmas(scheduler) if state.revises else None)


def restart(state: CacheState, timesteps: Any, sigmas: tuple[float, ...] | None = None) -> None:
    """A new generation whose denoiser calls follow ``timesteps`` (a tensor, an array or a list; ``None``: unknown):
    its step count, and, where ``warm_up`` is left to the schedule, whether it calls for a warm-up. ``sigmas``: a
    flow-matching Euler schedule the cached steps may be revised on."""
    end(state)
    values = None if timesteps is None else (timesteps.tolist() if hasattr(timesteps, "tolist") else list(timesteps))
    config = state.config
    if config.warm_up is None and values is not None:  # the schedule decides: an early second full step pays only
        config = dataclasses.replace(config, warm_up=early_steps_move(values))  # where it moves early
    state.generation = Generation(config, None if values is None else len(values), sigmas)
