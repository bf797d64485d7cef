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

import functools
import inspect
import logging
import threading
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import wrapt

from . import _context, _frames, _kept, _model, _warn, deepcache, preflight
from ._context import current
from ._report import FixEvent, report
from ._state import enabled
from ._text import dtype_name as _dt
from .config import Settings
from .deepcache import DeepCacheConfig
from .deepcache import check as deepcache_check
from .deepcache.installed import scoped as deepcache_scope
from .devices import canonical, unusable_reason
from .errors import (
    DeviceMismatchError,
    DtypeMismatchError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    InvalidCallError,
    ModelMismatchError,
    TorchfixWarning,
    UnsupportedModelError,
)
from .families import DENOISERS, config_value
from .families.entries import LIKELY
from .guards import dtype as dtype_guard
from .guards.plan import Finding
from .patches import libraries
from .patches.instance import AttrHandle, HookHandle, TensorHandle, add_hook, set_attr, swap_tensor
from .runtime import finite

__all__ = ["Finding", "PipelineProxy", "wrap"]

log = logging.getLogger("torchfix")


_finding = preflight.finding


def _modules(pipe: Any) -> dict[str, torch.nn.Module]:
    comps = getattr(pipe, "components", None)
    if not isinstance(comps, dict):
        raise InvalidArgumentTypeError(f"torchfix.wrap: {type(pipe).__name__} has no .components; wrap a diffusers DiffusionPipeline.")
    return {name: c for name, c in comps.items() if isinstance(c, torch.nn.Module)}


def _has_accelerate_hook(module: torch.nn.Module) -> bool:
    # accelerate's offload/device_map hooks move weights themselves; their devices are theirs to manage.
    return any(hasattr(m, "_hf_hook") for m in module.modules())


_POOLED_KEYS = ("pooled_prompt_embeds", "negative_pooled_prompt_embeds")


def _component_dtypes(modules: dict[str, torch.nn.Module]) -> list[Finding]:
    """Components in another dtype than the denoiser: information, never an error. Where torch rejects a mix
    inside one, it runs in the dtype :func:`torchfix.guards.dtype.component_dtype` gives (the pipeline's, unless
    kept higher on purpose, as a VAE with ``force_upcast``); whatever torch accepts in it runs as it is."""
    dtypes = {n: d for n, m in modules.items() if (d := _model.model_dtype(m)) is not None}
    main = next((n for n in DENOISERS if n in dtypes), None)
    if main is None or len(set(dtypes.values())) < 2:
        return []
    findings = []
    for name, dt in dtypes.items():
        if name in DENOISERS or dt == dtypes[main]:
            continue
        problem = f"{name} is {_dt(dt)}, {main} is {_dt(dtypes[main])}"
        runs = dtype_guard.component_dtype(dt, dtypes[main], kept_high=_model.kept_high(modules[name]))
        if runs == dt:
            fix = f"nothing to do: {name} is kept in {_dt(dt)} on purpose; what it is handed is cast to {_dt(dt)} where torch rejects it"
        else:
            fix = (
                f"nothing to do: where torch rejects a mix in {name}, it runs in the pipeline's dtype {_dt(runs)} (wrap() casts "
                f"those layers once, keeping the originals); to load it so: {name} = ...from_pretrained(..., "
                f"torch_dtype=torch.{_dt(runs)}) or pipe.{name}.to(torch.{_dt(runs)})"
            )
        findings.append(Finding("dtype", problem, fix, advisory=True, component=name))
    return findings


# What a ControlNet hands the denoiser, by the denoiser's keyword (UNet, SD3/Flux transformers).
_HANDOVER_KWARGS = (
    "down_block_additional_residuals",
    "mid_block_additional_residual",
    "down_intrinsic_residuals",
    "block_controlnet_hidden_states",
    "controlnet_block_samples",
    "controlnet_single_block_samples",
)


def _cast_handover(value: Any, receiver: torch.dtype | None, seen: list[torch.Tensor]) -> Any:
    """``value`` (a tensor, or a tuple/list of them) with each floating tensor cast where
    :func:`torchfix.guards.dtype.handover` says so; the tensors it cast go to ``seen``."""
    if isinstance(value, torch.Tensor):
        target = dtype_guard.handover(receiver, value.dtype)
        if target is None:
            return value
        seen.append(value)
        return value.to(target)
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_handover(v, receiver, seen) for v in value)
    return value


_LOCKS: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def _call_lock(pipe: Any) -> threading.RLock:
    """The one lock of ``pipe`` (shared by every wrapper of it; re-entrant: a callback may call it again)."""
    with _LOCKS_GUARD:
        try:
            lock = _LOCKS.get(pipe)
            if lock is None:
                lock = _LOCKS[pipe] = threading.RLock()
        except TypeError:  # not hashable or not weakly referable: its own attribute
            lock = vars(pipe).setdefault("_torchfix_call_lock", threading.RLock())
        return lock


_POSITIVE = {
    "height": "a multiple of the VAE's scale (e.g. 512)",
    "width": "a multiple of the VAE's scale (e.g. 512)",
    "num_frames": "a frame count the video pipeline takes (e.g. 49)",
    "num_images_per_prompt": "1 or more",
}


def _check_arguments(pipeline: str, kwargs: dict[str, Any]) -> None:
    """Arguments no pipeline can make a picture from, refused before step 0 (diffusers 0.42.1 runs ``height=0``
    silently, runs ``num_inference_steps=-1`` without denoising, and divides by zero in DDIM at 0).

    Raises:
        InvalidCallError: a size, frame or image count below 1, or fewer than 1 inference step where no
            ``timesteps``/``sigmas`` list sets them; the message names the argument, its value and what it must be.

    >>> _check_arguments("StableDiffusionPipeline", {"height": 512, "num_inference_steps": 20})
    """
    for name, example in _POSITIVE.items():
        value = kwargs.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise InvalidCallError(f"torchfix: {pipeline}({name}={value}): {name} must be at least 1, {example}.")
    steps = kwargs.get("num_inference_steps")
    given = any(kwargs.get(k) is not None for k in ("timesteps", "sigmas"))
    if isinstance(steps, int) and not isinstance(steps, bool) and steps < 1 and not given:
        raise InvalidCallError(
            f"torchfix: {pipeline}(num_inference_steps={steps}): at least 1 step is needed to denoise anything "
            "(e.g. 20-50; or pass a timesteps=/sigmas= list)."
        )


def _above_one(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 1


def _unet_guidance(pipe: Any, call: dict[str, Any]) -> str | None:
    """SD/SDXL: classifier-free guidance (``guidance_scale`` > 1 on a UNet without ``time_cond_proj_dim``) with no
    ``negative_prompt_embeds`` encodes the negative prompt, unless SDXL's ``force_zeros_for_empty_prompt`` makes zeros
    of a missing ``negative_prompt``."""
    scale = call.get("guidance_scale")
    if not _above_one(scale) or config_value(getattr(pipe, "unet", None), "time_cond_proj_dim") is not None:
        return None
    if call.get("negative_prompt_embeds") is not None:
        return None
    if call.get("negative_prompt") is None and config_value(pipe, "force_zeros_for_empty_prompt") is True:
        return None
    return f"guidance_scale={scale} (classifier-free guidance) and no negative_prompt_embeds"


def _sd3_guidance(pipe: Any, call: dict[str, Any]) -> str | None:
    """SD3: classifier-free guidance (``guidance_scale`` > 1) with no ``negative_prompt_embeds`` encodes the negative
    prompt ("" where none is given)."""
    scale = call.get("guidance_scale")
    if _above_one(scale) and call.get("negative_prompt_embeds") is None:
        return f"guidance_scale={scale} (classifier-free guidance) and no negative_prompt_embeds"
    return None


def _flux_true_cfg(pipe: Any, call: dict[str, Any]) -> str | None:
    """Flux: true CFG (``true_cfg_scale`` > 1 with a negative prompt or negative embeddings) with no
    ``negative_prompt_embeds`` encodes the negative prompt; its ``guidance_scale`` is an input of the model, not CFG."""
    scale, negative = call.get("true_cfg_scale"), call.get("negative_prompt")
    both = call.get("negative_prompt_embeds") is not None and call.get("negative_pooled_prompt_embeds") is not None
    if _above_one(scale) and (negative is not None or both) and call.get("negative_prompt_embeds") is None:
        return f"true_cfg_scale={scale} (true CFG), negative_prompt={negative!r} and no negative_prompt_embeds"
    return None


@dataclass(frozen=True)
class _Encoding:
    """When one kind of diffusers pipeline runs its text encoders in a call (read off its ``encode_prompt`` and
    ``__call__`` in diffusers 0.42.1), and what it needs then.

    Args:
        pipelines: pipeline class names (matched on the class and its bases).
        needs: the tokenizers and text encoders an encoding uses.
        embeds: what a call passes instead of ``prompt=`` (each with its ``negative_`` twin under guidance).
        negative: ``(pipe, bound call) -> why`` the call encodes a negative prompt too, or ``None``.
    """

    pipelines: tuple[str, ...]
    needs: tuple[str, ...]
    embeds: tuple[str, ...]
    negative: Callable[[Any, dict[str, Any]], str | None]


_CLIP_T5 = ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2")
_ENCODINGS = (
    _Encoding(
        ("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline", "StableDiffusionXLControlNetPipeline"),
        ("tokenizer_2", "text_encoder_2"),  # text_encoder may be None (the refiner layout): the second encoder alone
        ("prompt_embeds", "pooled_prompt_embeds"),
        _unet_guidance,
    ),
    _Encoding(
        ("StableDiffusionPipeline", "StableDiffusionImg2ImgPipeline", "StableDiffusionControlNetPipeline"),
        ("tokenizer", "text_encoder"),
        ("prompt_embeds",),
        _unet_guidance,
    ),
    _Encoding(
        ("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline"),
        _CLIP_T5,  # the T5 (text_encoder_3) may be None: SD3 pads with zeros
        ("prompt_embeds", "pooled_prompt_embeds"),
        _sd3_guidance,
    ),
    _Encoding(
        ("FluxPipeline", "FluxImg2ImgPipeline", "FluxKontextPipeline"),
        _CLIP_T5,
        ("prompt_embeds", "pooled_prompt_embeds"),
        _flux_true_cfg,
    ),
)


@functools.lru_cache(maxsize=64)
def _signature(cls: type) -> inspect.Signature | None:
    try:
        return inspect.signature(cls.__call__)
    except (TypeError, ValueError):
        return None


def _bound(pipe: Any, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The call's arguments by name, defaults filled in; ``None`` where they do not bind (diffusers' own error)."""
    signature = _signature(type(pipe))
    if signature is None:
        return None
    try:
        bound = signature.bind_partial(pipe, *args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def _listed(names: list[str] | tuple[str, ...], last: str) -> str:
    """``a, b and c`` (``last``: the word before the last name)."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {last} {names[-1]}"


def _missing_encoder(pipe: Any, args: tuple, kwargs: dict[str, Any]) -> str | None:
    """Why this call would fail inside ``encode_prompt`` for want of a tokenizer or text encoder the pipeline was loaded
    without (``text_encoder_2=None`` to save memory), or ``None``: it encodes a prompt only where ``prompt=`` is given
    without ``prompt_embeds``, or where guidance needs a negative prompt it is not given embeddings of
    (:data:`_ENCODINGS`). A pipeline without its encoders runs calls that pass precomputed embeddings, as diffusers does.
    """
    names = [c.__name__ for c in type(pipe).__mro__]
    rule = next((r for n in names for r in _ENCODINGS if n in r.pipelines), None)
    if rule is None:
        return None
    missing = [n for n in rule.needs if getattr(pipe, n, None) is None]
    if not missing:
        return None
    call = _bound(pipe, args, kwargs)
    if call is None:
        return None
    pipeline = type(pipe).__name__
    lost, uses = _listed(missing, "or"), _listed(rule.needs, "and")
    loaded = ", ".join(f"{n}=None" for n in missing)
    if call.get("prompt") is not None and call.get("prompt_embeds") is None:
        passed = " and ".join(f"{e}=" for e in rule.embeds)
        return (
            f"torchfix: {pipeline}(prompt={call['prompt']!r}) would encode the prompt with {uses}, but the pipeline has no "
            f"{lost} (it was loaded with {loaded}): the call would fail inside encode_prompt. Pass {passed} instead of prompt= "
            f"(made by pipe.encode_prompt with the text encoders loaded), or load the pipeline with its {_listed(missing, 'and')}."
        )
    why = rule.negative(pipe, call)
    if why is None:
        return None
    passed = " and ".join(f"negative_{e}=" for e in rule.embeds)
    off = "true_cfg_scale=1 (no true CFG)" if rule.negative is _flux_true_cfg else "guidance_scale=1 (no guidance)"
    zeros = config_value(pipe, "force_zeros_for_empty_prompt") is True and call.get("negative_prompt") is not None
    leave = ", leave negative_prompt out (force_zeros_for_empty_prompt then makes zeros of it)" if zeros else ""
    return (
        f"torchfix: {pipeline} with {why} would encode the negative prompt with {uses}, but the pipeline has no {lost} "
        f"(it was loaded with {loaded}): the call would fail inside encode_prompt. Pass {passed} as well{leave}, or {off}."
    )


def _resolution_error(pipe: Any, kwargs: dict[str, Any]) -> str | None:
    """Why an SD3-family or Flux-ControlNet call's height/width would fail deep inside, or ``None``.

    SD3's latents are cut into ``patch_size`` patches and Flux's packed in 2×2: a size that is not a
    multiple of ``vae_scale_factor × patch`` fails with ``size of tensor a (9) must match the size of
    tensor b (8)`` in the ControlNet pipelines, which check only ``% 8`` (SD3) or resize the latents
    but not the control image (Flux). The plain pipelines are left to diffusers: SD3's refuses such a
    size itself with a clear error, Flux's resizes.
    """
    transformer = getattr(pipe, "transformer", None)
    scale = getattr(pipe, "vae_scale_factor", None)
    if not hasattr(transformer, "config") or not isinstance(scale, int):
        return None
    if getattr(pipe, "controlnet", None) is None:
        return None  # the plain SD3 and Flux pipelines check or resize sizes themselves (diffusers 0.42.1), clearly
    found = preflight.denoiser(pipe)
    packed = found[1].packed if found is not None else 0  # Flux packs 2×2 latent pixels into a token
    patch = packed or transformer.config.get("patch_size", 1) or 1
    multiple = scale * patch
    bad = {k: v for k in ("height", "width") if isinstance(v := kwargs.get(k), int) and v % multiple}
    if not bad:
        return None
    sizes = ", ".join(f"{k}={v} (use {v // multiple * multiple} or {(v // multiple + 1) * multiple})" for k, v in bad.items())
    return (
        f"torchfix: {sizes} is not a multiple of {multiple} (vae_scale_factor {scale} × patch {patch}) for "
        f"{type(pipe).__name__}: the latents would not split into patches and the call would fail deep inside "
        "(`size of tensor a must match the size of tensor b`). Pass a height and width that are multiples of "
        f"{multiple}."
    )


def _returning_proxy(proxy: Any, method: Any) -> Any:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        result = method(*args, **kwargs)
        return proxy if result is proxy.__wrapped__ else result

    return call


def _handover_hook(name: str, mode: str) -> Any:
    """A forward pre-hook for the denoiser ``name``: ControlNet hand-overs cast to its dtype
    (:func:`torchfix.guards.dtype.handover`), one event per denoiser call."""

    def cast_handover(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        present = [k for k in _HANDOVER_KWARGS if kwargs.get(k) is not None]
        if not present:
            return None
        receiver = _model.model_dtype(module)
        seen: list[torch.Tensor] = []
        for key in present:
            kwargs[key] = _cast_handover(kwargs[key], receiver, seen)
        if not seen:
            return None
        site = _frames.call_site(1)
        given = ", ".join(sorted({_dt(t.dtype) for t in seen}))
        nbytes = sum(t.numel() for t in seen) * receiver.itemsize
        detail = (
            f"{len(seen)} ControlNet residual(s) in {given} handed to {name} ({_dt(receiver)}) → cast to {_dt(receiver)} "
            f"(rule: the receiver's dtype wins; torch would promote its activations and its next layer would reject them)"
        )
        report().add(FixEvent("torchfix.wrap", "dtype", "cast", site, name, detail, change=f"{given}→{_dt(receiver)}", nbytes=nbytes))
        if mode == "warn":
            text = f"torchfix.wrap: {detail}. To fix it for good: pipe.controlnet.to(torch.{_dt(receiver)})."
            _warn.once(("handover", name, given), text, site=site)
        return args, kwargs

    return cast_handover


def _encode_hook(pipe: Any, original: Any) -> Any:
    """``pipe.encode_prompt`` for one wrapped call: what it returns, with the prompt embeddings in the dtype the
    denoiser reads them in where torch would reject theirs (:func:`torchfix.preflight.embeddings_for_denoiser`)."""

    @functools.wraps(original)
    def encode_prompt(*args: Any, **kwargs: Any) -> Any:
        return preflight.embeddings_for_denoiser(pipe, original(*args, **kwargs), op="torchfix.wrap")

    return encode_prompt


def _finite_hook(path: str, mode: str) -> Any:
    """A forward hook for a VAE's ``decoder``/``encoder``: a non-finite fp16/bf16 result from finite input
    is re-run in fp32 (:mod:`torchfix.runtime.finite`; ``strict``: :class:`torchfix.NonFiniteError`)."""
    running: list[bool] = []

    def rerun_non_finite(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        if running or not finite.needs_rescue(output, (*args, *kwargs.values())):
            return None

        def again(*a: Any, **k: Any) -> Any:
            running.append(True)  # this hook sees the re-run too: it must let it through
            try:
                return module(*a, **k)
            finally:
                running.pop()

        return finite.rescued(path, output.dtype, mode, "torchfix.wrap", module, again, args, kwargs)

    return rerun_non_finite


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
        self._self_marks: list[_kept.Mark] = []  # marks set on kept tensors and buffers, undone by unwrap
        self._self_cached: tuple[torch.nn.Module, ...] = ()  # the denoisers DeepCache was applied to
        self._self_swaps: list[TensorHandle] = []  # every tensor wrap replaced, with its original
        self._self_learned = False  # the first call since the last preflight has told which parameters to cast
        self._self_scope = object()  # DeepCache applied by this wrapper caches only inside its calls

    def __getattr__(self, name: str) -> Any:
        # wrapt forwards every other attribute; a method of the pipeline that returns the pipeline itself
        # (``pipe.to("cuda")``) returns this wrapper instead, so ``torchfix.wrap(pipe).to(...)`` keeps it.
        if name == "__wrapped__":
            raise ValueError("wrapper has not been initialised")  # wrapt's protocol
        value = getattr(self.__wrapped__, name)
        if inspect.ismethod(value) and value.__self__ is self.__wrapped__:
            return _returning_proxy(self, value)
        return value

    # --- preflight -------------------------------------------------------------------------

    def _fingerprint(self) -> dict[str, int]:
        return {name: id(c) for name, c in _modules(self.__wrapped__).items()}

    def preflight(self) -> list[Finding]:
        """Check devices, meta weights and conditioning widths before anything runs.

        Runs before the first call and again whenever a component was replaced.
        Returns every finding (component, problem, fix, applied). Dtypes are not
        judged here: which mixes are a problem is learned from torch itself on
        the first call (the guards fix what torch rejects; afterwards the
        parameters they cast are cast once, see :attr:`findings`). Deliberate
        precision (fp32 norms, ``_keep_in_fp32_modules``, anything torch accepts)
        is never a finding.
        """
        pipe = self.__wrapped__
        modules = _modules(pipe)
        findings: list[Finding] = []
        self._forget_components()
        for name, module in modules.items():
            _frames.name_root(module, name, pipe)
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
                findings.append(_finding(name, f"weights on the meta device (never loaded): {names}{more}", fix, kind="device"))

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
                moved = 0
                for n, d in placed.items():
                    if d != self._self_device:
                        moved += self._move(modules[n], self._self_device)
                fix = f"moved to {self._self_device}; the originals ({moved:,} B) are kept for unwrap()"
                findings.append(_finding("pipeline", f"components on different devices: {where}", fix, True, "device"))
            else:
                fix = "move the pipeline with pipe.to(device), or wrap(pipe, device=...)"
                findings.append(_finding("pipeline", f"components on different devices: {where}", fix, kind="device"))

        # Kept-precision parameters and buffers, marked on the tensors (after any move: the moved
        # copies are the ones that run), so that a compiled component decides as it does eagerly.
        for module in modules.values():
            self._self_marks += _kept.mark_model(module)

        findings += preflight.conditioning(pipe)
        findings += _component_dtypes(modules)
        self._self_findings = findings
        self._self_fingerprint = self._fingerprint()
        self._self_learned = False
        for f in findings:
            log.info("torchfix preflight: %s", f)
        return list(findings)

    @property
    def findings(self) -> list[Finding]:
        """The findings of the last preflight (it runs before the first call)."""
        return list(self._self_findings)

    def _mode(self) -> str:
        if self._self_settings is not None:
            return self._self_settings.mode
        outer = current()
        return outer.mode if outer.active else "fix"

    # --- calls -----------------------------------------------------------------------------

    def _check_call(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """Arguments that cannot make a picture (sizes or steps below 1) and precomputed embeddings of another model
        are refused before anything runs, naming the argument or both widths; so is a
        T5 ``max_sequence_length`` longer than the T5 tokenizer's limit (it would be cut silently), a height or
        width that an SD3/Flux ControlNet pipeline cannot cut into patches, and a call that would encode a prompt
        with a text encoder the pipeline was loaded without."""
        pipe = self.__wrapped__
        _check_arguments(type(pipe).__name__, kwargs)
        resolution = _resolution_error(pipe, kwargs)
        if resolution is not None:
            raise InvalidCallError(resolution)
        length = kwargs.get("max_sequence_length")
        t5_tokenizer = getattr(pipe, "tokenizer_3", None) or (getattr(pipe, "tokenizer_2", None) if hasattr(pipe, "transformer") else None)
        limit = getattr(t5_tokenizer, "model_max_length", None)
        if isinstance(length, int) and isinstance(limit, int) and limit < 10**6 and length > limit:
            name = "tokenizer_3" if getattr(pipe, "tokenizer_3", None) is not None else "tokenizer_2"
            raise InvalidCallError(
                f"torchfix: max_sequence_length={length} is longer than {name}.model_max_length={limit} (the T5 tokenizer "
                f"of {type(pipe).__name__}): the prompt would be cut to {limit} tokens silently. Pass max_sequence_length <= {limit}."
            )
        expected = preflight.expected_widths(pipe)
        for group, keys in (("text", ("prompt_embeds", "negative_prompt_embeds")), ("pooled", _POOLED_KEYS)):
            want = expected.get(group)
            if want is None:
                continue
            width, source = want
            for key in keys:
                emb = kwargs.get(key)
                if isinstance(emb, torch.Tensor) and emb.shape[-1] != width:
                    likely = LIKELY.get((group, emb.shape[-1]), "a different pipeline")
                    raise ModelMismatchError(
                        f"torchfix: {key} has width {emb.shape[-1]} (shape {tuple(emb.shape)}), but {type(pipe).__name__} "
                        f"expects {width} ({source}). The embeddings were likely made by another model (e.g. {likely}); "
                        "encode the prompt again with this pipeline (pipe.encode_prompt) or pass prompt= instead."
                    )
        missing = _missing_encoder(pipe, args, kwargs)
        if missing is not None:
            raise InvalidCallError(missing)

    def _sync_state(self) -> None:
        if self._self_fingerprint != self._fingerprint():
            self.preflight()
        self._sync_deepcache()

    def _sync_deepcache(self) -> None:
        """DeepCache on the pipeline's denoisers as they are now (applied anew where one was replaced), and a new
        generation for each."""
        if self._self_deepcache is None:
            return
        pipe = self.__wrapped__
        found = tuple(model for _, model in deepcache.denoisers(pipe)[0])
        if found != self._self_cached:
            for model in self._self_cached:
                deepcache.remove(model)
            deepcache.apply(pipe, self._self_deepcache, scope=self._self_scope)
            self._self_cached = found
        deepcache.new_call(pipe)

    def _raise_on_findings(self) -> None:
        blocking = [f for f in self._self_findings if not f.applied and not f.advisory]
        if not blocking:
            return
        text = "\n".join(f"  - {f}" for f in blocking)
        kinds = {f.guard for f in blocking}
        error = DeviceMismatchError if "device" in kinds else ModelMismatchError if "model" in kinds else DtypeMismatchError
        raise error(f"torchfix preflight of {type(self.__wrapped__).__name__} found:\n{text}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the pipeline: preflight, guards, DeepCache. Calls of one pipeline from several threads run one at a
        time, in the order they get its lock (a pipeline holds one scheduler, one DeepCache state and one set of
        hooks: run at once, the calls would mix them; run in turn, each returns what a lone call returns)."""
        with _call_lock(self.__wrapped__):
            try:
                return self._call(*args, **kwargs)
            except Exception as exc:  # the pipeline's own error: its traceback ends where a plain call's would
                _frames.hide(exc)
                raise

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        mode = self._mode()
        if mode == "off":  # straight through: no preflight, no guards (a DeepCache the caller asked for still runs)
            self._sync_deepcache()
            with deepcache_scope(self._self_scope):
                return self.__wrapped__(*args, **kwargs)
        self._sync_state()
        self._raise_on_findings()
        self._check_call(args, kwargs)
        s = self._self_settings
        learn: list[tuple[Any, str, Any]] | None = [] if mode in ("fix", "warn") and not self._self_learned else None
        token = _context.param_casts.set(learn)
        hooks = self._call_hooks(mode)
        try:
            with deepcache_scope(self._self_scope), enabled(
                mode=None if s is None else s.mode,
                guards=None if s is None else tuple(s.guards),
                dtype=self._self_dtype,
                device_policy=None if s is None else s.device_policy,
            ):
                result = self.__wrapped__(*args, **kwargs)
        except BaseException:
            try:
                self._end_interrupted()
            except Exception:  # never let the clean-up hide the call's own error
                log.warning("torchfix.wrap: resetting diffusers' cache state after a failed call failed", exc_info=True)
            raise  # the pipeline's own error (or Ctrl-C), untouched
        finally:
            for h in hooks:
                h.restore()
            _context.param_casts.reset(token)
        if learn is not None:
            self._self_learned = True
            self._cast_once(learn, mode)
        return result

    def _end_interrupted(self) -> None:
        """A wrapped call that raised (or was interrupted) never reached diffusers' end-of-call reset of its cache
        hooks (``maybe_free_model_hooks``): do that reset for it, so the next call starts fresh at any size."""
        modules = _modules(self.__wrapped__)
        why = "held the state of a call that raised before diffusers' end-of-call reset"
        for name in DENOISERS:
            if (model := modules.get(name)) is not None:
                libraries.reset_cache_state(model, name, why, _frames.call_site(2))

    # --- during one call ---------------------------------------------------------------------

    def _call_hooks(self, mode: str) -> list[HookHandle | AttrHandle]:
        """Hooks that live for one wrapped call only (another pipeline sharing a component never sees
        them): the prompt embeddings handed over in the denoiser's dtype where torch would reject theirs (the
        pipeline's ``encode_prompt``, on this instance only), hand-overs cast to the receiver's dtype, the
        stale-state check of a diffusers cache on a denoiser (:func:`torchfix.patches.libraries.watch_cache`), and
        the VAE's non-finite check."""
        pipe = self.__wrapped__
        modules = _modules(pipe)
        hooks: list[HookHandle | AttrHandle] = []
        encode = getattr(pipe, "encode_prompt", None)
        if callable(encode) and preflight.text_reader(pipe) is not None:
            hooks.append(set_attr(pipe, "encode_prompt", _encode_hook(pipe, encode)))
        if mode in ("fix", "warn"):
            for name in ("unet", "transformer"):
                if name in modules:
                    hooks.append(add_hook(modules[name], _handover_hook(name, mode), pre=True, with_kwargs=True))
        for name in DENOISERS:
            model = modules.get(name)
            if model is not None and libraries.has_cache_state(model) and (watch := libraries.watch_cache(model)) is not None:
                hooks.append(watch)  # a diffusers cache enabled before torchfix was: its stale-state check for this call
        vae = modules.get("vae")
        for part in ("decoder", "encoder"):
            sub = getattr(vae, part, None)
            if isinstance(sub, torch.nn.Module):
                hooks.append(add_hook(sub, _finite_hook(f"vae.{part}", mode), with_kwargs=True))
        return hooks

    # --- what the first call taught ---------------------------------------------------------

    def _path(self, module: torch.nn.Module) -> str:
        for name, comp in _modules(self.__wrapped__).items():
            for path, sub in comp.named_modules():
                if sub is module:
                    return f"{name}.{path}" if path else name
        return type(module).__name__

    def _cast_once(self, casts: list[tuple[Any, str, Any]], mode: str) -> None:
        """Cast, once, each parameter or buffer the guards cast on every call of the first
        run (to the same dtype, so later calls are bit-identical to the first); keep the originals."""
        wanted: dict[tuple[int, str], tuple[torch.nn.Module, str, set[torch.dtype]]] = {}
        for module, name, dtype in casts:
            wanted.setdefault((id(module), name), (module, name, set()))[2].add(dtype)
        site = _frames.call_site(2)
        for module, name, dtypes in wanted.values():
            tensor = module._parameters.get(name)
            tensor = module._buffers.get(name) if tensor is None else tensor
            dtype = None if tensor is None else dtype_guard.cast_once(tensor.dtype, dtypes)
            if tensor is None or dtype is None:
                continue  # one cast cannot serve two dtypes, and a one-time cast never goes up: the guards keep casting per call
            before = tensor.dtype
            handle = swap_tensor(module, name, lambda t, dt=dtype: t.to(dt))
            self._self_swaps.append(handle)
            path = self._path(module)
            fix = f"cast to {dtype} once, after the first call; the original ({handle.nbytes:,} B) is kept for unwrap()"
            self._self_findings.append(
                _finding(path, f"{name} is {before} where its calls need {dtype} (torch rejects the mix)", fix, True)
            )
            detail = f"{name} {_dt(before)}→{_dt(dtype)} once, after the first call (the guards cast it on every call so far)"
            nbytes = tensor.numel() * dtype.itemsize
            change = f"{_dt(before)}→{_dt(dtype)}"
            report().add(FixEvent("torchfix.wrap", "dtype", "cast", site, path, detail, change=change, nbytes=nbytes))
            log.info("torchfix.wrap: %s.%s %s", path, name, detail)
            if mode == "warn":
                warnings.warn(
                    f"torchfix.wrap cast {path}.{name} from {_dt(before)} to {_dt(dtype)} once: its calls mix dtypes, which torch rejects. "
                    f"To fix it for good: {path}.to(torch.{_dt(dtype)}).",
                    TorchfixWarning,
                    stacklevel=3,
                )

    def _move(self, module: torch.nn.Module, device: torch.device) -> int:
        """Move every parameter and buffer of ``module`` to ``device``, keeping the originals; their bytes."""
        kept = 0
        for sub in module.modules():
            for name in [n for n, t in (*sub._parameters.items(), *sub._buffers.items()) if t is not None]:
                handle = swap_tensor(sub, name, lambda t: t.to(device))
                self._self_swaps.append(handle)
                kept += handle.nbytes
        return kept

    @property
    def kept_bytes(self) -> int:
        """Bytes held by the originals of what wrap cast or moved (released by :meth:`unwrap`)."""
        return sum(h.nbytes for h in self._self_swaps if h.active)

    # --- undo ------------------------------------------------------------------------------

    def _forget_components(self) -> None:
        for module in self._self_named:
            _frames.name_root(module, None)
        self._self_named = []
        _kept.unmark(self._self_marks)
        self._self_marks = []

    def unwrap(self) -> Any:
        """Remove everything torchfix attached (DeepCache, names, caches, references), put back every
        parameter and buffer it cast or moved (the very tensors: bit-identical); return the pipeline."""
        pipe = self.__wrapped__
        for handle in reversed(self._self_swaps):
            handle.restore()
        self._self_swaps = []
        self._self_learned = False
        for model in self._self_cached:
            deepcache.remove(model)
        self._self_cached = ()
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
        deepcache: a :class:`torchfix.DeepCacheConfig` to apply DeepCache to the UNet or transformer.
        dtype: the ``dtype=`` policy of the guards in this pipeline's calls (mixed matmuls and
            cats); wrap never casts a component to it up front.
        device: align components on this device when they differ (the originals are kept
            and :meth:`PipelineProxy.unwrap` puts them back).

    >>> import torchfix
    >>> # w = torchfix.wrap(pipe, deepcache=torchfix.DeepCacheConfig(interval=3)); w("a cat")
    """
    if isinstance(pipe, PipelineProxy):
        pipe = pipe.unwrap()
    settings = None if mode is None else Settings(mode=mode, dtype=dtype)
    parsed_dtype = Settings(dtype=dtype).dtype if dtype is not None else None
    if deepcache is not None and not isinstance(deepcache, DeepCacheConfig):
        raise InvalidArgumentTypeError(f"torchfix.wrap: deepcache must be a torchfix.DeepCacheConfig, got {type(deepcache).__name__}.")
    _modules(pipe)  # clear error for non-pipelines
    if deepcache is not None:
        try:
            deepcache_check(pipe, deepcache)
        except UnsupportedModelError as exc:
            if mode != "warn":
                raise UnsupportedModelError(f"torchfix.wrap(deepcache={deepcache!r}): {exc}") from None
            warnings.warn(f"torchfix.wrap: deepcache= is ignored: {exc}", TorchfixWarning, stacklevel=2)
            deepcache = None
        except ValueError as exc:
            raise InvalidArgumentError(f"torchfix.wrap(deepcache={deepcache!r}): {exc}") from None
    if device is not None:
        why = unusable_reason(device)
        if why is not None:
            raise InvalidArgumentError(
                f"torchfix.wrap(device={device!r}): that device cannot be used here: {why}. Pass a device this machine has "
                "(e.g. device='cpu'), or leave device out to keep the pipeline where it is."
            )
    return PipelineProxy(pipe, settings=settings, dtype=parsed_dtype, device=device, deepcache_config=deepcache)
