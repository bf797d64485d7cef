"""Where a UNet's skip connections are produced and consumed.

DeepCache's ``branch`` is a skip-connection index. For a UNet with ``conv_in``,
down blocks of ``resnets`` (+ ``attentions``, + ``motion_modules``) and ``downsamplers``, and up
blocks that consume the skips in reverse, skip ``k`` is produced by
``conv_in`` (k=0), a down layer, or a downsampler, and consumed by resnet
``j`` of up block ``i``. A cached step recomputes the producers of skips
``0..branch`` and the consumers of those skips, starting from the deep feature
that entered consumer ``branch`` at the last full step.

Three UNets share that layout (a layout's :attr:`Layout.variant`): diffusers' image UNet
(``UNet2DConditionModel``, variant ``""``), AnimateDiff's ``UNetMotionModel`` (``"motion"``: each layer's
resnet and attention are followed by a motion module that mixes the frames of a sample) and Stable Video
Diffusion's ``UNetSpatioTemporalConditionModel`` (``"spatiotemporal"``: spatio-temporal resnets and
attentions, told the frame count by an ``image_only_indicator``). The video UNets fold the frames into
the batch dimension (``[batch·frames, C, h, w]``) between ``conv_in`` and ``conv_out``; their frames stay
together per sample, so the rows of a batch stay independent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UnsupportedModelError, UnsupportedUNetError

__all__ = [
    "BLOCKS",
    "SUPPORTED_DOWN",
    "SUPPORTED_UP",
    "VARIANTS",
    "Layout",
    "UnsupportedModelError",
    "UnsupportedUNetError",
    "analyse",
    "variant_of",
]

# Per variant: the model classes (matched on the class and its bases), the helpers the cached step calls, and the
# down and up block classes whose layers it runs one by one.
VARIANTS = {
    "": ("UNet2DConditionModel",),
    "motion": ("UNetMotionModel",),
    "spatiotemporal": ("UNetSpatioTemporalConditionModel",),
}
_HELPERS = {
    "": ("get_time_embed", "get_class_embed", "get_aug_embed", "process_encoder_hidden_states", "time_embedding", "conv_in", "conv_out"),
    "motion": ("time_proj", "time_embedding", "conv_in", "conv_out"),
    "spatiotemporal": ("time_proj", "time_embedding", "add_time_proj", "add_embedding", "conv_in", "conv_norm_out", "conv_out"),
}
BLOCKS = {
    "": (("CrossAttnDownBlock2D", "DownBlock2D"), ("CrossAttnUpBlock2D", "UpBlock2D")),
    "motion": (("CrossAttnDownBlockMotion", "DownBlockMotion"), ("CrossAttnUpBlockMotion", "UpBlockMotion")),
    "spatiotemporal": (
        ("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
        ("CrossAttnUpBlockSpatioTemporal", "UpBlockSpatioTemporal"),
    ),
}
SUPPORTED_DOWN = tuple(name for down, _ in BLOCKS.values() for name in down)
SUPPORTED_UP = tuple(name for _, up in BLOCKS.values() for name in up)
_WHAT = {
    "": "diffusers' UNet2DConditionModel (SD1.x/2.x/SDXL layouts, diffusers >= 0.27)",
    "motion": "AnimateDiff's UNetMotionModel",
    "spatiotemporal": "Stable Video Diffusion's UNetSpatioTemporalConditionModel",
}


def variant_of(unet: torch.nn.Module | type) -> str:
    """Which UNet ``unet`` is (:data:`VARIANTS`), by its class and its bases; ``""`` (the image UNet) for any other.

    >>> variant_of(torch.nn.Module())
    ''
    """
    cls = unet if isinstance(unet, type) else type(unet)
    names = {base.__name__ for base in cls.__mro__}
    return next((v for v, classes in VARIANTS.items() if v and names & set(classes)), "")


@dataclass(frozen=True)
class Layout:
    """Skip producers (``("conv_in",)``, ``("layer", block, j)``, ``("down", block)``)
    and, for each skip, its consumer ``(up_block, resnet)``; ``variant``: which UNet (:data:`VARIANTS`)."""

    producers: tuple[tuple, ...]
    consumers: tuple[tuple[int, int], ...]
    variant: str = ""

    @property
    def n_skips(self) -> int:
        return len(self.producers)

    def describe(self, branch: int) -> str:
        """Human words for a branch: what is recomputed on cached steps."""
        prod = self.producers[branch]
        where = (
            "conv_in"
            if prod[0] == "conv_in"
            else (f"down_blocks.{prod[1]}.resnets.{prod[2]}" if prod[0] == "layer" else f"down_blocks.{prod[1]}.downsamplers")
        )
        i, j = self.consumers[branch]
        return f"branch {branch}: skip from {where} into up_blocks.{i}.resnets.{j}"


def _check_block(name: str, b: int, block: torch.nn.Module, variant: str, supported: tuple[str, ...], where: str) -> None:
    kind = type(block).__name__
    if kind not in supported:
        raise UnsupportedModelError(
            f"torchfix.deepcache: {name}.{where}_blocks.{b} is {kind}; the cached step of {_WHAT[variant]} runs only "
            f"{', '.join(supported)}, so it cannot recompute this block's layers (nothing is cached)."
        )
    n = len(block.resnets)
    for part in ("attentions", "motion_modules"):
        modules = getattr(block, part, None)
        if modules is not None and len(modules) != n:
            raise UnsupportedModelError(
                f"torchfix.deepcache: {name}.{where}_blocks.{b} has {len(block.resnets)} resnets but {len(modules)} {part}; "
                "the cached step runs them in pairs, so it would skip or repeat a layer (nothing is cached)."
            )
    if variant == "motion" and getattr(block, "motion_modules", None) is None:
        raise UnsupportedModelError(f"torchfix.deepcache: {name}.{where}_blocks.{b} ({kind}) has no motion_modules.")


def analyse(unet: torch.nn.Module) -> Layout:
    """The skip layout of a diffusers ``UNet2DConditionModel``-like UNet (or AnimateDiff's, or Stable Video
    Diffusion's: :data:`VARIANTS`), or a clear error."""
    name = type(unet).__name__
    variant = variant_of(unet)
    missing = [h for h in (*_HELPERS[variant], "down_blocks", "up_blocks") if not hasattr(unet, h)]
    if missing:
        raise UnsupportedModelError(f"torchfix.deepcache: {name} lacks {', '.join(missing)}; DeepCache's UNet family is {_WHAT[variant]}.")
    down, up = BLOCKS[variant]
    producers: list[tuple] = [("conv_in",)]
    for b, block in enumerate(unet.down_blocks):
        _check_block(name, b, block, variant, down, "down")
        producers += [("layer", b, j) for j in range(len(block.resnets))]
        if block.downsamplers is not None:
            producers.append(("down", b))
    remaining = list(range(len(producers)))
    consumers: dict[int, tuple[int, int]] = {}
    for i, block in enumerate(unet.up_blocks):
        _check_block(name, i, block, variant, up, "up")
        n = len(block.resnets)
        if n > len(remaining):
            raise UnsupportedModelError(
                f"torchfix.deepcache: {name}.up_blocks.{i} consumes more skip connections than the down path makes."
            )
        taken, remaining = remaining[-n:], remaining[:-n]
        for j, k in enumerate(reversed(taken)):
            consumers[k] = (i, j)
    if remaining:
        raise UnsupportedModelError(f"torchfix.deepcache: {len(remaining)} skip connection(s) of {name} are never consumed.")
    return Layout(tuple(producers), tuple(consumers[k] for k in range(len(producers))), variant)
