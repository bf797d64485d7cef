"""torchfix in ComfyUI: nodes that scope the guards to one MODEL, cache its denoiser at any resolution, and show
what was fixed. Loaded by the drop-in folder ``comfyui-torchfix/`` (its ``__init__.py`` re-exports
:data:`NODE_CLASS_MAPPINGS`); importing this module changes nothing in the process.

Each node clones the MODEL it gets (ComfyUI's ``ModelPatcher.clone``: the weights are shared, the options are
not) and adds wrappers to the clone through ComfyUI's own wrapper system, so the MODEL it was given, and every
other node's, runs exactly as before:

- **torchfix guards**: each denoiser call of the clone runs inside ``torchfix.enabled(mode)`` (``APPLY_MODEL``);
  what was fixed in a sampling run is logged at its end and kept for the report node.
- **torchfix cache**: DeepCache on the clone's diffusion model, for every ComfyUI model class the family registry
  knows (:func:`torchfix.families.supported`, host ``comfyui``) or reads off its code (:func:`torchfix.families.infer`);
  a class refused by name (:func:`torchfix.families.refuse`) is refused when the node runs, with the reason. Each
  sampling run (``OUTER_SAMPLE``) is a new generation whose step count comes from its sigmas; ComfyUI's cond/uncond passes
  (``transformer_options["cond_or_uncond"]``) keep separate caches; a call with ControlNet residuals runs in full;
  a new resolution, frame count or batch is a fresh cache. The cache engages only inside this clone's sampling
  (a scope token): the shared model outside it runs untouched.
- **torchfix report**: the guards' report of the last sampling run, as text.

>>> sorted(NODE_CLASS_MAPPINGS)
['TorchfixCache', 'TorchfixGuards', 'TorchfixReport']
"""

from __future__ import annotations

import logging
from typing import Any

from . import _context, deepcache
from ._report import Report, report
from ._state import enabled, installed
from .deepcache import DeepCacheConfig
from .deepcache.installed import scoped as deepcache_scope
from .errors import InvalidArgumentError

__all__ = [
    "NODE_CLASS_MAPPINGS",
    "NODE_DISPLAY_NAME_MAPPINGS",
    "CacheHolder",
    "GuardHolder",
    "TorchfixCache",
    "TorchfixGuards",
    "TorchfixReport",
    "report_text",
]

log = logging.getLogger("torchfix")

CATEGORY = "torchfix"
WRAPPER_KEYS = {"guards": "torchfix_guards", "cache": "torchfix_cache"}  # the keys of our wrappers on a clone
MODES = ("fix", "warn", "strict")


def _wrappers() -> Any:
    from comfy.patcher_extension import WrappersMP

    return WrappersMP


def _holders(model: Any) -> dict[str, Any]:
    """The holders of the torchfix nodes on ``model``, found through their wrappers (a clone made downstream, by a
    LoRA loader say, copies the wrappers and so keeps the holders; ``model_options`` is deep-copied instead)."""
    outer = getattr(model, "wrappers", {}).get("outer_sample", {})
    found = {}
    for what, key in WRAPPER_KEYS.items():
        wrappers = outer.get(key) or []
        if wrappers:
            found[what] = wrappers[-1].__self__
    return found


def _diffusion_model(guider: Any) -> Any:
    return guider.model_patcher.model.diffusion_model


class GuardHolder:
    """What one guards node put on its clone: the mode, and the report of the clone's last sampling run."""

    def __init__(self, mode: str) -> None:
        if mode not in MODES:
            raise InvalidArgumentError(f"torchfix guards node: mode must be one of {', '.join(MODES)}, got {mode!r}.")
        self.mode = mode
        self.last = Report()
        self.calls = 0
        self._start = 0

    def apply_model(self, executor: Any, *args: Any, **kwargs: Any) -> Any:
        """``APPLY_MODEL`` wrapper: this denoiser call with torchfix's guards on, in this node's mode."""
        self.calls += 1
        with enabled(self.mode):
            return executor(*args, **kwargs)

    def outer_sample(self, executor: Any, *args: Any, **kwargs: Any) -> Any:
        """``OUTER_SAMPLE`` wrapper: collects what the guards did in this sampling run, and logs it at its end."""
        self.calls, self._start = 0, len(report().events)
        try:
            with installed():  # the wrappers stay in for the run; each denoiser call switches them on for itself
                return executor(*args, **kwargs)
        finally:
            self.last = Report()
            for event in report().events[self._start :]:
                self.last.add(event)
            log.info("torchfix guards (%s) over %d denoiser call(s): %s", self.mode, self.calls, self.text())

    def text(self) -> str:
        """The last sampling run's report: one row per component and cause, or that nothing needed a fix."""
        if not len(self.last):
            return f"nothing to fix ({self.calls} denoiser call(s) guarded, mode {self.mode})"
        return self.last.summary()


class CacheHolder:
    """What one cache node put on its clone: the config, the token that scopes the cache to the clone's sampling,
    and what the last run did."""

    def __init__(self, config: DeepCacheConfig) -> None:
        self.config = config
        self.token = object()
        self.stats: dict[str, Any] = {"applied": False}

    def outer_sample(self, executor: Any, *args: Any, **kwargs: Any) -> Any:
        """``OUTER_SAMPLE`` wrapper (``args``: noise, latent, sampler, sigmas, ...): a new generation with the run's
        step count, cached only while this clone samples."""
        model = _diffusion_model(executor.class_obj)
        sigmas = args[3] if len(args) > 3 else kwargs.get("sigmas")
        state = deepcache.state_of(model)
        if state is None or state.scope is not self.token:
            deepcache.apply(model, self.config, scope=self.token)
        deepcache.new_call(model, timesteps=None if sigmas is None else sigmas[:-1])
        try:
            with deepcache_scope(self.token):
                return executor(*args, **kwargs)
        finally:
            self.stats = deepcache.stats(model)
            last = self.stats.get("last_call", {})
            log.info(
                "torchfix cache (%s): %s full and %s cached denoiser call(s)",
                self.stats.get("family"),
                last.get("full_steps"),
                last.get("cached_steps"),
            )


class _ModelNode:
    """A node that returns a clone of its MODEL carrying torchfix's wrappers (ComfyUI's node class convention)."""

    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"

    @staticmethod
    def _clone(model: Any, what: str, wrappers: dict[str, Any]) -> tuple[Any]:
        """``model.clone()`` with ``wrappers`` (``{"APPLY_MODEL": fn, ...}``) under our key for ``what``; a second
        torchfix node of the same kind replaces the first."""
        clone, key, kinds = model.clone(), WRAPPER_KEYS[what], _wrappers()
        for kind in ("APPLY_MODEL", "OUTER_SAMPLE"):
            clone.remove_wrappers_with_key(getattr(kinds, kind), key)
        for kind, wrapper in wrappers.items():
            clone.add_wrapper_with_key(getattr(kinds, kind), key, wrapper)
        return (clone,)


class TorchfixGuards(_ModelNode):
    """Node: torchfix's guards (strides, dtypes, devices) on this MODEL's denoiser calls only."""

    DESCRIPTION = (
        "Runs this model's denoiser calls with torchfix's guards: a call torch would reject (a layer left in another "
        "dtype, a non-contiguous view a backend mishandles, operands on two devices) is fixed (fix), fixed and warned "
        "about (warn) or refused with a clear error (strict); whatever torch accepts runs unchanged. The report goes "
        "to the console after each run and to the torchfix report node."
    )

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {"required": {"model": ("MODEL",), "mode": (list(MODES), {"default": "fix"})}}

    def patch(self, model: Any, mode: str) -> tuple[Any]:
        holder = GuardHolder(mode)
        return self._clone(model, "guards", {"APPLY_MODEL": holder.apply_model, "OUTER_SAMPLE": holder.outer_sample})


class TorchfixCache(_ModelNode):
    """Node: torchfix's resolution-tolerant DeepCache on this MODEL's denoiser."""

    DESCRIPTION = (
        "Skips the deep blocks of the denoiser on most steps and reuses what they computed at the last full steps, "
        "forecast to this step. Works at any resolution and frame count (a new size is a fresh cache), keeps cond and "
        "uncond apart, runs ControlNet steps in full, and refuses a model whose blocks it does not know. interval: one "
        "full step in this many; threshold > 0: refresh whenever the features moved more than this instead; branch: "
        "the UNet's skip connection the cached steps keep (SD1.x/SDXL only)."
    )

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {
            "required": {
                "model": ("MODEL",),
                "interval": ("INT", {"default": 3, "min": 1, "max": 16}),
                "threshold": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 10.0, "step": 0.01}),
                "branch": ("INT", {"default": 0, "min": 0, "max": 11}),
            }
        }

    def patch(self, model: Any, interval: int, threshold: float, branch: int) -> tuple[Any]:
        config = DeepCacheConfig(interval=interval, threshold=threshold if threshold > 0 else None, branch=branch)
        diffusion_model = model.model.diffusion_model
        deepcache.check(diffusion_model, config)  # an unknown model is refused here, with the families it knows
        return self._clone(model, "cache", {"OUTER_SAMPLE": CacheHolder(config).outer_sample})


class TorchfixReport:
    """Node: what torchfix did in the last sampling run of a MODEL (give it the sampler's LATENT so it runs after)."""

    CATEGORY = CATEGORY
    RETURN_TYPES = ("STRING",)
    FUNCTION = "report"
    OUTPUT_NODE = True
    DESCRIPTION = "The torchfix guards' report and the cache's counts for the last sampling run of this model, as text."

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {"required": {"model": ("MODEL",), "samples": ("LATENT",)}}

    def report(self, model: Any, samples: Any) -> dict[str, Any]:
        text = report_text(model)
        return {"ui": {"text": [text]}, "result": (text,)}


def report_text(model: Any) -> str:
    """What the torchfix nodes on ``model`` (a ModelPatcher) did in its last sampling run, and a first line where
    torchfix is on for the whole process (not the nodes' doing: an ``import torchfix`` or ``torchfix.enable()`` in
    some other code of this process), since then every workflow runs guarded, this model's with or without a node.

    >>> report_text(model)  # doctest: +SKIP
    'cache (comfy-unet): 2 full, 4 cached denoiser call(s)'
    """
    holders = _holders(model)
    lines = []
    if "guards" in holders:
        lines.append("guards: " + holders["guards"].text())
    if "cache" in holders:
        stats = holders["cache"].stats
        last = stats.get("last_call", {})
        lines.append(
            f"cache ({stats.get('family')}): {last.get('full_steps', 0)} full, {last.get('cached_steps', 0)} cached denoiser call(s)"
            if stats.get("applied")
            else "cache: not run yet"
        )
    lines = lines or ["no torchfix node on this model"]
    everywhere = _context.get_global()
    if everywhere.active:
        lines.insert(0, f"torchfix is on process-wide ({everywhere.describe()}): every workflow in this process runs guarded")
    return "\n".join(lines)


NODE_CLASS_MAPPINGS = {"TorchfixGuards": TorchfixGuards, "TorchfixCache": TorchfixCache, "TorchfixReport": TorchfixReport}
NODE_DISPLAY_NAME_MAPPINGS = {"TorchfixGuards": "torchfix guards", "TorchfixCache": "torchfix cache", "TorchfixReport": "torchfix report"}
