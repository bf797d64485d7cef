"""DeepCache for ComfyUI's own UNet (``comfy.ldm.modules.diffusionmodules.openaimodel.UNetModel``: SD1.x/2.x/SDXL
as ComfyUI runs them): on a cached step only ``input_blocks[0..branch]`` and the output blocks that consume their
skips run, around the deep feature of the last full steps, at any latent size.

ComfyUI's ``input_blocks`` are diffusers' skip producers one for one (``conv_in``, each layer, each downsampler)
and its ``output_blocks`` the consumers in reverse, so ``branch`` means the same skip connection in both. Full
steps are ComfyUI's own ``_forward`` (its ``DIFFUSION_MODEL`` wrappers, patches and ControlNet untouched); the
feature is what output block ``N − 2 − branch`` returns. A cached step runs :func:`shallow`, which mirrors
``UNetModel._forward`` of ComfyUI 0.3.64 (:data:`FOLLOWS`) for the blocks that run, patches included
(``input_block_patch``, ``output_block_patch``, ...); upsample sizes come from the live skips, as in ComfyUI, so
odd latent sizes round-trip. tests/comfyui checks a cached step fed a full step's feature against the full step.
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from .._frames import hiding_frames
from ..errors import InvalidArgumentError, UnsupportedModelError
from ..families import Family
from ..patches import instance
from . import engine, forecast
from .config import DeepCacheConfig
from .unet import UNetState, _capture_hook, _decide, _done_full

__all__ = ["FOLLOWS", "ComfyLayout", "analyse", "apply", "shallow"]

log = logging.getLogger("torchfix")

FOLLOWS = ("0.3.64",)  # the ComfyUI releases whose UNetModel._forward :func:`shallow` mirrors


@dataclass(frozen=True)
class ComfyLayout:
    """How many input and output blocks the UNet has (skip ``k`` comes from ``input_blocks[k]`` and goes into
    ``output_blocks[n − 1 − k]``)."""

    n_inputs: int
    n_outputs: int

    @property
    def n_skips(self) -> int:
        return self.n_inputs

    def producer(self, branch: int) -> str:
        """The output block whose output is the deep feature of ``branch``."""
        return f"output_blocks.{self.n_outputs - 2 - branch}"

    def describe(self, branch: int) -> str:
        return (
            f"branch {branch}: skip from input_blocks.{branch} into output_blocks.{self.n_outputs - 1 - branch}; "
            f"cached steps run input_blocks.0..{branch} and output_blocks.{self.n_outputs - 1 - branch}.."
            f"{self.n_outputs - 1}"
        )


def analyse(unet: torch.nn.Module) -> ComfyLayout:
    """The skip layout of ComfyUI's ``UNetModel``, or a clear error."""
    name = type(unet).__name__
    missing = [a for a in ("input_blocks", "output_blocks", "_forward", "time_embed", "out") if not hasattr(unet, a)]
    if missing:
        raise UnsupportedModelError(
            f"torchfix.deepcache: ComfyUI's {name} lacks {', '.join(missing)}; ComfyUI {FOLLOWS[0]}'s UNetModel has them."
        )
    n_in, n_out = len(unet.input_blocks), len(unet.output_blocks)
    if n_in != n_out or n_in < 2:
        raise UnsupportedModelError(
            f"torchfix.deepcache: ComfyUI's {name} has {n_in} input and {n_out} output blocks; DeepCache needs one output "
            "block per input block's skip connection."
        )
    if getattr(unet, "predict_codebook_ids", False):
        raise UnsupportedModelError(f"torchfix.deepcache: ComfyUI's {name} predicts codebook ids; not a diffusion UNet DeepCache knows.")
    return ComfyLayout(n_in, n_out)


def check(unet: torch.nn.Module, config: DeepCacheConfig) -> ComfyLayout:
    """The layout, after checking that ``config`` fits it."""
    layout = analyse(unet)  # revise, keep_first, ...: refused before this, by torchfix.deepcache.mechanisms
    if not 0 <= config.branch <= layout.n_skips - 2:
        raise InvalidArgumentError(
            f"torchfix.deepcache: branch={config.branch} but ComfyUI's {type(unet).__name__} has {layout.n_skips} skip "
            f"connections, of which 0..{layout.n_skips - 2} can be a DeepCache branch."
        )
    return layout


def _skipped_transformers(unet: torch.nn.Module, layout: ComfyLayout, branch: int) -> int:
    """How many spatial transformers the blocks a cached step skips hold: ComfyUI numbers them as they run
    (``transformer_options["transformer_index"]``) and patches key on the number."""
    from comfy.ldm.modules.attention import SpatialTransformer

    skipped = list(unet.input_blocks[branch + 1 :]) + ([unet.middle_block] if unet.middle_block is not None else [])
    skipped += list(unet.output_blocks[: layout.n_outputs - 1 - branch])
    return sum(isinstance(layer, SpatialTransformer) for block in skipped for layer in block)


def shallow(
    unet: Any,
    layout: ComfyLayout,
    branch: int,
    feature: torch.Tensor,
    x: torch.Tensor,
    timesteps: Any = None,
    context: Any = None,
    y: Any = None,
    control: Any = None,
    transformer_options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """ComfyUI's ``UNetModel._forward`` for a cached step: ``input_blocks[0..branch]``, then the output blocks from
    ``n − 1 − branch`` on, starting from ``feature``. Line for line what ComfyUI does for the blocks that run."""
    from comfy.ldm.modules.diffusionmodules.openaimodel import apply_control, forward_timestep_embed, timestep_embedding

    transformer_options = {} if transformer_options is None else transformer_options
    transformer_options["original_shape"] = list(x.shape)
    transformer_options["transformer_index"] = 0
    transformer_patches = transformer_options.get("patches", {})
    num_video_frames = kwargs.get("num_video_frames", unet.default_num_video_frames)
    image_only_indicator = kwargs.get("image_only_indicator", None)
    time_context = kwargs.get("time_context", None)
    video = {"time_context": time_context, "num_video_frames": num_video_frames, "image_only_indicator": image_only_indicator}
    if (y is not None) != (unet.num_classes is not None):
        raise InvalidArgumentError("torchfix.deepcache: ComfyUI's UNetModel: pass y if and only if the model is class-conditional.")
    hs = []
    t_emb = timestep_embedding(timesteps, unet.model_channels, repeat_only=False).to(x.dtype)
    emb = unet.time_embed(t_emb)
    for p in transformer_patches.get("emb_patch", ()):
        emb = p(emb, unet.model_channels, transformer_options)
    if unet.num_classes is not None:
        emb = emb + unet.label_emb(y)

    h = x
    for index in range(branch + 1):
        transformer_options["block"] = ("input", index)
        h = forward_timestep_embed(unet.input_blocks[index], h, emb, context, transformer_options, **video)
        h = apply_control(h, control, "input")
        for p in transformer_patches.get("input_block_patch", ()):
            h = p(h, transformer_options)
        hs.append(h)
        for p in transformer_patches.get("input_block_patch_after_skip", ()):
            h = p(h, transformer_options)

    if "transformer_index" in transformer_options:  # the spatial transformers of the skipped blocks
        transformer_options["transformer_index"] += _skipped_transformers(unet, layout, branch)
    h = feature
    for index in range(layout.n_outputs - 1 - branch, layout.n_outputs):
        transformer_options["block"] = ("output", index)
        hsp = hs.pop()
        hsp = apply_control(hsp, control, "output")
        for p in transformer_patches.get("output_block_patch", ()):
            h, hsp = p(h, hsp, transformer_options)
        h = torch.cat([h, hsp], dim=1)
        del hsp
        output_shape = hs[-1].shape if hs else None
        h = forward_timestep_embed(unet.output_blocks[index], h, emb, context, transformer_options, output_shape, **video)
    h = h.type(x.dtype)
    return unet.out(h)


# ComfyUI patch points that run on the deep feature or what follows it in the output path.
IN_PLACE_PATCHES = ("output_block_patch",)


def _changes_in_place(options: Any) -> bool:
    patches = options.get("patches") if isinstance(options, dict) else None
    return isinstance(patches, dict) and any(patches.get(name) for name in IN_PLACE_PATCHES)


def _make_forward(unet: torch.nn.Module, state: UNetState) -> Any:
    unet_ref = weakref.ref(unet)
    source = unet._forward
    sig = inspect.signature(source)
    original = source

    @functools.wraps(source)
    def _forward(*args: Any, **kwargs: Any) -> Any:
        arguments = sig.bind(*args, **kwargs).arguments
        full = _decide(state, arguments["x"], None, arguments)
        if full is None:
            return original(*args, **kwargs)
        # patches that change what they are handed in place (FreeU scales h inside output_block_patch)
        patched = _changes_in_place(arguments.get("transformer_options"))
        if full:
            step = state.step
            capturing, state.copy_feature = step.capturing, patched
            try:
                output = original(*args, **kwargs)
            except BaseException:
                state.step = state.idle()
                raise
            if capturing and (0 not in step.pending or engine.changed(step.pending[0], state.feature_marker)):
                what = "never ran its last layer (a patch replaced it?)" if 0 not in step.pending else "was changed in place after it"
                state.step = state.idle()
                raise UnsupportedModelError(
                    f"torchfix.deepcache: ComfyUI's {type(unet).__name__}: the deep feature (what "
                    f"{state.layout.producer(state.config.branch)} returns) {what}, so the cached steps cannot be "
                    "trusted; nothing was cached. Remove the torchfix cache from this model, or the patch that does this."
                )
            _done_full(state)
            return output
        extra = arguments.pop("kwargs", None) or {}
        feature = forecast.for_this_step(state)
        if patched:
            feature = feature.clone()  # the history's own tensor (forecast=0) must not be changed by the patch
        return shallow(unet_ref(), state.layout, state.config.branch, feature, **arguments, **extra)

    _forward.__torchfix_deepcache__ = True  # type: ignore[attr-defined]
    return hiding_frames(_forward)


def apply(unet: torch.nn.Module, family: Family, config: DeepCacheConfig, layout: ComfyLayout) -> UNetState:
    """Install the capture hook and the ``_forward`` on ComfyUI's ``unet`` (the caller registers the state)."""
    state = UNetState(family, config, unet._forward, layout=layout, check_feature=True)  # type: ignore[arg-type]
    state.follow(unet)
    producer = unet.output_blocks[layout.n_outputs - 2 - config.branch]
    last = producer[-1] if len(producer) else producer
    state.handles.append(instance.add_hook(last, _capture_hook(weakref.ref(state), pre=False)))
    state.handles.append(instance.set_attr(unet, "_forward", _make_forward(unet, state)))
    what = layout.describe(config.branch)
    log.debug("torchfix.deepcache: applied to ComfyUI's %s (%s, interval=%d)", type(unet).__name__, what, config.interval)
    return state
