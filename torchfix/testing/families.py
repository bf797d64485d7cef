"""A tiny offline denoiser for every model family torchfix knows (:mod:`torchfix.families`), and a loop that
drives one like a pipeline does: random weights from small configs (the sizes diffusers' own tests use, with at
least two blocks per list), nothing downloaded.

Each :class:`Tiny` builds its model and the arguments of one denoiser step at a batch size, a latent size (and
a frame count for video), so one conformance suite can hold every family to the same guarantees
(tests/deepcache/test_families.py). Adding a family = one registry entry + one entry here.

>>> from torchfix.testing.families import FAMILIES
>>> FAMILIES["wan"].family
'wan'
>>> # model = FAMILIES["wan"].build(); outs = denoise(model, FAMILIES["wan"], steps=8)
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from .tiny import ADDED_IN, JOYIMAGE, LTX2, WAN, Call, Size, Tiny, _batch, _diffusers_below, _ids, _image, _take, _text, _video, _wake  # noqa: F401

__all__ = ["ADDED_IN", "FAMILIES", "Outputs", "Tiny", "denoise", "output_of", "replace"]


def _timestep(tiny: Tiny, t: float, batch: int, latents: Any = None) -> torch.Tensor:
    """The timestep ``t`` (1 = noise) of a step as ``tiny``'s model takes it: one value per sample, or the builder's
    ``timestep_as`` of it (per frame, or 1 = clean) where it has one and ``latents`` are given."""
    step = torch.full((batch,), t * tiny.scale)
    return step if tiny.timestep_as is None or latents is None else tiny.timestep_as(step, latents)


def _clean_is_one(t: torch.Tensor, latents: Any) -> torch.Tensor:
    """A ``timestep_as`` for models whose time runs the other way (1 = the clean image), as their pipelines pass it:
    ZImagePipeline ``(1000 - t) / 1000``, Lumina2Pipeline ``1 - t / num_train_timesteps``."""
    return 1.0 - t


def output_of(out: Any) -> Any:
    """The sample a denoiser call returned (a tuple's first item, or ``.sample``)."""
    sample = out[0] if isinstance(out, tuple) else getattr(out, "sample", out)
    return sample


def _update(latents: Any, output: Any, step: float) -> Any:
    """One Euler step of the loop: ``latents − step·output``, as pipelines read the output: where it has twice the
    latents' channels (a learned variance: PixArt, DiT, Latte), its first half; where it has fewer (the latents carry
    conditioning channels: Motif-Video), the channels it predicts. Anything else: the latents scaled."""
    if isinstance(latents, list):
        return [_update(x, o, step) for x, o in zip(latents, output if isinstance(output, list) else [None] * len(latents))]
    if not isinstance(output, torch.Tensor) or output.dim() != latents.dim() or output.shape[2:] != latents.shape[2:]:
        return latents * (1.0 - step)
    channels = latents.shape[1]
    if output.dim() == 3 and output.shape[::2] == latents.shape[::2] and output.shape[1] > latents.shape[1]:
        return latents - step * output[:, -latents.shape[1] :]  # tokens [text | image]: the image's (Qwen-Image 2.1)
    if output.shape == latents.shape:
        return latents - step * output
    if output.shape[1] == 2 * channels:
        return latents - step * output[:, :channels]
    if output.shape[1] < channels and output.shape[0] == latents.shape[0]:
        moved = latents.clone()
        moved[:, : output.shape[1]] -= step * output
        return moved
    return latents * (1.0 - step)


class Outputs(list):
    """Per prompt, the outputs of each step; ``latents``: where the loop ended."""

    latents: Any = None


@torch.no_grad()
def denoise(
    model: torch.nn.Module,
    tiny: Tiny,
    *,
    steps: int = 8,
    batch: int = 1,
    size: Size | None = None,
    frames: int | None = None,
    seed: int = 0,
    prompts: tuple[int, ...] = (0,),
    arguments: list[dict[str, Any]] | None = None,
    context: bool = False,
) -> Outputs:
    """Run ``steps`` denoiser steps like a pipeline: timesteps from 1 to 0, latents moved by each output, the same
    prompt objects every step. With several ``prompts`` each step calls the model once per prompt (guidance passes
    run as separate calls, each its own stream) on the same latents. ``context``: each call inside the model's
    ``cache_context`` (``"cond"``, ``"uncond"``, ...) where it has one, as diffusers' pipelines do (its own cache
    hooks need one).
    Returns the outputs, per prompt, per step, and the final latents (``.latents``).

    >>> # outs = denoise(FAMILIES["flux"].build(), FAMILIES["flux"], steps=8)
    """
    calls = arguments or [tiny.arguments(batch, size, frames, seed, p) for p in prompts]
    latents = calls[0][tiny.latent]
    outputs = Outputs([] for _ in calls)
    names = ("cond", "uncond", *(f"pass{k}" for k in range(2, len(calls))))
    for i in range(steps):
        t = 1.0 - i / steps
        first = None
        for k, call in enumerate(calls):
            named = getattr(model, "cache_context", None) if context else None  # SD3's transformer has none
            with named(names[k]) if named is not None else contextlib.nullcontext():
                out = output_of(model(**{**call, tiny.latent: latents, tiny.timestep: _timestep(tiny, t, _batch(latents), latents)}))
            outputs[k].append(out)
            first = out if first is None else first
        latents = _update(latents, first, 1.0 / steps)
    outputs.latents = latents
    return outputs


# --- the builders ---------------------------------------------------------------------------------------------


def _sd15() -> torch.nn.Module:
    from . import tiny_sd15_unet

    return tiny_sd15_unet()


def _sdxl() -> torch.nn.Module:
    from . import tiny_sdxl_unet

    return tiny_sdxl_unet()


# diffusers' own tests' configs (tests/models/unets/test_models_unet_motion.py, test_models_unet_spatiotemporal.py):
# two down blocks each, one of them with cross-attention.
_MOTION = {
    "block_out_channels": (16, 32),
    "norm_num_groups": 16,
    "down_block_types": ("CrossAttnDownBlockMotion", "DownBlockMotion"),
    "up_block_types": ("UpBlockMotion", "CrossAttnUpBlockMotion"),
    "cross_attention_dim": 16,
    "num_attention_heads": 2,
    "out_channels": 4,
    "in_channels": 4,
    "layers_per_block": 1,
    "sample_size": 16,
}
_SPATIOTEMPORAL = {
    "block_out_channels": (32, 64),
    "down_block_types": ("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
    "up_block_types": ("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
    "cross_attention_dim": 32,
    "num_attention_heads": 8,
    "out_channels": 4,
    "in_channels": 4,
    "layers_per_block": 2,
    "sample_size": 32,
    "projection_class_embeddings_input_dim": 3 * 32,
    "addition_time_embed_dim": 32,
}


def _motion_inputs(c: Call) -> dict[str, Any]:
    """AnimateDiff's step: latents ``[B, C, F, H, W]`` and the prompt repeated per frame (``[B·F, T, D]``), as
    ``AnimateDiffPipeline`` passes it."""
    return {"sample": _video(c), "encoder_hidden_states": _text(c, 4, 16).repeat_interleave(c.frames, dim=0)}


def _spatiotemporal_inputs(c: Call) -> dict[str, Any]:
    """Stable Video Diffusion's step: latents ``[B, F, C, H, W]``, one CLIP image embedding per sample (``[B, 1, D]``)
    and the added time ids (fps, motion bucket, noise augmentation)."""
    return {
        "sample": c.randn(c.batch, c.frames, 4, *c.size),
        "encoder_hidden_states": _text(c, 1, 32),
        "added_time_ids": torch.tensor([[6.0, 127.0, 0.02]] * c.batch),
    }


def _flux_like(c: Call, channels: int = 4, text: int = 32, tokens: int = 12, pooled: int | None = 32) -> dict[str, Any]:
    h, w = c.size
    out = {
        "hidden_states": c.randn(c.batch, h * w, channels),
        "encoder_hidden_states": c.randn(c.batch, tokens, text, prompt=True),
        "img_ids": _ids(h, w),
        "txt_ids": torch.zeros(tokens, 3),
    }
    if pooled:
        out["pooled_projections"] = c.randn(c.batch, pooled, prompt=True)
    return out


def _unpooled_flux(family: str, model: str, config: dict[str, Any], guidance: bool = False) -> Tiny:
    """A Flux-like builder without pooled text (Chroma, Bria, LongCat-Image, Ovis-Image): packed latents, position
    ids shared by the batch, flow matching; ``guidance``: a distilled-guidance scale per sample."""

    def inputs(c: Call) -> dict[str, Any]:
        out = _flux_like(c, pooled=None)
        if guidance:
            out["guidance"] = torch.full((c.batch,), 3.5)
        return out

    return Tiny(family, model, config, inputs, scale=1.0, sizes=((4, 4), (6, 8)), shared=("img_ids", "txt_ids"))


def _cogview_inputs(c: Call) -> dict[str, Any]:
    """CogView3-Plus's and CogView4's step: the latents, 8 text tokens 8 wide, and SDXL-like size conditioning."""
    return {
        "hidden_states": _image(c),
        "encoder_hidden_states": _text(c, 8, 8),
        "original_size": torch.tensor([[64, 64]] * c.batch),
        "target_size": torch.tensor([[64, 64]] * c.batch),
        "crop_coords": torch.tensor([[0, 0]] * c.batch),
    }


def _qwen_like(c: Call) -> dict[str, Any]:
    """Qwen-Image's and Nucleus-MoE's step: packed latents (16 channels), 8 text tokens 16 wide, the image shapes
    (and, before diffusers 0.37, each sample's text length ``txt_seq_lens``, which Qwen-Image needed then; 0.37
    reads it from the mask and deprecates the argument, 0.39 drops it)."""
    arguments = {
        "hidden_states": c.randn(c.batch, c.size[0] * c.size[1], 16),
        "encoder_hidden_states": _text(c, 8, 16),
        "encoder_hidden_states_mask": torch.ones(c.batch, 8, dtype=torch.long),
        "img_shapes": [(1, *c.size)] * c.batch,
    }
    if _diffusers_below("0.37"):
        arguments["txt_seq_lens"] = [8] * c.batch
    return arguments


def _wan_like(family: str, model: str) -> Tiny:
    """A Wan-layout video transformer (Wan, SkyReels-V2): one list of blocks, the text attended to."""
    return Tiny(family, model, WAN, lambda c: {"hidden_states": _video(c), "encoder_hidden_states": _text(c, 12, 16)}, frames=(2, 3))


_TINY = [
    Tiny(
        "unet",
        "UNet2DConditionModel",
        {},
        lambda c: {"sample": _image(c), "encoder_hidden_states": _text(c, 8, 32)},
        latent="sample",
        sizes=((8, 8), (9, 12)),
        build_with=_sd15,
        name="sd15",
    ),
    Tiny(
        "unet",
        "UNet2DConditionModel",
        {},
        lambda c: {
            "sample": _image(c),
            "encoder_hidden_states": _text(c, 8, 64),
            "added_cond_kwargs": {
                "text_embeds": c.randn(c.batch, 32, prompt=True),
                "time_ids": torch.tensor([[16.0, 16, 0, 0, 16, 16]] * c.batch),
            },
        },
        latent="sample",
        sizes=((8, 8), (9, 12)),
        build_with=_sdxl,
        name="sdxl",
    ),
    Tiny(
        "animatediff",
        "UNetMotionModel",
        _MOTION,
        _motion_inputs,
        latent="sample",
        sizes=((8, 8), (9, 12)),
        frames=(4, 3),
        per_frame=("encoder_hidden_states",),
    ),
    Tiny(
        "svd",
        "UNetSpatioTemporalConditionModel",
        _SPATIOTEMPORAL,
        _spatiotemporal_inputs,
        latent="sample",
        scale=1.0,  # SVD's EDM timesteps are 0.25·ln(σ): a few units, not DDPM's 0..1000
        sizes=((8, 8), (9, 12)),
        frames=(4, 3),
    ),
    Tiny(
        "sd3",
        "SD3Transformer2DModel",
        {
            "sample_size": 32,
            "patch_size": 2,
            "in_channels": 4,
            "num_layers": 4,
            "attention_head_dim": 8,
            "num_attention_heads": 4,
            "caption_projection_dim": 32,
            "joint_attention_dim": 32,
            "pooled_projection_dim": 64,
            "out_channels": 4,
            "pos_embed_max_size": 96,
        },
        lambda c: {
            "hidden_states": _image(c),
            "encoder_hidden_states": _text(c, 12, 32),
            "pooled_projections": c.randn(c.batch, 64, prompt=True),
        },
    ),
    Tiny(
        "flux",
        "FluxTransformer2DModel",
        {
            "patch_size": 1,
            "in_channels": 4,
            "num_layers": 2,
            "num_single_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,
            "pooled_projection_dim": 32,
            "axes_dims_rope": [4, 4, 8],
        },
        _flux_like,
        scale=1.0,
        sizes=((4, 4), (6, 8)),
        prompts=("encoder_hidden_states", "pooled_projections"),
        shared=("img_ids", "txt_ids"),
    ),
    Tiny(
        "flux2",
        "Flux2Transformer2DModel",
        {
            "patch_size": 1,
            "in_channels": 4,
            "num_layers": 2,
            "num_single_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,
            "timestep_guidance_channels": 256,
            "axes_dims_rope": [4, 4, 4, 4],
        },
        lambda c: {
            "hidden_states": c.randn(c.batch, c.size[0] * c.size[1], 4),
            "encoder_hidden_states": _text(c, 12, 32),
            "img_ids": _ids(*c.size, width=4).long().unsqueeze(0).expand(c.batch, -1, -1),
            "txt_ids": torch.zeros(c.batch, 12, 4, dtype=torch.long),
            "guidance": torch.full((c.batch,), 3.5),
        },
        scale=1.0,
        sizes=((4, 4), (6, 8)),
    ),
    _unpooled_flux(
        "chroma",
        "ChromaTransformer2DModel",
        {
            "patch_size": 1,
            "in_channels": 4,
            "num_layers": 2,
            "num_single_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,
            "axes_dims_rope": [4, 4, 8],
            "approximator_num_channels": 8,
            "approximator_hidden_dim": 16,
            "approximator_layers": 1,
        },
    ),
    Tiny(
        "qwenimage",
        "QwenImageTransformer2DModel",
        {
            "patch_size": 2,
            "in_channels": 16,
            "out_channels": 4,
            "num_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 4,
            "joint_attention_dim": 16,
            "guidance_embeds": False,
            "axes_dims_rope": (8, 4, 4),
        },
        _qwen_like,
        scale=1.0,
        sizes=((4, 4), (6, 8)),
        per_sample=("img_shapes", "txt_seq_lens"),
    ),
    Tiny(
        "hidream",
        "HiDreamImageTransformer2DModel",
        {
            "patch_size": 2,
            "in_channels": 4,
            "out_channels": 4,
            "num_layers": 2,
            "num_single_layers": 2,
            "attention_head_dim": 8,
            "num_attention_heads": 4,
            "caption_channels": [8, 4],
            "text_emb_dim": 8,
            "num_routed_experts": 2,
            "num_activated_experts": 2,
            "axes_dims_rope": (4, 2, 2),
            "max_resolution": (32, 32),
            "llama_layers": (0, 1, 2, 3),
            "force_inference_output": True,
        },
        lambda c: {
            "hidden_states": _image(c),
            "encoder_hidden_states_t5": _text(c, 8, 8),
            "encoder_hidden_states_llama3": c.randn(len(c.config["llama_layers"]), c.batch, 8, 4, prompt=True),
            "pooled_embeds": c.randn(c.batch, 8, prompt=True),
        },
        timestep="timesteps",
        sizes=((8, 8), (12, 16)),
        prompts=("encoder_hidden_states_t5", "encoder_hidden_states_llama3", "pooled_embeds"),
        batch_dim=(("encoder_hidden_states_llama3", 1),),
    ),
    Tiny(
        "sana",
        "SanaTransformer2DModel",
        {
            "patch_size": 1,
            "in_channels": 4,
            "out_channels": 4,
            "num_layers": 2,
            "attention_head_dim": 4,
            "num_attention_heads": 2,
            "num_cross_attention_heads": 2,
            "cross_attention_head_dim": 4,
            "cross_attention_dim": 8,
            "caption_channels": 8,
            "sample_size": 32,
        },
        lambda c: {"hidden_states": _image(c), "encoder_hidden_states": _text(c, 8, 8)},
        sizes=((8, 8), (9, 12)),
    ),
    Tiny(
        "pixart",
        "PixArtTransformer2DModel",
        {
            "sample_size": 8,
            "num_layers": 2,
            "patch_size": 2,
            "attention_head_dim": 2,
            "num_attention_heads": 2,
            "in_channels": 4,
            "cross_attention_dim": 8,
            "out_channels": 8,
            "attention_bias": True,
            "activation_fn": "gelu-approximate",
            "num_embeds_ada_norm": 8,
            "norm_type": "ada_norm_single",
            "norm_elementwise_affine": False,
            "norm_eps": 1e-06,
            "use_additional_conditions": False,
            "caption_channels": None,
        },
        lambda c: {
            "hidden_states": _image(c),
            "encoder_hidden_states": _text(c, 8, 8),
            "added_cond_kwargs": {"aspect_ratio": None, "resolution": None},
        },
    ),
    Tiny(
        "lumina2",
        "Lumina2Transformer2DModel",
        {
            "sample_size": 16,
            "patch_size": 2,
            "in_channels": 4,
            "hidden_size": 24,
            "num_layers": 2,
            "num_refiner_layers": 1,
            "num_attention_heads": 3,
            "num_kv_heads": 1,
            "multiple_of": 2,
            "ffn_dim_multiplier": None,
            "norm_eps": 1e-05,
            "scaling_factor": 1.0,
            "axes_dim_rope": (4, 2, 2),
            "axes_lens": (128, 128, 128),
            "cap_feat_dim": 32,
        },
        lambda c: {
            "hidden_states": _image(c),
            "encoder_hidden_states": _text(c, 16, 32),
            "encoder_attention_mask": torch.ones(c.batch, 16, dtype=torch.bool),
        },
        scale=1.0,
        timestep_as=_clean_is_one,
    ),
    Tiny(
        "cogview4",
        "CogView4Transformer2DModel",
        {
            "patch_size": 2,
            "in_channels": 4,
            "num_layers": 2,
            "attention_head_dim": 4,
            "num_attention_heads": 4,
            "out_channels": 4,
            "text_embed_dim": 8,
            "time_embed_dim": 8,
            "condition_dim": 4,
        },
        _cogview_inputs,
    ),
    Tiny(
        "auraflow",
        "AuraFlowTransformer2DModel",
        {
            "sample_size": 32,
            "patch_size": 2,
            "in_channels": 4,
            "num_mmdit_layers": 2,
            "num_single_dit_layers": 2,
            "attention_head_dim": 8,
            "num_attention_heads": 4,
            "caption_projection_dim": 32,
            "joint_attention_dim": 32,
            "out_channels": 4,
            "pos_embed_max_size": 256,
        },
        lambda c: {"hidden_states": _image(c), "encoder_hidden_states": _text(c, 12, 32)},
    ),
    Tiny(
        "zimage",
        "ZImageTransformer2DModel",
        {
            "all_patch_size": (2,),
            "all_f_patch_size": (1,),
            "in_channels": 16,
            "dim": 16,
            "n_layers": 2,
            "n_refiner_layers": 1,
            "n_heads": 1,
            "n_kv_heads": 2,
            "qk_norm": True,
            "cap_feat_dim": 16,
            "rope_theta": 256.0,
            "t_scale": 1000.0,
            "axes_dims": [8, 4, 4],
            "axes_lens": [256, 32, 32],
        },
        lambda c: {
            "x": [c.randn(16, 1, *c.size) for _ in range(c.batch)],
            "cap_feats": [c.randn(16, 16, prompt=True) for _ in range(c.batch)],
        },
        latent="x",
        timestep="t",
        scale=1.0,
        timestep_as=_clean_is_one,
        prompts=("cap_feats",),
        per_sample=("x", "cap_feats"),
    ),
    Tiny(
        "kandinsky5",
        "Kandinsky5Transformer3DModel",
        {
            "in_visual_dim": 16,
            "in_text_dim": 16,
            "in_text_dim2": 16,
            "time_dim": 16,
            "out_visual_dim": 16,
            "patch_size": (1, 2, 2),
            "model_dim": 16,
            "ff_dim": 32,
            "num_text_blocks": 1,
            "num_visual_blocks": 2,
            "axes_dims": (1, 1, 2),
            "visual_cond": False,
            "attention_type": "regular",
        },
        lambda c: {
            "hidden_states": c.randn(c.batch, c.frames, *c.size, 16),
            "encoder_hidden_states": _text(c, 8, 16),
            "pooled_projections": c.randn(c.batch, 16, prompt=True),
            "visual_rope_pos": [torch.arange(c.frames), torch.arange(c.size[0] // 2), torch.arange(c.size[1] // 2)],
            "text_rope_pos": torch.arange(8),
        },
        frames=(1, 2),
        prompts=("encoder_hidden_states", "pooled_projections"),
        shared=("text_rope_pos",),
    ),
    _wan_like("wan", "WanTransformer3DModel"),
    Tiny(
        "wan-vace",
        "WanVACETransformer3DModel",
        {**WAN, "in_channels": 16, "out_channels": 16, "text_dim": 32, "num_layers": 4, "vace_layers": [0, 2], "vace_in_channels": 48},
        lambda c: {"hidden_states": _video(c, 16), "encoder_hidden_states": _text(c, 12, 32), "control_hidden_states": _video(c, 48)},
        frames=(2, 3),
    ),
    _wan_like("skyreels-v2", "SkyReelsV2Transformer3DModel"),
    Tiny(
        "hunyuanvideo",
        "HunyuanVideoTransformer3DModel",
        {
            "in_channels": 4,
            "out_channels": 4,
            "num_attention_heads": 2,
            "attention_head_dim": 10,
            "num_layers": 2,
            "num_single_layers": 2,
            "num_refiner_layers": 1,
            "patch_size": 1,
            "patch_size_t": 1,
            "guidance_embeds": True,
            "text_embed_dim": 16,
            "pooled_projection_dim": 8,
            "rope_axes_dim": (2, 4, 4),
            "image_condition_type": None,
        },
        lambda c: {
            "hidden_states": _video(c),
            "encoder_hidden_states": _text(c, 12, 16),
            "pooled_projections": c.randn(c.batch, 8, prompt=True),
            "encoder_attention_mask": torch.ones(c.batch, 12),
            "guidance": torch.full((c.batch,), 6000.0),
        },
        sizes=((4, 4), (5, 6)),
        frames=(1, 2),
        prompts=("encoder_hidden_states", "pooled_projections"),
    ),
    Tiny(
        "hunyuanvideo15",
        "HunyuanVideo15Transformer3DModel",
        {
            "in_channels": 4,
            "out_channels": 4,
            "num_attention_heads": 2,
            "attention_head_dim": 8,
            "num_layers": 2,
            "num_refiner_layers": 1,
            "mlp_ratio": 2.0,
            "patch_size": 1,
            "patch_size_t": 1,
            "text_embed_dim": 16,
            "text_embed_2_dim": 8,
            "image_embed_dim": 12,
            "rope_axes_dim": (2, 2, 4),
            "target_size": 16,
            "task_type": "t2v",
        },
        lambda c: {
            "hidden_states": _video(c),
            "encoder_hidden_states": _text(c, 6, 16),
            "encoder_hidden_states_2": _text(c, 4, 8),
            "encoder_attention_mask": torch.ones(c.batch, 6),
            "encoder_attention_mask_2": torch.ones(c.batch, 4),
            "image_embeds": torch.zeros(c.batch, 3, 12),
        },
        sizes=((4, 4), (5, 6)),
        frames=(1, 2),
        prompts=("encoder_hidden_states", "encoder_hidden_states_2"),
    ),
    Tiny(
        "ltx",
        "LTXVideoTransformer3DModel",
        {
            "in_channels": 4,
            "out_channels": 4,
            "num_attention_heads": 2,
            "attention_head_dim": 8,
            "cross_attention_dim": 16,
            "num_layers": 2,
            "qk_norm": "rms_norm_across_heads",
            "caption_channels": 16,
        },
        lambda c: {
            "hidden_states": c.randn(c.batch, c.frames * c.size[0] * c.size[1], 4),
            "encoder_hidden_states": _text(c, 16, 16),
            "encoder_attention_mask": torch.ones(c.batch, 16, dtype=torch.bool),
            "num_frames": c.frames,
            "height": c.size[0],
            "width": c.size[1],
        },
        sizes=((4, 4), (5, 6)),
        frames=(2, 3),
    ),
    Tiny(
        "ltx2",
        "LTX2VideoTransformer3DModel",
        LTX2,
        lambda c: {
            "hidden_states": c.randn(c.batch, c.frames * c.size[0] * c.size[1], 4),
            "audio_hidden_states": c.randn(c.batch, 9, 4),
            "encoder_hidden_states": _text(c, 16, 16),
            "audio_encoder_hidden_states": _text(c, 16, 16),
            "encoder_attention_mask": torch.ones(c.batch, 16, dtype=torch.bool),
            "num_frames": c.frames,
            "height": c.size[0],
            "width": c.size[1],
            "audio_num_frames": 9,
            "fps": 25.0,
        },
        sizes=((4, 4), (5, 6)),
        frames=(2, 3),
        prompts=("encoder_hidden_states", "audio_encoder_hidden_states"),
    ),
    Tiny(
        "cogvideox",
        "CogVideoXTransformer3DModel",
        {
            "num_attention_heads": 2,
            "attention_head_dim": 8,
            "in_channels": 4,
            "out_channels": 4,
            "time_embed_dim": 2,
            "text_embed_dim": 8,
            "num_layers": 2,
            "sample_width": 8,
            "sample_height": 8,
            "sample_frames": 8,
            "patch_size": 2,
            "patch_size_t": None,
            "temporal_compression_ratio": 4,
            "max_text_seq_length": 16,
        },
        # as many text tokens as image tokens at the first size (16 and 16): where the streams' order matters most
        lambda c: {"hidden_states": c.randn(c.batch, c.frames, 4, *c.size), "encoder_hidden_states": _text(c, 16, 8)},
        sizes=((8, 8), (8, 12)),
        frames=(1, 2),
    ),
    Tiny(
        "mochi",
        "MochiTransformer3DModel",
        {
            "patch_size": 2,
            "num_attention_heads": 2,
            "attention_head_dim": 8,
            "num_layers": 3,
            "pooled_projection_dim": 16,
            "in_channels": 4,
            "out_channels": None,
            "qk_norm": "rms_norm",
            "text_embed_dim": 16,
            "time_embed_dim": 4,
            "activation_fn": "swiglu",
            "max_sequence_length": 16,
        },
        lambda c: {
            "hidden_states": _video(c),
            "encoder_hidden_states": _text(c, 16, 16),
            "encoder_attention_mask": torch.ones(c.batch, 16, dtype=torch.bool),
        },
        frames=(2, 3),
    ),
    Tiny(
        "cosmos",
        "CosmosTransformer3DModel",
        {
            "in_channels": 4,
            "out_channels": 4,
            "num_attention_heads": 2,
            "attention_head_dim": 12,
            "num_layers": 2,
            "mlp_ratio": 2,
            "text_embed_dim": 16,
            "adaln_lora_dim": 4,
            "max_size": (4, 32, 32),
            "patch_size": (1, 2, 2),
            "rope_scale": (2.0, 1.0, 1.0),
            "concat_padding_mask": False,
            "extra_pos_embed_type": "learnable",
        },
        lambda c: {
            "hidden_states": _video(c),
            "encoder_hidden_states": _text(c, 12, 16),
            "attention_mask": torch.ones(c.batch, 12),
            "fps": 30,
        },
        frames=(1, 2),
    ),
    # --- more denoisers of diffusers 0.42.1's pipelines ---
    _unpooled_flux(
        "bria",
        "BriaTransformer2DModel",
        {
            "patch_size": 1,
            "in_channels": 4,
            "num_layers": 2,
            "num_single_layers": 2,
            "attention_head_dim": 8,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,
            "pooled_projection_dim": None,
            "axes_dims_rope": [0, 4, 4],
        },
    ),
    _unpooled_flux(
        "longcat-image",
        "LongCatImageTransformer2DModel",
        {
            "patch_size": 1,
            "in_channels": 4,
            "num_layers": 2,
            "num_single_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,
            "pooled_projection_dim": 32,
            "axes_dims_rope": [4, 4, 8],
        },
        guidance=True,
    ),
    _unpooled_flux(
        "ovis-image",
        "OvisImageTransformer2DModel",
        {
            "patch_size": 1,
            "in_channels": 4,
            "out_channels": 4,
            "num_layers": 2,
            "num_single_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,
            "axes_dims_rope": (4, 4, 8),
        },
    ),
    Tiny(
        "cogview3plus",
        "CogView3PlusTransformer2DModel",
        {
            "patch_size": 2,
            "in_channels": 4,
            "num_layers": 2,
            "attention_head_dim": 4,
            "num_attention_heads": 2,
            "out_channels": 4,
            "text_embed_dim": 8,
            "time_embed_dim": 8,
            "condition_dim": 2,
            "pos_embed_max_size": 8,
            "sample_size": 8,
        },
        _cogview_inputs,
    ),
    Tiny(
        "nucleus-moe",
        "NucleusMoEImageTransformer2DModel",
        {
            "patch_size": 2,
            "in_channels": 16,
            "out_channels": 4,
            "num_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 4,
            "joint_attention_dim": 16,
            "axes_dims_rope": (8, 4, 4),
            "moe_enabled": False,
            "capacity_factors": [8.0, 8.0],
        },
        _qwen_like,
        scale=1.0,
        sizes=((4, 4), (6, 8)),
        per_sample=("img_shapes", "txt_seq_lens"),
    ),
    Tiny(
        "joyimage",
        "JoyImageEditTransformer3DModel",
        JOYIMAGE,
        lambda c: {"hidden_states": _video(c, 16), "encoder_hidden_states": _text(c, 12, 16)},
        scale=1.0,
        sizes=((4, 4), (6, 8)),
        frames=(1, 2),
    ),
    Tiny(
        "dit",
        "DiTTransformer2DModel",
        {
            "in_channels": 4,
            "out_channels": 8,
            "activation_fn": "gelu-approximate",
            "num_attention_heads": 2,
            "attention_head_dim": 4,
            "attention_bias": True,
            "num_layers": 2,
            "norm_type": "ada_norm_zero",
            "num_embeds_ada_norm": 8,
            "patch_size": 2,
            "sample_size": 8,
        },
        lambda c: {"hidden_states": _image(c), "class_labels": torch.randint(0, 8, (c.batch,), generator=c.prompt)},
        sizes=((8, 8), (12, 12)),  # square only: its output is unpatchified as a square
        prompts=("class_labels",),
    ),
    Tiny(
        "chronoedit",
        "ChronoEditTransformer3DModel",
        {
            "patch_size": (1, 2, 2),
            "num_attention_heads": 2,
            "attention_head_dim": 8,
            "in_channels": 16,
            "out_channels": 16,
            "text_dim": 32,
            "freq_dim": 16,
            "ffn_dim": 32,
            "num_layers": 2,
            "cross_attn_norm": True,
            "qk_norm": "rms_norm_across_heads",
            "eps": 1e-06,
            "image_dim": None,
            "added_kv_proj_dim": None,
            "rope_max_seq_len": 64,
            "pos_embed_seq_len": None,
            "rope_temporal_skip_len": 8,
        },
        lambda c: {"hidden_states": _video(c, 16), "encoder_hidden_states": _text(c, 12, 32)},
        frames=(2, 3),
    ),
    Tiny(
        "sana-video",
        "SanaVideoTransformer3DModel",
        {
            "in_channels": 16,
            "out_channels": 16,
            "num_attention_heads": 2,
            "attention_head_dim": 12,
            "num_layers": 2,
            "num_cross_attention_heads": 2,
            "cross_attention_head_dim": 12,
            "cross_attention_dim": 24,
            "caption_channels": 16,
            "mlp_ratio": 2.5,
            "dropout": 0.0,
            "attention_bias": False,
            "sample_size": 8,
            "patch_size": (1, 2, 2),
            "norm_elementwise_affine": False,
            "norm_eps": 1e-06,
            "qk_norm": "rms_norm_across_heads",
            "rope_max_seq_len": 32,
        },
        lambda c: {"hidden_states": _video(c, 16), "encoder_hidden_states": _text(c, 12, 16)},
        frames=(2, 3),
    ),
    Tiny(
        "allegro",
        "AllegroTransformer3DModel",
        {
            "num_attention_heads": 2,
            "attention_head_dim": 8,
            "in_channels": 4,
            "out_channels": 4,
            "num_layers": 2,
            "cross_attention_dim": 16,
            "sample_width": 8,
            "sample_height": 8,
            "sample_frames": 8,
            "caption_channels": 8,
        },
        lambda c: {"hidden_states": _video(c), "encoder_hidden_states": _text(c, 16, 8)},
        frames=(2, 3),
    ),
    Tiny(
        "easyanimate",
        "EasyAnimateTransformer3DModel",
        {
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "in_channels": 4,
            "mmdit_layers": 2,
            "num_layers": 2,
            "out_channels": 4,
            "patch_size": 2,
            "sample_height": 60,
            "sample_width": 90,
            "text_embed_dim": 16,
            "time_embed_dim": 8,
            "time_position_encoding_type": "3d_rope",
            "timestep_activation_fn": "silu",
        },
        lambda c: {"hidden_states": _video(c), "encoder_hidden_states": _text(c, 16, 16)},
        frames=(2, 3),
    ),
    Tiny(
        "motif-video",
        "MotifVideoTransformer3DModel",
        {
            "in_channels": 33,
            "out_channels": 16,
            "num_attention_heads": 2,
            "attention_head_dim": 12,
            "num_layers": 2,
            "num_single_layers": 2,
            "num_decoder_layers": 0,
            "mlp_ratio": 4.0,
            "patch_size": 1,
            "patch_size_t": 1,
            "qk_norm": "rms_norm",
            "norm_type": "layer_norm",
            "text_embed_dim": 32,
            "image_embed_dim": 4,
            "rope_theta": 256.0,
            "rope_axes_dim": (4, 4, 4),
            "enable_text_cross_attention_dual": False,
            "enable_text_cross_attention_single": False,
        },
        lambda c: {"hidden_states": _video(c, 33), "encoder_hidden_states": _text(c, 12, 32)},
        sizes=((4, 4), (5, 6)),
        frames=(2, 3),
    ),
    Tiny(
        "latte",
        "LatteTransformer3DModel",
        {
            "sample_size": 8,
            "num_layers": 2,
            "patch_size": 2,
            "attention_head_dim": 4,
            "num_attention_heads": 2,
            "caption_channels": 8,
            "in_channels": 4,
            "cross_attention_dim": 8,
            "out_channels": 8,
            "attention_bias": True,
            "activation_fn": "gelu-approximate",
            "num_embeds_ada_norm": 1000,
            "norm_type": "ada_norm_single",
            "norm_elementwise_affine": False,
            "norm_eps": 1e-06,
            "video_length": 2,
        },
        lambda c: {"hidden_states": _video(c), "encoder_hidden_states": _text(c, 8, 8), "enable_temporal_attentions": True},
        frames=(2, 2),  # its temporal position embedding is for video_length frames
    ),
    Tiny(
        "bria-fibo2",
        "BriaFibo2Transformer2DModel",
        {
            "in_channels": 4,
            "patch_size": 2,
            "dim": 32,
            "n_layers": 2,
            "n_refiner_layers": 2,
            "n_heads": 2,
            "cap_feat_dim": 16,
            "injection_layer_ids": (1,),
            "perceiver_num_layers": 2,
            "min_num_gist_tokens": 4,
            "max_num_gist_tokens": 8,
            "gist_step": 4,
            "gist_min_text_len": 4,
            "gist_max_text_len": 16,
            "axes_dims": (4, 6, 6),
            "axes_lens": (16, 16, 16),
        },
        # the Perceiver's bundle, then one bundle per injection block: (batch, 1 + injections, tokens, width)
        lambda c: {
            "hidden_states": _image(c),
            "encoder_hidden_states": c.randn(c.batch, 2, 10, 16, prompt=True),
            "encoder_attention_mask": torch.ones(c.batch, 10, dtype=torch.bool),
        },
        scale=1.0,
        sizes=((8, 8), (6, 10)),
    ),
]


def _day0() -> list[Tiny]:
    """The builders of the denoisers the registry has no entry for (the cache reads theirs off their code:
    :mod:`torchfix.families.from_code`), keyed ``auto:<class>``."""
    from ._day0_image import TINY as image

    found = list(image)
    with contextlib.suppress(ImportError):
        from ._day0_video import TINY as video

        found += video
    return found


FAMILIES: dict[str, Tiny] = {tiny.key: tiny for tiny in [*_TINY, *_day0()]}


def replace(tiny: Tiny, **changes: Any) -> Tiny:
    """A copy of ``tiny`` with ``changes``."""
    return dataclasses.replace(tiny, **changes)
