"""The cache engine every family shares: a state per denoiser, a stream per guidance pass, and one step
decision (full, cached, or a probe that lets the features decide).

A *generation* is one pipeline call (:mod:`torchfix.deepcache.streams`); within it each guidance pass is a
*stream* with its own step count and history of full steps. What a full step keeps per stream depends on the
family's mechanism: the deep feature of a UNet (:mod:`torchfix.deepcache.unet`), the residual of each run of
transformer blocks (:mod:`torchfix.deepcache.blocks`). Both keep it per *run* (a UNet has one), so the
forecast, the sensitivity measurement and the revision are written once.

>>> from torchfix.deepcache.engine import MODES
>>> MODES
('off', 'plain', 'full', 'cached', 'probe')
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ..families import Family
from . import parallel, streams
from ._graphs import outside_graphs
from .config import DeepCacheConfig, must_run_full
from .forecast import forecast, moved, remember

__all__ = [
    "MODES",
    "CacheState",
    "Stream",
    "changed",
    "context_listener",
    "decide",
    "for_this_step",
    "keep_pending",
    "keep_reference",
    "marker",
    "probe",
    "ranks",
]

# What a denoiser call does: "off" (caching not engaged: the model runs untouched), "plain" (runs in full and
# keeps nothing: a call with ControlNet residuals, or interval 1), "full" (runs and keeps what the cached steps
# reuse), "cached" (reuses it), "probe" (the features decide between full and cached, once they are seen).
MODES = ("off", "plain", "full", "cached", "probe")

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
class CacheState:
    """What the cache keeps for one denoiser; only the streams hold activation memory."""

    family: Family
    config: DeepCacheConfig
    original_forward: Any
    handles: list[Any] = field(default_factory=list)
    streams: dict[Any, Stream] = field(default_factory=dict)
    current: Stream | None = None  # the stream of the call in progress (or the last one)
    signature: tuple | None = None  # what the latents the streams belong to look like
    total: int | None = None
    # the config this generation's steps follow: ``config`` with ``warm_up`` decided from the scheduler's timesteps
    schedule: DeepCacheConfig | None = None
    pending_new_call: bool = True
    mode: str = "off"
    pending: dict[int, Value] = field(default_factory=dict)  # per run: what the full step in progress produced
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
    sigmas: tuple[float, ...] | None = None  # this generation's flow-matching Euler sigmas, where it revises

    @property
    def cache_bytes(self) -> int:
        return sum(s.nbytes for s in self.streams.values())

    @property
    def step(self) -> int:
        """Denoiser calls so far in the current stream of this generation."""
        return 0 if self.current is None else self.current.step

    def may_revise(self) -> bool:
        """Whether this denoiser revises its cached steps where the scheduler allows (a UNet never does)."""
        return False

    def reset(self) -> None:
        """Forget every stream and the current generation (what it did stays readable: ``streams.last_call``)."""
        streams.keep_summary(self)
        self.streams.clear()
        self.current = None
        self.signature = None
        self.pending_new_call = True
        self.pending = {}
        self.mode = "off"

    def follow(self, model: torch.nn.Module) -> None:
        self.model = weakref.ref(model)


@outside_graphs
def decide(state: CacheState, latents: Any, prompt: Any, arguments: dict[str, Any], *, verified: bool = True) -> str:
    """What this denoiser call does (:data:`MODES`), after picking its stream; counted unless it is a probe.
    ``verified``: the family's blocks were checked on this call path (until then a call runs in full). Kept
    out of compiled graphs: it is Python state, not tensor math."""
    if not streams.engaged(state):
        state.mode = "off"
        return "off"
    streams.follow_scheduler(state)
    context = state.family.context(arguments) if state.family.context is not None else state.context
    stream = streams.enter(state, latents, prompt, Stream, context)
    state.last_streams = len(state.streams)
    index = stream.step
    stream.step += 1
    config = streams.generation_config(state)
    extra = arguments.get("kwargs") or {}  # what a forward's **kwargs took (ComfyUI's Wan takes control there)
    if config.interval == 1 or any(
        arguments.get(name, extra.get(name)) is not None for name in state.family.full_only_arguments
    ):
        mode = "plain"
    elif stream.last() is None or not verified:
        mode = "full"
    else:
        full = must_run_full(index, streams.stream_steps(state, stream) or config.num_steps, config, stream.cached_run)
        mode = "probe" if full is None else ("full" if full else "cached")
    state.mode = mode
    if mode != "probe":
        _count(state, stream, mode != "cached")
    return mode


def count_full(state: CacheState, stream: Stream) -> None:
    """Count the call in progress as a full step (a cached step that had to run in full)."""
    _count(state, stream, True)


def _count(state: CacheState, stream: Stream, full: bool) -> None:
    if full:
        state.full_steps += 1
        stream.full += 1
        stream.cached_run = 0
    else:
        state.cached_steps += 1
        stream.cached += 1
        stream.cached_run += 1


@outside_graphs
def probe(state: CacheState, signal: torch.Tensor) -> str:
    """A step the features decide: cached while ``signal`` (what a cached step starts from) moved less than the
    threshold since the last full step, in every sample of the batch, else full. Eager: it reads a tensor."""
    stream = state.current
    full = stream.reference is None or moved(signal, stream.reference, parallel.summer(ranks(state))) >= state.config.threshold
    state.mode = "full" if full else "cached"
    _count(state, stream, full)
    return state.mode


def ranks(state: CacheState) -> parallel.Group:
    """The ranks that share this denoiser's calls (context or tensor parallel), whose sums every decision adds;
    :data:`parallel.ALONE` for one process or data parallelism."""
    model = state.model() if state.model is not None else None
    return parallel.ALONE if model is None else parallel.of(model)


def keep_reference(state: CacheState, signal: torch.Tensor) -> None:
    """On a full step with a threshold: what the next probes compare with."""
    if state.config.threshold is not None and state.current is not None:
        state.current.reference = signal.detach()


def order(state: CacheState, extra: int = 0) -> int:
    """How many full steps back a stream's history reaches: what the forecast order needs, or more."""
    return max(state.config.forecast, extra)


@outside_graphs
def keep_pending(state: CacheState, extra: int = 0) -> bool:
    """After a full step: what each run produced joins its stream's history (eager: histories are Python lists).
    Returns whether anything was kept."""
    stream = state.current
    kept = bool(state.pending) and stream is not None
    for run, value in state.pending.items() if kept else ():
        remember(stream.run_history(run), stream.step - 1, value, order(state, extra))
    state.pending = {}
    return kept


@outside_graphs
def for_this_step(state: CacheState, run: int = 0) -> Value:
    """The value forecast for the cached step in progress from run ``run``'s history (eager: the step gaps are
    Python numbers)."""
    stream = state.current
    history = stream.run_history(run)
    return forecast(history, stream.step - 1, state.config.forecast) if state.config.forecast else history[-1][1]


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
