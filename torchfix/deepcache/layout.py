"""Where a UNet's skip connections are produced and consumed.

DeepCache's ``branch`` is a skip-connection index. For a UNet with ``conv_in``,
down blocks of ``resnets`` (+ ``attentions``) and ``downsamplers``, and up
blocks that consume the skips in reverse, skip ``k`` is produced by
``conv_in`` (k=0), a down layer, or a downsampler, and consumed by resnet
``j`` of up block ``i``. A cached step recomputes the producers of skips
``0..branch`` and the consumers of those skips, starting from the deep feature
that entered consumer ``branch`` at the last full step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UnsupportedModelError, UnsupportedUNetError

__all__ = ["SUPPORTED_DOWN", "SUPPORTED_UP", "Layout", "UnsupportedModelError", "UnsupportedUNetError", "analyse"]

SUPPORTED_DOWN = ("CrossAttnDownBlock2D", "DownBlock2D")
SUPPORTED_UP = ("CrossAttnUpBlock2D", "UpBlock2D")
_HELPERS = ("get_time_embed", "get_class_embed", "get_aug_embed", "process_encoder_hidden_states", "time_embedding", "conv_in", "conv_out")




@dataclass(frozen=True)
class Layout:
    """Skip producers (``("conv_in",)``, ``("layer", block, j)``, ``("down", block)``)
    and, for each skip, its consumer ``(up_block, resnet)``."""

    producers: tuple[tuple, ...]
    consumers: tuple[tuple[int, int], ...]

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


def analyse(unet: torch.nn.Module) -> Layout:
    """The skip layout of a diffusers ``UNet2DConditionModel``-like UNet, or a clear error."""
    name = type(unet).__name__
    missing = [h for h in (*_HELPERS, "down_blocks", "up_blocks") if not hasattr(unet, h)]
    if missing:
        raise UnsupportedModelError(
            f"torchfix.deepcache: {name} lacks {', '.join(missing)}; DeepCache's UNet family is diffusers' UNet2DConditionModel "
            "(SD1.x/2.x/SDXL layouts, diffusers >= 0.27)."
        )
    producers: list[tuple] = [("conv_in",)]
    for b, block in enumerate(unet.down_blocks):
        if type(block).__name__ not in SUPPORTED_DOWN:
            raise UnsupportedModelError(
                f"torchfix.deepcache: down_blocks.{b} is {type(block).__name__}; supported down blocks: {', '.join(SUPPORTED_DOWN)}."
            )
        producers += [("layer", b, j) for j in range(len(block.resnets))]
        if block.downsamplers is not None:
            producers.append(("down", b))
    remaining = list(range(len(producers)))
    consumers: dict[int, tuple[int, int]] = {}
    for i, block in enumerate(unet.up_blocks):
        if type(block).__name__ not in SUPPORTED_UP:
            raise UnsupportedModelError(
                f"torchfix.deepcache: up_blocks.{i} is {type(block).__name__}; supported up blocks: {', '.join(SUPPORTED_UP)}."
            )
        n = len(block.resnets)
        if n > len(remaining):
            raise UnsupportedModelError(f"torchfix.deepcache: up_blocks.{i} consumes more skip connections than the down path makes.")
        taken, remaining = remaining[-n:], remaining[:-n]
        for j, k in enumerate(reversed(taken)):
            consumers[k] = (i, j)
    if remaining:
        raise UnsupportedModelError(f"torchfix.deepcache: {len(remaining)} skip connection(s) of {name} are never consumed.")
    return Layout(tuple(producers), tuple(consumers[k] for k in range(len(producers))))
