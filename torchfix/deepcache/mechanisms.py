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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import InvalidArgumentError
from ..families import Family
from .config import DeepCacheConfig

__all__ = ["MECHANISMS", "OWN_OPTIONS", "Mechanism", "foreign_options", "of", "refuse_foreign", "without_foreign"]

# The options one mechanism reads, with the value that means "not set" (the dataclass default).
OWN_OPTIONS: dict[str, Any] = {
    field.name: field.default
    for field in dataclasses.fields(DeepCacheConfig)
    if field.name in ("branch", "keep_first", "keep_last", "sensitivity", "revise")
}


@dataclass(frozen=True)
class Mechanism:
    """One way of caching a denoiser.

    Args:
        name: its key in :data:`MECHANISMS`, in stats and errors.
        what: what it skips, in words.
        options: the :data:`OWN_OPTIONS` it reads.
        check: ``(model, config, family) -> layout``: refuses what cannot be cached, before anything is installed.
        install: ``(model, family, filled config, layout) -> state``: the forwards and hooks, reversible.
    """

    name: str
    what: str
    options: frozenset[str]
    check: Callable[[torch.nn.Module, DeepCacheConfig, Family], Any]
    install: Callable[[torch.nn.Module, Family, DeepCacheConfig, Any], Any]


def _unet_check(model: torch.nn.Module, config: DeepCacheConfig, family: Family) -> Any:
    from .layout import analyse

    layout = analyse(model)
    if config.branch >= layout.n_skips:
        raise InvalidArgumentError(
            f"torchfix.deepcache: branch={config.branch} but {type(model).__name__} has {layout.n_skips} skip connections "
            f"(branch 0..{layout.n_skips - 1})."
        )
    return layout


def _unet_install(model: torch.nn.Module, family: Family, config: DeepCacheConfig, layout: Any) -> Any:
    from .unet import apply_unet

    return apply_unet(model, family, config, layout)


def _comfy_check(model: torch.nn.Module, config: DeepCacheConfig, family: Family) -> Any:
    from . import comfy_unet

    return comfy_unet.check(model, config)


def _comfy_install(model: torch.nn.Module, family: Family, config: DeepCacheConfig, layout: Any) -> Any:
    from . import comfy_unet

    return comfy_unet.apply(model, family, config, layout)


def _blocks_check(model: torch.nn.Module, config: DeepCacheConfig, family: Family) -> Any:
    from .blocks import check_transformer
    from .config import for_family

    return check_transformer(model, for_family(config, family))


def _blocks_install(model: torch.nn.Module, family: Family, config: DeepCacheConfig, layout: Any) -> Any:
    from .blocks import apply_transformer

    return apply_transformer(model, config, layout)


UNET = Mechanism("unet", "the deep part of the UNet below skip connection `branch`", frozenset({"branch"}), _unet_check, _unet_install)
COMFY_UNET = Mechanism(
    "comfyui-unet", "ComfyUI's UNetModel below skip connection `branch`", frozenset({"branch"}), _comfy_check, _comfy_install
)
BLOCKS = Mechanism(
    "blocks",
    "runs of transformer blocks, between the first `keep_first` and the last `keep_last`",
    frozenset({"keep_first", "keep_last", "sensitivity", "revise"}),
    _blocks_check,
    _blocks_install,
)
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
        if name not in mechanism.options and getattr(config, name) != unset
    ]


def refuse_foreign(model: torch.nn.Module, family: Family, config: DeepCacheConfig) -> None:
    """:class:`InvalidArgumentError` where ``config`` sets an option ``model``'s mechanism does not have: it would be
    ignored, and a silent no-op is not torchfix's way."""
    mechanism = of(family)
    foreign = foreign_options(config, mechanism)
    if foreign:
        owners = sorted({m.name for m in MECHANISMS.values() for o in foreign if o.split("=")[0] in m.options})
        raise InvalidArgumentError(
            f"torchfix.deepcache: {', '.join(foreign)} set, but {type(model).__name__} ({family.title}) is cached by the "
            f"{mechanism.name!r} mechanism ({mechanism.what}), which has no such option (it belongs to {' and '.join(owners)}). "
            f"Leave it out for this model; its options: {', '.join(sorted(mechanism.options))}."
        )


def without_foreign(config: DeepCacheConfig, family: Family) -> tuple[DeepCacheConfig, list[str]]:
    """``config`` with the options ``family``'s mechanism does not have put back to unset, and which they were (for
    one process-wide config applied to every pipeline: ``torchfix.deepcache.auto``)."""
    mechanism = of(family)
    foreign = foreign_options(config, mechanism)
    unset = {name: OWN_OPTIONS[name] for name in (o.split("=")[0] for o in foreign)}
    return (dataclasses.replace(config, **unset) if unset else config), foreign
