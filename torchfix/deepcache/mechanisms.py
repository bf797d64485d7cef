"""How a denoiser is cached, chosen from a table by its family: a *mechanism* checks a model against a config
(before anything is installed), installs the cache, and names the :class:`torchfix.DeepCacheConfig` options only it
reads. ``apply``/``check`` dispatch through :func:`of` instead of a ladder of ``isinstance`` tests, and a config
that sets an option its model's mechanism does not have is refused, never silently ignored (``branch=5`` on a
transformer, ``keep_first=3`` on a UNet).

==========================  =====================================  ===============================
mechanism                   models                                 its own options
==========================  =====================================  ===============================
``unet``                    diffusers' UNets (SD, SDXL, AnimateDiff, SVD)   ``branch``
``comfyui-unet``            ComfyUI's ``UNetModel``                ``branch``
``blocks``                  diffusion transformers (both hosts)    ``keep_first``, ``keep_last``, ``sensitivity``, ``revise``
==========================  =====================================  ===============================

The options every mechanism reads (``interval``, ``schedule``, ``start``, ``stop``, ``power``, ``num_steps``,
``forecast``, ``threshold``, ``warm_up``) are the generation's and stay on :class:`DeepCacheConfig` for all.

>>> from torchfix import families
>>> of(families.get("flux")).name, of(families.get("unet")).name
('blocks', 'unet')
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidArgumentError
from ..families import Family
from .config import DeepCacheConfig

__all__ = [
    "BLOCKS",
    "COMFY_UNET",
    "MECHANISMS",
    "OWN_OPTIONS",
    "UNET",
    "Blocks",
    "BlocksOptions",
    "ComfyUNet",
    "Mechanism",
    "UNet",
    "UNetOptions",
    "foreign_options",
    "of",
    "refuse_foreign",
    "without_foreign",
]


# --- each mechanism's own options, behind the public DeepCacheConfig -------------------------------------------------


class _Options:
    @classmethod
    def of(cls, config: DeepCacheConfig) -> Any:
        """This mechanism's options as ``config`` sets them (each is a DeepCacheConfig field of the same name)."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class UNetOptions(_Options):
    """The options only the UNet mechanisms read (``branch``: the skip connection whose consumer's input is the kept
    deep feature).

    >>> UNetOptions.of(DeepCacheConfig(branch=2))
    UNetOptions(branch=2)
    """

    branch: int = 0


@dataclass(frozen=True)
class BlocksOptions(_Options):
    """The options only the transformer-blocks mechanism reads (DeepCacheConfig fields: the blocks that always run,
    the share of an input change the cached blocks pass through, and whether cached steps are revised).

    >>> BlocksOptions.of(DeepCacheConfig(keep_first=2)).keep_first
    2
    """

    keep_first: int | None = None
    keep_last: int | None = None
    sensitivity: float | None = None
    revise: bool | None = None


# The options one mechanism reads, with the value that means "not set" (the dataclass default).
OWN_OPTIONS: dict[str, Any] = {
    f.name: f.default for options in (UNetOptions, BlocksOptions) for f in dataclasses.fields(options)
}


# --- the mechanisms ----------------------------------------------------------------------------------------------


class Mechanism:
    """One way of caching a denoiser: :meth:`check` refuses what cannot be cached, before anything is installed;
    :meth:`install` puts in its forwards and hooks (reversible), whose model forward decides each call
    (:attr:`on_call` names it); :attr:`options` is the config of the options only it reads.

    Attributes:
        name: its key in errors and stats.
        what: what it skips, in words.
        options: its own options' dataclass (:class:`UNetOptions`, :class:`BlocksOptions`).
        on_call: where each call of a cached model goes (its module's model forward), for the reader.
    """

    name: str = ""
    what: str = ""
    options: type = UNetOptions
    on_call: str = ""

    @property
    def option_names(self) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(self.options))

    def check(self, model: torch.nn.Module, config: DeepCacheConfig, family: Family) -> Any:
        """The layout ``install`` needs, or a clear error (nothing installed)."""
        raise NotImplementedError

    def install(self, model: torch.nn.Module, family: Family, config: DeepCacheConfig, layout: Any) -> Any:
        """The cache state, its forwards and hooks installed."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<mechanism {self.name!r}>"


class UNet(Mechanism):
    """diffusers' UNets (SD, SDXL, AnimateDiff, SVD): the deep part below skip connection ``branch``."""

    name, what, options = "unet", "the deep part of the UNet below skip connection `branch`", UNetOptions
    on_call = "torchfix.deepcache.unet._make_forward"

    def check(self, model: torch.nn.Module, config: DeepCacheConfig, family: Family) -> Any:
        from .layout import analyse

        layout = analyse(model)
        if config.branch >= layout.n_skips:
            raise InvalidArgumentError(
                f"torchfix.deepcache: branch={config.branch} but {type(model).__name__} has {layout.n_skips} skip connections "
                f"(branch 0..{layout.n_skips - 1})."
            )
        return layout

    def install(self, model: torch.nn.Module, family: Family, config: DeepCacheConfig, layout: Any) -> Any:
        from .unet import apply_unet

        return apply_unet(model, family, config, layout)


class ComfyUNet(Mechanism):
    """ComfyUI's ``UNetModel``: the deep part below skip connection ``branch``, around ComfyUI's own ``_forward``."""

    name, what, options = "comfyui-unet", "ComfyUI's UNetModel below skip connection `branch`", UNetOptions
    on_call = "torchfix.deepcache.comfy_unet._make_forward"

    def check(self, model: torch.nn.Module, config: DeepCacheConfig, family: Family) -> Any:
        from . import comfy_unet

        return comfy_unet.check(model, config)

    def install(self, model: torch.nn.Module, family: Family, config: DeepCacheConfig, layout: Any) -> Any:
        from . import comfy_unet

        return comfy_unet.apply(model, family, config, layout)


class Blocks(Mechanism):
    """Diffusion transformers (both hosts): runs of blocks between the first ``keep_first`` and the last ``keep_last``."""

    name, what, options = "blocks", "runs of transformer blocks, between the first `keep_first` and the last `keep_last`", BlocksOptions
    on_call = "torchfix.deepcache.blocks._model_forward"

    def check(self, model: torch.nn.Module, config: DeepCacheConfig, family: Family) -> Any:
        from .blocks import check_transformer
        from .config import for_family

        return check_transformer(model, for_family(config, family))

    def install(self, model: torch.nn.Module, family: Family, config: DeepCacheConfig, layout: Any) -> Any:
        from .blocks import apply_transformer

        return apply_transformer(model, config, layout)


UNET, COMFY_UNET, BLOCKS = UNet(), ComfyUNet(), Blocks()
# (family kind, host) -> mechanism
MECHANISMS: dict[tuple[str, str], Mechanism] = {
    ("unet", "diffusers"): UNET,
    ("unet", "comfyui"): COMFY_UNET,
    ("transformer", "diffusers"): BLOCKS,
    ("transformer", "comfyui"): BLOCKS,
}


def of(family: Family) -> Mechanism:
    """The mechanism that caches ``family``'s denoisers."""
    return MECHANISMS[(family.kind, family.host)]


def foreign_options(config: DeepCacheConfig, mechanism: Mechanism) -> list[str]:
    """The options ``config`` sets that ``mechanism`` does not read (``name=value``)."""
    return [
        f"{name}={getattr(config, name)!r}"
        for name, unset in OWN_OPTIONS.items()
        if name not in mechanism.option_names and getattr(config, name) != unset
    ]


def refuse_foreign(model: torch.nn.Module, family: Family, config: DeepCacheConfig) -> None:
    """:class:`InvalidArgumentError` where ``config`` sets an option ``model``'s mechanism does not have: it would be
    ignored, and a silent no-op is not torchfix's way."""
    mechanism = of(family)
    foreign = foreign_options(config, mechanism)
    if foreign:
        owners = sorted({m.name for m in MECHANISMS.values() for o in foreign if o.split("=")[0] in m.option_names})
        raise InvalidArgumentError(
            f"torchfix.deepcache: {', '.join(foreign)} set, but {type(model).__name__} ({family.title}) is cached by the "
            f"{mechanism.name!r} mechanism ({mechanism.what}), which has no such option (it belongs to {' and '.join(owners)}). "
            f"Leave it out for this model; its options: {', '.join(sorted(mechanism.option_names))}."
        )


def without_foreign(config: DeepCacheConfig, family: Family) -> tuple[DeepCacheConfig, list[str]]:
    """``config`` with the options ``family``'s mechanism does not have put back to unset, and which they were (for
    one process-wide config applied to every pipeline: ``torchfix.deepcache.auto``)."""
    mechanism = of(family)
    foreign = foreign_options(config, mechanism)
    unset = {name: OWN_OPTIONS[name] for name in (o.split("=")[0] for o in foreign)}
    return (dataclasses.replace(config, **unset) if unset else config), foreign
