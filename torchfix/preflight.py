"""Preflight of the conditioning: every component that reads the prompt (or image) conditioning checked against what
feeds it, before step 0, by config alone (no tensor is touched). ``torchfix.wrap`` runs it before its first call;
under plain ``import torchfix`` it runs when a pipeline starts its denoising loop (the encoders have run, no step
has), once per set of components. Which widths a denoiser reads is its family's registry entry
(:class:`torchfix.families.Width`); which side models read what lives in :mod:`torchfix.families.entries`.
Beside the widths, the prompt embeddings' dtype: :func:`embeddings_for_denoiser` hands them to the denoiser in its
dtype where torch would reject theirs, before the pipeline draws its noise in their dtype.

>>> from torchfix.testing import tiny_sd15_pipeline
>>> conditioning(tiny_sd15_pipeline())  # doctest: +SKIP
[]
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch

from . import _context, _frames, _model, _warn, families
from ._frames import uncompiled
from ._report import FixEvent, report
from ._text import dtype_name
from .errors import DtypeMismatchError
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

__all__ = [
    "component_width",
    "conditioning",
    "denoiser",
    "embeddings_for_denoiser",
    "expected_widths",
    "finding",
    "refusal",
    "side_models",
    "text_reader",
]


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
    where it was read: the layer whose weights read it, else the config entries its family's registry entry names."""
    found = denoiser(pipe)
    if found is None:
        return {}
    out: dict[str, tuple[int, str]] = {}
    for width in found[1].widths:
        if width.what not in out and (value := _expected(width, pipe, found[0])) is not None:
            out[width.what] = value
    return out


def _expected(width: families.Width, pipe: Any, name: str) -> tuple[int, str] | None:
    """The width the denoiser ``name`` takes for ``width``, read from the layer that reads it (the first projection
    that consumes the encoder's output, :data:`CONDITIONING_WEIGHTS`) where the weights show it, else from the
    config (``width.expected``): a config edited apart from its weights does not decide. A UNet's text: the width its
    ``encoder_hid_proj`` or its first cross-attention ``to_k`` reads."""
    configured = width.expected(pipe, name)
    entry = width.expects if isinstance(width.expects, str) else ("cross_attention_dim" if width.what == "text" else None)
    model = getattr(pipe, name, None)
    found = _weights_width(model, entry) if entry is not None and isinstance(model, torch.nn.Module) else None
    if found is None:
        return configured
    if configured is not None and configured[0] != found[0]:
        return found[0], f"{name}.{found[1]}={found[0]}, where {configured[1]} says otherwise"
    return configured if configured is not None else (found[0], f"{name}.{found[1]}={found[0]}")


def encoder_width(module: Any, attribute: str = "hidden_size") -> int | None:
    """The width a text encoder's output has: its hidden states' (``hidden_size``; T5's ``d_model``) as its input
    embeddings show it, its projection's (``projection_dim``) as ``text_projection`` shows it; else its config
    (:func:`component_width`)."""
    if isinstance(module, torch.nn.Module):
        if attribute == "projection_dim":
            projection = getattr(module, "text_projection", None)
            if isinstance(projection, torch.nn.Linear):
                return projection.out_features
        else:
            embeddings = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
            if isinstance(embeddings, torch.nn.Embedding):
                return embeddings.embedding_dim
    return component_width(module, attribute)


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
        expected = _expected(width, pipe, name)
        if expected is None:
            continue
        feeds = [(n, w) for n in width.feeds if (w := encoder_width(getattr(pipe, n, None), width.attr)) is not None]
        kind = "output" if width.what == "text" else "pooled"
        if not feeds:
            if width.required and all(getattr(pipe, n, None) is None for n in width.feeds):
                # Dropped to save memory, the embeddings computed beforehand (a documented diffusers pattern): only a call
                # that would encode a prompt needs it, and torchfix.wrap refuses such a call before it runs.
                problem = f"{name} takes {width.what} embeddings ({expected[1]}), and there is no {' or '.join(width.feeds)}"
                key = "prompt_embeds" if width.what == "text" else f"{width.what}_prompt_embeds"
                fix = (
                    f"nothing to do for calls that pass precomputed {key} (and negative ones under "
                    f"guidance); a call that would encode a prompt needs the {family.title} pipeline's "
                    f"{' and '.join(width.feeds)}, and is refused before it runs"
                )
                findings.append(Finding("model", problem, fix, advisory=True, component=name))
            continue
        total = sum(w for _, w in feeds)
        if total == expected[0] or (width.padded and total < expected[0]):
            continue
        what = (
            f"{feeds[0][0]} ({width.label}) {kind} width {total}"
            if len(feeds) == 1
            else (f"{width.label} {kind} width {' + '.join(f'{n} {w}' for n, w in feeds)} = {total}")
        )
        relation = "is wider than" if width.padded else "does not match"
        findings.append(finding(name, f"{what} {relation} {expected[1]}", _MISMATCH_FIX, kind="model"))
    return findings


def _linear(module: Any) -> torch.nn.Linear | None:
    """``module`` where it is a ``Linear``, else the ``Linear`` a peft LoRA layer wraps (its ``base_layer``, which reads
    the input as it comes), else ``None``."""
    if isinstance(module, torch.nn.Linear):
        return module
    base = getattr(module, "base_layer", None)
    return base if isinstance(base, torch.nn.Linear) else None


def _prompt_side(path: str) -> bool:
    """Whether the layer at ``path`` may read the prompt: not inside AnimateDiff's motion modules, whose ``attn2`` attends
    across frames to the frames themselves (an SDXL motion UNet's first block has no cross-attention, only those).

    >>> _prompt_side("down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k")
    True
    >>> _prompt_side("down_blocks.0.motion_modules.0.transformer_blocks.0.attn2.to_k")
    False
    """
    return "motion_modules" not in path.split(".")


def _reader(model: torch.nn.Module, entry: str) -> tuple[str, torch.nn.Linear] | None:
    """The layer of ``model`` that reads the conditioning of config ``entry`` (:data:`CONDITIONING_WEIGHTS`), with its
    path; ``None`` where no such ``Linear`` (or LoRA-wrapped ``Linear``) is found."""
    for path in CONDITIONING_WEIGHTS.get(entry, ()):
        if path.startswith("*"):
            found = next(
                ((n, m) for n, m in model.named_modules() if n.endswith(path[1:]) and _prompt_side(n) and _linear(m) is not None), None
            )
        else:
            try:
                found = (path, model.get_submodule(path))
            except AttributeError:
                found = None
        layer = None if found is None else _linear(found[1])
        if layer is not None:
            return found[0], layer
    return None


def _weights_width(model: torch.nn.Module, entry: str) -> tuple[int, str] | None:
    """The width ``model``'s weights read the conditioning at for config ``entry`` (:data:`CONDITIONING_WEIGHTS`),
    with where it was read; ``None`` where no such layer is found."""
    found = _reader(model, entry)
    return None if found is None else (found[1].in_features, f"{found[0]}.in_features")


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


def side_models(pipe: Any) -> list[tuple[str, torch.nn.Module]]:
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
    for cname, net in side_models(pipe):
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
    return (
        _consumer_findings(pipe, weights_only=weights_only)
        + _ip_adapter_findings(pipe, weights_only=weights_only)
        + (_t2i_adapter_findings(pipe))
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


# --- the prompt embeddings' dtype, before the noise is drawn -----------------------------------------------------

# Which families' pipelines draw the initial noise in the prompt embeddings' dtype is their registry entry's
# ``noise`` (SD/SDXL, SD3, Flux and PixArt in diffusers 0.42.1); of those, SD3's and Flux's encode_prompt hand
# precomputed prompt_embeds on as given (SD/SDXL's and PixArt's cast them to their encoder's dtype).
_TEXT_ENTRIES = tuple(entry for entry, what in SHARED_CONDITIONING if what == "text")


def text_reader(pipe: Any) -> tuple[str, torch.nn.Linear] | None:
    """The denoiser layer that reads the prompt embeddings (``transformer.context_embedder``, a UNet's first
    ``attn2.to_k``), with its path from the pipeline, where the family's pipelines draw their noise in the
    embeddings' dtype (:attr:`torchfix.families.Family.noise`); ``None`` elsewhere."""
    found = denoiser(pipe)
    if found is None or not found[1].noise.startswith("embeddings"):
        return None
    model = uncompiled(getattr(pipe, found[0]))
    for entry in _TEXT_ENTRIES:
        layer = _reader(model, entry)
        if layer is not None:
            return f"{found[0]}.{layer[0]}", layer[1]
    return None


def _stray_embeddings(result: Any, width: int, target: torch.dtype) -> list[int]:
    """Where in ``result`` (what ``encode_prompt`` returned) prompt embeddings of another floating dtype than ``target``
    lie: 3-d tensors of the width the denoiser reads, outside autocast (under which torch takes the mix)."""
    items = result if isinstance(result, (tuple, list)) else (result,)
    return [
        i
        for i, t in enumerate(items)
        if isinstance(t, torch.Tensor)
        and t.is_floating_point()
        and t.dim() == 3
        and t.shape[-1] == width
        and t.dtype != target
        and not torch.is_autocast_enabled(t.device.type)
    ]


def _replaced(result: Any, cast: dict[int, torch.Tensor]) -> Any:
    if isinstance(result, torch.Tensor):
        return cast[0]
    items = [cast.get(i, t) for i, t in enumerate(result)]
    if isinstance(result, tuple) and hasattr(result, "_fields"):  # a namedtuple
        return type(result)(*items)
    return type(result)(items)


def _producers(pipe: Any, target: torch.dtype) -> list[tuple[str, torch.dtype]]:
    """The text encoders feeding the prompt embeddings (the family's ``text`` widths) whose own dtype is not ``target``."""
    found = denoiser(pipe)
    feeds = [] if found is None else [n for w in found[1].widths if w.what == "text" for n in w.feeds]
    out = []
    for name in dict.fromkeys(feeds):
        module = getattr(pipe, name, None)
        own = _model.model_dtype(module) if isinstance(module, torch.nn.Module) else None
        if own is not None and own != target:
            out.append((name, own))
    return out


def _in_own_call(pipe: Any, depth: int = 64) -> bool:
    """Whether ``pipe``'s own ``__call__`` is running (its frame's ``self`` is ``pipe``): there its next step draws the
    noise from what ``encode_prompt`` returned; an ``encode_prompt`` called by the user is theirs to keep as it is."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name == "__call__" and frame.f_locals.get("self") is pipe:
            return True
        frame = frame.f_back
    return False


def embeddings_for_denoiser(pipe: Any, result: Any, *, op: str) -> Any:
    """``result`` (what ``pipe.encode_prompt`` returned) with its prompt embeddings in the dtype the denoiser reads them
    in, where torch would reject theirs: the maintainers' fix (diffusers#9677: the encoder output cast to the
    denoiser's dtype), made where the encoders hand them over, so that the pipeline draws its initial noise in that
    dtype too and a seed gives the picture the fixed pipeline gives (torch 2.11's CPU ``randn`` in bf16 is not its
    fp32 draw rounded). Only inside the pipeline's own call (an ``encode_prompt`` the user calls returns what it
    returns), where the settings in force fix dtypes (``strict``: a :class:`torchfix.DtypeMismatchError` naming the
    encoders and the fix instead), and where the pipeline would crash plainly (its family hands the embeddings to the
    denoiser as they are: :func:`text_reader`; no autocast); a plain, correct pipeline's embeddings already have that
    dtype and pass untouched.

    >>> from torchfix.testing import tiny_sd15_pipeline
    >>> embeddings_for_denoiser(tiny_sd15_pipeline(), (None, None), op="torchfix")  # doctest: +SKIP
    (None, None)
    """
    settings = _context.current()
    if not settings.active or not settings.dtype_on or settings.dtype is not None or torch.compiler.is_compiling():
        return result  # off, the dtype guard off, or the caller chose the dtype mixes run in: theirs
    found = text_reader(pipe)
    target = _model.pipeline_dtype(pipe)
    if found is None or target is None or _model.layer_dtype(found[1]) != target:
        return result  # a reading layer kept in another precision, or quantized: the guards decide at the layer
    path, layer = found
    stray = _stray_embeddings(result, layer.in_features, target)
    if not stray or not _in_own_call(pipe):
        return result
    items = result if isinstance(result, (tuple, list)) else (result,)
    given = ", ".join(sorted({dtype_name(items[i].dtype) for i in stray}))
    made = _producers(pipe, target)
    names = " and ".join(n for n, _ in made)
    to = dtype_name(target)
    load = f"load {names} in torch.{to} (pipe.{made[0][0]}.to(torch.{to}))" if made else ""
    family = denoiser(pipe)
    if family is not None and family[1].noise == "embeddings as given":
        passed = f"pass prompt_embeds=pipe.encode_prompt(...)[0].to(torch.{to}) (diffusers#9677)"
        kept = ", ".join(sorted({dtype_name(d) for _, d in made}))
        fix = f"keep {names} in {kept} if you meant to and {passed}, or {load}" if made else f"{passed}"
    else:
        fix = load or f"load the text encoders in torch.{to}"
    source = f" ({', '.join(f'{n} is {dtype_name(d)}' for n, d in made)})" if made else ""
    if settings.mode == "strict":
        raise DtypeMismatchError(
            f"torchfix: {type(pipe).__name__}.encode_prompt returned prompt embeddings in {given}{source}, but {path} reads "
            f"them in {to}: torch rejects the mix, and the pipeline would draw its initial noise in {given}. To fix: {fix}."
        )
    cast = {i: items[i].to(target) for i in stray}
    site = _frames.call_site(2)
    detail = (
        f"{len(stray)} prompt embedding tensor(s) from encode_prompt in {given}{source} → {to} before the noise is drawn "
        f"(rule: the denoiser's dtype; {path} reads them in {to}, torch would reject {given}, and the pipeline draws its "
        "initial noise in the embeddings' dtype)"
    )
    nbytes = sum(t.numel() * t.element_size() for t in cast.values())
    report().add(FixEvent(op, "dtype", "cast", site, path, detail, change=f"{given}→{to}", nbytes=nbytes))
    if settings.mode == "warn":
        _warn.once(("embeddings", type(pipe).__name__, given, to), f"{op}: {detail}. To fix it for good: {fix}.", site=site)
    return _replaced(result, cast)
