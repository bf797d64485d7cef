"""DeepCache for every diffusion transformer family: skip runs of blocks on cached steps, each run replaced by
the residual it added at the last full steps, after checking on the first call that the blocks do what the
family's registry entry says.

A transformer's blocks form a chain: each takes the *streams* (the image tokens; for some families the text
or audio tokens too) and returns them updated (:class:`torchfix.families.Blocks` says which parameter takes
which stream and in which order they come back). On a full step every block runs and each *run* of cached
blocks keeps its residual ``out − in`` per stream; on a cached step the first block of a run returns
``in + residual`` (the residual forecast from the last full steps) and the others pass their inputs through.
The blocks the family keeps (``keep_first``/``keep_last``), the embedders, whatever the model computes between
blocks and the output layers always run, so a cached step still sees this step's timestep and latents. On a cached
step of a ComfyUI transformer the skipped blocks are not called at all: for the call, stand-ins take their places in
the block lists (:func:`_shadows`).

**Verified, never guessed.** The first full call of every call path (the set of arguments a call passes) runs
eagerly with every block of the family's lists observed: a block must be called once, in a fixed order; it
must return the streams its entry names, as tensors shaped like their inputs; and which output continues which
input is read off by object identity (the tensor block *k* returns *is* the one block *k + 1* takes). Where
the model computes something between two blocks (VACE's control hints, the text concatenated into the image
tokens between Flux.2's double and single blocks) the chain is split: each run gets its own residual. A
model whose blocks behave otherwise is refused with :class:`torchfix.UnsupportedModelError` before any step
is cached, naming what was found.

How much of this step's input passes through is measured (``DeepCacheConfig.sensitivity``): a trained
transformer's blocks undo much of an input change, so a cached run returns ``forecast_out + s·(in −
forecast_in)``, ``s`` measured per sample at each full step. Where one run ends the chain and feeds the
model's output layers (Flux), each full step may also *revise* the cached steps since the last one
(``DeepCacheConfig.revise``).

>>> from torchfix.deepcache.blocks import analyse_transformer
>>> # analyse_transformer(pipe.transformer).describe(0, 0)
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import families
from .._frames import hiding_frames, under_dynamo
from ..errors import InvalidArgumentError, UnsupportedModelError
from ..families import Blocks, Family
from ..patches import instance
from . import engine, forecast, generation, installed, parallel, prompt_only, schedule
from ._graphs import outside_graphs
from .chain import Chain, Recorder, check_calls, observe, out_of_order, outputs_of, reader, returned, verify
from .config import DeepCacheConfig, for_family
from .residuals import cached, reshaped, residuals, restart_run
from .revise import after_call

__all__ = [
    "BlockState",
    "BlockStep",
    "Chain",
    "Plan",
    "TransformerLayout",
    "analyse_transformer",
    "apply_transformer",
    "check_transformer",
    "transformer_config",
]

log = logging.getLogger("torchfix")

# DeepCache's name in diffusers' HookRegistry (the model; its blocks get HOOK_NAME + "_block").
HOOK_NAME = "torchfix_deepcache"


# --- the blocks as the entry names them ------------------------------------------------------------------------


@dataclass(frozen=True)
class TransformerLayout:
    """The blocks of a transformer's cacheable lists, in the entry's order, with their attribute paths."""

    family: Family
    names: tuple[str, ...]
    blocks: tuple[torch.nn.Module, ...] = field(repr=False, compare=False)
    specs: tuple[Blocks, ...] = field(repr=False, compare=False)

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    def describe(self, keep_first: int, keep_last: int) -> str:
        """Human words for what a cached step skips (in the entry's order; the call order is checked at the first call)."""
        first, last = keep_first, self.n_blocks - keep_last - 1
        return (
            f"blocks {self.names[first]} .. {self.names[last]} cached ({last - first + 1} of {self.n_blocks}); "
            f"the first {keep_first} and last {keep_last} always run"
        )


def _family_of(model: torch.nn.Module) -> Family:
    family = families.resolve(model)  # the registry's entry, else one read off the model's code (verified at the first call)
    if family.kind != "transformer":
        raise UnsupportedModelError(
            f"torchfix.deepcache: {type(model).__name__} is a {family.title} UNet, not a diffusion transformer whose blocks "
            "form a chain."
        )
    return family


def analyse_transformer(model: torch.nn.Module) -> TransformerLayout:
    """The cacheable blocks of a registered transformer family, or a clear error naming what is missing."""
    family = _family_of(model)
    names, blocks, specs = [], [], []
    for spec in family.blocks:
        blocklist = getattr(model, spec.attr, None)
        if not isinstance(blocklist, torch.nn.ModuleList):
            raise UnsupportedModelError(
                f"torchfix.deepcache: {type(model).__name__} (family {family.name!r}) has no block list {spec.attr!r}; its "
                f"entry expects {family.describe()}. This diffusers release may have changed the model."
            )
        for i, block in enumerate(blocklist):
            params = inspect.signature(instance.forward_source(block)).parameters
            missing = [p for p in spec.inputs.values() if p not in params]
            if missing:
                raise UnsupportedModelError(
                    f"torchfix.deepcache: {type(model).__name__}.{spec.attr}.{i} ({type(block).__name__}) takes no "
                    f"{', '.join(missing)}; the {family.name!r} entry expects {spec.describe()}. This diffusers release may "
                    "have changed the model."
                )
            names.append(f"{spec.attr}.{i}")
            blocks.append(block)
            specs.append(spec)
    if not blocks:
        raise UnsupportedModelError(f"torchfix.deepcache: {type(model).__name__} has no blocks in {family.describe()}.")
    return TransformerLayout(family, tuple(names), tuple(blocks), tuple(specs))


def transformer_config(model: torch.nn.Module, config: DeepCacheConfig) -> DeepCacheConfig:
    """``config`` with what it leaves as ``None`` filled in for this transformer's family."""
    return for_family(config, _family_of(model))


def check_transformer(model: torch.nn.Module, config: DeepCacheConfig) -> TransformerLayout:
    """The layout, after checking that ``config`` fits the model (what can be known before a call)."""
    layout = analyse_transformer(model)
    family, n = layout.family, layout.n_blocks
    if config.keep_first + config.keep_last >= n:
        raise InvalidArgumentError(
            f"torchfix.deepcache: keep_first={config.keep_first} + keep_last={config.keep_last} leaves nothing to cache in "
            f"{type(model).__name__}'s {n} blocks; allowed: keep_first + keep_last <= {n - 1}."
        )
    last = layout.blocks[-1]
    if config.keep_last == 0 and getattr(last, "context_pre_only", False):
        raise InvalidArgumentError(
            f"torchfix.deepcache: keep_last=0, but {type(model).__name__}'s last block ({layout.names[-1]}) drops the text "
            "stream (context_pre_only) and cannot be cached; use keep_last >= 1."
        )
    reason = revise_off(model, family, config)
    if config.revise is True and reason is not None:
        raise InvalidArgumentError(
            f"torchfix.deepcache: revise=True, but {type(model).__name__}: {reason}; leave revise=None to revise only where it can."
        )
    return layout


def revise_off(model: torch.nn.Module, family: Family, config: DeepCacheConfig) -> str | None:
    """Why ``model`` cannot revise its cached steps, as far as can be known before a call (``None``: it may;
    the first call checks that its output is the tail applied to the last block's image stream)."""
    if config.revise is False:
        return "revise=False"
    if config.keep_last != 0:
        return f"keep_last={config.keep_last} (a block runs after the cached ones; revising needs keep_last=0)"
    if family.tail is None:
        return f"the {family.name!r} family's output layers are not one norm and one projection of the last block's output"
    norm, proj = (getattr(model, name, None) for name in family.tail)
    if not (isinstance(norm, torch.nn.Module) and isinstance(proj, torch.nn.Module)):
        return f"no {' and '.join(family.tail)} output layers"
    if len(inspect.signature(instance.forward_source(norm)).parameters) < 2:
        return f"its {family.tail[0]} takes no conditioning"
    return None


# --- the state, by lifetime -------------------------------------------------------------------------------------


@dataclass(eq=False)
class Plan:
    """What one transformer's cache knows for its lifetime: the blocks (:class:`TransformerLayout`), the chain each
    call path was verified to have (each frozen once verified), whether its cached steps can be revised, and the
    prompt-only modules found on the model."""

    layout: TransformerLayout
    chains: dict[frozenset, Chain] = field(default_factory=dict)  # call path (the arguments a call passes) -> its chain
    cannot_revise: str | None = None  # why the cached steps are not revised (None: they may be)
    prompt_only_names: tuple[str, ...] = ()  # the family's prompt-only modules found on the model
    stand_ins: dict[int, Any] = field(default_factory=dict)  # ComfyUI: layout position -> what a cached step calls instead
    shadows: dict[frozenset, tuple] = field(default_factory=dict)  # call path -> (list, index, position) of its cached blocks
    told_patched: bool = False  # a call with host block patches on skipped blocks was said to run in full


@dataclass(eq=False)
class BlockStep(engine.Step):
    """One call of a transformer, handed from its forward to its blocks' forwards (``state.step``)."""

    chain: Chain | None = None  # the verified chain of this call's path (None: this call verifies it)
    recorder: Recorder | None = None  # while the call verifies its path: what it observes
    path: frozenset = frozenset()  # the call path
    cursor: int = 0  # blocks called so far in this call (eager: checked against the chain's order)
    eager: bool = True  # this call runs eagerly throughout (not reached through torch.compile: no block is a graph)
    inputs: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)  # per run: the streams entering it (full step)
    revising: bool = False  # this call's stream revises its cached steps
    entered: torch.Tensor | None = None  # a cached step's image stream entering the cached blocks
    used: Any = 1.0  # the sensitivity a cached step used
    conditioning: torch.Tensor | None = None  # the conditioning a cached step's norm got
    prompt_only_calls: dict[str, int] = field(default_factory=dict)  # calls of each prompt-only module in this call
    total: Any = None  # adds per-rank sums over the ranks that share this call (parallel.summer; None: alone)
    shadows: dict[str, list] | None = None  # what the model's block lists read during a cached ComfyUI step


@dataclass(eq=False)
class BlockState(engine.CacheState):
    """The cache of one transformer over its lifetime: the engine's state and the :class:`Plan`; the call in
    progress is a :class:`BlockStep`."""

    plan: Plan = None  # type: ignore[assignment]
    step: BlockStep = field(default_factory=BlockStep)
    revised_steps: int = 0
    prompt_only_reused: int = 0  # prompt-only calls a cached step answered with a full step's output

    def idle(self) -> BlockStep:
        return BlockStep()

    def describe(self) -> str:
        plan = self.plan
        if plan.chains:
            chain = self.step.chain or next(iter(plan.chains.values()))
            described = chain.describe(plan.layout) + f" (keep_first={self.config.keep_first}, keep_last={self.config.keep_last})"
        else:
            described = plan.layout.describe(self.config.keep_first, self.config.keep_last)
            described += " (the call order is checked at the first call)"
        if plan.prompt_only_names:
            described += f"; prompt-only, reused on cached steps: {', '.join(plan.prompt_only_names)}"
        return described


# --- the model's forward: decide, verify or run, keep ------------------------------------------------------------


@outside_graphs
def _begin(state: BlockState, arguments: dict[str, Any]) -> BlockStep:
    """This call's step: what it does, and whether it verifies a new call path; eager: Python state only."""
    family, plan = state.family, state.plan
    path = frozenset(k for k, v in arguments.items() if v is not None and k != "kwargs") | frozenset(arguments.get("kwargs") or ())
    chain = plan.chains.get(path)
    shadows = _shadows(state, chain, path)
    engaged, moved, swapped = installed.check(state)
    if moved:
        raise UnsupportedModelError(
            f"torchfix.deepcache: {type(state.model()).__name__}.enable_parallelism(...) came after DeepCache was applied, so "
            "this call reached DeepCache already split into this rank's shard: its streams would not be the pipeline's. "
            "torchfix has now moved its hook outside diffusers' context-parallel hooks; call the model again (nothing "
            "was cached), or apply DeepCache after enable_parallelism (a pipeline call does this by itself)."
        )
    if not engaged:
        state.step = BlockStep()
        return state.step
    latents, prompt = arguments.get(family.latent), arguments.get(family.prompt) if family.prompt else None
    context = family.context(arguments) if family.context is not None else state.context
    stream = generation.enter(state, latents, prompt, context, swapped=swapped)
    mode = schedule.decide(state, stream, arguments, verified=chain is not None, plan=plan, chain=chain)
    revising = mode != "off" and plan.cannot_revise is None and state.generation.sigmas is not None
    # Under torch.compile some blocks run inside graphs (their Python never runs) and others, past a graph break or
    # dynamo's recompile limit, eagerly: the call order can only be checked where every block runs eagerly.
    revising = revising and (chain is None or chain.revise is None)
    total = parallel.summer(parallel.ranks(state))
    eager = not under_dynamo()
    step = BlockStep(mode, chain=chain, path=path, eager=eager, revising=revising, total=total)
    if mode in ("cached", "probe") and eager:  # a cached ComfyUI step: the skipped blocks out of the call path
        step.shadows = shadows
    if mode == "full" and chain is None:
        step.recorder = Recorder(plan.layout)
    state.step = step
    return step


def _shadows(state: BlockState, chain: Chain | None, path: frozenset) -> dict[str, list] | None:
    """What a cached step of this call path reads for its block lists, where the blocks it skips leave the call path:
    each list with every block of a cached run replaced by its stand-in (made at apply: :func:`_stand_in`), every index
    where it was (ComfyUI's loops look patches, ControlNet residuals and modulations up by it). ``None`` where the
    blocks are called as they are: before the path is verified, for a diffusers transformer (whose block hooks, group
    offloading and layerwise casting expect every block to be called), or where the model's lists are not the ones
    the cache was applied to. Made once per call path."""
    plan = state.plan
    if chain is None or not plan.stand_ins:
        return None
    if path not in plan.shadows:  # (list, index in it, layout position) of each block of a cached run
        names = plan.layout.names
        plan.shadows[path] = tuple((*names[p].rpartition(".")[::2], p) for p, slot in chain.slots.items() if slot.run >= 0)
    model, lists = state.model(), {}
    for attr, index, position in plan.shadows[path]:
        if attr in vars(model):  # something else stands in front of the block list: the blocks are called
            return None
        held = lists.setdefault(attr, list(getattr(model, attr)))
        if held[int(index)] is not plan.layout.blocks[position]:  # a block swapped since apply: called (the checks catch it)
            return None
        held[int(index)] = plan.stand_ins[position]
    return lists


def _model_forward(state: BlockState) -> Any:
    def make(original: Any, source: Any) -> Any:
        sig = inspect.signature(source)

        @functools.wraps(source)
        def forward(*args: Any, **kwargs: Any) -> Any:
            step = _begin(state, sig.bind_partial(*args, **kwargs).arguments)
            output = None
            try:
                if step.recorder is not None:  # the first call of this call path: observed, and its chain verified
                    output = verify(state, state.model(), original, args, kwargs)
                else:
                    with instance.shadowed(state.model(), step.shadows) if step.shadows else contextlib.nullcontext():
                        output = original(*args, **kwargs)  # a cached ComfyUI step: stand-ins for the skipped blocks
                    if step.mode in ("full", "cached") and step.chain is not None and step.eager and not torch.compiler.is_compiling():
                        check_calls(state, step)
            finally:  # the step is over: what it kept joins the history; a full step may revise the cached ones
                kept = forecast.keep(state, 2 if step.revising else 0, measure=step.chain is not None)
                output = after_call(state, output, kept)
            return output

        forward.__torchfix_deepcache__ = True  # type: ignore[attr-defined]
        return hiding_frames(forward)

    return make


def _block_forward(state_ref: weakref.ref[BlockState], position: int, block: torch.nn.Module, spec: Blocks) -> Any:
    read = reader(block, spec)

    def make(original: Any, source: Any) -> Any:
        @functools.wraps(source)
        def forward(*args: Any, **kwargs: Any) -> Any:
            state = state_ref()
            step = state.step if state is not None else None
            mode = step.mode if step is not None else "off"
            if mode in ("off", "plain"):
                return original(*args, **kwargs)
            if step.recorder is not None:
                return observe(state, position, read, original, args, kwargs)
            slot = step.chain.slots[position]
            if step.eager and not torch.compiler.is_compiling():
                if slot.order != step.cursor:
                    raise out_of_order(state, position)
                step.cursor += 1
            if slot.run < 0:
                return original(*args, **kwargs)
            run = step.chain.runs[slot.run]
            if mode in ("probe", "cached"):
                mode = _entering(state, step, slot, read(args, kwargs), spec)
            if mode == "cached":
                return _in_place_of(state, step, position, read(args, kwargs), spec)
            if slot.first:
                now = read(args, kwargs)
                if step.chain.inplace:  # the blocks update what enters the run in place: keep it as it enters
                    now = tuple(v.detach().clone() if isinstance(v, torch.Tensor) else v for v in now)
                step.inputs[slot.run] = tuple(now[spec.returns.index(s)] for s in run.streams)
                if slot.run == 0:
                    generation.keep_reference(state, now[spec.returns.index("image")])
            out = original(*args, **kwargs)
            if slot.last and slot.run in step.inputs:
                values = outputs_of(spec, out)
                entered = dict(zip(run.streams, step.inputs.pop(slot.run)))
                step.pending[slot.run] = residuals(state, run.streams, entered, dict(zip(spec.returns, values)))
            return out

        forward.__torchfix_deepcache__ = True  # type: ignore[attr-defined]
        return forward

    return make


def _entering(state: BlockState, step: BlockStep, slot: Any, now: tuple[Any, ...], spec: Blocks) -> str:
    """What a block of a cached run does on a step still cached or undecided: at a run's first block, a restart where
    the streams changed shape within the generation (full from here), and a probe's decision by the features entering
    the first cached block. Returns the step's mode from here."""
    mode = step.mode
    if slot.first and reshaped(state, slot.run, step.chain.runs[slot.run], now, spec):
        mode = restart_run(state, slot.run)
    if mode == "probe":
        mode = step.mode = schedule.probe(state, now[spec.returns.index("image")])
    return mode


def _in_place_of(state: BlockState, step: BlockStep, position: int, now: tuple[Any, ...], spec: Blocks) -> Any:
    """What block ``position`` returns on a cached step, given the streams it got: ``in + residual`` for the first
    block of a run (:func:`~torchfix.deepcache.residuals.cached`), the streams as they came for the others."""
    slot = step.chain.slots[position]
    if not slot.first:
        return returned(now, step.chain.tuple_out[position])
    run = step.chain.runs[slot.run]
    if slot.run == 0 and step.revising:
        step.entered, step.used = now[spec.returns.index("image")], 1.0  # cached sets the sensitivity it used
    ordered = tuple(now[spec.returns.index(s)] for s in run.streams)
    out = cached(state, slot.run, run, ordered)
    return returned(tuple(out[run.streams.index(s)] for s in spec.returns), step.chain.tuple_out[position])


def _stand_in(state_ref: weakref.ref[BlockState], position: int, block: torch.nn.Module, spec: Blocks) -> Any:
    """What a cached ComfyUI step's block list holds in place of block ``position`` of a cached run (:func:`_shadows`):
    a plain function taking the block's arguments that returns what the block's installed forward would return on
    that step, without calling the block. Where the step turns full at it (a probe, streams of another shape) it
    calls the block, through its module call and hooks."""
    read = reader(block, spec)

    def stand_in(*args: Any, **kwargs: Any) -> Any:
        state = state_ref()
        step = state.step if state is not None else None
        if step is None or step.chain is None or step.mode not in ("cached", "probe"):
            return block(*args, **kwargs)
        slot = step.chain.slots[position]
        if _entering(state, step, slot, read(args, kwargs), spec) != "cached":
            return block(*args, **kwargs)
        if slot.order != step.cursor:
            raise out_of_order(state, position)
        step.cursor += 1
        return _in_place_of(state, step, position, read(args, kwargs), spec)

    stand_in.__qualname__ = stand_in.__name__ = f"torchfix_cached_{type(block).__name__}"
    stand_in.__torchfix_deepcache__ = True  # type: ignore[attr-defined]
    return stand_in


def _norm_hook(state_ref: weakref.ref[BlockState], norm: torch.nn.Module) -> Any:
    """A pre-hook on the output layers' norm: while verifying, what it gets (is it the last block's output?); on a
    cached step that will be revised, the conditioning it gets (a reference, no copy)."""
    params = list(inspect.signature(instance.forward_source(norm)).parameters)

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        state = state_ref()
        if state is None or (state.step.recorder is None and not (state.step.revising and state.step.mode == "cached")):
            return
        values = dict(zip(params, args)) | kwargs
        first, conditioning = values.get(params[0]), values.get(params[1])
        if state.step.recorder is not None:
            state.step.recorder.norm_input, state.step.recorder.norm_conditioning = first, conditioning
        elif isinstance(conditioning, torch.Tensor):
            state.step.conditioning = conditioning.detach()

    return hook


def apply_transformer(model: torch.nn.Module, config: DeepCacheConfig, layout: TransformerLayout) -> BlockState:
    """Install the block and model forwards on ``model`` (the caller registers the state and follows the scheduler)."""
    state = BlockState(layout.family, config, model.forward, plan=Plan(layout, cannot_revise=revise_off(model, layout.family, config)))
    state.revises = state.plan.cannot_revise is None
    state.follow(model)
    state_ref = weakref.ref(state)
    for position, (block, spec) in enumerate(zip(layout.blocks, layout.specs)):
        state.handles.append(instance.wrap_forward(block, HOOK_NAME + "_block", _block_forward(state_ref, position, block, spec)))
        if layout.family.host == "comfyui":  # its cached steps call these instead of the blocks they skip
            state.plan.stand_ins[position] = _stand_in(state_ref, position, block, spec)
    state.plan.prompt_only_names = tuple(prompt_only.install(state, model, layout.family.prompt_only))
    state.handles.append(
        instance.wrap_forward(model, HOOK_NAME, _model_forward(state), reset=state.reset, on_context=engine.context_listener(state_ref))
    )
    if state.revises:
        norm = getattr(model, layout.family.tail[0])
        state.handles.append(instance.add_hook(norm, _norm_hook(state_ref, norm), pre=True, with_kwargs=True))
    log.debug("torchfix.deepcache: applied to %s (%s, interval=%d)", type(model).__name__, state.describe(), config.interval)
    return state
