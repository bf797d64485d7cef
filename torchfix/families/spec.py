"""What torchfix knows about a model family, as data: where a denoiser's blocks are, how each block list is
called (its *signature*), which blocks must always run, what conditioning widths it consumes, and the cache
defaults measured for it. The entries live in :mod:`torchfix.families.entries`; this module holds their shape
and the lookup. Pure: nothing here imports diffusers or touches a model.

A block list's signature names, for each *stream* the blocks carry from one block to the next, the forward
parameter that receives it (``"image"``: the latent tokens; ``"text"``: text tokens updated block by block;
``"audio"``: LTX-2's audio tokens), and the order in which the block returns them. Anything else a block takes
(text the blocks only attend to, embeddings, masks) is conditioning: the same for every block of a step.
The first call of a model checks the signature against what the blocks actually do (the cache's
:mod:`torchfix.deepcache.blocks`): a model whose blocks behave otherwise is refused, never guessed at.

>>> from torchfix.families import Blocks
>>> Blocks("blocks", {"image": "hidden_states"}, ("image",)).describe()
'blocks(hidden_states=image) -> image'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InvalidArgumentError, UnknownNameError

__all__ = [
    "DENOISERS",
    "HOSTS",
    "Blocks",
    "Family",
    "Width",
    "config_int",
    "config_value",
    "find",
    "get",
    "main_denoiser",
    "names",
    "refusal",
    "refuse",
    "register",
    "supported",
    "unregister",
]

# A pipeline's components that are denoisers, in the order they run (Wan 2.2: two experts on one scheduler).
DENOISERS = ("unet", "transformer", "transformer_2")


def main_denoiser(pipe: Any) -> tuple[str, torch.nn.Module] | None:
    """The pipeline's first denoiser component (:data:`DENOISERS` order) and its name; ``None`` without one."""
    return next(((n, m) for n in DENOISERS if isinstance(m := getattr(pipe, n, None), torch.nn.Module)), None)


def config_value(module: Any, entry: str) -> Any:
    """``module.config[entry]`` (a diffusers ``FrozenDict`` or a transformers config object), ``None`` where absent.

    >>> config_value(torch.nn.Linear(1, 1), "hidden_size") is None
    True
    """
    config = getattr(module, "config", None)
    return config.get(entry) if hasattr(config, "get") else getattr(config, entry, None)


def config_int(module: Any, entry: str) -> int | None:
    """:func:`config_value` where it is an int (never a bool), else ``None``."""
    value = config_value(module, entry)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


_COMFY = "comfy."  # ComfyUI's packages: a class there is matched by its module path only, never by its name alone

# Whose model classes an entry describes: diffusers' (run by its pipelines) or ComfyUI's (``comfy.ldm``).
HOSTS = ("diffusers", "comfyui")
# Where a family's pipelines take the initial noise's dtype from (Family.noise).
NOISE = ("", "embeddings", "embeddings as given")

# Arguments whose presence makes any denoiser call run in full: residuals added to blocks from outside
# (ControlNets) and blocks skipped on purpose (SD3's skip-layer guidance). A cached step cannot honour them.
FULL_ONLY = (
    "controlnet_block_samples",
    "controlnet_single_block_samples",
    "block_controlnet_hidden_states",
    "controlnet_blocks_repeat",
    "skip_layers",
    "down_intrablock_additional_residuals",
)


@dataclass(frozen=True)
class Blocks:
    """One list of blocks in a denoiser's chain and how its blocks are called.

    Args:
        attr: the model attribute holding the ``ModuleList`` (``"transformer_blocks"``).
        inputs: stream → forward parameter (``{"image": "hidden_states", "text": "encoder_hidden_states"}``).
            ``"image"`` must be one of them.
        returns: the streams each block returns, in order; one stream: the block returns that tensor alone.

    >>> Blocks("transformer_blocks", {"image": "hidden_states", "text": "encoder_hidden_states"}, ("text", "image")).describe()
    'transformer_blocks(hidden_states=image, encoder_hidden_states=text) -> (text, image)'
    """

    attr: str
    inputs: Mapping[str, str]
    returns: tuple[str, ...]

    def __post_init__(self) -> None:
        if "image" not in self.inputs or set(self.returns) != set(self.inputs):
            raise InvalidArgumentError(
                f"Blocks({self.attr!r}): the streams returned {self.returns} must be the streams taken {tuple(self.inputs)}, "
                "image among them."
            )

    @property
    def streams(self) -> tuple[str, ...]:
        """The streams, in the order the block returns them."""
        return self.returns

    def describe(self) -> str:
        ins = ", ".join(f"{p}={s}" for s, p in self.inputs.items())
        out = self.returns[0] if len(self.returns) == 1 else f"({', '.join(self.returns)})"
        return f"{self.attr}({ins}) -> {out}"


@dataclass(frozen=True)
class Width:
    """A conditioning the denoiser consumes and the components that produce it, for the wrapper's preflight.

    Args:
        what: ``"text"`` (``prompt_embeds``) or ``"pooled"`` (``pooled_prompt_embeds``).
        expects: the denoiser's config attribute holding the width it takes, or ``(pipe) -> (width, source)``
            where it needs arithmetic (SDXL's pooled width is what remains of its added conditioning), ``None``
            where the denoiser takes none.
        feeds: the pipeline components whose outputs make it (their widths add up: concatenated).
        attr: the config attribute of a feeding component that gives its width (``hidden_size``; T5: ``d_model``).
        label: what the feeds are, in messages (``"T5"``, ``"CLIP"``).
        padded: the feeds' total may be narrower than expected (SD3 zero-pads CLIP to the T5 width), never wider.
        required: a denoiser that expects it with no feeding component present is a finding.
    """

    what: str
    expects: str | Callable[[Any], tuple[int, str] | None]
    feeds: tuple[str, ...]
    attr: str = "hidden_size"
    label: str = ""
    padded: bool = False
    required: bool = False

    def expected(self, pipe: Any, denoiser: str) -> tuple[int, str] | None:
        """``(width, where it comes from)`` the pipeline's denoiser takes, or ``None``."""
        if callable(self.expects):
            return self.expects(pipe)
        value = config_int(getattr(pipe, denoiser, None), self.expects)
        return None if value is None else (value, f"{denoiser}.config.{self.expects}={value}")


@dataclass(frozen=True)
class Family:
    """One model family: enough for the cache to drive its denoiser and for the wrapper to check its pipelines.

    Args:
        name: short key (``"flux"``), used in stats, errors, docs and ``torchfix.testing.FAMILIES``.
        title: what users call it (``"Flux.1 (dev, schnell, Kontext)"``).
        classes: denoiser class names this entry describes (matched on the class and its bases).
        kind: ``"transformer"`` (a chain of blocks) or ``"unet"`` (diffusers' UNet2DConditionModel, UNetMotionModel or
            UNetSpatioTemporalConditionModel: :mod:`torchfix.deepcache.layout`).
        blocks: the block lists the cache may skip, in the order a forward calls them; lists not named here
            (refiners, embedders, control branches) run on every step.
        latent: the forward parameter holding the latents (a new shape, dtype or device starts a new generation).
        prompt: the forward parameter whose object tells guidance streams apart where a pipeline sets no
            ``cache_context`` (``None``: there is none).
        keep_first, keep_last: blocks at the start and the end of the chain that always run, by default.
        full_only: more arguments that make a call run in full (beside :data:`FULL_ONLY`).
        prompt_only: modules (attribute paths; a ``ModuleList``: each of its modules) whose output depends on the
            prompt alone: text projections and text refiners that take no timestep. A cached step that calls one
            with what it got when it last ran in the stream reuses what it returned then (checked on every call:
            :mod:`torchfix.deepcache.prompt_only`); they run on every full step.
        tail: ``(norm, proj)`` where the model's output is ``proj(norm(h, conditioning))`` of the last block's
            image stream: the cache may then revise its cached steps (checked on the first call).
        defaults: :class:`torchfix.DeepCacheConfig` fields this family leaves ``None`` by default.
        widths: the conditionings the wrapper's preflight checks (:class:`Width`).
        packed: latent pixels per token side where the pipeline packs latents (Flux: 2), else 0.
        pipelines: diffusers pipeline classes that run it (docs, support table).
        host: whose model classes these are: ``"diffusers"``, or ``"comfyui"`` (ComfyUI's own ``comfy.ldm`` classes,
            named by module path, run through its model patcher; :mod:`torchfix.comfyui`).
        context: ``(bound forward arguments) -> str | None``: which guidance passes a call runs, where the host says
            it in an argument rather than by ``cache_context`` or a prompt object (ComfyUI's
            ``transformer_options["cond_or_uncond"]``); each distinct answer is a stream of its own.
        patched: ``(bound forward arguments) -> frozenset of (list, index)``: the blocks a call's host-side block patches
            run in place of or right after (ComfyUI's ``transformer_options["patches_replace"]["dit"]`` and
            ``["patches"]["double_block"]``), ``list`` indexing :attr:`blocks`, ``index`` the block in it (-1: every
            block of the list; ``(-1, -1)``: a patch torchfix cannot place). A call with a patch on a block its cached
            step would skip runs in full (:mod:`torchfix.deepcache.blocks`).
        noise: where its diffusers pipelines take the initial noise's dtype from: ``"embeddings"`` (the prompt
            embeddings as ``encode_prompt`` returns them: ``prepare_latents(..., prompt_embeds.dtype, ...)``, and
            the embeddings reach the denoiser as they are), ``"embeddings as given"`` (the same, and precomputed
            ``prompt_embeds`` pass through ``encode_prompt`` uncast), or ``""`` (elsewhere: Sana draws in float32
            and casts at the call). :func:`torchfix.preflight.embeddings_for_denoiser` reads it.
    """

    name: str
    title: str
    classes: tuple[str, ...]
    kind: str = "transformer"
    blocks: tuple[Blocks, ...] = ()
    latent: str = "hidden_states"
    prompt: str | None = "encoder_hidden_states"
    keep_first: int = 0
    keep_last: int = 0
    full_only: tuple[str, ...] = ()
    prompt_only: tuple[str, ...] = ()
    tail: tuple[str, str] | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    widths: tuple[Width, ...] = ()
    packed: int = 0
    pipelines: tuple[str, ...] = ()
    host: str = "diffusers"
    context: Callable[[Mapping[str, Any]], str | None] | None = None
    noise: str = ""
    patched: Callable[[Mapping[str, Any]], frozenset[tuple[int, int]]] | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("transformer", "unet"):
            raise InvalidArgumentError(f"Family({self.name!r}).kind must be 'transformer' or 'unet', got {self.kind!r}.")
        if self.host not in HOSTS:
            raise InvalidArgumentError(f"Family({self.name!r}).host must be one of {HOSTS}, got {self.host!r}.")
        if self.noise not in NOISE:
            raise InvalidArgumentError(f"Family({self.name!r}).noise must be one of {NOISE}, got {self.noise!r}.")
        if self.kind == "transformer" and not self.blocks:
            raise InvalidArgumentError(f"Family({self.name!r}): a transformer family names at least one block list.")

    @property
    def full_only_arguments(self) -> tuple[str, ...]:
        return FULL_ONLY + self.full_only

    def expected_widths(self, pipe: Any, denoiser: str) -> dict[str, tuple[int, str]]:
        """What the pipeline's denoiser takes: ``{what: (width, source)}`` (the first entry for each)."""
        out: dict[str, tuple[int, str]] = {}
        for width in self.widths:
            if width.what not in out and (found := width.expected(pipe, denoiser)) is not None:
                out[width.what] = found
        return out

    def describe(self) -> str:
        """The signature in words, for errors and docs."""
        if self.kind == "unet":
            return "UNet: down_blocks / mid_block / up_blocks with skip connections"
        return "; ".join(b.describe() for b in self.blocks)


_REGISTRY: dict[str, Family] = {}


def register(family: Family, *, replace: bool = False) -> Family:
    """Add ``family`` to the registry (loud on a duplicate name or class, unless ``replace``).

    >>> from torchfix.families import Family, Blocks, register, get
    >>> fam = Family("demo-tiny", "A tiny demo", ("DemoModel",), blocks=(Blocks("blocks", {"image": "x"}, ("image",)),))
    >>> register(fam) is get("demo-tiny")
    True
    """
    _load()
    if not replace:
        if family.name in _REGISTRY:
            raise InvalidArgumentError(f"torchfix.families: a family named {family.name!r} is registered already (pass replace=True).")
        taken = {c: f.name for f in _REGISTRY.values() for c in f.classes}
        clash = [c for c in family.classes if c in taken]
        if clash:
            raise InvalidArgumentError(f"torchfix.families: {', '.join(clash)} already belongs to family {taken[clash[0]]!r}.")
    _REGISTRY[family.name] = family
    return family


def unregister(name: str) -> Family:
    """Take the family registered as ``name`` out of the registry (its models are then read off their code, or
    refused); torchfix's own entries stay.

    >>> from torchfix.families import Family, Blocks, register, unregister
    >>> fam = register(Family("demo-gone", "A demo", ("GoneModel",), blocks=(Blocks("blocks", {"image": "x"}, ("image",)),)))
    >>> unregister("demo-gone") is fam
    True
    """
    _load()
    if name in _BUILTIN:
        raise InvalidArgumentError(f"torchfix.families: {name!r} is one of torchfix's own entries; register(..., replace=True) changes it.")
    try:
        return _REGISTRY.pop(name)
    except KeyError:
        raise UnknownNameError(f"torchfix.families: no family {name!r}; known: {', '.join(sorted(_REGISTRY))}.") from None


def get(name: str) -> Family:
    """The family registered as ``name``."""
    _load()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownNameError(f"torchfix.families: no family {name!r}; known: {', '.join(sorted(_REGISTRY))}.") from None


def names(builtin: bool = False) -> tuple[str, ...]:
    """Every registered family's name, in registration order (``builtin``: only torchfix's own entries)."""
    _load()
    return tuple(n for n in _REGISTRY if not builtin or n in _BUILTIN)


def find(model: Any) -> Family | None:
    """The family of ``model`` (a denoiser instance or class): its class, else the nearest base, named by module
    path (``"comfy.ldm.flux.model.Flux"``: ComfyUI's classes, some named as diffusers' are) or by name alone. A
    ComfyUI class (or a class deriving from one) matches by its own module path only: ComfyUI's subclasses change
    how blocks are called (Wan VACE adds its hints between blocks), so they are read off their code instead.

    >>> find(object()) is None
    True
    """
    _load()
    by_class = {c: f for f in _REGISTRY.values() for c in f.classes}
    cls = model if isinstance(model, type) else type(model)
    comfy = any(base.__module__.startswith(_COMFY) for base in cls.__mro__)
    for base in cls.__mro__:
        family = by_class.get(f"{base.__module__}.{base.__qualname__}")
        if family is None and not comfy:  # ComfyUI's HiDream has diffusers' class name: never matched by name alone
            family = by_class.get(base.__name__)
        if family is not None or comfy:  # ComfyUI's subclasses run blocks their own way (Wan VACE, S2V): read anew
            return family
    return None


_REFUSED: dict[str, tuple[str, str, bool]] = {}  # class path -> (what users call it, why it is not cached, subclasses too)


def refuse(path: str, title: str, why: str, *, subclasses: bool = True) -> None:
    """Refuse the class at module path ``path`` by name, with the reason: a class whose forward reads like a
    denoiser's but that the cache must not drive (state added in place inside a helper the code reading cannot see, a
    building block nested in other models, a model whose output a cached step would compute from nothing of its own
    input). ``subclasses``: its subclasses too (a subclass of a refused diffusers building block is the user's own,
    read off its code). An entry :func:`register` takes for the class wins over it.

    >>> refuse("demo.Model", "A demo", "its blocks share state"); refusal(type("Model", (), {"__module__": "demo"}))
    ('A demo', 'its blocks share state')
    >>> _ = _REFUSED.pop("demo.Model")
    """
    _REFUSED[path] = (title, why, subclasses)


def refusal(model: Any) -> tuple[str, str] | None:
    """``(title, why)`` where ``model`` (an instance or a class) is refused by name (:func:`refuse`), else ``None``."""
    _load()
    cls = model if isinstance(model, type) else type(model)
    for base in cls.__mro__:
        refused = _REFUSED.get(f"{base.__module__}.{base.__qualname__}")
        if refused is not None and (base is cls or refused[2]):
            return refused[:2]
    return None


def supported(kind: str | None = None) -> str:
    """The registered families in words (for error messages): ``"SD1.x/2.x/SDXL (unet), SD3/SD3.5 (sd3), ..."``."""
    _load()
    return ", ".join(f"{f.title} ({f.name})" for f in _REGISTRY.values() if kind is None or f.kind == kind)


def with_defaults(family: Family, **changes: Any) -> Family:
    """A copy of ``family`` with ``changes`` (a variant entry)."""
    return dataclasses.replace(family, **changes)


_LOADED: list[bool] = []
_BUILTIN: set[str] = set()


def _load() -> None:
    if not _LOADED:
        _LOADED.append(True)
        from . import entries  # noqa: F401  (registers the built-in families, then calls builtin_done)


def builtin_done() -> None:
    """The built-in entries are in (the last line of :mod:`torchfix.families.entries`): what is registered now is
    torchfix's own. Not in :func:`_load`: where ``entries`` is imported first, its first ``register`` runs ``_load``
    while the registry is still empty."""
    _BUILTIN.update(_REGISTRY)
