"""DeepCache configuration (pure: no torch, no patching); the step schedule it sets is
:mod:`torchfix.deepcache.schedule`'s.

>>> from torchfix.deepcache.config import DeepCacheConfig
>>> DeepCacheConfig(interval=3).interval
3
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgumentError, InvalidArgumentTypeError

__all__ = [
    "FAMILY_DEFAULTS",
    "SCHEDULES",
    "DeepCacheConfig",
    "corrects",
    "for_family",
]

SCHEDULES = ("uniform", "nonuniform")


@dataclass(frozen=True)
class DeepCacheConfig:
    """How DeepCache trades speed for fidelity.

    Every generation starts with a full UNet step; between full steps, *cached*
    steps recompute only the shallow part of the UNet and reuse the deep feature
    from the last full step.

    Args:
        interval: one full step every ``interval`` steps. Higher is faster with
            more error; 1 disables caching (bit-identical to no DeepCache).
            With a forecast (the default) the second full step may come at
            step 2 (``warm_up``): full steps 0, 2, 2 + interval, ... (at interval
            2: steps 0, 1 and 2, then every other step)
            Speed bound: ``S / (F + C·f)`` for S steps, F full, C cached, f the
            cost of a cached step relative to a full one.
        branch: which skip connection the cached deep feature re-enters at
            (0 = the shallowest, just after ``conv_in``). A lower branch skips
            more of the UNet (smaller f: faster) and reuses more (more error).
            Valid: 0 .. number of skip connections − 1 (11 for SD1.5, 8 for SDXL).
        schedule: ``"uniform"`` (full steps evenly spaced) or ``"nonuniform"``
            (the same number of full steps, packed towards the early steps,
            where the deep features change fastest; same speed, lower error).
        start, stop: the caching window as fractions of the steps; steps outside
            it are always full. Keeping the last steps full (``stop=0.9``)
            sharpens details at little cost. ``stop=None`` (the default): the best
            measured for the model family (:data:`FAMILY_DEFAULTS`: a UNet caches to
            the end, a transformer runs its last 10% of steps in full).
        power: for ``nonuniform``: how strongly full steps concentrate early
            (1.0 is uniform).
        num_steps: steps per generation, for a bare UNet driven without a
            diffusers scheduler (pipelines report it themselves). Needed only by
            ``nonuniform`` and the ``start``/``stop`` window.
        keep_first, keep_last: for a diffusion transformer: how many blocks at the
            start and at the end of its block chain (in call order) run on every
            step; the blocks in between are cached. Fewer kept blocks is faster
            (and on the trained models no less exact: ``keep_first=None``, the
            default, is 0; ``keep_last=None`` is the family's: 0 where the last block
            returns every stream, as Flux's and Wan's do, so a cached step runs only
            the embedders and the output layers, and 1 where it drops the text
            stream, as SD3's and Mochi's do: :mod:`torchfix.families`). A UNet
            ignores them (``branch`` plays that role).
        forecast: on a cached step, extrapolate the cached feature (UNet) or residual
            (transformer) from the last ``forecast + 1`` full steps with finite
            differences normalised by the step gap (0: reuse it as it was, as DeepCache
            0.1.1 does; 1: linear; 2: quadratic), never further past the last full step
            than the gap before it (:mod:`torchfix.deepcache.forecast`). Each order
            holds one more feature per stream. ``None`` (the default): the best measured
            for the model family (:data:`FAMILY_DEFAULTS`: quadratic for a UNet, linear for a transformer).
        threshold: refresh when the features move: a step inside the caching window is
            cached only while what it starts from differs from the last full step's by
            less than ``threshold`` (mean absolute difference over mean absolute value):
            for a transformer, the hidden states entering the cached blocks (the output
            of the blocks that always run); for a UNet, its input sample (what a cached
            step recomputes from). ``interval`` then caps the run (at most
            ``interval − 1`` cached steps after a full one). ``None``: the fixed schedule.
        warm_up: with a forecast and ``interval >= 2``, put the second full step at step 2
            (full steps 0, 2, 2 + interval, ...) so the first cached steps forecast
            instead of reusing step 0's feature (:func:`warms_up`; on the trained UNet at
            interval 3, forecast 2: rel-L2 0.011 instead of 0.026 for the same work). At
            interval 2, steps 0, 1 and 2 run in full (one more full step than 0, 2, 4, ...;
            on the trained UNet 1.65× at 0.0018 instead of 1.77× at 0.0101).
            ``None`` (the default):
            where the scheduler's first step moves the timestep at least half as much as
            its average step (DDIM/PNDM on UNets, Flux's schedule; not SD3's shift-3
            schedule, whose first steps barely move: :func:`early_steps_move`).
        sensitivity: for a transformer: how much of the difference between what enters the
            cached blocks on a cached step and its forecast passes through to what they
            return. 1.0 adds the forecast residual to this step's input (the cached blocks
            pass input changes straight through, as before); 0.0 uses the forecast of the
            blocks' output and ignores this step's input (TaylorSeer's whole-block
            forecast); in between, a mix. ``None`` (the default): measured at every full
            step from the forecast the step proves wrong (the least-squares slope of the
            blocks' output error on their input error, kept in [0, 1];
            :func:`torchfix.deepcache.forecast.sensitivity`; after a warm-up, not from a
            forecast that reaches back to step 0), 1.0 until the first measurement and with
            ``forecast=0``. On the trained transformers the measured value (0.0-0.5) cuts
            the error at the default settings by 8-13% for the same work. Each value other
            than 1.0 holds the inputs beside the residuals. A UNet ignores it.
        revise: for a transformer whose cached blocks end the chain (``keep_last=0``, Flux) driven
            by a flow-matching Euler scheduler (``FlowMatchEulerDiscreteScheduler``, as Flux's and
            SD3's pipelines use): at each full step, look back at the cached steps since the last
            one, *interpolate* the cached blocks' output for each between the full steps around it
            (quadratic through the last three full steps; linear through two, or where the oldest is
            step 0 of a warmed-up generation) instead of the extrapolation it used, rerun the output
            layers on it, and add what the latents would have moved by with that output (each step's
            velocity change times its step size) to this step's output, so the latents land where
            the revised steps would have put them. Costs the output layers once per cached step. On
            the trained Flux-like model, on the benchmark prompts and on held-out ones: interval 3
            0.0039 instead of 0.0067, interval 4 with ``stop=1.0`` 0.0121 instead of 0.0146
            (docs/deepcache.md has every interval). ``None`` (the default): where the model and the
            scheduler allow it (else nothing changes; ``stats()["revise"]`` says why); ``True``: the
            same, and an error at ``apply`` where the model does not allow it; ``False``: never.

    >>> DeepCacheConfig(interval=4, branch=1).interval
    4
    """

    interval: int = 3
    branch: int = 0
    schedule: str = "uniform"
    start: float = 0.0
    stop: float | None = None
    power: float = 1.6
    num_steps: int | None = None
    keep_first: int | None = None
    keep_last: int | None = None
    forecast: int | None = None
    threshold: float | None = None
    warm_up: bool | None = None
    sensitivity: float | None = None
    revise: bool | None = None

    def __post_init__(self) -> None:
        unset = {n for n in ("forecast", "keep_first", "keep_last") if getattr(self, n) is None}  # filled in per model
        for name in (n for n in ("interval", "branch", "keep_first", "keep_last", "forecast") if n not in unset):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidArgumentTypeError(f"DeepCacheConfig.{name} must be an int, got {value!r}.")
        if self.interval < 1:
            raise InvalidArgumentError(f"DeepCacheConfig.interval={self.interval} must be >= 1 (1 means no caching).")
        if self.branch < 0:
            raise InvalidArgumentError(f"DeepCacheConfig.branch={self.branch} must be >= 0 (0 is the shallowest skip connection).")
        for name in ("keep_first", "keep_last"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise InvalidArgumentError(f"DeepCacheConfig.{name}={getattr(self, name)} must be >= 0 (transformer blocks always run).")
        if self.forecast is not None and self.forecast not in (0, 1, 2):
            raise InvalidArgumentError(f"DeepCacheConfig.forecast={self.forecast} must be 0 (reuse), 1 (linear) or 2 (quadratic).")
        if self.warm_up is not None and not isinstance(self.warm_up, bool):
            raise InvalidArgumentTypeError(f"DeepCacheConfig.warm_up must be True, False or None, got {self.warm_up!r}.")
        if self.revise is not None and not isinstance(self.revise, bool):
            raise InvalidArgumentTypeError(f"DeepCacheConfig.revise must be True, False or None, got {self.revise!r}.")
        if self.sensitivity is not None and (
            not isinstance(self.sensitivity, (int, float)) or isinstance(self.sensitivity, bool) or not 0.0 <= self.sensitivity <= 1.0
        ):
            raise InvalidArgumentError(
                f"DeepCacheConfig.sensitivity={self.sensitivity!r} must be a number in [0, 1] (1.0: the cached blocks pass "
                "input changes through; 0.0: forecast their output), or None to measure it."
            )
        number = isinstance(self.threshold, (int, float)) and not isinstance(self.threshold, bool)
        if self.threshold is not None and not (number and self.threshold > 0):
            raise InvalidArgumentError(
                f"DeepCacheConfig.threshold={self.threshold!r} must be a "
                f"positive number, or None for the fixed schedule."
            )
        if self.schedule not in SCHEDULES:
            raise InvalidArgumentError(f"DeepCacheConfig.schedule={self.schedule!r} must be one of {SCHEDULES}.")
        if not (0.0 <= self.start < (FAMILY_DEFAULTS["transformer"]["stop"] if self.stop is None else self.stop) <= 1.0):
            raise InvalidArgumentError(
                f"DeepCacheConfig window start={self.start}, stop={self.stop} must satisfy 0 <= start < stop <= 1 "
                "(fractions of the denoising steps)."
            )
        if not self.power >= 1.0:
            raise InvalidArgumentError(f"DeepCacheConfig.power={self.power} must be >= 1.0 (1.0 spaces full steps evenly).")
        if self.num_steps is not None and (not isinstance(self.num_steps, int) or isinstance(self.num_steps, bool) or self.num_steps < 1):
            raise InvalidArgumentError(f"DeepCacheConfig.num_steps={self.num_steps!r} must be a positive int or None.")


# What DeepCacheConfig() leaves as None, per model family: the best measured on the denoisers trained here
# (benchmarks/caches.py, section "caches" of docs/benchmarks.md).
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "unet": {"forecast": 2, "stop": 1.0, "keep_first": 1, "keep_last": 1},
    "transformer": {"forecast": 1, "stop": 0.9, "keep_first": 0},
}


def for_family(config: DeepCacheConfig, family: Any) -> DeepCacheConfig:
    """``config`` with what it leaves as ``None`` filled in for ``family``: a :class:`torchfix.families.Family`
    (its kind's defaults, then its own), or a kind (``"unet"`` or ``"transformer"``).

    >>> for_family(DeepCacheConfig(interval=4), "transformer").stop
    0.9
    >>> for_family(DeepCacheConfig(interval=4, stop=1.0), "transformer").stop
    1.0
    """
    if isinstance(family, str):
        defaults = dict(FAMILY_DEFAULTS[family])
    else:
        defaults = {**FAMILY_DEFAULTS[family.kind], "keep_first": family.keep_first, "keep_last": family.keep_last, **family.defaults}
    unset = {k: v for k, v in defaults.items() if getattr(config, k) is None}
    return dataclasses.replace(config, **unset) if unset else config


def corrects(config: DeepCacheConfig) -> bool:
    """Whether a transformer's cached step mixes the forecast output of the cached blocks with the forecast
    residual (``sensitivity`` other than 1.0, or measured: ``None`` with a forecast). Only then does a stream
    keep the blocks' inputs beside their residuals.

    >>> corrects(DeepCacheConfig()), corrects(DeepCacheConfig(forecast=0)), corrects(DeepCacheConfig(sensitivity=1.0))
    (True, False, False)
    """
    if config.sensitivity is None:
        return config.forecast != 0
    return config.sensitivity != 1.0
