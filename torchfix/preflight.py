"""Preflight of the conditioning: every component that reads the prompt (or image) conditioning checked against what
feeds it, before step 0, by config alone (no tensor is touched). ``torchfix.wrap`` runs it before its first call;
under plain ``import torchfix`` it runs when a pipeline starts its denoising loop (the encoders have run, no step
has), once per set of components. Which widths a denoiser reads is its family's registry entry
(:class:`torchfix.families.Width`); which side models read what lives in :mod:`torchfix.families.entries`.

>>> from torchfix.testing import tiny_sd15_pipeline
>>> conditioning(tiny_sd15_pipeline())  # doctest: +SKIP
[]
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from . import families
from ._frames import uncompiled
from .families import DENOISERS, config_int, main_denoiser
from .families.entries import (
    CONDITIONING_WEIGHTS,
    IMAGE_ENCODER_WEIGHTS,
    IMAGE_PROJECTION_DEFAULT,
    IMAGE_PROJECTION_READS,
    LIKELY,
    SHARED_CONDITIONING,
    T2I_XL_LAYOUT,
    T2I_XL_MODULE,
)
from .guards.plan import Finding

__all__ = ["component_width", "conditioning", "denoiser", "expected_widths", "finding", "refusal"]


def finding(component: str, problem: str, fix: str, applied: bool = False, kind: str = "dtype") -> Finding:
    """One preflight result: which component, what is wrong, what was (or must be) done, and
    ``kind`` (``dtype``, ``device`` or ``model``: which error it raises unfixed)."""
    return Finding(kind, problem, fix, component=component, applied=applied)


def component_width(module: Any, attribute: str = "hidden_size") -> int | None:
    config = getattr(module, "config", None)
    value = getattr(config, attribute, None) if config is not None else None
    if value is None and attribute == "hidden_size":
        value = getattr(config, "d_model", None)  # T5
    return value if isinstance(value, int) else None


def denoiser(pipe: Any) -> tuple[str, families.Family] | None:
    """The pipeline's (first) denoiser component and its family, where torchfix knows it."""
    for name in DENOISERS:
        model = getattr(pipe, name, None)
        if isinstance(model, torch.nn.Module) and (family := families.find(uncompiled(model))) is not None:
            return name, family
    return None


def expected_widths(pipe: Any) -> dict[str, tuple[int, str]]:
    """The widths the denoiser takes: ``text`` (prompt_embeds) and ``pooled`` (pooled_prompt_embeds), each with
    the config entries it comes from (its family's registry entry says which)."""
    found = denoiser(pipe)
    return {} if found is None else found[1].expected_widths(pipe, found[0])


_MISMATCH_FIX = "these components come from different models: load the text encoder(s) and the denoiser of one model"


def _text_encoder_findings(pipe: Any) -> list[Finding]:
    """Each conditioning the denoiser consumes (its family's :class:`torchfix.families.Width` entries) against the
    components that make it: widths that do not add up are a finding that names both."""
    found = denoiser(pipe)
    if found is None:
        return []
    name, family = found
    findings = []
    for width in family.widths:
        expected = width.expected(pipe, name)
        if expected is None:
            continue
        feeds = [(n, w) for n in width.feeds if (w := component_width(getattr(pipe, n, None), width.attr)) is not None]
        kind = "output" if width.what == "text" else "pooled"
        if not feeds:
            if width.required and all(getattr(pipe, n, None) is None for n in width.feeds):
                problem = f"{name} takes {width.what} embeddings ({expected[1]}), but there is no {' or '.join(width.feeds)}"
                fix = f"use the {family.title} pipeline with its {' and '.join(width.feeds)}"
                findings.append(finding(name, problem, fix, kind="model"))
            continue
        total = sum(w for _, w in feeds)
        if total == expected[0] or (width.padded and total < expected[0]):
            continue
        what = f"{feeds[0][0]} ({width.label}) {kind} width {total}" if len(feeds) == 1 else (
            f"{width.label} {kind} width {' + '.join(f'{n} {w}' for n, w in feeds)} = {total}"
        )
        relation = "is wider than" if width.padded else "does not match"
        findings.append(finding(name, f"{what} {relation} {expected[1]}", _MISMATCH_FIX, kind="model"))
    return findings


def _weights_width(model: torch.nn.Module, entry: str) -> tuple[int, str] | None:
    """The width ``model``'s weights read the conditioning at for config ``entry`` (:data:`CONDITIONING_WEIGHTS`),
    with where it was read; ``None`` where no such layer is found."""
    for path in CONDITIONING_WEIGHTS.get(entry, ()):
        if path.startswith("*"):
            found = next(((n, m) for n, m in model.named_modules() if n.endswith(path[1:]) and isinstance(m, torch.nn.Linear)), None)
        else:
            try:
                found = (path, model.get_submodule(path))
            except AttributeError:
                found = None
        if found is not None and isinstance(found[1], torch.nn.Linear):
            return found[1].in_features, f"{found[0]}.in_features"
    return None


def _reads(model: torch.nn.Module, entry: str, *, weights_only: bool = False) -> tuple[int, str] | None:
    """The width ``model`` reads the conditioning at for config ``entry``, and where that was read: its weights first
    (a config can disagree with the weights it came with), else its config (``weights_only``: never), where a model
    with ``encoder_hid_dim`` reads the prompt embeddings at that width (it projects them itself)."""
    found = _weights_width(model, entry)
    if found is not None or weights_only:
        return found
    if entry == "cross_attention_dim" and (hid := config_int(model, "encoder_hid_dim")) is not None:
        return hid, "config.encoder_hid_dim"
    value = config_int(model, entry)
    return None if value is None else (value, f"config.{entry}")


def _consumers(pipe: Any) -> list[tuple[str, torch.nn.Module]]:
    """Side models that read the same prompt conditioning as the denoiser: a ControlNet, each net of a
    Multi-ControlNet."""
    model = getattr(pipe, "controlnet", None)
    nets = getattr(model, "nets", None)
    if isinstance(nets, torch.nn.ModuleList):
        return [(f"controlnet.nets[{i}]", net) for i, net in enumerate(nets)]
    return [("controlnet", model)] if isinstance(model, torch.nn.Module) else []


def _consumer_findings(pipe: Any, *, weights_only: bool = False) -> list[Finding]:
    """Each side model that consumes the prompt conditioning checked against the denoiser it feeds (the widths of
    :data:`torchfix.families.entries.SHARED_CONDITIONING`, read from the weights where they show them): a ControlNet
    made for another base model fails deep inside its first attention (``mat1 and mat2 shapes cannot be multiplied
    (154x2048 and 768x320)``)."""
    denoiser = main_denoiser(pipe)
    if denoiser is None:
        return []
    dname, dmodel = denoiser
    findings = []
    for cname, net in _consumers(pipe):
        for entry, what in SHARED_CONDITIONING:
            theirs, ours = _reads(net, entry, weights_only=weights_only), _reads(dmodel, entry, weights_only=weights_only)
            if theirs is None or ours is None or theirs[0] == ours[0]:
                continue
            named = entry != "projection_class_embeddings_input_dim"  # a sum of widths, not one model's
            likely = LIKELY.get((what, theirs[0])) if named else None
            base = LIKELY.get((what, ours[0])) if named else None
            problem = (
                f"{cname} reads the {what} embeddings at width {theirs[0]} ({cname}.{theirs[1]}), {dname} at {ours[0]} "
                f"({dname}.{ours[1]}): both read the same prompt embeddings"
            )
            made = f"{cname} was likely made for {likely}" if likely else f"{cname} was likely made for another base model"
            fix = f"{made}{f', the pipeline is {base}' if base else ''}: load the {type(net).__name__} made for this pipeline's base model"
            findings.append(finding(cname, problem, fix, kind="model"))
    return findings


def _input_linear(layer: torch.nn.Module) -> torch.nn.Linear | None:
    """The layer of an IP-Adapter image projection that reads the image features (diffusers' names for it), or
    ``None`` where the projection is of a kind torchfix does not know (never guessed)."""
    for name in ("image_embeds", "proj_in"):
        if isinstance(found := getattr(layer, name, None), torch.nn.Linear):
            return found
    ff = getattr(layer, "ff", None)
    return next((m for m in ff.modules() if isinstance(m, torch.nn.Linear)), None) if isinstance(ff, torch.nn.Module) else None


def _encoder_width(encoder: torch.nn.Module, entry: str, weights_only: bool) -> int | None:
    """An image encoder's ``projection_dim`` or ``hidden_size`` as its weights show it (:data:`IMAGE_ENCODER_WEIGHTS`),
    else as its config says (``weights_only``: never)."""
    path, attr = IMAGE_ENCODER_WEIGHTS[entry]
    try:
        value = getattr(encoder.get_submodule(path), attr, None)
    except AttributeError:
        value = None
    if isinstance(value, int) or weights_only:
        return value if isinstance(value, int) else None
    return config_int(encoder, entry)


def _ip_adapter_findings(pipe: Any, *, weights_only: bool = False) -> list[Finding]:
    """Each IP-Adapter image projection loaded into the denoiser against the image encoder that feeds it (a plus
    adapter reads hidden states, a plain one ``image_embeds``): an adapter for another image encoder fails inside
    its first layer."""
    denoiser = main_denoiser(pipe)
    encoder = getattr(pipe, "image_encoder", None)
    layers = getattr(getattr(denoiser and denoiser[1], "encoder_hid_proj", None), "image_projection_layers", None)
    if not isinstance(encoder, torch.nn.Module) or not isinstance(layers, torch.nn.ModuleList):
        return []
    findings = []
    for i, layer in enumerate(layers):
        kind = type(layer).__name__
        reads = IMAGE_PROJECTION_READS.get(kind, IMAGE_PROJECTION_DEFAULT)
        first, given = _input_linear(layer), _encoder_width(encoder, reads, weights_only)
        if "FaceID" in kind or first is None or given is None or first.in_features == given:
            continue
        problem = (
            f"IP-Adapter {i} ({kind}) takes image features of width {first.in_features}, but the image encoder's {reads} "
            f"is {given} ({type(encoder).__name__})"
        )
        fix = "the adapter was made for another image encoder: load the image encoder its weights name (e.g. image_encoder_folder=)"
        findings.append(finding("image_encoder", problem, fix, kind="model"))
    return findings


def _t2i_adapter_findings(pipe: Any) -> list[Finding]:
    """A T2I-Adapter (each of a MultiAdapter) against the UNet it feeds: the SDXL layout for an SDXL-family UNet only."""
    unet, adapter = getattr(pipe, "unet", None), getattr(pipe, "adapter", None)
    if not isinstance(unet, torch.nn.Module) or not isinstance(adapter, torch.nn.Module):
        return []
    nets = getattr(adapter, "adapters", None)
    listed = [("adapter", adapter)]
    if isinstance(nets, torch.nn.ModuleList):
        listed = [(f"adapter.adapters[{i}]", a) for i, a in enumerate(nets)]
    xl = getattr(unet.config, "addition_embed_type", None) == "text_time"
    findings = []
    for name, net in listed:
        built = getattr(net, "adapter", None)  # the module diffusers built: what the weights are, whatever the config says
        if isinstance(built, torch.nn.Module):
            adapter_xl, layout = type(built).__name__ == T2I_XL_MODULE, type(built).__name__
        else:
            layout = getattr(getattr(net, "config", None), "adapter_type", None)
            adapter_xl = layout == T2I_XL_LAYOUT
        if not isinstance(layout, str) or adapter_xl == xl:
            continue
        base = "SDXL" if xl else "SD1.x/2.x"
        takes = T2I_XL_LAYOUT if xl else "full_adapter or light_adapter"
        problem = f"{name} is a {'SDXL' if adapter_xl else 'SD1.x/2.x'} T2I-Adapter ({layout}), unet is {base}: it takes {takes}"
        fix = f"the adapter was made for {'SDXL' if adapter_xl else 'SD1.x/2.x'}: load the T2I-Adapter made for {base}"
        findings.append(finding(name, problem, fix, kind="model"))
    return findings


def conditioning(pipe: Any) -> list[Finding]:
    """Every conditioning check for ``pipe`` (``torchfix.wrap``'s preflight): the text encoders against the denoiser
    (its family's widths), each ControlNet against the denoiser it feeds, IP-Adapter projections against the image
    encoder, T2I-Adapters against the UNet."""
    return _text_encoder_findings(pipe) + _side_model_findings(pipe)


def _side_model_findings(pipe: Any, *, weights_only: bool = False) -> list[Finding]:
    return _consumer_findings(pipe, weights_only=weights_only) + _ip_adapter_findings(pipe, weights_only=weights_only) + (
        _t2i_adapter_findings(pipe)
    )


# pipeline -> (the components it was checked with, the refusal text or None): a pipeline is checked once per set
_CHECKED: weakref.WeakKeyDictionary[Any, tuple[tuple[int, ...], str | None]] = weakref.WeakKeyDictionary()


def refusal(pipe: Any) -> str | None:
    """The preflight error text for ``pipe`` as it is now, or ``None``: the side models (ControlNets, IP-Adapters,
    T2I-Adapters) that do not fit what feeds them, by their weights alone (under plain ``import torchfix`` torchfix
    refuses only what would fail: a config that disagrees with its weights decides nothing here); computed once per
    set of components (a swapped component is checked anew)."""
    components = getattr(pipe, "components", None)
    if not isinstance(components, dict):
        return None
    key = tuple(id(c) for c in components.values())
    try:
        cached = _CHECKED.get(pipe)
    except TypeError:  # not weakly referable
        cached = None
    if cached is not None and cached[0] == key:
        return cached[1]
    blocking = [f for f in _side_model_findings(pipe, weights_only=True) if not f.applied and not f.advisory]
    text = None
    if blocking:
        listed = "\n".join(f"  - {f}" for f in blocking)
        text = f"torchfix preflight of {type(pipe).__name__} (before step 0) found:\n{listed}"
    try:
        _CHECKED[pipe] = (key, text)
    except TypeError:
        pass
    return text
