"""The step schedule: which denoiser calls of a generation run in full, and what the call in progress does.

:func:`full_steps` and :func:`must_run_full` are the schedule a :class:`~torchfix.deepcache.DeepCacheConfig` sets
(pure: no torch); :func:`decide` applies it to the call in progress in its stream and counts it; :func:`probe`
lets the features decide a step that a ``threshold`` leaves open.

>>> from torchfix.deepcache.config import DeepCacheConfig
>>> sorted(full_steps(10, DeepCacheConfig(interval=3)))  # forecasting: the second full step at 2
[0, 2, 5, 8]
>>> sorted(full_steps(10, DeepCacheConfig(interval=3, forecast=0)))  # reuse: DeepCache 0.1.1's steps
[0, 3, 6, 9]
"""

from __future__ import annotations

import functools
import itertools
import math
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..errors import TorchfixWarning
from ._graphs import outside_graphs
from .config import DeepCacheConfig
from .forecast import moved
from .parallel import ranks, summer

if TYPE_CHECKING:
    from .engine import CacheState
    from .generation import Stream

__all__ = [
    "count",
    "decide",
    "early_steps_move",
    "full_steps",
    "generation_steps",
    "is_full_step",
    "must_run_full",
    "probe",
    "restarted",
    "stream_steps",
    "warms_up",
    "window",
]


def warms_up(config: DeepCacheConfig) -> bool:
    """Whether a generation warms up: the second full step at step 2 instead of at ``interval`` (full steps
    0, 2, 2 + interval, ...), and at ``interval=2`` steps 0, 1 and 2 all in full (then every other step). With a
    forecast (``forecast`` 1 or 2, or ``None``: both families forecast by default), ``interval >= 2`` and
    ``warm_up`` not False (``None`` counts as True here; a pipeline's scheduler decides it per generation,
    :func:`early_steps_move`). A forecast needs two full steps; without the early second one, the first
    ``interval − 1`` cached steps could only reuse step 0's feature as it was. At interval 2 that reuse, and
    the forecast of step 3 across the fast first steps, cost the most: on the trained models interval 2 without
    the warm-up was less exact than interval 3 (SD1.5-like UNet 1.77× at rel-L2 0.0101 against 2.31× at 0.0110);
    with it, one more full step of 20, 1.65× at 0.0018.

    >>> warms_up(DeepCacheConfig(interval=3)), warms_up(DeepCacheConfig(interval=3, forecast=0))
    (True, False)
    """
    return config.warm_up is not False and config.forecast != 0 and config.interval >= 2


def early_steps_move(timesteps: Sequence[float]) -> bool:
    """Whether a schedule's first step moves the timestep at least half as much as its average step: where
    it does, the features change fast from the start and a forecast pays for an early second full step
    (measured on the trained denoisers, the same work either way: the SD1.5-like UNet's schedule gains, 0.42×
    the error at interval 3, and so does Flux's, 0.38× at interval 4; SD3's shift-3 schedule, whose first step
    moves 0.35× the average, loses: 1.9× at interval 4).

    >>> early_steps_move([999, 949, 899, 849]), early_steps_move([1000, 982, 962, 941, 919, 894, 867, 838, 806, 9])
    (True, False)
    """
    values = [float(t) for t in timesteps]
    if len(values) < 3:
        return True
    gaps = [abs(b - a) for a, b in itertools.pairwise(values)]
    mean = sum(gaps) / len(gaps)
    return mean == 0 or gaps[0] >= 0.5 * mean


def _warm_full(index: int, interval: int) -> bool:
    """Whether step ``index`` runs in full on a warmed-up schedule: 0, then 2, 2 + interval, ... (at interval 2
    also step 1: steps 0, 1 and 2, then every other step)."""
    return index == 0 or (index == 1 and interval == 2) or (index >= 2 and (index - 2) % interval == 0)


def _stop(config: DeepCacheConfig) -> float:
    return 1.0 if config.stop is None else config.stop


@functools.lru_cache(maxsize=256)
def full_steps(total: int, config: DeepCacheConfig) -> frozenset[int]:
    """Indices (0-based UNet calls of one generation) that run the full UNet."""
    if config.interval == 1 or total <= 1:
        return frozenset(range(total))
    lo = math.ceil(config.start * total)
    hi = max(lo + 1, math.ceil(_stop(config) * total))
    outside = set(range(lo)) | set(range(hi, total))
    width = hi - lo
    count = math.ceil(width / config.interval)
    if config.schedule == "uniform":
        inside = set(range(lo, hi, config.interval))
        if warms_up(config) and lo == 0:
            inside = {i for i in range(lo, hi) if _warm_full(i, config.interval)}
    else:
        inside = set()
        for k in range(count):
            pos = lo + round(width * (k / count) ** config.power)
            while pos in inside:  # collisions early on: take the next free step
                pos += 1
            inside.add(min(pos, hi - 1))
    return frozenset(outside | inside | {0})


def window(total: int | None, config: DeepCacheConfig) -> tuple[int, int | None]:
    """``[lo, hi)``: the steps caching may skip (``hi`` None: open-ended)."""
    if total is None:
        return 1, None
    lo = math.ceil(config.start * total)
    return lo, max(lo + 1, math.ceil(_stop(config) * total))


def must_run_full(index: int, total: int | None, config: DeepCacheConfig, cached_run: int) -> bool | None:
    """With a ``threshold``: True where step ``index`` runs in full whatever the features do (the first step,
    outside the window, or ``cached_run`` already at the cap), else ``None`` (the features decide).
    Without one: :func:`is_full_step`.

    >>> cfg = DeepCacheConfig(interval=4, threshold=0.1, stop=0.9)
    >>> [must_run_full(i, 10, cfg, 0) for i in (0, 1, 9)], must_run_full(4, 10, cfg, 3)
    ([True, None, True], True)
    """
    if config.threshold is None:
        return is_full_step(index, total, config)
    lo, hi = window(total, config)
    if index == 0 or config.interval == 1 or index < lo or (hi is not None and index >= hi) or cached_run >= config.interval - 1:
        return True
    return None


def is_full_step(index: int, total: int | None, config: DeepCacheConfig) -> bool:
    """Whether UNet call ``index`` of a generation runs in full.

    With ``total`` unknown (a bare UNet and no ``num_steps``) the schedule is
    uniform over an open-ended run.
    """
    if index == 0 or config.interval == 1:
        return True
    if total is None or index >= total:
        if warms_up(config):
            return _warm_full(index, config.interval)
        return index % config.interval == 0
    return index in full_steps(total, config)


def stream_steps(state: CacheState, stream: Stream) -> int | None:
    """Denoiser calls ``stream`` gets in this generation, counted from its first: the generation's steps less
    those taken before it started (a second expert's share), ``None`` where unknown."""
    total = generation_steps(state)
    return None if total is None else max(total - stream.start, 1)


def generation_steps(state: CacheState) -> int | None:
    """Denoiser calls per stream in this generation: the timesteps the scheduler set, less those an img2img
    pipeline skips (``scheduler.set_begin_index(t_start)``, called after ``set_timesteps``), so the caching
    window's tail (``stop``) falls on the last steps that actually run. ``None``: unknown.

    >>> from torchfix.deepcache.generation import Generation
    >>> class S: generation, scheduler = Generation(None, total=20), None
    >>> generation_steps(S())
    20
    """
    total = state.generation.total
    if total is None:
        return None
    scheduler = state.scheduler() if state.scheduler is not None else None
    begin = getattr(scheduler, "begin_index", None)
    return total - begin if isinstance(begin, int) and 0 < begin < total else total


# --- the call in progress ---------------------------------------------------------------------------------------


@outside_graphs
def decide(
    state: CacheState, stream: Stream, arguments: dict[str, Any], *, verified: bool = True, plan: Any = None, chain: Any = None
) -> str:
    """What this denoiser call does in ``stream`` (:data:`MODES`, but "off"), counted unless it is a probe.
    ``verified``: the family's blocks were checked on this call path (until then a call runs in full); ``plan``, ``chain``:
    a transformer's plan and the verified chain of this path, whose cached blocks a host's block patches may touch (such a call runs
    as without the cache: :func:`_patched`). Kept out of compiled graphs: it is Python state, not tensor math."""
    index = stream.step
    stream.step += 1
    config = state.generation.config
    extra = arguments.get("kwargs") or {}  # what a forward's **kwargs took (ComfyUI's Wan takes control there)
    plain = plan is not None and state.family.patched is not None and bool(_patched(state, plan, chain, arguments))
    if plain or config.interval == 1 or any(arguments.get(name, extra.get(name)) is not None for name in state.family.full_only_arguments):
        mode = "plain"
    elif not stream.histories.get(0) or not verified:
        mode = "full"
    else:
        full = must_run_full(index, stream_steps(state, stream) or config.num_steps, config, stream.cached_run)
        mode = "probe" if full is None else ("full" if full else "cached")
    if mode != "probe":
        count(state, stream, mode != "cached")
    return mode


def count(state: CacheState, stream: Stream, full: bool) -> None:
    """Count the call in progress as a full step or a cached one (a probe is counted once decided, and a cached
    step that had to run in full again as full: :func:`restarted`)."""
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
    stream = state.generation.current
    full = stream.reference is None or moved(signal, stream.reference, summer(ranks(state))) >= state.config.threshold
    count(state, stream, full)
    return "full" if full else "cached"


def restarted(state: CacheState, was_cached: bool) -> None:
    """The call in progress, decided as cached, runs in full from its first run on: counted as full."""
    stream = state.generation.current
    if was_cached:
        state.cached_steps -= 1
        stream.cached -= 1
    count(state, stream, True)


def _patched(state: Any, plan: Any, chain: Any, arguments: dict[str, Any]) -> list[str]:
    """The blocks of this call that a cached step would skip and that a host-side block patch of the call takes the
    place of or follows (ComfyUI's ``patches_replace["dit"]``, ``patches["double_block"]``: the family's ``patched``).
    Such a call runs as without the cache: a cached step would leave the patch out, or (a patch that adds to what its
    block returns, as PuLID-Flux's does) add it again on top of a residual that holds it already. Said once per cache.
    Before its call path is verified every block counts as one a cached step may skip."""
    family = state.family
    touched = family.patched(arguments) if family.patched is not None else ()
    if not touched:
        return []
    layout = plan.layout
    skipped = {p for p, slot in chain.slots.items() if slot.run >= 0} if chain is not None else set(range(layout.n_blocks))
    attrs = [spec.attr for spec in family.blocks]
    hit = []
    for position in sorted(skipped):
        attr, _, index = layout.names[position].rpartition(".")
        k = attrs.index(attr)
        if (-1, -1) in touched or (k, -1) in touched or (k, int(index)) in touched:
            hit.append(layout.names[position])
    if hit and not plan.told_patched:
        plan.told_patched = True
        warnings.warn(
            f"torchfix.deepcache: {type(state.model()).__name__}: a call carries block patches (ComfyUI's "
            f"transformer_options patches_replace['dit'] or patches['double_block']) on blocks a cached step would skip "
            f"({', '.join(hit[:4])}{', ...' if len(hit) > 4 else ''}). Such calls run in full, every block and patch as "
            "without the cache (a cached step would drop the patch, or apply it twice on top of the cached residual); "
            "calls without them are cached as before.",
            TorchfixWarning,
            stacklevel=4,
        )
    return hit
