"""``torchfix.wrap(pipe)``: check a diffusers pipeline before it runs, run it with
the guards on, and keep every piece of torchfix state tied to the components
it was made for.

>>> import torchfix
>>> from torchfix.testing import tiny_sd15_pipeline
>>> w = torchfix.wrap(tiny_sd15_pipeline())  # doctest: +SKIP
>>> w.preflight()                            # doctest: +SKIP
[]
>>> images = w("a cat", num_inference_steps=4).images  # doctest: +SKIP
>>> pipe = w.unwrap()                        # doctest: +SKIP
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import wrapt

from . import _frames, deepcache
from ._context import current
from ._state import enabled
from .config import Settings
from .deepcache import DeepCacheConfig
from .devices import canonical
from .errors import DeviceMismatchError, DtypeMismatchError, ModelMismatchError
from .guards.dtype import kept_in_fp32

__all__ = ["Finding", "PipelineProxy", "wrap"]

log = logging.getLogger("torchfix")


@dataclass(frozen=True)
class Finding:
    """One preflight result: which component, what is wrong, and what was (or must be) done."""

    component: str
    problem: str
    fix: str
    applied: bool = False
    kind: str = "dtype"  # "dtype", "device" or "model": which error an unfixed finding raises

    def __str__(self) -> str:
        return f"{self.component}: {self.problem} — {'fixed: ' if self.applied else 'to fix: '}{self.fix}"


def _modules(pipe: Any) -> dict[str, torch.nn.Module]:
    comps = getattr(pipe, "components", None)
    if not isinstance(comps, dict):
        raise TypeError(f"torchfix.wrap: {type(pipe).__name__} has no .components; wrap a diffusers DiffusionPipeline.")
    return {name: c for name, c in comps.items() if isinstance(c, torch.nn.Module)}


def _has_accelerate_hook(module: torch.nn.Module) -> bool:
    # accelerate's offload/device_map hooks move weights themselves; their devices are theirs to manage.
    return any(hasattr(m, "_hf_hook") for m in module.modules())


def _layerwise_cast(module: torch.nn.Module) -> bool:
    registry = getattr(module, "_diffusers_hook", None)
    hooks = getattr(registry, "hooks", None) or getattr(registry, "_hooks", None) or {}
    return any("layerwise_casting" in str(name) for name in hooks)


def _dominant_dtype(modules: dict[str, torch.nn.Module]) -> torch.dtype | None:
    counts: Counter[torch.dtype] = Counter()
    for m in modules.values():
        for p in m.parameters():
            if p.is_floating_point() and p.device.type != "meta":
                counts[p.dtype] += p.numel()
    return counts.most_common(1)[0][0] if counts else None


def _stray_dtype(name: str, model: torch.nn.Module, target: torch.dtype) -> Iterator[tuple[str, torch.nn.Module, torch.dtype, str | None]]:
    """Submodules whose own parameters are floating and not ``target``; with the reason to keep each, if any."""
    force_upcast = bool(getattr(getattr(model, "config", None), "force_upcast", False))
    for path, sub in model.named_modules():
        own = [p for p in sub.parameters(recurse=False) if p.is_floating_point()]
        dtypes = {p.dtype for p in own}
        if not own or dtypes == {target}:
            continue
        dtype = next(iter(dtypes - {target}))
        reason = None
        if dtype == torch.float32 and kept_in_fp32(model, path):
            reason = f"listed in {type(model).__name__}._keep_in_fp32_modules"
        elif force_upcast and dtype == torch.float32:
            reason = "the VAE's config.force_upcast keeps it in float32 for decoding"
        elif _layerwise_cast(sub) or _layerwise_cast(model):
            reason = "diffusers layerwise casting stores it in another dtype on purpose"
        yield (f"{name}.{path}" if path else name), sub, dtype, reason


class PipelineProxy(wrapt.ObjectProxy):
    """A diffusers pipeline with torchfix around every call. ``isinstance`` still holds;
    attributes and methods pass through; the pipeline class is never modified."""

    def __init__(
        self, pipe: Any, *, settings: Settings | None, dtype: torch.dtype | None, device: Any, deepcache_config: DeepCacheConfig | None
    ):
        super().__init__(pipe)
        self._self_settings = settings
        self._self_dtype = dtype
        self._self_device = canonical(device) if device is not None else None
        self._self_deepcache = deepcache_config
        self._self_fingerprint: dict[str, int] | None = None
        self._self_findings: list[Finding] = []
        self._self_named: list[torch.nn.Module] = []
        self._self_cached_unet: torch.nn.Module | None = None

    # --- preflight -------------------------------------------------------------------------

    def _fingerprint(self) -> dict[str, int]:
        return {name: id(c) for name, c in _modules(self.__wrapped__).items()}

    def preflight(self) -> list[Finding]:
        """Check dtypes, devices, meta weights and conditioning widths; fix what mode ``fix`` may.

        Runs before the first call and again whenever a component was replaced.
        Returns every finding (component, problem, fix, applied).
        """
        pipe = self.__wrapped__
        mode = self._mode()
        modules = _modules(pipe)
        findings: list[Finding] = []
        self._forget_components()
        for name, module in modules.items():
            _frames.name_root(module, name)
            self._self_named.append(module)

        # meta weights: never loaded (offload hooks keep meta weights on purpose)
        for name, module in modules.items():
            if _has_accelerate_hook(module):
                continue
            meta = [n for n, p in module.named_parameters() if p.device.type == "meta"]
            if meta:
                more = f" and {len(meta) - 3} more" if len(meta) > 3 else ""
                names = ", ".join(f"{name}.{n}" for n in meta[:3])
                fix = "load the weights (from_pretrained / load_state_dict(..., assign=True)) before running"
                findings.append(Finding(name, f"weights on the meta device (never loaded): {names}{more}", fix, kind="device"))

        # devices
        placed: dict[str, torch.device] = {}
        for name, module in modules.items():
            if _has_accelerate_hook(module):
                continue
            devs = {canonical(p.device) for p in module.parameters() if p.device.type != "meta"}
            if len(devs) == 1:
                placed[name] = next(iter(devs))
        if len(set(placed.values())) > 1:
            where = ", ".join(f"{n} on {d}" for n, d in placed.items())
            if self._self_device is not None:
                for n, d in placed.items():
                    if d != self._self_device:
                        modules[n].to(self._self_device)
                findings.append(
                    Finding("pipeline", f"components on different devices: {where}", f"moved to {self._self_device}", True, "device")
                )
            else:
                fix = "move the pipeline with pipe.to(device), or wrap(pipe, device=...)"
                findings.append(Finding("pipeline", f"components on different devices: {where}", fix, kind="device"))

        # dtypes
        target = self._self_dtype or _dominant_dtype(modules)
        if target is not None:
            for name, module in modules.items():
                for path, sub, dtype, reason in _stray_dtype(name, module, target):
                    if reason is not None:
                        findings.append(Finding(path, f"{dtype} in a {target} pipeline", f"kept: {reason}", True))
                    elif mode == "strict" or mode == "off":
                        findings.append(Finding(path, f"{dtype} in a {target} pipeline", f"cast it once: {path}.to({target})"))
                    else:
                        sub.to(target)
                        findings.append(Finding(path, f"was {dtype} in a {target} pipeline", f"cast to {target} once, up front", True))

        findings += self._conditioning()
        self._self_findings = findings
        self._self_fingerprint = self._fingerprint()
        for f in findings:
            log.info("torchfix preflight: %s", f)
        return list(findings)

    @property
    def findings(self) -> list[Finding]:
        """The findings of the last preflight (it runs before the first call)."""
        return list(self._self_findings)

    def _conditioning(self) -> list[Finding]:
        pipe = self.__wrapped__
        unet = getattr(pipe, "unet", None)
        if unet is None or not hasattr(unet, "config"):
            return []
        expected = unet.config.cross_attention_dim
        widths = [(n, getattr(getattr(pipe, n, None), "config", None)) for n in ("text_encoder", "text_encoder_2")]
        widths = [(n, c.hidden_size) for n, c in widths if c is not None and hasattr(c, "hidden_size")]
        findings = []
        if widths and isinstance(expected, int) and sum(w for _, w in widths) != expected:
            total = " + ".join(f"{n} {w}" for n, w in widths)
            width = sum(w for _, w in widths)
            problem = f"text encoder output width {total} = {width} does not match unet.config.cross_attention_dim={expected}"
            fix = "these components come from different models: load the text encoder(s) and UNet of one model"
            findings.append(Finding("unet", problem, fix, kind="model"))
        if unet.config.addition_embed_type == "text_time" and getattr(pipe, "text_encoder_2", None) is None:
            problem = "addition_embed_type='text_time' needs pooled text embeddings, but there is no text_encoder_2"
            findings.append(Finding("unet", problem, "use an SDXL pipeline with both text encoders", kind="model"))
        return findings

    def _mode(self) -> str:
        if self._self_settings is not None:
            return self._self_settings.mode
        outer = current()
        return outer.mode if outer.active else "fix"

    # --- calls -----------------------------------------------------------------------------

    def _check_embeddings(self, kwargs: dict[str, Any]) -> None:
        unet = getattr(self.__wrapped__, "unet", None)
        if unet is None:
            return
        expected = unet.config.cross_attention_dim
        for key in ("prompt_embeds", "negative_prompt_embeds"):
            emb = kwargs.get(key)
            if isinstance(emb, torch.Tensor) and emb.shape[-1] != expected:
                likely = {2048: "SDXL", 768: "SD1.5", 1024: "SD2.x"}.get(emb.shape[-1], "a different pipeline")
                raise ModelMismatchError(
                    f"torchfix: {key} has width {emb.shape[-1]} (shape {tuple(emb.shape)}), but this pipeline's UNet "
                    f"({type(unet).__name__}) expects cross_attention_dim={expected}. The embeddings were likely made by "
                    f"another model (e.g. {likely}); "
                    "encode the prompt again with this pipeline (pipe.encode_prompt) or pass prompt= instead."
                )
        if unet.config.addition_embed_type == "text_time":
            time_dim = unet.config.addition_time_embed_dim or 0
            pooled_expected = unet.config.projection_class_embeddings_input_dim - 6 * time_dim
            for key in ("pooled_prompt_embeds", "negative_pooled_prompt_embeds"):
                emb = kwargs.get(key)
                if isinstance(emb, torch.Tensor) and emb.shape[-1] != pooled_expected:
                    raise ModelMismatchError(
                        f"torchfix: {key} has width {emb.shape[-1]}, but this UNet's text_time conditioning expects "
                        f"{pooled_expected} (projection_class_embeddings_input_dim={unet.config.projection_class_embeddings_input_dim} "
                        f"minus 6 × addition_time_embed_dim={time_dim}). The embeddings were likely made by another model; "
                        "encode the prompt again with this pipeline."
                    )

    def _sync_state(self) -> None:
        if self._self_fingerprint != self._fingerprint():
            self.preflight()
        unet = getattr(self.__wrapped__, "unet", None)
        if self._self_deepcache is not None and unet is not self._self_cached_unet:
            if self._self_cached_unet is not None:
                deepcache.remove(self._self_cached_unet)
            deepcache.apply(self.__wrapped__, self._self_deepcache)
            self._self_cached_unet = unet
        if self._self_cached_unet is not None:
            deepcache.new_call(self._self_cached_unet)

    def _raise_on_findings(self) -> None:
        blocking = [f for f in self._self_findings if not f.applied]
        if not blocking:
            return
        text = "\n".join(f"  - {f}" for f in blocking)
        kinds = {f.kind for f in blocking}
        error = DeviceMismatchError if "device" in kinds else ModelMismatchError if "model" in kinds else DtypeMismatchError
        raise error(f"torchfix preflight of {type(self.__wrapped__).__name__} found:\n{text}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._sync_state()
        self._raise_on_findings()
        self._check_embeddings(kwargs)
        s = self._self_settings
        with enabled(
            mode=None if s is None else s.mode,
            guards=None if s is None else tuple(s.guards),
            dtype=self._self_dtype,
            device_policy=None if s is None else s.device_policy,
        ):
            return self.__wrapped__(*args, **kwargs)

    # --- undo ------------------------------------------------------------------------------

    def _forget_components(self) -> None:
        for module in self._self_named:
            _frames.name_root(module, None)
        self._self_named = []

    def unwrap(self) -> Any:
        """Remove everything torchfix attached (DeepCache, names, caches, references); return the pipeline."""
        pipe = self.__wrapped__
        if self._self_cached_unet is not None:
            deepcache.remove(self._self_cached_unet)
            self._self_cached_unet = None
        self._forget_components()
        self._self_findings = []
        self._self_fingerprint = None
        return pipe

    def __repr__(self) -> str:
        return f"<torchfix.wrap of {self.__wrapped__!r}>"


def wrap(
    pipe: Any,
    *,
    mode: str | None = None,
    deepcache: DeepCacheConfig | None = None,
    dtype: torch.dtype | str | None = None,
    device: Any = None,
) -> PipelineProxy:
    """Wrap a diffusers pipeline: preflight before the first call, guards on during every call.

    Args:
        pipe: a diffusers ``DiffusionPipeline``.
        mode: ``fix``, ``warn``, ``strict`` or ``off`` for this pipeline's calls (default: the
            settings in force outside, else ``fix``).
        deepcache: a :class:`torchfix.DeepCacheConfig` to apply DeepCache to the UNet.
        dtype: the pipeline's dtype; stray submodules are cast to it (default: the dominant dtype).
        device: align components on this device when they differ.

    >>> import torchfix
    >>> # w = torchfix.wrap(pipe, deepcache=torchfix.DeepCacheConfig(interval=3)); w("a cat")
    """
    if isinstance(pipe, PipelineProxy):
        pipe = pipe.unwrap()
    settings = None if mode is None else Settings(mode=mode, dtype=dtype)
    parsed_dtype = Settings(dtype=dtype).dtype if dtype is not None else None
    if deepcache is not None and not isinstance(deepcache, DeepCacheConfig):
        raise TypeError(f"torchfix.wrap: deepcache must be a torchfix.DeepCacheConfig, got {type(deepcache).__name__}.")
    _modules(pipe)  # clear error for non-pipelines
    return PipelineProxy(pipe, settings=settings, dtype=parsed_dtype, device=device, deepcache_config=deepcache)
