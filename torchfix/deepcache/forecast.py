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

import math
from typing import Any

import torch

from ._graphs import outside_graphs

__all__ = ["for_this_step", "forecast", "interpolate", "keep_pending", "moved", "remember", "sensitivity"]

Value = Any  # a tensor, or a tuple of tensors and None (a transformer's (text, image) residual)


def remember(history: list[tuple[int, Value]], index: int, value: Value, order: int) -> None:
    """Append full step ``index``'s ``value``, keeping the ``order + 1`` newest (what ``order`` needs)."""
    history.append((index, value))
    del history[: max(len(history) - (order + 1), 0)]


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


@outside_graphs
def moved(now: torch.Tensor, ref: torch.Tensor) -> float:
    """How far ``now`` moved from ``ref``: ``mean|now − ref| / mean|ref|`` (FirstBlockCache's measure).

    >>> import torch
    >>> round(moved(torch.tensor([1.1, 2.0]), torch.tensor([1.0, 2.0])), 4)
    0.0333
    """
    diff = (now.float() - ref.float()).abs().mean()
    return float(diff / ref.float().abs().mean().clamp_min(1e-12))


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
    wide = torch.promote_types(input_error.dtype, torch.float32)  # half precision sums in float32
    e_in = input_error.to(wide)
    power = float((e_in * e_in).sum())
    if not math.isfinite(power) or power <= 1e-30:
        return None
    slope = 1.0 + float((residual_error.to(wide) * e_in).sum()) / power
    return min(max(slope, 0.0), 1.0) if math.isfinite(slope) else None


# A cache state (UNet or transformer) has ``current`` (the stream of the call in progress, with ``history``
# and ``step``), ``config.forecast`` and ``pending`` (the value a full step produced, not yet in the history).


@outside_graphs
def for_this_step(state: Any) -> Value:
    """The value forecast for the cached step in progress, from its stream's history (eager: the step
    gaps are Python numbers)."""
    stream = state.current
    return forecast(stream.history, stream.step - 1, state.config.forecast)


def keep_pending(state: Any, order: int = 0) -> None:
    """After a full step: the value it produced joins its stream's history, keeping what the forecast order
    (or ``order``, where more is needed) needs. Called eagerly, outside any graph (the history is a Python
    list whose length a graph would guard on)."""
    if state.pending is not None and state.current is not None:
        remember(state.current.history, state.current.step - 1, state.pending, max(state.config.forecast, order))
    state.pending = None
