"""The chain of a transformer's blocks, as the first call of each call path finds it: which blocks run in which
order, which runs of them hand their streams straight on (and so can be cached as one residual), and how each block
takes and returns its streams. Verified, never guessed: :func:`verify` runs that first call eagerly with every
block observed (:func:`observe`), and builds the :class:`Chain` from what it saw, or refuses the model with
:class:`torchfix.UnsupportedModelError`, naming what was found, before anything is cached.

>>> Slot(0).run
-1
"""

from __future__ import annotations

import inspect
import logging
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .. import _warn, families
from ..errors import InvalidArgumentError, UnsupportedModelError
from ..families import Blocks
from ..patches import instance
from . import generation, parallel
from ._graphs import outside_graphs
from .config import corrects
from .engine import changed, marker
from .residuals import residuals
from .revise import sample_of

if TYPE_CHECKING:
    from .blocks import BlockState, BlockStep, TransformerLayout

__all__ = ["Chain", "Recorder", "Run", "Slot", "check_calls", "observe", "out_of_order", "outputs_of", "reader", "returned", "verify"]

log = logging.getLogger("torchfix")


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
class Recorder:
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



# --- reading a block's arguments and outputs -------------------------------------------------------------------


def reader(block: torch.nn.Module, spec: Blocks) -> Any:
    """``read(args, kwargs) -> tuple of the streams in spec.returns order`` without binding the whole signature."""
    params = list(inspect.signature(instance.forward_source(block)).parameters)
    where = [(spec.inputs[s], params.index(spec.inputs[s])) for s in spec.returns]

    def read(args: tuple, kwargs: dict[str, Any]) -> tuple[Any, ...]:
        return tuple(kwargs[name] if name in kwargs else (args[i] if i < len(args) else None) for name, i in where)

    return read


def outputs_of(spec: Blocks, out: Any) -> tuple[Any, ...] | None:
    """A block's returned streams in ``spec.returns`` order, or ``None`` where it returned something else."""
    n = len(spec.returns)
    if n == 1 and isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (tuple, list)) and len(out) == n:
        return tuple(out)
    return None


def returned(values: tuple[Any, ...], tuple_out: bool) -> Any:
    return values if tuple_out or len(values) > 1 else values[0]


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_describe(v) for v in value) + ")"
    return type(value).__name__


# --- verification ------------------------------------------------------------------------------------------------


def observe(state: BlockState, position: int, read: Any, original: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """Run block ``position`` while verifying, and note what it took and returned."""
    rec, layout = state.step.recorder, state.plan.layout
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
    before = {s: marker(v) for s, v in inputs.items() if isinstance(v, torch.Tensor)}
    if cached and not extends:  # a run starts here: what enters it, as it is now (the block may update it in place)
        entering = {s: v.detach().clone() if isinstance(v, torch.Tensor) else v for s, v in inputs.items()}
    out = original(*args, **kwargs)
    values = outputs_of(spec, out)
    rec.inplace |= any(changed(inputs[s], mark) for s, mark in before.items()) or any(
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
                generation.keep_reference(state, entering["image"])
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
    rec = state.step.recorder
    if rec.run_inputs is None or last is None or not rec.runs or rec.problems:  # a refused chain keeps nothing
        rec.run_inputs = None
        return
    names = state.plan.layout.specs[rec.seen[rec.runs[-1][0]].position].returns
    rec.pending[len(rec.runs) - 1] = residuals(state, names, rec.run_inputs, last.values if last.values is not None else last.outputs)
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
    rec, layout = state.step.recorder, state.plan.layout
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
    state.step.pending = dict(rec.pending)
    return chain


def _tail_off(state: BlockState, model: Any, output: Any, runs: list[list[int]], seen: list[_Seen]) -> str | None:
    """Why the cached steps cannot be revised on this chain (``None``: they can): one run that ends the chain and
    whose image stream goes straight into the output layers, whose result is the model's output."""
    rec, family = state.step.recorder, state.family
    if state.plan.cannot_revise is not None:
        return state.plan.cannot_revise
    if len(runs) != 1 or runs[0][-1] != len(seen) - 1:
        return "the cached blocks do not end the chain in one run"
    last = rec.last_image
    if rec.norm_input is None or rec.norm_input is not last or not isinstance(rec.norm_conditioning, torch.Tensor):
        return f"the last block's image stream does not go straight into {family.tail[0]}"
    sample = sample_of(output)
    with torch.no_grad():
        norm, proj = (getattr(model, name) for name in family.tail)
        again = proj(norm(last, rec.norm_conditioning))
    if sample is None or again.shape != sample.shape or not torch.allclose(again.float(), sample.float(), rtol=1e-4, atol=1e-5):
        return f"the model's output is not {family.tail[1]}({family.tail[0]}(...)) of the last block's output"
    return None



# --- the observed call ----------------------------------------------------------------------------------------


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
        state.step.mode, state.step.pending, state.step.recorder = "off", {}, None
        raise
    state.step.recorder = None
    if chain.revise is not None and state.config.revise is True:
        raise InvalidArgumentError(f"torchfix.deepcache: revise=True, but {type(model).__name__}: {chain.revise}; leave revise=None.")
    state.plan.chains[state.step.path] = state.step.chain = chain
    if chain.revise is not None:
        state.step.revising = False
    log.debug("torchfix.deepcache: %s verified: %s", type(model).__name__, chain.describe(state.plan.layout))
    return output


def _watch(state: BlockState) -> parallel.Watch | None:
    """While the first call is observed under torch.distributed with no group the model shows: a watch for the
    collectives it issues (they mean other ranks share the call)."""
    if parallel.ranks(state).shared or not parallel.distributed():
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


verify = outside_graphs(_verify_call)


# --- later calls of a verified call path -------------------------------------------------------------------


def check_calls(state: BlockState, step: BlockStep) -> None:
    """After an eager call: every block ran, once, as on the first call (compiled blocks do not count: 0)."""
    if 0 < step.cursor != step.chain.calls:
        raise UnsupportedModelError(
            f"torchfix.deepcache: {state.family.name!r}: this call ran {step.cursor} of the {step.chain.calls} blocks its first "
            "call ran with the same arguments; the cached steps would be wrong. Remove DeepCache from this model "
            "(torchfix.deepcache.remove)."
        )


def out_of_order(state: BlockState, position: int) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"torchfix.deepcache: {state.plan.layout.names[position]} was called as block {state.step.cursor} of this call, but as block "
        f"{state.step.chain.slots[position].order} on the first call with the same arguments; the cached steps would be wrong. "
        "Remove DeepCache from this model (torchfix.deepcache.remove)."
    )
