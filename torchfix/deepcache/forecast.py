"""Forecast a cached feature from the last full steps, and measure how far the features moved.

On a cached step, plain DeepCache reuses the deep feature (UNet) or the middle blocks' residual
(transformer) of the last full step as it was. A trained denoiser's features drift smoothly between
steps, so extrapolating them from the last two or three full steps with finite differences
(TaylorSeer's idea, normalised by the gap between the steps) is closer to what a full step would
compute. The extrapolation never reaches further past the last full step than the last gap
between full steps (uncapped extrapolation blows up), and ``DeepCacheConfig.interval`` caps how
many cached steps follow one full step.

Both functions run eagerly, outside compiled graphs: the step gaps are Python numbers that change
every step, which a compiled graph would specialise on.

>>> import torch
>>> history = [(0, torch.tensor([0.0])), (3, torch.tensor([3.0]))]
>>> forecast(history, 5, 1)
tensor([5.])
"""

from __future__ import annotations

from typing import Any

import torch

from ._graphs import outside_graphs
from .config import corrects

__all__ = ["as_dtype", "for_this_step", "forecast", "interpolate", "is_one", "keep", "moved", "per_sample", "remember", "sensitivity"]

Value = Any  # a tensor, or a tuple of tensors and None (a transformer's (text, image) residual)


def remember(history: list[tuple[int, Value]], index: int, value: Value, order: int) -> None:
    """Append full step ``index``'s ``value``, keeping the ``order + 1`` newest (what ``order`` needs)."""
    history.append((index, value))
    del history[: max(len(history) - (order + 1), 0)]


@outside_graphs
def keep(state: Any, extra: int = 0, *, measure: bool = False) -> bool:
    """After a full step: what each run produced (``state.step.pending``) joins its stream's history, as far back as
    the forecast order needs, or ``extra`` full steps (eager: histories are Python lists); with ``measure`` (a
    transformer's verified chain), after measuring how much of an input's forecast error its blocks pass through.
    Returns whether anything was kept."""
    stream, step = state.generation.current, state.step
    if measure and step.pending and stream is not None:
        _measure(state)
    kept = bool(step.pending) and stream is not None
    for run, value in step.pending.items() if kept else ():
        remember(stream.histories.setdefault(run, []), stream.step - 1, value, max(state.config.forecast, extra))
    step.pending = {}
    return kept


@outside_graphs
def for_this_step(state: Any, run: int = 0) -> Value:
    """The value forecast for the cached step in progress from run ``run``'s history (eager: the step gaps are
    Python numbers)."""
    stream = state.generation.current
    history = stream.histories.setdefault(run, [])
    return forecast(history, stream.step - 1, state.config.forecast) if state.config.forecast else history[-1][1]


@outside_graphs
def _measure(state: Any) -> None:
    """At a full step whose residuals and inputs the stream could have forecast: the sensitivity of each stream
    of each run, per sample (the forecast it proves wrong). After a warm-up, a forecast that reaches back to step
    0 is off for the fast start, not for the blocks' response to their input: it measures nothing."""
    stream, config, total = state.generation.current, state.config, state.step.total
    if config.sensitivity is not None or not corrects(config) or stream is None:
        return
    for r, value in state.step.pending.items():
        history = stream.run_history(r)
        k = len(value) // 2
        if len(history) < 2 or len(value) != 2 * k:
            continue
        oldest = history[-min(config.forecast, len(history) - 1) - 1][0]  # the first point the forecast used
        if oldest == 0 and state.generation.warms_up:  # off the curve the later full steps follow (fast first steps)
            continue
        predicted = forecast(history, stream.step - 1, config.forecast)
        for part in range(k):
            residual, entered = value[part], value[k + part]
            if residual is None or entered is None or predicted[part] is None or predicted[k + part] is None:
                continue
            slopes = per_sample(residual - predicted[part], entered - predicted[k + part], total)
            if slopes is not None:
                stream.sensitivity[(r, part)] = slopes
                if r == 0 and part == state.step.chain.runs[0].image:
                    state.last_sensitivity = float(slopes.mean())


def as_dtype(s: Any, like: torch.Tensor) -> Any:
    """A measured sensitivity (per sample), or what a full step kept, in the dtype of what it meets now (the very tensor
    where they agree): the result keeps the model's dtype, also where the latents' dtype changed after step 0."""
    return s.to(like.dtype) if isinstance(s, torch.Tensor) else s


def is_one(s: Any) -> bool:
    return s is None or (not isinstance(s, torch.Tensor) and s == 1.0)


def _map(fn: Any, *values: Value) -> Value:
    if isinstance(values[0], tuple):
        return tuple(None if any(v is None for v in parts) else fn(*parts) for parts in zip(*values))
    return fn(*values)


@outside_graphs
def forecast(history: list[tuple[int, Value]], index: int, order: int) -> Value:
    """The value at step ``index`` extrapolated from ``history`` (oldest first) to ``order`` 0-2, with the
    step reached past the newest full step capped at the gap before it.

    >>> import torch
    >>> h = [(0, torch.tensor([0.0])), (2, torch.tensor([4.0])), (4, torch.tensor([16.0]))]
    >>> forecast(h, 5, 2)  # x**2 at 5, from 0, 2 and 4
    tensor([25.])
    """
    i2, v2 = history[-1]
    order = min(order, len(history) - 1)
    if order == 0:
        return v2
    i1, v1 = history[-2]
    step = min(index - i2, i2 - i1)  # never further out than the last gap
    gap = i2 - i1
    if order == 1:
        return _map(lambda a, b: b + (b - a) * (step / gap), v1, v2)
    i0, v0 = history[-3]
    gap0 = i1 - i0

    def quadratic(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        d1 = (c - b) / gap  # slope over the last gap
        d0 = (b - a) / gap0
        d2 = (d1 - d0) / ((gap + gap0) / 2)  # change of slope per step
        # Newton's form about the newest point: c + slope·s + curvature·s·(s + gap)/2
        return c + d1 * step + d2 * (step * (step + gap) / 2)

    return _map(quadratic, v0, v1, v2)


@outside_graphs
def interpolate(history: list[tuple[int, Value]], index: int) -> Value:
    """The value at step ``index`` (between the two newest full steps of ``history``, oldest first) on the
    polynomial through the newest three (two where there are only two): what a cached step would have used
    had it known the full step after it.

    >>> import torch
    >>> h = [(0, torch.tensor([0.0])), (2, torch.tensor([4.0])), (6, torch.tensor([36.0]))]
    >>> interpolate(h, 4)  # x**2 at 4, from 0, 2 and 6
    tensor([16.])
    """
    points = history[-3:]
    steps = [i for i, _ in points]
    weights = []
    for i in steps:
        w = 1.0
        for m in steps:
            if m != i:
                w *= (index - m) / (i - m)
        weights.append(w)
    return _map(lambda *values: sum(w * v for w, v in zip(weights, values)), *(v for _, v in points))


Total = Any  # None, or a function adding per-rank partial sums over the ranks that share a call (parallel.summer)


@outside_graphs
def moved(now: torch.Tensor, ref: torch.Tensor, total: Total = None) -> float:
    """How far ``now`` moved from ``ref``: ``Σ|now − ref| / Σ|ref|`` (FirstBlockCache's measure, a ratio of means), per
    sample of the batch (dimension 0), the largest: no sample is cached once it moved as far as the threshold.
    ``total``: adds each rank's sums over the ranks that share the call (context parallelism: each holds a shard of
    the tokens), so every rank measures what one process would.

    >>> import torch
    >>> round(moved(torch.tensor([1.1, 2.0]), torch.tensor([1.0, 2.0])), 4)
    0.0333
    >>> round(moved(torch.tensor([[1.1, 2.0], [1.0, 2.0]]), torch.tensor([[1.0, 2.0], [1.0, 2.0]])), 4)
    0.0333
    """
    if now.dim() < 2:
        now, ref = now.unsqueeze(0), ref.unsqueeze(0)
    diff = (now.float() - ref.float()).abs().flatten(1).sum(1)
    sums = torch.stack((diff, ref.float().abs().flatten(1).sum(1)), 1)
    if total is not None:
        sums = total(sums)
    return float((sums[:, 0] / sums[:, 1].clamp_min(1e-12)).max())


@outside_graphs
def sensitivity(residual_error: torch.Tensor, input_error: torch.Tensor) -> float | None:
    """How much of an input's forecast error a residual block chain passes to its output, measured at a full
    step: the least-squares slope ``s`` of the output's forecast error on the input's, kept in [0, 1].
    With ``out = in + residual``, the output's error is ``residual_error + input_error``, so
    ``s = 1 + <residual_error, input_error> / |input_error|²``. ``None`` where the input was forecast
    exactly (a text stream that does not change between steps): nothing to measure.

    >>> import torch
    >>> e_in = torch.tensor([1.0, -2.0, 0.5])
    >>> round(sensitivity(-0.7 * e_in, e_in), 3)  # the blocks undo 70% of an input change
    0.3
    """
    slopes = per_sample(residual_error.reshape(1, -1), input_error.reshape(1, -1))
    return None if slopes is None else float(slopes[0])


@outside_graphs
def per_sample(residual_error: torch.Tensor, input_error: torch.Tensor, total: Total = None) -> torch.Tensor | None:
    """:func:`sensitivity` for each sample of the batch (dimension 0), as a tensor (float32 at least) shaped to broadcast
    against the inputs (``[B, 1, ...]``); a sample with nothing to measure gets 1.0 (its input passes through).
    ``None`` where no sample has anything to measure. Each sample is measured alone, so a batch of two is
    cached as two calls of one would be. ``total``: as for :func:`moved` (the two sums of each sample).

    >>> import torch
    >>> e_in = torch.tensor([[1.0, -2.0], [0.0, 0.0]])
    >>> per_sample(-0.5 * e_in, e_in).flatten().tolist()
    [0.5, 1.0]
    """
    wide = torch.promote_types(input_error.dtype, torch.float32)  # half precision sums in float32
    e_in = input_error.to(wide).flatten(1)
    power, dot = (e_in * e_in).sum(1), (residual_error.to(wide).flatten(1) * e_in).sum(1)
    if total is not None:
        power, dot = total(torch.stack((power, dot), 1)).to(wide).unbind(1)
    defined = torch.isfinite(power) & (power > 1e-30)
    if not bool(defined.any()):
        return None
    slope = 1.0 + dot / torch.where(defined, power, torch.ones_like(power))
    slope = torch.where(defined & torch.isfinite(slope), slope.clamp(0.0, 1.0), torch.ones_like(slope))
    return slope.reshape(-1, *([1] * (input_error.dim() - 1)))
