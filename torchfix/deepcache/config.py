"""DeepCache configuration and step schedule (pure: no torch, no patching).

>>> from torchfix.deepcache.config import DeepCacheConfig, full_steps
>>> sorted(full_steps(10, DeepCacheConfig(interval=3)))
[0, 3, 6, 9]
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

__all__ = ["SCHEDULES", "DeepCacheConfig", "full_steps", "is_full_step"]

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
            sharpens details at little cost.
        power: for ``nonuniform``: how strongly full steps concentrate early
            (1.0 is uniform).
        num_steps: steps per generation, for a bare UNet driven without a
            diffusers scheduler (pipelines report it themselves). Needed only by
            ``nonuniform`` and the ``start``/``stop`` window.
        keep_first, keep_last: for a diffusion transformer (SD3, Flux): how many
            blocks at the start and at the end of its block chain run on every
            step; the blocks in between are cached. Fewer kept blocks is faster
            with more error. A UNet ignores them (``branch`` plays that role).

    >>> DeepCacheConfig(interval=4, branch=1).interval
    4
    """

    interval: int = 3
    branch: int = 0
    schedule: str = "uniform"
    start: float = 0.0
    stop: float = 1.0
    power: float = 1.6
    num_steps: int | None = None
    keep_first: int = 1
    keep_last: int = 1

    def __post_init__(self) -> None:
        for name in ("interval", "branch", "keep_first", "keep_last"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"DeepCacheConfig.{name} must be an int, got {value!r}.")
        if self.interval < 1:
            raise ValueError(f"DeepCacheConfig.interval={self.interval} must be >= 1 (1 means no caching).")
        if self.branch < 0:
            raise ValueError(f"DeepCacheConfig.branch={self.branch} must be >= 0 (0 is the shallowest skip connection).")
        for name in ("keep_first", "keep_last"):
            if getattr(self, name) < 0:
                raise ValueError(f"DeepCacheConfig.{name}={getattr(self, name)} must be >= 0 (transformer blocks always run).")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"DeepCacheConfig.schedule={self.schedule!r} must be one of {SCHEDULES}.")
        if not (0.0 <= self.start < self.stop <= 1.0):
            raise ValueError(
                f"DeepCacheConfig window start={self.start}, stop={self.stop} must satisfy 0 <= start < stop <= 1 "
                "(fractions of the denoising steps)."
            )
        if not self.power >= 1.0:
            raise ValueError(f"DeepCacheConfig.power={self.power} must be >= 1.0 (1.0 spaces full steps evenly).")
        if self.num_steps is not None and (not isinstance(self.num_steps, int) or isinstance(self.num_steps, bool) or self.num_steps < 1):
            raise ValueError(f"DeepCacheConfig.num_steps={self.num_steps!r} must be a positive int or None.")


@functools.lru_cache(maxsize=256)
def full_steps(total: int, config: DeepCacheConfig) -> frozenset[int]:
    """Indices (0-based UNet calls of one generation) that run the full UNet."""
    if config.interval == 1 or total <= 1:
        return frozenset(range(total))
    lo = math.ceil(config.start * total)
    hi = max(lo + 1, math.ceil(config.stop * total))
    outside = set(range(lo)) | set(range(hi, total))
    width = hi - lo
    count = math.ceil(width / config.interval)
    if config.schedule == "uniform":
        inside = {lo + k * config.interval for k in range(count)}
    else:
        inside = set()
        for k in range(count):
            pos = lo + round(width * (k / count) ** config.power)
            while pos in inside:  # collisions early on: take the next free step
                pos += 1
            inside.add(min(pos, hi - 1))
    return frozenset(outside | inside | {0})


def is_full_step(index: int, total: int | None, config: DeepCacheConfig) -> bool:
    """Whether UNet call ``index`` of a generation runs in full.

    With ``total`` unknown (a bare UNet and no ``num_steps``) the schedule is
    uniform over an open-ended run.
    """
    if index == 0 or config.interval == 1:
        return True
    if total is None or index >= total:
        return index % config.interval == 0
    return index in full_steps(total, config)
