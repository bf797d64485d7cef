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
"""

from __future__ import annotations

import functools
from typing import Any

import torch

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


def _call_up_block(block: torch.nn.Module, h: torch.Tensor, res: tuple, upsample_size: Any, ctx: dict[str, Any]) -> torch.Tensor:
    if getattr(block, "has_cross_attention", False):
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
        "emb": emb,
        "encoder_hidden_states": encoder_hidden_states,
        "cross_attention_kwargs": cross_attention_kwargs,
        "attention_mask": attention_mask,
        "encoder_attention_mask": encoder_attention_mask,
    }

    # Down: produce skips 0..branch, nothing deeper.
    h = unet.conv_in(sample)
    skips = [h]
    for prod in layout.producers[1 : branch + 1]:
        block = unet.down_blocks[prod[1]]
        if prod[0] == "layer":
            h = block.resnets[prod[2]](h, emb)
            h = _attention(block, prod[2], h, ctx)
        else:
            for downsampler in block.downsamplers:
                h = downsampler(h)
        skips.append(h)
    if down_block_additional_residuals is not None:  # ControlNet adds to the skips, not to the down path
        skips = [s + r for s, r in zip(skips, down_block_additional_residuals)]

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

            h, res = apply_freeu(block.resolution_idx, h, res, **freeu)
        h = torch.cat([h, res], dim=1)
        h = block.resnets[j](h, emb)
        h = _attention(block, j, h, ctx)
    remaining = skips[: k + 1]
    if block.upsamplers is not None:
        size = remaining[-1].shape[2:] if forward_upsample_size and first < len(unet.up_blocks) - 1 else None
        for upsampler in block.upsamplers:
            h = upsampler(h, size)
    for i in range(first + 1, len(unet.up_blocks)):
        up = unet.up_blocks[i]
        n = len(up.resnets)
        res, remaining = tuple(remaining[-n:]), remaining[:-n]
        size = remaining[-1].shape[2:] if forward_upsample_size and i < len(unet.up_blocks) - 1 else None
        h = _call_up_block(up, h, res, size, ctx)

    if unet.conv_norm_out:
        h = unet.conv_act(unet.conv_norm_out(h))
    h = unet.conv_out(h)
    if not return_dict:
        return (h,)
    from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

    return UNet2DConditionOutput(sample=h)


_lora_scaled: list[Any] = []


def shallow_forward(unet: Any, *args: Any, **kwargs: Any) -> Any:
    """:func:`_shallow`, with PEFT LoRA layers scaled by ``cross_attention_kwargs["scale"]``
    as the UNet's own forward does. The decorator is looked up on first use, so
    importing torchfix never imports diffusers."""
    if not _lora_scaled:
        try:
            from diffusers.utils.peft_utils import apply_lora_scale
        except ImportError:  # diffusers before 0.37 scales inline in the UNet's forward: the same, here
            _lora_scaled.append(_scaling_lora(_shallow))
        else:
            _lora_scaled.append(apply_lora_scale("cross_attention_kwargs")(_shallow))
    return _lora_scaled[0](unet, *args, **kwargs)


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
