"""The cached step: the shallow part of a diffusers UNet around one cached deep feature.

It mirrors ``UNet2DConditionModel.forward`` using the model's own helpers for
the embeddings, then runs only the down layers that produce skips ``0..branch``
and the up layers that consume them, starting from the cached feature. It follows
the forward of diffusers 0.27 to 0.42 (:data:`FOLLOWS`); tests/deepcache/
test_shallow_parity.py checks it against the *installed* diffusers' forward,
bit for bit, for every conditioning kind it handles (class labels, text_time,
text, image and image-hint embeddings, encoder_hid_dim, timestep_cond, GLIGEN,
attention masks, FreeU, LoRA scale, ControlNet residuals) at even and odd sizes.
Upsample sizes come from the live skip tensors, as diffusers' ``forward_upsample_size`` does, so odd latent sizes (45×60 → 23×30 → 12×15)
round-trip, and nothing depends on a shape fixed at trace time.

The video UNets (:data:`torchfix.deepcache.layout.VARIANTS`) have a forward of their own each, mirrored the same way
(``UNetMotionModel.forward``: AnimateDiff; ``UNetSpatioTemporalConditionModel.forward``: Stable Video Diffusion;
diffusers 0.35 to 0.42 alike) and checked against it by tests/deepcache/test_temporal_unets.py: the frames fold
into the batch dimension after the embeddings, each layer's motion module (or spatio-temporal resnet and
attention) sees the frame count of *this* call, and the output unfolds them again.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..errors import InvalidCallError
from .layout import Layout

__all__ = ["FOLLOWS", "shallow_forward"]

FOLLOWS = ("0.27", "0.42")  # the diffusers releases whose UNet2DConditionModel.forward this mirrors


def _attention(block: torch.nn.Module, j: int, h: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
    attentions = getattr(block, "attentions", None)
    if attentions is None:
        return h
    return attentions[j](
        h,
        encoder_hidden_states=ctx["encoder_hidden_states"],
        cross_attention_kwargs=ctx["cross_attention_kwargs"],
        attention_mask=ctx["attention_mask"],
        encoder_attention_mask=ctx["encoder_attention_mask"],
        return_dict=False,
    )[0]


def _freeu(block: torch.nn.Module) -> dict[str, Any] | None:
    params = {k: getattr(block, k, None) for k in ("s1", "s2", "b1", "b2")}
    return params if all(params.values()) else None


def _layer(block: torch.nn.Module, j: int, h: torch.Tensor, ctx: dict[str, Any]) -> torch.Tensor:
    """Layer ``j`` of a down or up block: its resnet, its attention (where it has one) and, in AnimateDiff's
    blocks, its motion module, called as the block's own forward calls them (AnimateDiff's by keyword: FreeNoise's
    split inference wraps its resnets and attentions in modules that split only the tensors passed by keyword)."""
    variant = ctx["variant"]
    if variant == "spatiotemporal":
        indicator = ctx["image_only_indicator"]
        h = block.resnets[j](h, ctx["emb"], image_only_indicator=indicator)
        attentions = getattr(block, "attentions", None)
        if attentions is None:
            return h
        return attentions[j](h, encoder_hidden_states=ctx["encoder_hidden_states"], image_only_indicator=indicator, return_dict=False)[0]
    if variant == "motion":
        h = block.resnets[j](input_tensor=h, temb=ctx["emb"])
        if getattr(block, "attentions", None) is not None:
            h = block.attentions[j](
                hidden_states=h,
                encoder_hidden_states=ctx["encoder_hidden_states"],
                cross_attention_kwargs=ctx["cross_attention_kwargs"],
                attention_mask=ctx["attention_mask"],
                encoder_attention_mask=ctx["encoder_attention_mask"],
                return_dict=False,
            )[0]
        return block.motion_modules[j](h, num_frames=ctx["num_frames"])
    h = block.resnets[j](h, ctx["emb"])
    return _attention(block, j, h, ctx)


def _resample(sampler: torch.nn.Module, h: torch.Tensor, ctx: dict[str, Any], *size: Any) -> torch.Tensor:
    """A down- or upsampler (``size``: an upsampler's output size), called as the variant's blocks call it."""
    if ctx["variant"] == "motion":
        return sampler(hidden_states=h, **({"output_size": size[0]} if size else {}))
    return sampler(h, *size)


def _call_up_block(block: torch.nn.Module, h: torch.Tensor, res: tuple, upsample_size: Any, ctx: dict[str, Any]) -> torch.Tensor:
    variant = ctx["variant"]
    cross = getattr(block, "has_cross_attention", False)
    if variant == "spatiotemporal":
        extra = {"encoder_hidden_states": ctx["encoder_hidden_states"]} if cross else {}
        return block(
            hidden_states=h,
            temb=ctx["emb"],
            res_hidden_states_tuple=res,
            upsample_size=upsample_size,
            image_only_indicator=ctx["image_only_indicator"],
            **extra,
        )
    if variant == "motion":
        if cross:
            return block(
                hidden_states=h,
                temb=ctx["emb"],
                res_hidden_states_tuple=res,
                encoder_hidden_states=ctx["encoder_hidden_states"],
                upsample_size=upsample_size,
                attention_mask=ctx["attention_mask"],
                num_frames=ctx["num_frames"],
                cross_attention_kwargs=ctx["cross_attention_kwargs"],
            )
        return block(
            hidden_states=h, temb=ctx["emb"], res_hidden_states_tuple=res, upsample_size=upsample_size, num_frames=ctx["num_frames"]
        )
    if cross:
        return block(
            hidden_states=h,
            temb=ctx["emb"],
            res_hidden_states_tuple=res,
            encoder_hidden_states=ctx["encoder_hidden_states"],
            cross_attention_kwargs=ctx["cross_attention_kwargs"],
            upsample_size=upsample_size,
            attention_mask=ctx["attention_mask"],
            encoder_attention_mask=ctx["encoder_attention_mask"],
        )
    return block(hidden_states=h, temb=ctx["emb"], res_hidden_states_tuple=res, upsample_size=upsample_size)


def _shallow(
    unet: Any,
    layout: Layout,
    branch: int,
    cached: torch.Tensor,
    sample: torch.Tensor,
    timestep: Any,
    encoder_hidden_states: torch.Tensor,
    class_labels: torch.Tensor | None = None,
    timestep_cond: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    cross_attention_kwargs: dict[str, Any] | None = None,
    added_cond_kwargs: dict[str, torch.Tensor] | None = None,
    down_block_additional_residuals: tuple[torch.Tensor, ...] | None = None,
    mid_block_additional_residual: torch.Tensor | None = None,
    down_intrablock_additional_residuals: tuple[torch.Tensor, ...] | None = None,
    encoder_attention_mask: torch.Tensor | None = None,
    return_dict: bool = True,
) -> Any:
    del mid_block_additional_residual, down_intrablock_additional_residuals  # mid is cached; adapters run full steps
    factor = 2**unet.num_upsamplers
    forward_upsample_size = any(dim % factor != 0 for dim in sample.shape[-2:])
    if attention_mask is not None:
        attention_mask = ((1 - attention_mask.to(sample.dtype)) * -10000.0).unsqueeze(1)
    if encoder_attention_mask is not None:
        encoder_attention_mask = ((1 - encoder_attention_mask.to(sample.dtype)) * -10000.0).unsqueeze(1)
    if unet.config.center_input_sample:
        sample = 2 * sample - 1.0

    t_emb = unet.get_time_embed(sample=sample, timestep=timestep)
    emb = unet.time_embedding(t_emb, timestep_cond)
    class_emb = unet.get_class_embed(sample=sample, class_labels=class_labels)
    if class_emb is not None:
        emb = torch.cat([emb, class_emb], dim=-1) if unet.config.class_embeddings_concat else emb + class_emb
    aug_emb = unet.get_aug_embed(emb=emb, encoder_hidden_states=encoder_hidden_states, added_cond_kwargs=added_cond_kwargs)
    if unet.config.addition_embed_type == "image_hint":  # Kandinsky 2.2 ControlNet: the hint joins the sample
        aug_emb, hint = aug_emb
        sample = torch.cat([sample, hint], dim=1)
    emb = emb + aug_emb if aug_emb is not None else emb
    if unet.time_embed_act is not None:
        emb = unet.time_embed_act(emb)
    encoder_hidden_states = unet.process_encoder_hidden_states(
        encoder_hidden_states=encoder_hidden_states, added_cond_kwargs=added_cond_kwargs
    )
    if cross_attention_kwargs is not None and cross_attention_kwargs.get("gligen") is not None:
        # GLIGEN: the grounding boxes become the gated attention's objects, as in the UNet's forward.
        cross_attention_kwargs = dict(cross_attention_kwargs)
        cross_attention_kwargs["gligen"] = {"objs": unet.position_net(**cross_attention_kwargs.pop("gligen"))}
    ctx = {
        "variant": "",
        "emb": emb,
        "encoder_hidden_states": encoder_hidden_states,
        "cross_attention_kwargs": cross_attention_kwargs,
        "attention_mask": attention_mask,
        "encoder_attention_mask": encoder_attention_mask,
    }
    h = _down_up(unet, layout, branch, cached, unet.conv_in(sample), ctx, down_block_additional_residuals, forward_upsample_size)
    if unet.conv_norm_out:
        h = unet.conv_act(unet.conv_norm_out(h))
    h = unet.conv_out(h)
    if not return_dict:
        return (h,)
    from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

    return UNet2DConditionOutput(sample=h)


def _down_up(
    unet: Any,
    layout: Layout,
    branch: int,
    cached: torch.Tensor,
    h: torch.Tensor,
    ctx: dict[str, Any],
    residuals: tuple[torch.Tensor, ...] | None,
    forward_upsample_size: bool,
) -> torch.Tensor:
    """The shallow part of any variant, from ``conv_in``'s output ``h`` to what enters the output layers: the down
    layers that produce skips ``0..branch`` (``residuals``: ControlNet's, added to the skips), then, from the cached
    feature, the up layers that consume them."""
    # Down: produce skips 0..branch, nothing deeper.
    skips = [h]
    for prod in layout.producers[1 : branch + 1]:
        block = unet.down_blocks[prod[1]]
        if prod[0] == "layer":
            h = _layer(block, prod[2], h, ctx)
        else:
            for downsampler in block.downsamplers:
                h = _resample(downsampler, h, ctx)
        skips.append(h)
    if residuals is not None:  # ControlNet adds to the skips, not to the down path
        skips = [s + r for s, r in zip(skips, residuals)]

    # Up: from the cached feature, through the consumers of skips branch..0.
    first, j0 = layout.consumers[branch]
    block = unet.up_blocks[first]
    h = cached
    freeu = _freeu(block)
    k = branch
    for j in range(j0, len(block.resnets)):
        res = skips[k]
        k -= 1
        if freeu is not None:
            from diffusers.utils.torch_utils import apply_freeu

            if h is cached:  # FreeU scales it in place: the kept feature must stay as it was for the next cached steps
                h = h.clone()
            h, res = apply_freeu(block.resolution_idx, h, res, **freeu)
        h = torch.cat([h, res], dim=1)
        h = _layer(block, j, h, ctx)
    remaining = skips[: k + 1]
    if block.upsamplers is not None:
        size = remaining[-1].shape[2:] if forward_upsample_size and first < len(unet.up_blocks) - 1 else None
        for upsampler in block.upsamplers:
            h = _resample(upsampler, h, ctx, size)
    for i in range(first + 1, len(unet.up_blocks)):
        up = unet.up_blocks[i]
        n = len(up.resnets)
        res, remaining = tuple(remaining[-n:]), remaining[:-n]
        size = remaining[-1].shape[2:] if forward_upsample_size and i < len(unet.up_blocks) - 1 else None
        h = _call_up_block(up, h, res, size, ctx)
    return h


def _timesteps(timestep: Any, sample: torch.Tensor, batch: int) -> torch.Tensor:
    """The timesteps as the video UNets' forwards make them: a tensor of ``batch`` (a Python number becomes a
    one-element tensor on the sample's device, as diffusers makes it)."""
    timesteps = timestep
    if not torch.is_tensor(timesteps):
        is_float = isinstance(timestep, float)
        try:
            from diffusers.utils.torch_utils import maybe_adjust_dtype_for_device
        except ImportError:  # diffusers before 0.36 chose inline: 32 bits on MPS and NPU
            narrow = sample.device.type in ("mps", "npu")
            dtype = (torch.float32 if narrow else torch.float64) if is_float else (torch.int32 if narrow else torch.int64)
        else:
            dtype = maybe_adjust_dtype_for_device(torch.float64 if is_float else torch.int64, sample.device)
        timesteps = torch.tensor([timesteps], dtype=dtype, device=sample.device)
    elif len(timesteps.shape) == 0:
        timesteps = timesteps[None].to(sample.device)
    return timesteps.expand(batch)


def _shallow_motion(
    unet: Any,
    layout: Layout,
    branch: int,
    cached: torch.Tensor,
    sample: torch.Tensor,
    timestep: Any,
    encoder_hidden_states: torch.Tensor,
    timestep_cond: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    cross_attention_kwargs: dict[str, Any] | None = None,
    added_cond_kwargs: dict[str, torch.Tensor] | None = None,
    down_block_additional_residuals: tuple[torch.Tensor, ...] | None = None,
    mid_block_additional_residual: torch.Tensor | None = None,
    return_dict: bool = True,
) -> Any:
    """AnimateDiff's ``UNetMotionModel.forward`` (sample ``[B, C, F, H, W]``; the pipeline repeats the prompt per
    frame: ``encoder_hidden_states`` ``[B·F, T, D]``), shallow part only."""
    del mid_block_additional_residual  # mid is cached
    factor = 2**unet.num_upsamplers
    forward_upsample_size = any(dim % factor != 0 for dim in sample.shape[-2:])
    if attention_mask is not None:
        attention_mask = ((1 - attention_mask.to(sample.dtype)) * -10000.0).unsqueeze(1)
    num_frames = sample.shape[2]
    t_emb = unet.time_proj(_timesteps(timestep, sample, sample.shape[0])).to(dtype=unet.dtype)
    emb = unet.time_embedding(t_emb, timestep_cond)
    if unet.config.addition_embed_type == "text_time":
        if added_cond_kwargs is None or "text_embeds" not in added_cond_kwargs or "time_ids" not in added_cond_kwargs:
            raise InvalidCallError(  # as diffusers' own forward refuses it (a ValueError too)
                f"torchfix.deepcache: {type(unet).__name__} has the config param `addition_embed_type` set to 'text_time', "
                "which requires the keyword arguments `text_embeds` and `time_ids` in `added_cond_kwargs`; pass both."
            )
        text_embeds = added_cond_kwargs["text_embeds"]
        time_embeds = unet.add_time_proj(added_cond_kwargs["time_ids"].flatten()).reshape((text_embeds.shape[0], -1))
        emb = emb + unet.add_embedding(torch.concat([text_embeds, time_embeds], dim=-1).to(emb.dtype))
    emb = emb.repeat_interleave(num_frames, dim=0, output_size=emb.shape[0] * num_frames)
    if unet.encoder_hid_proj is not None and unet.config.encoder_hid_dim_type == "ip_image_proj":
        if added_cond_kwargs is None or "image_embeds" not in added_cond_kwargs:
            raise InvalidCallError(  # as diffusers' own forward refuses it (a ValueError too)
                f"torchfix.deepcache: {type(unet).__name__} has the config param `encoder_hid_dim_type` set to "
                "'ip_image_proj', which requires the keyword argument `image_embeds` in `added_cond_kwargs`; pass it."
            )
        image_embeds = unet.encoder_hid_proj(added_cond_kwargs["image_embeds"])
        image_embeds = [e.repeat_interleave(num_frames, dim=0, output_size=e.shape[0] * num_frames) for e in image_embeds]
        encoder_hidden_states = (encoder_hidden_states, image_embeds)
    ctx = {
        "variant": "motion",
        "emb": emb,
        "encoder_hidden_states": encoder_hidden_states,
        "cross_attention_kwargs": cross_attention_kwargs,
        "attention_mask": attention_mask,
        "encoder_attention_mask": None,
        "num_frames": num_frames,
    }
    folded = sample.permute(0, 2, 1, 3, 4).reshape((sample.shape[0] * num_frames, -1, *sample.shape[3:]))
    h = _down_up(unet, layout, branch, cached, unet.conv_in(folded), ctx, down_block_additional_residuals, forward_upsample_size)
    if unet.conv_norm_out:
        h = unet.conv_act(unet.conv_norm_out(h))
    h = unet.conv_out(h)
    h = h[None, :].reshape((-1, num_frames, *h.shape[1:])).permute(0, 2, 1, 3, 4)
    if not return_dict:
        return (h,)
    from diffusers.models.unets.unet_motion_model import UNetMotionOutput

    return UNetMotionOutput(sample=h)


def _shallow_spatiotemporal(
    unet: Any,
    layout: Layout,
    branch: int,
    cached: torch.Tensor,
    sample: torch.Tensor,
    timestep: Any,
    encoder_hidden_states: torch.Tensor,
    added_time_ids: torch.Tensor,
    return_dict: bool = True,
) -> Any:
    """Stable Video Diffusion's ``UNetSpatioTemporalConditionModel.forward`` (sample ``[B, F, C, H, W]``,
    ``encoder_hidden_states`` ``[B, 1, D]``, ``added_time_ids`` ``[B, 3]``), shallow part only."""
    factor = 2**unet.num_upsamplers
    forward_upsample_size = any(dim % factor != 0 for dim in sample.shape[-2:])
    batch_size, num_frames = sample.shape[:2]
    t_emb = unet.time_proj(_timesteps(timestep, sample, batch_size)).to(dtype=sample.dtype)
    emb = unet.time_embedding(t_emb)
    time_embeds = unet.add_time_proj(added_time_ids.flatten()).reshape((batch_size, -1)).to(emb.dtype)
    emb = emb + unet.add_embedding(time_embeds)
    emb = emb.repeat_interleave(num_frames, dim=0, output_size=emb.shape[0] * num_frames)
    encoder_hidden_states = encoder_hidden_states.repeat_interleave(
        num_frames, dim=0, output_size=encoder_hidden_states.shape[0] * num_frames
    )
    h = unet.conv_in(sample.flatten(0, 1))
    ctx = {
        "variant": "spatiotemporal",
        "emb": emb,
        "encoder_hidden_states": encoder_hidden_states,
        "image_only_indicator": torch.zeros(batch_size, num_frames, dtype=h.dtype, device=h.device),
    }
    h = _down_up(unet, layout, branch, cached, h, ctx, None, forward_upsample_size)
    h = unet.conv_out(unet.conv_act(unet.conv_norm_out(h)))
    h = h.reshape(batch_size, num_frames, *h.shape[1:])
    if not return_dict:
        return (h,)
    from diffusers.models.unets.unet_spatio_temporal_condition import UNetSpatioTemporalConditionOutput

    return UNetSpatioTemporalConditionOutput(sample=h)


_lora_scaled: dict[str, Any] = {}


def shallow_forward(unet: Any, layout: Layout, *args: Any, **kwargs: Any) -> Any:
    """The cached step of ``layout``'s variant (:func:`_shallow`, :func:`_shallow_motion`,
    :func:`_shallow_spatiotemporal`), with PEFT LoRA layers scaled by ``cross_attention_kwargs["scale"]`` where the
    model's own forward does. The decorator is looked up on first use, so importing torchfix never imports diffusers."""
    variant = layout.variant
    if variant not in _lora_scaled:
        _lora_scaled[variant] = _scaled(variant)
    return _lora_scaled[variant](unet, layout, *args, **kwargs)


def _scaled(variant: str) -> Any:
    try:
        from diffusers.utils.peft_utils import apply_lora_scale
    except ImportError:  # diffusers before 0.37 scales inline in the image UNet's forward (the same, here), and not at
        apply_lora_scale = None  # all in the video UNets' (diffusers 0.35, 0.36)
    if variant == "spatiotemporal":  # takes no cross_attention_kwargs
        return _shallow_spatiotemporal
    if variant == "motion":
        return _shallow_motion if apply_lora_scale is None else apply_lora_scale("cross_attention_kwargs")(_shallow_motion)
    return _scaling_lora(_shallow) if apply_lora_scale is None else apply_lora_scale("cross_attention_kwargs")(_shallow)


def _scaling_lora(forward: Any) -> Any:
    """What diffusers 0.37+'s ``apply_lora_scale("cross_attention_kwargs")`` does, for a diffusers that has no such
    decorator (0.35, 0.36: its UNet forward does it inline): ``scale`` popped from a copy of
    ``cross_attention_kwargs``, the PEFT LoRA layers scaled by it around the call, unscaled after (an error too)."""
    from diffusers.utils import USE_PEFT_BACKEND, scale_lora_layers, unscale_lora_layers

    @functools.wraps(forward)
    def scaled(unet: Any, *args: Any, **kwargs: Any) -> Any:
        lora_scale = 1.0
        attention_kwargs = kwargs.get("cross_attention_kwargs")
        if attention_kwargs is not None:
            attention_kwargs = dict(attention_kwargs)
            kwargs["cross_attention_kwargs"] = attention_kwargs
            lora_scale = attention_kwargs.pop("scale", 1.0)
        if USE_PEFT_BACKEND:
            scale_lora_layers(unet, lora_scale)
        try:
            return forward(unet, *args, **kwargs)
        finally:
            if USE_PEFT_BACKEND:
                unscale_lora_layers(unet, lora_scale)

    return scaled
