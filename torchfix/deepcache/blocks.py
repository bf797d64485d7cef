"""DeepCache for every diffusion transformer family: skip runs of blocks on cached steps, each run replaced by
the residual it added at the last full steps, after checking on the first call that the blocks do what the
family's registry entry says.

A transformer's blocks form a chain: each takes the *streams* (the image tokens; for some families the text
or audio tokens too) and returns them updated (:class:`torchfix.families.Blocks` says which parameter takes
which stream and in which order they come back). On a full step every block runs and each *run* of cached
blocks keeps its residual ``out − in`` per stream; on a cached step the first block of a run returns
``in + residual`` (the residual forecast from the last full steps) and the others pass their inputs through.
The blocks the family keeps (``keep_first``/``keep_last``), the embedders, whatever the model computes between
blocks and the output layers always run, so a cached step still sees this step's timestep and latents.

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

import functools
import inspect
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _warn, families
from .._frames import hiding_frames, under_dynamo
from ..errors import InvalidArgumentError, UnsupportedModelError
from ..families import Blocks, Family
from ..patches import instance
from . import engine, parallel, prompt_only, streams
from ._graphs import outside_graphs
from .config import DeepCacheConfig, corrects, for_family, warms_up
from .forecast import forecast, interpolate, per_sample

__all__ = [
    "BlockState",
    "Chain",
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


# --- the chain as the first call found it ----------------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    """One block's place in the chain: its run (-1: it always runs), and whether it starts or ends the run."""

    order: int
    run: int = -1
    first: bool = False
    last: bool = False


@dataclass(frozen=True)
class Run:
    """Consecutive cached blocks that hand their streams straight on: one residual per stream."""

    positions: tuple[int, ...]  # layout positions, in call order
    streams: tuple[str, ...]

    @property
    def image(self) -> int:
        return self.streams.index("image")


@dataclass(frozen=True)
class Chain:
    """What the first call of a call path found: the blocks' call order, the runs, and how each block returns."""

    slots: dict[int, Slot]  # layout position -> slot
    runs: tuple[Run, ...]
    calls: int
    tuple_out: dict[int, bool]  # layout position -> whether it returns a tuple
    revise: str | None  # why the cached steps cannot be revised (None: they can)
    inplace: bool = False  # a block updates a stream in place (ComfyUI's ``x += ...``): full steps copy what enters a run

    def describe(self, layout: TransformerLayout) -> str:
        parts = [f"{layout.names[r.positions[0]]} .. {layout.names[r.positions[-1]]}" for r in self.runs]
        cached = sum(len(r.positions) for r in self.runs)
        return f"{cached} of {self.calls} blocks cached in {len(self.runs)} run(s): {'; '.join(parts)}"


@dataclass(eq=False)
class _Seen:
    """One block call observed while verifying."""

    position: int
    outputs: dict[str, torch.Tensor]  # held until the next call has been seen
    linked: bool  # every stream it takes is what the previous call returned
    tuple_out: bool
    values: dict[str, torch.Tensor] | None = None  # a cached block's outputs as returned (a later block may update them in place)


@dataclass(eq=False)
class _Recorder:
    """Observes one eager full call: its block calls in order, what each handed the next, and where block outputs
    went. Holds the previous call's outputs and weak references only."""

    layout: TransformerLayout
    seen: list[_Seen] = field(default_factory=list)
    produced: dict[int, tuple[weakref.ref, int]] = field(default_factory=dict)  # id(tensor) -> (ref, call index)
    confirmed: dict[str, set[str]] = field(default_factory=dict)  # list attr -> streams whose output position was confirmed
    crossed: list[str] = field(default_factory=list)
    consumed: list[tuple[int, int, str]] = field(default_factory=list)  # (producer call, consumer call, parameter)
    problems: list[str] = field(default_factory=list)
    runs: list[list[int]] = field(default_factory=list)  # call indices of each run of cached blocks
    run_inputs: dict[str, torch.Tensor] | None = None  # the streams entering the open run
    pending: dict[int, tuple] = field(default_factory=dict)  # per closed run: its residuals (and inputs)
    last_image: Any = None  # the image stream the last block returned
    inplace: bool = False  # a block changed a stream it was given in place
    norm_input: Any = None  # what the output layers' norm got (revisable tail)
    norm_conditioning: Any = None


@dataclass(eq=False)
class BlockState(engine.CacheState):
    """The cache of one transformer: the engine's state, the layout, and the chains verified so far."""

    layout: TransformerLayout | None = None
    chains: dict[frozenset, Chain] = field(default_factory=dict)
    chain: Chain | None = None  # the chain of the call in progress
    recorder: _Recorder | None = None
    cursor: int = 0  # blocks called so far in this call (eager: checked against the chain's order)
    eager: bool = True  # this call runs eagerly throughout (not reached through torch.compile: no block is a graph)
    inputs: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)  # per run: the streams entering it (full step)
    cannot_revise: str | None = None  # why the cached steps are not revised (None: they may be)
    revising: bool = False  # this call's stream revises its cached steps
    entered: torch.Tensor | None = None  # a cached step's image stream entering the cached blocks
    used: Any = 1.0  # the sensitivity a cached step used
    conditioning: torch.Tensor | None = None  # the conditioning a cached step's norm got
    revised_steps: int = 0
    path: frozenset = frozenset()  # the call path being verified
    prompt_only_names: tuple[str, ...] = ()  # the family's prompt-only modules found on the model
    prompt_only_calls: dict[str, int] = field(default_factory=dict)  # calls of each in the call in progress
    prompt_only_reused: int = 0  # their calls a cached step answered with a full step's output

    def may_revise(self) -> bool:
        return self.cannot_revise is None

    def reset(self) -> None:
        super().reset()
        self.inputs = {}
        self.entered = self.conditioning = None

    def describe(self) -> str:
        if self.chain is not None or self.chains:
            chain = self.chain or next(iter(self.chains.values()))
            described = chain.describe(self.layout) + f" (keep_first={self.config.keep_first}, keep_last={self.config.keep_last})"
        else:
            described = self.layout.describe(self.config.keep_first, self.config.keep_last)
            described += " (the call order is checked at the first call)"
        if self.prompt_only_names:
            described += f"; prompt-only, reused on cached steps: {', '.join(self.prompt_only_names)}"
        return described


# --- reading a block's arguments and outputs -------------------------------------------------------------------


def _reader(block: torch.nn.Module, spec: Blocks) -> Any:
    """``read(args, kwargs) -> tuple of the streams in spec.returns order`` without binding the whole signature."""
    params = list(inspect.signature(instance.forward_source(block)).parameters)
    where = [(spec.inputs[s], params.index(spec.inputs[s])) for s in spec.returns]

    def read(args: tuple, kwargs: dict[str, Any]) -> tuple[Any, ...]:
        return tuple(kwargs[name] if name in kwargs else (args[i] if i < len(args) else None) for name, i in where)

    return read


def _outputs(spec: Blocks, out: Any) -> tuple[Any, ...] | None:
    """A block's returned streams in ``spec.returns`` order, or ``None`` where it returned something else."""
    n = len(spec.returns)
    if n == 1 and isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (tuple, list)) and len(out) == n:
        return tuple(out)
    return None


def _returned(values: tuple[Any, ...], tuple_out: bool) -> Any:
    return values if tuple_out or len(values) > 1 else values[0]


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_describe(v) for v in value) + ")"
    return type(value).__name__


# --- verification ------------------------------------------------------------------------------------------------


def _observe(state: BlockState, position: int, read: Any, original: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """Run block ``position`` while verifying, and note what it took and returned."""
    rec, layout = state.recorder, state.layout
    spec, name = layout.specs[position], layout.names[position]
    index = len(rec.seen)
    taken = read(args, kwargs)
    inputs = {s: v for s, v in zip(spec.returns, taken) if v is not None}  # a stream given as None is absent on this path
    for stream, value in inputs.items():
        if not isinstance(value, torch.Tensor):
            rec.problems.append(f"{name} got {spec.inputs[stream]}={_describe(value)} where the {stream} stream should be a tensor")
    if "image" not in inputs:
        rec.problems.append(f"{name} got no image stream ({spec.inputs['image']}=None)")
    previous = rec.seen[-1] if rec.seen else None
    linked = False
    if previous is not None:
        prev_spec = layout.specs[previous.position]
        hits = {s for s in inputs if previous.outputs.get(s) is inputs[s]}
        for s, value in inputs.items():
            for t, out in previous.outputs.items():
                if t != s and out is value:
                    rec.crossed.append(
                        f"{layout.names[previous.position]} returned its {t} output into {name}'s {spec.inputs[s]} (the {s} stream)"
                    )
        rec.confirmed.setdefault(prev_spec.attr, set()).update(hits)
        linked = bool(hits) and hits == set(inputs) == set(previous.outputs)
    for pname, value in [*((f"#{i}", a) for i, a in enumerate(args)), *kwargs.items()]:  # where earlier outputs went
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, torch.Tensor) and (hit := rec.produced.get(id(item))) is not None and hit[0]() is item:
                if not (hit[1] == index - 1 and any(item is v for v in inputs.values())):
                    rec.consumed.append((hit[1], index, pname))
    cached = state.config.keep_first <= index < layout.n_blocks - state.config.keep_last
    extends = cached and linked and bool(rec.runs) and rec.runs[-1][-1] == index - 1
    before = {s: engine.marker(v) for s, v in inputs.items() if isinstance(v, torch.Tensor)}
    if cached and not extends:  # a run starts here: what enters it, as it is now (the block may update it in place)
        entering = {s: v.detach().clone() if isinstance(v, torch.Tensor) else v for s, v in inputs.items()}
    out = original(*args, **kwargs)
    values = _outputs(spec, out)
    rec.inplace |= any(engine.changed(inputs[s], mark) for s, mark in before.items()) or any(
        any(v is given for given in inputs.values()) for v in (values or ()) if isinstance(v, torch.Tensor)
    )
    if values is None:
        rec.problems.append(f"{name} returned {_describe(out)}; its entry expects {spec.describe()}")
        values = ()
    outputs = {s: v for s, v in zip(spec.returns, values) if v is not None or s in inputs}
    for stream, value in outputs.items():
        given = inputs.get(stream)
        if given is None and stream not in inputs:
            rec.problems.append(f"{name} returned the {stream} stream it was not given")
        elif not isinstance(value, torch.Tensor):
            if cached:  # a block that always runs may drop a stream (SD3's last block drops the text)
                rec.problems.append(f"{name} returned {_describe(value)} for the {stream} stream (it drops it: keep that block running)")
        elif isinstance(given, torch.Tensor) and value.shape != given.shape:
            if cached:
                rec.problems.append(
                    f"{name} returned the {stream} stream as {_describe(value)} from {_describe(given)}: not a residual update"
                )
        else:
            rec.produced[id(value)] = (weakref.ref(value), index)
    # runs, closed as they end: only the open run's inputs and the previous call's outputs are held
    if not extends:
        _close_run(state, previous)
        if cached:
            if not rec.runs and isinstance(entering.get("image"), torch.Tensor):
                engine.keep_reference(state, entering["image"])
            rec.runs.append([])
            rec.run_inputs = entering
    if cached:
        rec.runs[-1].append(index)
    if previous is not None:
        previous.outputs, previous.values = {}, None
    rec.last_image = outputs.get("image")
    kept = {s: v.detach().clone() for s, v in outputs.items() if isinstance(v, torch.Tensor)} if cached else None
    rec.seen.append(_Seen(position, outputs, linked, isinstance(out, (tuple, list)), kept))
    return out


def _close_run(state: BlockState, last: _Seen | None) -> None:
    """The open run ends with call ``last``: its residuals."""
    rec = state.recorder
    if rec.run_inputs is None or last is None or not rec.runs or rec.problems:  # a refused chain keeps nothing
        rec.run_inputs = None
        return
    names = state.layout.specs[rec.seen[rec.runs[-1][0]].position].returns
    rec.pending[len(rec.runs) - 1] = _residuals(state, names, rec.run_inputs, last.values if last.values is not None else last.outputs)
    rec.run_inputs = None


def _refuse(state: BlockState, model: Any, found: str) -> UnsupportedModelError:
    family, name = state.family, type(model).__name__ if model is not None else "the model"
    entry = f"the entry read off its code ({family.name!r})" if families.is_inferred(family) else f"the registry entry {family.name!r}"
    return UnsupportedModelError(
        f"torchfix.deepcache: {name}'s blocks do not behave as {entry} says, so caching them "
        f"could compute garbage; nothing was cached. Found: {found}. The entry expects: {family.describe()}. "
        "Run it without DeepCache (torchfix.deepcache.remove); docs/families.md says how to describe a model."
    )


def _finish(state: BlockState, model: Any, output: Any) -> Chain:
    """After the observed call: check what was seen, and build the chain (or raise, naming what was found)."""
    rec, layout = state.recorder, state.layout
    seen = rec.seen
    order = [s.position for s in seen]
    missing = [layout.names[p] for p in range(layout.n_blocks) if p not in order]
    twice = sorted({layout.names[p] for p in order if order.count(p) > 1})
    if missing or twice:
        rec.problems.append(
            (f"blocks never called: {', '.join(missing[:4])}" if missing else "")
            + (f"; blocks called more than once: {', '.join(twice[:4])}" if twice else "")
        )
    if rec.crossed:
        rec.problems.append("which output continues which input differs from the entry: " + "; ".join(rec.crossed[:3]))
    for spec in {spec.attr: spec for spec in layout.specs}.values():
        unconfirmed = set(spec.returns) - rec.confirmed.get(spec.attr, set())
        if len(spec.returns) > 1 and len(unconfirmed) > 1:
            rec.problems.append(
                f"no {spec.attr} block hands {' or '.join(sorted(unconfirmed))} straight to the next block, so which output "
                "continues which input cannot be confirmed"
            )
    if rec.problems:
        raise _refuse(state, model, "; ".join(p for p in rec.problems if p))
    _close_run(state, seen[-1] if seen else None)
    runs = rec.runs
    run_of = {i: r for r, members in enumerate(runs) for i in members}
    for producer, consumer, param in rec.consumed:  # a cached block's output used where a cached step would hand it a stand-in
        run = run_of.get(producer)
        if run is not None and producer != runs[run][-1] and run_of.get(consumer) != run:
            raise _refuse(
                state,
                model,
                f"{layout.names[seen[producer].position]}'s output is also used by {layout.names[seen[consumer].position]} ({param}), "
                "outside the blocks cached with it (a skip connection); keep fewer blocks running (keep_first/keep_last)",
            )
    n = len(seen)
    slots = {seen[i].position: Slot(i) for i in range(n)}
    chain_runs = []
    for r, members in enumerate(runs):
        positions = tuple(seen[i].position for i in members)
        for i in members:
            slots[seen[i].position] = Slot(i, r, i == members[0], i == members[-1])
        chain_runs.append(Run(positions, layout.specs[positions[0]].returns))
    chain = Chain(
        slots, tuple(chain_runs), n, {s.position: s.tuple_out for s in seen}, _tail_off(state, model, output, runs, seen), rec.inplace
    )
    state.pending = dict(rec.pending)
    return chain


def _tail_off(state: BlockState, model: Any, output: Any, runs: list[list[int]], seen: list[_Seen]) -> str | None:
    """Why the cached steps cannot be revised on this chain (``None``: they can): one run that ends the chain and
    whose image stream goes straight into the output layers, whose result is the model's output."""
    rec, family = state.recorder, state.family
    if state.cannot_revise is not None:
        return state.cannot_revise
    if len(runs) != 1 or runs[0][-1] != len(seen) - 1:
        return "the cached blocks do not end the chain in one run"
    last = rec.last_image
    if rec.norm_input is None or rec.norm_input is not last or not isinstance(rec.norm_conditioning, torch.Tensor):
        return f"the last block's image stream does not go straight into {family.tail[0]}"
    sample = _sample(output)
    with torch.no_grad():
        norm, proj = (getattr(model, name) for name in family.tail)
        again = proj(norm(last, rec.norm_conditioning))
    if sample is None or again.shape != sample.shape or not torch.allclose(again.float(), sample.float(), rtol=1e-4, atol=1e-5):
        return f"the model's output is not {family.tail[1]}({family.tail[0]}(...)) of the last block's output"
    return None


# --- a full step's residuals and a cached step's stand-in --------------------------------------------------------


def _residuals(state: BlockState, names: tuple[str, ...], inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]) -> tuple:
    """What a run keeps at a full step: its residual per stream, and where the cached step corrects for its
    input (``config.corrects``), the streams that entered it."""
    present = [inputs.get(s) is not None and outputs.get(s) is not None for s in names]  # an absent stream keeps None
    kept = tuple((outputs[s] - inputs[s]).detach() if p else None for s, p in zip(names, present))
    if corrects(state.config):
        kept += tuple(inputs[s].detach() if p else None for s, p in zip(names, present))
    return kept


def _sensitivity(state: BlockState, stream: engine.Stream, run: int, part: int) -> Any:
    fixed = state.config.sensitivity
    return fixed if fixed is not None else stream.sensitivity.get((run, part))


def _as(s: Any, like: torch.Tensor) -> Any:
    """A measured sensitivity (per sample), or what a full step kept, in the dtype of what it meets now (the very tensor
    where they agree): the result keeps the model's dtype, also where the latents' dtype changed after step 0."""
    return s.to(like.dtype) if isinstance(s, torch.Tensor) else s


def _is_one(s: Any) -> bool:
    return s is None or (not isinstance(s, torch.Tensor) and s == 1.0)


@outside_graphs
def _cached(state: BlockState, r: int, run: Run, now: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """What a run returns on a cached step: per stream ``in + residual − (1 − s)·(in − forecast_in)`` (eager: the
    forecast's step gaps and ``s`` change per step)."""
    stream = state.current
    value = engine.for_this_step(state, r)
    k = len(run.streams)
    out = []
    for part, current in enumerate(now):
        residual = _as(value[part], current)
        predicted = _as(value[k + part], current) if len(value) > k else None
        s = _sensitivity(state, stream, r, part)
        if part == run.image and r == 0:
            state.used = 1.0 if _is_one(s) or predicted is None else s
        if residual is None:
            out.append(current)
        elif _is_one(s) or predicted is None:
            out.append(current + residual)
        else:
            out.append(current + residual - (1.0 - _as(s, current)) * (current - predicted))
    return tuple(out)


@outside_graphs
def _measure(state: BlockState) -> None:
    """At a full step whose residuals and inputs the stream could have forecast: the sensitivity of each stream
    of each run, per sample (the forecast it proves wrong). After a warm-up, a forecast that reaches back to step
    0 is off for the fast start, not for the blocks' response to their input: it measures nothing."""
    stream, config = state.current, state.config
    if config.sensitivity is not None or not corrects(config) or stream is None:
        return
    for r, value in state.pending.items():
        history = stream.run_history(r)
        k = len(value) // 2
        if len(history) < 2 or len(value) != 2 * k:
            continue
        oldest = history[-min(config.forecast, len(history) - 1) - 1][0]  # the first point the forecast used
        if _off_the_curve(state, oldest):
            continue
        predicted = forecast(history, stream.step - 1, config.forecast)
        total = parallel.summer(engine.ranks(state))
        for part in range(k):
            residual, entered = value[part], value[k + part]
            if residual is None or entered is None or predicted[part] is None or predicted[k + part] is None:
                continue
            slopes = per_sample(residual - predicted[part], entered - predicted[k + part], total)
            if slopes is not None:
                stream.sensitivity[(r, part)] = slopes
                if r == 0 and part == state.chain.runs[0].image:
                    state.last_sensitivity = float(slopes.mean())


def _off_the_curve(state: BlockState, step: int) -> bool:
    """Whether full step ``step`` is off the curve the later full steps follow: step 0 of a generation that warmed
    up (its first steps move fast). A forecast or an interpolation through it is off for the fast start."""
    return step == 0 and warms_up(streams.generation_config(state))


# --- revising the cached steps since the last full one -----------------------------------------------------------


def _sample(output: Any) -> torch.Tensor | None:
    """The model's output tensor: the first of a tuple, or ``.sample``."""
    sample = output[0] if isinstance(output, tuple) and output else getattr(output, "sample", output)
    return sample if isinstance(sample, torch.Tensor) else None


def _revision(state: BlockState, stream: engine.Stream, sample: torch.Tensor) -> torch.Tensor | None:
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
    run = state.chain.runs[0]
    k, image = len(run.streams), run.image
    change = torch.zeros_like(sample, dtype=torch.promote_types(sample.dtype, torch.float32))  # half precision sums in float32
    points = [(i, (value[image], value[k + image] if len(value) > k else None)) for i, value in stream.run_history(0)]
    if len(points) == 3 and _off_the_curve(state, points[0][0]):
        # the quadratic through step 0 overshoots between the next two (on the trained Flux-like model 2-5× the
        # error of the line through them; from the third full step on, the quadratic is the more exact)
        points = points[1:]
    norm, proj = (getattr(model, name) for name in state.family.tail)
    for at, entered, conditioning, used_output, s in stream.since_full:
        residual, predicted = interpolate(points, at)
        if residual is None:
            return None
        revised = entered + residual
        if predicted is not None and not _is_one(s):
            revised = revised + (1.0 - _as(s, entered)) * (predicted - entered)
        output = proj(norm(revised, conditioning))
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


# --- the model's forward: decide, verify, keep -------------------------------------------------------------------


@outside_graphs
def _begin(state: BlockState, arguments: dict[str, Any]) -> str:
    """Decide this call (and whether it verifies a new call path); eager: Python state only."""
    family = state.family
    if streams.order_for_parallel(state)[0]:
        raise UnsupportedModelError(
            f"torchfix.deepcache: {type(state.model()).__name__}.enable_parallelism(...) came after DeepCache was applied, so "
            "this call reached DeepCache already split into this rank's shard: its streams would not be the pipeline's. "
            "torchfix has now moved its hook outside diffusers' context-parallel hooks; call the model again (nothing "
            "was cached), or apply DeepCache after enable_parallelism (a pipeline call does this by itself)."
        )
    path = frozenset(k for k, v in arguments.items() if v is not None and k != "kwargs") | frozenset(arguments.get("kwargs") or ())
    chain = state.chains.get(path)
    mode = engine.decide(
        state, arguments.get(family.latent), arguments.get(family.prompt) if family.prompt else None, arguments, verified=chain is not None
    )
    state.chain, state.cursor, state.inputs, state.prompt_only_calls = chain, 0, {}, {}
    # Under torch.compile some blocks run inside graphs (their Python never runs) and others, past a graph break or
    # dynamo's recompile limit, eagerly: the call order can only be checked where every block runs eagerly.
    state.eager = not under_dynamo()
    state.revising = mode != "off" and state.cannot_revise is None and state.sigmas is not None and (chain is None or chain.revise is None)
    if mode == "full" and chain is None:
        state.recorder = _Recorder(state.layout)
        state.path = path
    return mode


@outside_graphs
def _keep(state: BlockState, output: Any) -> torch.Tensor | None:
    """After a call: a full step's residuals join their stream's history, after measuring the sensitivity (eager:
    histories are Python lists). Where the cached steps are revised: a cached step is noted, and a full step returns
    what to add to its output for the cached steps since the last one (``None``: nothing)."""
    if state.pending and state.current is not None and state.chain is not None:
        _measure(state)
    kept = engine.keep_pending(state, 2 if state.revising else 0)
    change = None
    stream = state.current
    if state.revising and stream is not None and state.chain is not None and state.chain.revise is None:
        sample = _sample(output)
        if state.mode == "cached" and state.entered is not None and state.conditioning is not None and sample is not None:
            stream.since_full.append((stream.step - 1, state.entered, state.conditioning, sample.detach(), state.used))
        elif state.mode == "full" and kept and stream.since_full and sample is not None:
            change = _revision(state, stream, sample)
        if state.mode != "cached":
            stream.since_full.clear()
    state.mode, state.entered, state.conditioning, state.inputs = "off", None, None, {}
    return change


def _verify_call(state: BlockState, model: Any, original: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """The observed full call (eager, also under torch.compile: one step), then the chain it found."""
    watch = _watch(state)
    try:
        if watch is None:
            output = original(*args, **kwargs)
        else:
            with watch:
                output = original(*args, **kwargs)
        chain = _finish(state, model, output)
        if watch is not None and watch.collectives:
            _shared_unseen(state, model, watch.collectives)
    except BaseException:
        state.mode, state.pending, state.recorder = "off", {}, None
        raise
    state.recorder = None
    if chain.revise is not None and state.config.revise is True:
        raise InvalidArgumentError(f"torchfix.deepcache: revise=True, but {type(model).__name__}: {chain.revise}; leave revise=None.")
    state.chains[state.path] = state.chain = chain
    if chain.revise is not None:
        state.revising = False
    log.debug("torchfix.deepcache: %s verified: %s", type(model).__name__, chain.describe(state.layout))
    return output


def _watch(state: BlockState) -> parallel.Watch | None:
    """While the first call is observed under torch.distributed with no group the model shows: a watch for the
    collectives it issues (they mean other ranks share the call)."""
    if engine.ranks(state).shared or not parallel.distributed():
        return None
    return parallel.Watch()


def _shared_unseen(state: BlockState, model: Any, collectives: list[str]) -> None:
    """The observed call communicated, yet the model shows no parallel config torchfix reads: other ranks share its
    calls in a way torchfix cannot see. A threshold's decisions would differ per rank (a hang): refused; a measured
    sensitivity would be fitted per rank (the ranks' results drift apart): a warning."""
    what = (
        f"torchfix.deepcache: {type(model).__name__}'s call issued collectives ({', '.join(sorted(set(collectives))[:3])}) "
        "but the model has no diffusers parallel config (enable_parallelism) to say which ranks share it"
    )
    if state.config.threshold is not None:
        raise UnsupportedModelError(
            f"{what}: each rank would measure its own shard and take its own refresh decisions, and ranks that decide "
            "differently wait for each other forever. Use a fixed schedule (threshold=None), or parallelise the model "
            "with diffusers' enable_parallelism(config=ContextParallelConfig(...)), whose group torchfix reduces over."
        )
    if state.config.sensitivity is None and corrects(state.config):
        _warn.once(
            ("unseen-ranks", id(state)),
            f"{what}: the sensitivity is fitted on each rank's own share, so the ranks' results drift apart (about 1e-5). "
            "Pass DeepCacheConfig(sensitivity=...) a fixed value, or parallelise with diffusers' enable_parallelism.",
            stacklevel=4,
        )


_verify_eagerly = outside_graphs(_verify_call)


def _model_forward(state: BlockState) -> Any:
    def make(original: Any, source: Any) -> Any:
        sig = inspect.signature(source)

        @functools.wraps(source)
        def forward(*args: Any, **kwargs: Any) -> Any:
            arguments = sig.bind_partial(*args, **kwargs).arguments
            mode = _begin(state, arguments)
            if state.recorder is not None:
                output = _verify_eagerly(state, state.model(), original, args, kwargs)
                change = _keep(state, output)
                return output if change is None else _revised(output, change)
            output = None
            try:
                output = original(*args, **kwargs)
            finally:
                change = _keep(state, output)
            if mode in ("full", "cached") and state.chain is not None and state.eager and not torch.compiler.is_compiling():
                _check_calls(state)
            return output if change is None else _revised(output, change)

        forward.__torchfix_deepcache__ = True  # type: ignore[attr-defined]
        return hiding_frames(forward)

    return make


def _check_calls(state: BlockState) -> None:
    """After an eager call: every block ran, once, as on the first call (compiled blocks do not count: 0)."""
    if 0 < state.cursor != state.chain.calls:
        raise UnsupportedModelError(
            f"torchfix.deepcache: {state.family.name!r}: this call ran {state.cursor} of the {state.chain.calls} blocks its first "
            "call ran with the same arguments; the cached steps would be wrong. Remove DeepCache from this model "
            "(torchfix.deepcache.remove)."
        )


def _out_of_order(state: BlockState, position: int) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"torchfix.deepcache: {state.layout.names[position]} was called as block {state.cursor} of this call, but as block "
        f"{state.chain.slots[position].order} on the first call with the same arguments; the cached steps would be wrong. "
        "Remove DeepCache from this model (torchfix.deepcache.remove)."
    )


def _block_forward(state_ref: weakref.ref[BlockState], position: int, block: torch.nn.Module, spec: Blocks) -> Any:
    read = _reader(block, spec)

    def make(original: Any, source: Any) -> Any:
        @functools.wraps(source)
        def forward(*args: Any, **kwargs: Any) -> Any:
            state = state_ref()
            mode = state.mode if state is not None else "off"
            if mode in ("off", "plain"):
                return original(*args, **kwargs)
            if state.recorder is not None:
                return _observe(state, position, read, original, args, kwargs)
            slot = state.chain.slots[position]
            if state.eager and not torch.compiler.is_compiling():
                if slot.order != state.cursor:
                    raise _out_of_order(state, position)
                state.cursor += 1
            if slot.run < 0:
                return original(*args, **kwargs)
            run = state.chain.runs[slot.run]
            if mode in ("probe", "cached") and slot.first and _reshaped(state, slot.run, run, read(args, kwargs), spec):
                mode = _restart(state, slot.run)  # the streams changed shape within the generation: full from here
            if mode == "probe":  # the first cached block: the features entering it decide
                mode = engine.probe(state, read(args, kwargs)[spec.returns.index("image")])
            if mode == "cached":
                now = read(args, kwargs)
                if not slot.first:
                    return _returned(now, state.chain.tuple_out[position])
                if slot.run == 0 and state.revising:
                    state.entered, state.used = now[spec.returns.index("image")], 1.0  # _cached sets the sensitivity it used
                ordered = tuple(now[spec.returns.index(s)] for s in run.streams)
                out = _cached(state, slot.run, run, ordered)
                return _returned(tuple(out[run.streams.index(s)] for s in spec.returns), state.chain.tuple_out[position])
            if slot.first:
                now = read(args, kwargs)
                if state.chain.inplace:  # the blocks update what enters the run in place: keep it as it enters
                    now = tuple(v.detach().clone() if isinstance(v, torch.Tensor) else v for v in now)
                state.inputs[slot.run] = tuple(now[spec.returns.index(s)] for s in run.streams)
                if slot.run == 0:
                    engine.keep_reference(state, now[spec.returns.index("image")])
            out = original(*args, **kwargs)
            if slot.last and slot.run in state.inputs:
                values = _outputs(spec, out)
                entered = dict(zip(run.streams, state.inputs.pop(slot.run)))
                state.pending[slot.run] = _residuals(state, run.streams, entered, dict(zip(spec.returns, values)))
            return out

        forward.__torchfix_deepcache__ = True  # type: ignore[attr-defined]
        return forward

    return make


def _reshaped(state: BlockState, r: int, run: Run, now: tuple[Any, ...], spec: Blocks) -> bool:
    """Whether the streams entering run ``r`` are shaped otherwise than what its last full step kept: a model whose
    streams change shape within a generation (Qwen-Image 2.1's KV cache: the first step runs text and image tokens,
    later steps the image's alone), or a guidance pass whose text length changed."""
    kept = state.current.last(r) if state.current is not None else None
    if kept is None:
        return state.current is not None and state.current.reference is not None and r == 0 and (
            state.current.reference.shape != now[spec.returns.index("image")].shape
        )
    entering = [now[spec.returns.index(s)] for s in run.streams]
    return any(
        isinstance(k, torch.Tensor) and isinstance(e, torch.Tensor) and k.shape != e.shape for k, e in zip(kept, entering)
    )


def _restart(state: BlockState, r: int) -> str:
    """A cached step whose streams no longer fit what the cache kept runs in full from run ``r`` on, and the stream's
    history starts again there: nothing kept at another shape is ever added to this one (the step counts as full
    where it is the first run)."""
    stream = state.current
    for run in [k for k in stream.histories if k >= r]:
        stream.histories.pop(run)
    stream.sensitivity = {k: v for k, v in stream.sensitivity.items() if k[0] < r}
    if r == 0:
        stream.reference = None
        stream.since_full.clear()
        if state.mode == "cached":
            state.cached_steps -= 1
            stream.cached -= 1
        engine.count_full(state, stream)
    state.mode = "full"
    log.info("torchfix.deepcache: %s: the streams changed shape within a generation; this step ran in full", state.family.name)
    return "full"


def _norm_hook(state_ref: weakref.ref[BlockState], norm: torch.nn.Module) -> Any:
    """A pre-hook on the output layers' norm: while verifying, what it gets (is it the last block's output?); on a
    cached step that will be revised, the conditioning it gets (a reference, no copy)."""
    params = list(inspect.signature(instance.forward_source(norm)).parameters)

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        state = state_ref()
        if state is None or (state.recorder is None and not (state.revising and state.mode == "cached")):
            return
        values = dict(zip(params, args)) | kwargs
        first, conditioning = values.get(params[0]), values.get(params[1])
        if state.recorder is not None:
            state.recorder.norm_input, state.recorder.norm_conditioning = first, conditioning
        elif isinstance(conditioning, torch.Tensor):
            state.conditioning = conditioning.detach()

    return hook


def apply_transformer(model: torch.nn.Module, config: DeepCacheConfig, layout: TransformerLayout) -> BlockState:
    """Install the block and model forwards on ``model`` (the caller registers the state and follows the scheduler)."""
    state = BlockState(layout.family, config, model.forward, layout=layout)
    state.follow(model)
    state_ref = weakref.ref(state)
    for position, (block, spec) in enumerate(zip(layout.blocks, layout.specs)):
        state.handles.append(instance.wrap_forward(block, HOOK_NAME + "_block", _block_forward(state_ref, position, block, spec)))
    state.prompt_only_names = tuple(prompt_only.install(state, model, layout.family.prompt_only))
    state.handles.append(
        instance.wrap_forward(model, HOOK_NAME, _model_forward(state), reset=state.reset, on_context=engine.context_listener(state_ref))
    )
    state.cannot_revise = revise_off(model, layout.family, config)
    if state.cannot_revise is None:
        norm = getattr(model, layout.family.tail[0])
        state.handles.append(instance.add_hook(norm, _norm_hook(state_ref, norm), pre=True, with_kwargs=True))
    log.debug("torchfix.deepcache: applied to %s (%s, interval=%d)", type(model).__name__, state.describe(), config.interval)
    return state
