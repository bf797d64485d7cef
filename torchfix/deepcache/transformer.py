"""DeepCache for diffusion transformers (SD3/SD3.5, Flux): run the first and last blocks on
every step, and on cached steps replace the blocks in between with the residual they added
at the last full step.

A transformer's blocks are a chain: each takes ``(hidden_states, encoder_hidden_states)``
and returns ``(encoder_hidden_states, hidden_states)`` (SD3's joint blocks; Flux's double-
then single-stream blocks). On a full step the middle run ``[keep_first, n - keep_last)``
runs and its residual ``out - in`` is kept, one per *stream*; on a cached step the first
middle block returns ``in + residual`` (the residual forecast from the last full steps) and
the others pass their inputs through. The first and last blocks, the embedders and the
output layers always run, so a cached step still sees this step's timestep and latents.

How much of this step's input passes through is measured (``DeepCacheConfig.sensitivity``):
a trained transformer's blocks undo much of an input change, so the cached step returns
``forecast_out + s·(in − forecast_in)``, with ``s`` the slope of the blocks' output error on
their input error at the last full step (``s = 1`` is ``in + residual``; ``s = 0`` forecasts
the blocks' output, TaylorSeer's whole-block forecast).

Where the cached blocks end the chain (Flux) and the scheduler is a flow-matching Euler one, each
full step also *revises* the cached steps since the last one (``DeepCacheConfig.revise``): their
blocks' output interpolated between the full steps around them, the output layers rerun on it, and
the change in where the latents went (velocity change × step size) added to this step's output.

A *stream* is one conditioning: the ``encoder_hidden_states`` object a call passes. A
pipeline that runs its guidance branches as separate calls (Flux's true CFG, modular
guiders) gets one cache per branch, and no branch ever sees another's residual. Each
stream counts its own calls; the first call of each stream is a full step.

>>> from torchfix.deepcache.transformer import analyse_transformer
>>> # analyse_transformer(flux.transformer).describe(1, 1)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ..patches import instance
from . import streams
from ._graphs import outside_graphs
from .config import DeepCacheConfig, corrects, for_family, must_run_full, warms_up
from .forecast import for_this_step, forecast, interpolate, keep_pending, moved, sensitivity
from .layout import UnsupportedUNetError

__all__ = [
    "TransformerCacheState",
    "TransformerLayout",
    "analyse_transformer",
    "apply_transformer",
    "check_transformer",
    "transformer_config",
]

log = logging.getLogger("torchfix")

# Calls that add per-block residuals from outside the blocks (ControlNet) or skip blocks
# (SD3's skip-layer guidance) cannot reuse a residual of the middle blocks: they run in full.
_FULL_ONLY = ("block_controlnet_hidden_states", "controlnet_block_samples", "controlnet_single_block_samples", "skip_layers")
# DeepCache's name in diffusers' HookRegistry (the model; its blocks get HOOK_NAME + "_block").
HOOK_NAME = "torchfix_deepcache"


@dataclass(frozen=True)
class TransformerLayout:
    """The blocks of a diffusion transformer in call order, with their attribute paths."""

    names: tuple[str, ...]
    blocks: tuple[torch.nn.Module, ...] = field(repr=False, compare=False)

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    def describe(self, keep_first: int, keep_last: int) -> str:
        """Human words for what a cached step skips."""
        first, last = keep_first, self.n_blocks - keep_last - 1
        return (
            f"blocks {self.names[first]} .. {self.names[last]} cached ({last - first + 1} of {self.n_blocks}); "
            f"the first {keep_first} and last {keep_last} always run"
        )


def analyse_transformer(model: torch.nn.Module) -> TransformerLayout:
    """The block chain of an SD3- or Flux-like transformer, or a clear error."""
    names, blocks = [], []
    for attr in ("transformer_blocks", "single_transformer_blocks"):
        for i, block in enumerate(getattr(model, attr, None) or ()):
            names.append(f"{attr}.{i}")
            blocks.append(block)
    if not blocks:
        raise UnsupportedUNetError(
            f"torchfix.deepcache: {type(model).__name__} has no transformer_blocks; DeepCache for transformers supports "
            "SD3/SD3.5 (SD3Transformer2DModel) and Flux (FluxTransformer2DModel) layouts."
        )
    return TransformerLayout(tuple(names), tuple(blocks))


def transformer_config(model: torch.nn.Module, config: DeepCacheConfig) -> DeepCacheConfig:
    """``config`` with what it leaves as ``None`` filled in for this transformer: the family's defaults, and
    ``keep_last`` 0 where the last block keeps the text stream (Flux), 1 where it drops it (SD3's
    ``context_pre_only``: it must run)."""
    config = for_family(config, "transformer")
    if config.keep_last is None:
        last = analyse_transformer(model).blocks[-1]
        config = dataclasses.replace(config, keep_last=1 if getattr(last, "context_pre_only", False) else 0)
    return config


def check_transformer(model: torch.nn.Module, config: DeepCacheConfig) -> TransformerLayout:
    """The layout, after checking that ``config.keep_first``/``keep_last`` leave blocks to cache."""
    layout = analyse_transformer(model)
    n = layout.n_blocks
    if config.keep_first + config.keep_last >= n:
        raise ValueError(
            f"torchfix.deepcache: keep_first={config.keep_first} + keep_last={config.keep_last} leaves nothing to cache in "
            f"{type(model).__name__}'s {n} blocks; allowed: keep_first + keep_last <= {n - 1}."
        )
    last = layout.blocks[-1]
    if config.keep_last == 0 and getattr(last, "context_pre_only", False):
        raise ValueError(
            f"torchfix.deepcache: keep_last=0, but {type(model).__name__}'s last block ({layout.names[-1]}) drops the text "
            "stream (context_pre_only) and cannot be cached; use keep_last >= 1."
        )
    reason = revise_off(model, config)
    if config.revise is True and reason is not None:
        raise ValueError(
            f"torchfix.deepcache: revise=True, but {type(model).__name__}: {reason}; leave revise=None to revise only where it can."
        )
    return layout


def revise_off(model: torch.nn.Module, config: DeepCacheConfig) -> str | None:
    """Why ``model`` with ``config`` cannot revise its cached steps (``None``: it can). Revising reruns the output
    layers on a revised output of the cached blocks, so they must end the chain and feed ``norm_out`` and
    ``proj_out``, whose output is the model's (Flux's layout)."""
    if config.revise is False:
        return "revise=False"
    if config.keep_last != 0:
        return f"keep_last={config.keep_last} (a block runs after the cached ones; revising needs keep_last=0)"
    if not all(isinstance(getattr(model, name, None), torch.nn.Module) for name in ("norm_out", "proj_out")):
        return "no norm_out and proj_out output layers"
    if len(inspect.signature(model.norm_out.forward).parameters) < 2:
        return "its norm_out takes no conditioning"
    return None


@dataclass
class _Stream:
    prompt: Any  # the encoder_hidden_states object this stream is keyed by (held, so its id stays unique)
    step: int = 0
    # (step, (text, image) residual added by the cached blocks[, (text, image) entering them]) of the last full
    # steps, oldest first: the inputs are kept where the cached step corrects for them (config.corrects)
    history: list[tuple[int, tuple[torch.Tensor | None, ...]]] = field(default_factory=list)
    # (text, image): the measured share of an input's forecast error the cached blocks pass through (None: not yet)
    sensitivity: tuple[float | None, float | None] = (None, None)
    reference: torch.Tensor | None = None  # with a threshold: the hidden states entering the cached blocks at the last full step
    cached_run: int = 0  # cached steps since the last full one
    full: int = 0
    cached: int = 0
    # where the cached steps are revised: per cached step since the last full one, (step, the image hidden states
    # entering the cached blocks, the conditioning the output layers got, the model's output, the sensitivity used)
    since_full: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, float]] = field(default_factory=list)

    @property
    def residual(self) -> tuple[torch.Tensor | None, ...] | None:
        return self.history[-1][1] if self.history else None

    @property
    def nbytes(self) -> int:
        held = [t for _, r in self.history for t in r if t is not None] + ([self.reference] if self.reference is not None else [])
        held += [t for record in self.since_full for t in record[1:4]]
        return sum(t.numel() * t.element_size() for t in held)


@dataclass
class TransformerCacheState:
    """Everything DeepCache keeps for one transformer. Only the streams' residuals hold activation memory."""

    config: DeepCacheConfig
    layout: TransformerLayout
    original_forward: Any
    handles: list[Any] = field(default_factory=list)
    streams: dict[int, _Stream] = field(default_factory=dict)
    signature: tuple | None = None  # (shape, dtype, device) of the latents the streams belong to
    total: int | None = None
    # the config this generation's steps follow: ``config`` with ``warm_up`` decided from the scheduler's timesteps
    schedule: DeepCacheConfig | None = None
    pending_new_call: bool = True
    # per call: "full" (run and keep the residual), "cached" (reuse it), "probe" (the first cached block decides
    # between the two from how far the features moved) or "off" (run, keep nothing)
    mode: str = "off"
    current: _Stream | None = None
    inputs: tuple[Any, Any] | None = None  # (text, image) entering the middle blocks on a full step
    pending: tuple[Any, ...] | None = None  # the (text, image) residual of the full step in progress[, and its inputs]
    full_steps: int = 0
    cached_steps: int = 0
    generations: int = 0
    last_streams: int = 0  # streams of the current (or last) generation; kept when the cache is freed
    summary: dict[str, Any] | None = None  # last_call of the generation the last reset ended
    last_sensitivity: float | None = None  # the image stream's, as last measured (kept when the cache is freed)
    scope: object | None = None  # torchfix.wrap's token: cache only inside its pipeline's calls
    pipe: Any = None  # weakref to the pipeline applied to (its scheduler is followed)
    scheduler: Any = None  # weakref to the scheduler whose set_timesteps is hooked
    scheduler_hook: Any = None
    reinstalls: int = 0
    model: Any = None  # weakref to the transformer (its output layers rerun where cached steps are revised)
    cannot_revise: str | None = None  # why the model cannot revise its cached steps (None: it can)
    sigmas: tuple[float, ...] | None = None  # this generation's flow-matching Euler sigmas (None: not revised)
    revising: bool = False  # this call's stream revises its cached steps
    entered: torch.Tensor | None = None  # a cached step's image hidden states entering the cached blocks
    used: float = 1.0  # the sensitivity a cached step used
    conditioning: torch.Tensor | None = None  # the conditioning a cached step's norm_out got
    revised_steps: int = 0

    @property
    def cache_bytes(self) -> int:
        return sum(s.nbytes for s in self.streams.values())

    def reset(self) -> None:
        """Forget every stream and the current generation (what it did stays readable: ``streams.last_call``)."""
        streams.keep_summary(self)
        self.streams.clear()
        self.signature = None
        self.pending_new_call = True
        self.current = None
        self.inputs = None
        self.pending = None
        self.mode = "off"
        self.entered = self.conditioning = None


@outside_graphs
def _decide(state: TransformerCacheState, hidden: torch.Tensor, prompt: Any, arguments: dict[str, Any]) -> None:
    """Pick the stream and whether this call is full (``mode`` "off" outside the scope of ``torchfix.wrap``'s
    call: the blocks run untouched). Kept out of compiled graphs: it is Python state."""
    state.revising = False
    if not streams.engaged(state):
        state.mode = "off"
        return
    streams.follow_scheduler(state)
    stream = streams.enter(state, hidden, prompt, _Stream)
    state.last_streams = len(state.streams)
    index = stream.step
    stream.step += 1
    config = streams.generation_config(state)
    state.revising = state.cannot_revise is None and state.sigmas is not None
    if any(arguments.get(name) is not None for name in _FULL_ONLY):
        full, keep = True, False
    elif stream.residual is None:
        full, keep = True, config.interval > 1
    else:
        full = must_run_full(index, streams.generation_steps(state) or config.num_steps, config, stream.cached_run)
        keep = full is not False
    if full is None:
        state.mode = "probe"  # counted when the first cached block has measured the features
        return
    state.mode = "cached" if not full else ("full" if keep else "off")
    _count(state, stream, full)


def _count(state: TransformerCacheState, stream: _Stream, full: bool) -> None:
    if full:
        state.full_steps += 1
        stream.full += 1
        stream.cached_run = 0
    else:
        state.cached_steps += 1
        stream.cached += 1
        stream.cached_run += 1


@outside_graphs
def _keep(state: TransformerCacheState, output: Any) -> torch.Tensor | None:
    """After a call: a full step's residual joins its stream's history, after measuring how much of the
    input's forecast error the cached blocks passed through (eager: the history is a Python list). Where
    the cached steps are revised: a cached step is noted, and a full step returns what to add to its output
    for the cached steps since the last one (``None``: nothing)."""
    if state.pending is not None and state.current is not None and len(state.pending) == 4:
        _measure(state)
    kept = state.pending is not None
    keep_pending(state, 2 if state.revising else 0)
    change = None
    stream = state.current
    if state.revising and stream is not None:
        sample = _sample(output)
        if state.mode == "cached" and state.entered is not None and state.conditioning is not None and sample is not None:
            stream.since_full.append((stream.step - 1, state.entered, state.conditioning, sample.detach(), state.used))
        elif state.mode == "full" and kept and stream.since_full and sample is not None:
            change = _revision(state, stream, sample)
        if state.mode != "cached":
            stream.since_full.clear()
    state.mode, state.inputs, state.entered, state.conditioning = "off", None, None, None
    return change


def _sample(output: Any) -> torch.Tensor | None:
    """The model's output tensor: the first of a tuple, or ``.sample``."""
    sample = output[0] if isinstance(output, tuple) and output else getattr(output, "sample", None)
    return sample if isinstance(sample, torch.Tensor) else None


def _revision(state: TransformerCacheState, stream: _Stream, sample: torch.Tensor) -> torch.Tensor | None:
    """What full step ``stream.step − 1`` adds to its output for the cached steps since the last full one:
    per cached step, the output layers rerun on the cached blocks' output interpolated between the full
    steps around it, minus the output the step returned, times its step size; all over this step's size.
    The latents then land where the revised steps would have put them (a flow-matching Euler step is
    ``latents + (σ[i+1] − σ[i])·output``). ``None`` where the scheduler's step index is unknown."""
    model = state.model() if state.model is not None else None
    scheduler = state.scheduler() if state.scheduler is not None else None
    index = getattr(scheduler, "step_index", None)
    sigmas = state.sigmas
    if model is None or not isinstance(index, int) or sigmas is None or index + 1 >= len(sigmas):
        return None
    step = stream.step - 1
    size = sigmas[index + 1] - sigmas[index]
    if size == 0 or index - (step - stream.since_full[0][0]) < 0:
        return None
    change = torch.zeros_like(sample, dtype=torch.promote_types(sample.dtype, torch.float32))  # half precision sums in float32
    image = [(i, (value[1], value[3] if len(value) > 3 else None)) for i, value in stream.history]  # what norm_out gets
    if len(image) == 3 and _off_the_curve(state, image[0][0]):
        # the quadratic through step 0 overshoots between the next two (on the trained Flux-like model 2-5× the
        # error of the line through them; from the third full step on, the quadratic is the more exact)
        image = image[1:]
    for at, entered, conditioning, used_output, s in stream.since_full:
        residual, predicted = interpolate(image, at)
        if residual is None:
            return None
        revised = entered + residual
        if predicted is not None and s != 1.0:
            revised = revised + (1.0 - s) * (predicted - entered)
        output = model.proj_out(model.norm_out(revised, conditioning))
        if output.shape != used_output.shape:
            return None
        i = index - (step - at)
        change += (output - used_output) * (sigmas[i + 1] - sigmas[i])
    state.revised_steps += len(stream.since_full)
    return (change / size).to(sample.dtype)


def _revised(output: Any, change: torch.Tensor) -> Any:
    """``output`` with ``change`` added to its sample (a tuple's first item, or ``.sample``)."""
    if isinstance(output, tuple):
        return (output[0] + change, *output[1:])
    output.sample = output.sample + change
    return output


def _off_the_curve(state: TransformerCacheState, step: int) -> bool:
    """Whether full step ``step`` is off the curve the later full steps follow: step 0 of a generation that warmed
    up (its first steps move fast). A forecast or an interpolation through it is off for the fast start."""
    return step == 0 and warms_up(streams.generation_config(state))


def _measure(state: TransformerCacheState) -> None:
    """At a full step whose residual and inputs the stream could have forecast (a forecast order and two
    full steps before it): the sensitivity of each of the (text, image) parts, where there is one to measure.
    Where the generation warmed up (its first steps move fast), a forecast that reaches back to step 0 is
    off for the fast start, not for the blocks' response to their input: it measures nothing (on the trained
    Flux-like model it set 0.0 for the first cached runs and cost up to 12% at intervals 5 and 6)."""
    stream, config = state.current, state.config
    if config.sensitivity is not None or len(stream.history) < 2:  # set by the user; nothing to forecast from yet
        return
    oldest = stream.history[-min(config.forecast, len(stream.history) - 1) - 1][0]  # the first point the forecast used
    if _off_the_curve(state, oldest):
        return
    predicted = forecast(stream.history, stream.step - 1, config.forecast)
    measured = list(stream.sensitivity)
    for part in (0, 1):
        residual, entered = state.pending[part], state.pending[part + 2]
        if residual is None or entered is None or predicted[part] is None or predicted[part + 2] is None:
            continue
        value = sensitivity(residual - predicted[part], entered - predicted[part + 2])
        if value is not None:
            measured[part] = value
    stream.sensitivity = (measured[0], measured[1])
    if measured[1] is not None:
        state.last_sensitivity = measured[1]


@outside_graphs
def _cached(state: TransformerCacheState, text: Any, hidden: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """What the cached blocks return on a cached step that corrects for its input: per part,
    ``in + residual − (1 − s)·(in − forecast_in)`` (eager: ``s`` is a Python number that changes per step)."""
    stream, config = state.current, state.config
    value = for_this_step(state) if config.forecast else stream.residual
    out = []
    for part, now in enumerate((text, hidden)):
        residual, predicted = value[part], value[part + 2]
        s = config.sensitivity if config.sensitivity is not None else stream.sensitivity[part]
        if part == 1:
            state.used = 1.0 if s is None or predicted is None else s
        if now is None or residual is None:
            out.append(now)
        elif s is None or s == 1.0 or predicted is None:
            out.append(now + residual)
        else:
            out.append(now + residual - (1.0 - s) * (now - predicted))
    return out[0], out[1]


@outside_graphs
def _probe(state: TransformerCacheState, hidden: torch.Tensor) -> None:
    """A step the features decide: cached while the hidden states entering the cached blocks moved less than
    the threshold since the last full step, else full. Eager: it reads a tensor's value."""
    stream = state.current
    full = stream.reference is None or moved(hidden, stream.reference) >= state.config.threshold
    state.mode = "full" if full else "cached"
    _count(state, stream, full)


def _block_forward(state_ref: weakref.ref[TransformerCacheState], first: bool, last: bool) -> Any:
    return lambda original, source: _block_forward_of(state_ref, first, last, original, source)


def _block_forward_of(state_ref: weakref.ref[TransformerCacheState], first: bool, last: bool, original: Any, source: Any) -> Any:
    sig = inspect.signature(source)

    @functools.wraps(source)
    def forward(*args: Any, **kwargs: Any) -> Any:
        state = state_ref()
        mode = state.mode if state is not None else "off"
        if mode == "off":
            return original(*args, **kwargs)
        if mode != "full" or first:
            bound = sig.bind_partial(*args, **kwargs).arguments
            hidden, text = bound.get("hidden_states"), bound.get("encoder_hidden_states")
        if mode == "probe" and first:
            _probe(state, hidden)
            mode = state.mode
        if mode == "cached":
            if not first:
                return text, hidden
            if state.revising:
                state.entered, state.used = hidden, 1.0  # corrects() sets the sensitivity it used
            if corrects(state.config):
                return _cached(state, text, hidden)
            r_text, r_hidden = for_this_step(state) if state.config.forecast else state.current.residual
            return (text + r_text if r_text is not None and text is not None else text), hidden + r_hidden
        if first:
            state.inputs = (text, hidden)
            if state.config.threshold is not None:
                state.current.reference = hidden.detach()
        out = original(*args, **kwargs)
        if last and state.inputs is not None:
            text_in, hidden_in = state.inputs
            text_out, hidden_out = out
            r_text = (text_out - text_in).detach() if text_out is not None and text_in is not None else None
            state.pending = (r_text, (hidden_out - hidden_in).detach())  # kept by the model's forward, outside any graph
            if corrects(state.config):  # with the inputs, to forecast them and measure the blocks' sensitivity
                state.pending += (text_in.detach() if text_in is not None else None, hidden_in.detach())
            state.inputs = None
        return out

    forward.__torchfix_deepcache__ = True  # type: ignore[attr-defined]
    return forward


def _model_forward(state: TransformerCacheState) -> Any:
    def make(original: Any, source: Any) -> Any:
        sig = inspect.signature(source)

        @functools.wraps(source)
        def forward(*args: Any, **kwargs: Any) -> Any:
            arguments = sig.bind_partial(*args, **kwargs).arguments
            _decide(state, arguments["hidden_states"], arguments.get("encoder_hidden_states"), arguments)
            output = None
            try:
                output = original(*args, **kwargs)
            finally:
                change = _keep(state, output)
            return output if change is None else _revised(output, change)

        forward.__torchfix_deepcache__ = True  # type: ignore[attr-defined]
        return forward

    return make


def _conditioning_hook(state_ref: weakref.ref[TransformerCacheState], norm_out: torch.nn.Module) -> Any:
    """A pre-hook on ``norm_out`` that keeps, on a cached step that will be revised, the conditioning it gets
    (a reference, no copy): the revision reruns it on the revised hidden states."""
    sig = inspect.signature(norm_out.forward)

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        state = state_ref()
        if state is not None and state.revising and state.mode == "cached":
            conditioning = sig.bind_partial(*args, **kwargs).arguments.get(list(sig.parameters)[1])
            if isinstance(conditioning, torch.Tensor):
                state.conditioning = conditioning.detach()

    return hook


def apply_transformer(model: torch.nn.Module, config: DeepCacheConfig, layout: TransformerLayout) -> TransformerCacheState:
    """Install the block and model forwards on ``model`` (the caller registers the state and the scheduler hook)."""
    state = TransformerCacheState(config, layout, model.forward)
    state_ref = weakref.ref(state)
    first, last = config.keep_first, layout.n_blocks - config.keep_last - 1
    for i in range(first, last + 1):
        make = _block_forward(state_ref, i == first, i == last)
        state.handles.append(instance.wrap_forward(layout.blocks[i], HOOK_NAME + "_block", make))
    state.handles.append(instance.wrap_forward(model, HOOK_NAME, _model_forward(state), reset=state.reset))
    state.model = weakref.ref(model)
    state.cannot_revise = revise_off(model, config)
    if state.cannot_revise is None:
        state.handles.append(instance.add_hook(model.norm_out, _conditioning_hook(state_ref, model.norm_out), pre=True, with_kwargs=True))
    what = layout.describe(config.keep_first, config.keep_last)
    log.debug("torchfix.deepcache: applied to %s (%s, interval=%d)", type(model).__name__, what, config.interval)
    return state
