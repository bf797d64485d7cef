"""The maths of the transformer cache inside one call, per run of cached blocks: what a full step keeps
(:func:`residuals`), what a cached step returns in their place (:func:`cached`), and the restart of a stream whose
tokens changed shape within a generation (:func:`reshaped`, :func:`restart_run`). What a call leaves behind when it
ends is :func:`torchfix.deepcache.forecast.keep`'s and :func:`torchfix.deepcache.revise.after_call`'s.

A run's value per full step is ``(residual per stream, ...)`` and, where the cached step corrects for its input
(``DeepCacheConfig.sensitivity``), ``(..., the streams that entered it)``; a cached run returns
``in + residual − (1 − s)·(in − forecast_in)`` with ``s`` measured per sample at each full step.

>>> from torchfix.deepcache.chain import Run
>>> Run((0, 1), ("image",)).image
0
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from ..families import Blocks
from . import forecast
from ._graphs import outside_graphs
from .config import corrects
from .forecast import as_dtype, is_one
from .generation import Stream
from .schedule import restarted

if TYPE_CHECKING:
    from .blocks import BlockState
    from .chain import Run

__all__ = ["cached", "reshaped", "residuals", "restart_run"]

log = logging.getLogger("torchfix")


# --- a full step's residuals and a cached step's stand-in --------------------------------------------------------


def residuals(state: BlockState, names: tuple[str, ...], inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]) -> tuple:
    """What a run keeps at a full step: its residual per stream, and where the cached step corrects for its
    input (``config.corrects``), the streams that entered it."""
    present = [inputs.get(s) is not None and outputs.get(s) is not None for s in names]  # an absent stream keeps None
    kept = tuple((outputs[s] - inputs[s]).detach() if p else None for s, p in zip(names, present))
    if corrects(state.config):
        kept += tuple(inputs[s].detach() if p else None for s, p in zip(names, present))
    return kept


def _sensitivity(state: BlockState, stream: Stream, run: int, part: int) -> Any:
    fixed = state.config.sensitivity
    return fixed if fixed is not None else stream.sensitivity.get((run, part))


@outside_graphs
def cached(state: BlockState, r: int, run: Run, now: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """What a run returns on a cached step: per stream ``in + residual − (1 − s)·(in − forecast_in)`` (eager: the
    forecast's step gaps and ``s`` change per step)."""
    stream = state.generation.current
    value = forecast.for_this_step(state, r)
    k = len(run.streams)
    out = []
    for part, current in enumerate(now):
        residual = as_dtype(value[part], current)
        predicted = as_dtype(value[k + part], current) if len(value) > k else None
        s = _sensitivity(state, stream, r, part)
        if part == run.image and r == 0:
            state.step.used = 1.0 if is_one(s) or predicted is None else s
        if residual is None:
            out.append(current)
        elif is_one(s) or predicted is None:
            out.append(current + residual)
        else:
            out.append(current + residual - (1.0 - as_dtype(s, current)) * (current - predicted))
    return tuple(out)


# --- streams that change shape within a generation ------------------------------------------------------------


def reshaped(state: BlockState, r: int, run: Run, now: tuple[Any, ...], spec: Blocks) -> bool:
    """Whether the streams entering run ``r`` are shaped otherwise than what its last full step kept: a model whose
    streams change shape within a generation (Qwen-Image 2.1's KV cache: the first step runs text and image tokens,
    later steps the image's alone), or a guidance pass whose text length changed."""
    kept = state.generation.current.last(r) if state.generation.current is not None else None
    if kept is None:
        return state.generation.current is not None and state.generation.current.reference is not None and r == 0 and (
            state.generation.current.reference.shape != now[spec.returns.index("image")].shape
        )
    entering = [now[spec.returns.index(s)] for s in run.streams]
    return any(
        isinstance(k, torch.Tensor) and isinstance(e, torch.Tensor) and k.shape != e.shape for k, e in zip(kept, entering)
    )


def restart_run(state: BlockState, r: int) -> str:
    """A cached step whose streams no longer fit what the cache kept runs in full from run ``r`` on, and the stream's
    history starts again there: nothing kept at another shape is ever added to this one (the step counts as full
    where it is the first run)."""
    stream = state.generation.current
    for run in [k for k in stream.histories if k >= r]:
        stream.histories.pop(run)
    stream.sensitivity = {k: v for k, v in stream.sensitivity.items() if k[0] < r}
    if r == 0:
        stream.reference = None
        stream.since_full.clear()
        restarted(state, state.step.mode == "cached")
    state.step.mode = "full"
    log.info("torchfix.deepcache: %s: the streams changed shape within a generation; this step ran in full", state.family.name)
    return "full"


