"""Tiny offline builders for the image (and Kandinsky 6 video) denoisers of diffusers 0.42.1 that the family registry
does not know yet, in the format of :mod:`torchfix.testing.families`: one :class:`~torchfix.testing.families.Tiny`
per class, ``family = "auto:" + class name``, random weights from small configs (diffusers' own test sizes where it
has them, at least two blocks in every block list), nothing downloaded.

:data:`UNBUILDABLE` names the classes that cannot run tiny here, with the reason (empty: all of them run).
"""

from __future__ import annotations

from typing import Any

import torch

from .tiny import Call, Tiny, _ids, _image, _text

__all__ = ["TINY", "UNBUILDABLE"]


def _bool(*shape: int) -> torch.Tensor:
    return torch.ones(*shape, dtype=torch.bool)


# --- Qwen-Image 2.1: one joint [text | image] sequence, the output covers both (the pipeline keeps the last tokens) ---


def _qwenimage21(c: Call) -> dict[str, Any]:
    """8 text tokens 16 wide, then the target image's slots (each stands for 2×2 latent tokens: ``h·w`` divisible by 4)."""
    h, w = c.size
    tokens = h * w
    img_mask = torch.zeros(c.batch, 8 + tokens // 4, dtype=torch.bool)
    img_mask[:, 8:] = True
    return {
        "hidden_states": c.randn(c.batch, tokens, 16),
        "encoder_hidden_states": _text(c, 8, 16),
        "encoder_hidden_states_mask": _bool(c.batch, 8),
        "img_shapes": [[(1, h, w)]] * c.batch,
        "img_mask": img_mask,
    }


# --- Flux 3 ---


def _flux3(c: Call) -> dict[str, Any]:
    h, w = c.size
    txt_ids = torch.zeros(12, 4, dtype=torch.long)
    txt_ids[:, 3] = torch.arange(12)
    return {
        "hidden_states": c.randn(c.batch, h * w, 4),
        "encoder_hidden_states": _text(c, 12, 32),
        "img_ids": _ids(h, w, width=4),
        "txt_ids": txt_ids,
    }


# --- Krea 2: text = a stack of 3 tapped encoder layers per token ---


def _krea2(c: Call) -> dict[str, Any]:
    h, w = c.size
    text = 6
    position_ids = torch.zeros(text + h * w, 3)
    position_ids[text:, 1] = torch.arange(h).repeat_interleave(w).float()
    position_ids[text:, 2] = torch.arange(w).repeat(h).float()
    return {
        "hidden_states": c.randn(c.batch, h * w, 16),
        "encoder_hidden_states": c.randn(c.batch, text, 3, 16, prompt=True),
        "position_ids": position_ids,
        "encoder_attention_mask": _bool(c.batch, text),
    }


# --- Ideogram 4: one packed [text | image] sequence for the latents, the text features and the layout ---

_IDEOGRAM_TEXT = 4


def _ideogram4(c: Call) -> dict[str, Any]:
    from diffusers.models.transformers.transformer_ideogram4 import (
        IMAGE_POSITION_OFFSET,
        LLM_TOKEN_INDICATOR,
        OUTPUT_IMAGE_INDICATOR,
    )

    h, w = c.size
    text, tokens = _IDEOGRAM_TEXT, h * w
    hidden_states = torch.zeros(c.batch, text + tokens, 16)
    hidden_states[:, text:] = c.randn(c.batch, tokens, 16)
    features = torch.zeros(c.batch, text + tokens, 24)
    features[:, :text] = c.randn(c.batch, text, 24, prompt=True)
    position_ids = torch.zeros(c.batch, text + tokens, 3, dtype=torch.long)
    position_ids[:, :text] = torch.arange(text)[:, None]
    position_ids[:, text:, 0] = IMAGE_POSITION_OFFSET
    position_ids[:, text:, 1] = torch.arange(h).repeat_interleave(w) + IMAGE_POSITION_OFFSET
    position_ids[:, text:, 2] = torch.arange(w).repeat(h) + IMAGE_POSITION_OFFSET
    indicator = torch.full((c.batch, text + tokens), OUTPUT_IMAGE_INDICATOR, dtype=torch.long)
    indicator[:, :text] = LLM_TOKEN_INDICATOR
    return {
        "hidden_states": hidden_states,
        "encoder_hidden_states": features,
        "position_ids": position_ids,
        "segment_ids": torch.ones(c.batch, text + tokens, dtype=torch.long),
        "indicator": indicator,
    }


# --- GLM-Image: the AR model's prior tokens (one per 2×2 patch) ride with the prompt ---


def _glm_image(c: Call) -> dict[str, Any]:
    h, w = c.size
    patches = (h // 2) * (w // 2)
    return {
        "hidden_states": _image(c),
        "encoder_hidden_states": _text(c, 12, 32),
        "prior_token_id": torch.randint(0, 64, (c.batch, patches), generator=c.prompt),
        "prior_token_drop": torch.zeros(c.batch, patches, dtype=torch.bool),
        "target_size": torch.tensor([[float(h), float(w)]] * c.batch),
        "crop_coords": torch.zeros(c.batch, 2),
    }


# --- Kandinsky 6: video latents in the (B, T, H, W, C) layout, audio latents beside them ---


def _kandinsky6(c: Call) -> dict[str, Any]:
    return {
        "hidden_states": c.randn(c.batch, c.frames, *c.size, 4),
        "encoder_hidden_states": _text(c, 8, 16),
        "pooled_projections": c.randn(c.batch, 8, prompt=True),
        "audio_hidden_states": c.randn(c.batch, 6, 4),
    }


def _omnigen(c: Call) -> dict[str, Any]:
    """8 prompt tokens, the time token, then the image tokens (2×2 patches): causal over the prompt and the time
    token, the image tokens see everything (what OmniGen's processor builds for an unpadded prompt)."""
    text = 8
    seq = text + 1 + (c.size[0] // 2) * (c.size[1] // 2)
    mask = torch.zeros(seq, seq)
    mask[: text + 1, : text + 1] = torch.tril(torch.ones(text + 1, text + 1))
    mask[text + 1 :] = 1.0
    return {
        "hidden_states": _image(c),
        "input_ids": torch.randint(1, 64, (c.batch, text), generator=c.prompt),
        "input_img_latents": [],
        "input_image_sizes": {},
        "attention_mask": mask.expand(c.batch, -1, -1).clone(),
        "position_ids": torch.arange(seq).expand(c.batch, -1).clone(),
    }


TINY: list[Tiny] = [
    Tiny(
        "auto:QwenImage21Transformer2DModel",
        "QwenImage21Transformer2DModel",
        {
            "patch_size": 1,
            "in_channels": 16,
            "out_channels": 16,
            "num_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "context_in_dim": 16,
            "mlp_ratio": 2,
            "axes_dims_rope": (4, 6, 6),
            "causal_condition": True,
        },
        _qwenimage21,
        scale=1.0,
        sizes=((4, 4), (3, 8)),  # h·w divisible by 4 (2×2 latent tokens per vision-language slot)
        per_sample=("img_shapes",),
    ),
    Tiny(
        "auto:Flux3Transformer2DModel",
        "Flux3Transformer2DModel",
        {
            "in_channels": 4,
            "cond_in_channels": 4,
            "num_layers": 2,
            "num_single_layers": 2,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,
            "mlp_ratio": 2.0,
            "axes_dims_rope": (4, 4, 4, 4),
        },
        _flux3,
        scale=1.0,
        sizes=((4, 4), (5, 7)),
        shared=("img_ids", "txt_ids"),
    ),
    Tiny(
        "auto:Krea2Transformer2DModel",
        "Krea2Transformer2DModel",
        {
            "in_channels": 16,
            "num_layers": 2,
            "attention_head_dim": 8,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 32,
            "timestep_embed_dim": 8,
            "text_hidden_dim": 16,
            "num_text_layers": 3,
            "text_num_attention_heads": 2,
            "text_num_key_value_heads": 1,
            "text_intermediate_size": 16,
            "num_layerwise_text_blocks": 2,
            "num_refiner_text_blocks": 2,
            "axes_dims_rope": (4, 2, 2),
            "rope_theta": 1000.0,
            "norm_eps": 1e-5,
        },
        _krea2,
        scale=1.0,
        sizes=((4, 4), (5, 7)),
        shared=("position_ids",),
    ),
    Tiny(
        "auto:Ideogram4Transformer2DModel",
        "Ideogram4Transformer2DModel",
        {
            "in_channels": 16,
            "num_layers": 2,
            "attention_head_dim": 8,
            "num_attention_heads": 4,
            "intermediate_size": 32,
            "adaln_dim": 16,
            "llm_features_dim": 24,
            "rope_theta": 10_000,
            "mrope_section": (2, 1, 1),
            "norm_eps": 1e-5,
        },
        _ideogram4,
        scale=1.0,  # model time in [0, 1], 0 = noise (the pipeline passes 1 - sigma)
        sizes=((4, 4), (5, 7)),
    ),
    Tiny(
        "auto:GlmImageTransformer2DModel",
        "GlmImageTransformer2DModel",
        {
            "patch_size": 2,
            "in_channels": 4,
            "out_channels": 4,
            "num_layers": 2,
            "attention_head_dim": 8,
            "num_attention_heads": 2,
            "text_embed_dim": 32,
            "time_embed_dim": 16,
            "condition_dim": 8,
            "prior_vq_quantizer_codebook_size": 64,
        },
        _glm_image,
        sizes=((8, 8), (6, 10)),
        prompts=("encoder_hidden_states", "prior_token_id"),
    ),
    Tiny(
        "auto:ErnieImageTransformer2DModel",
        "ErnieImageTransformer2DModel",
        {
            "hidden_size": 16,
            "num_attention_heads": 1,
            "num_layers": 2,
            "ffn_hidden_size": 16,
            "in_channels": 16,
            "out_channels": 16,
            "patch_size": 1,
            "text_in_dim": 16,
            "rope_theta": 256,
            "rope_axes_dim": (8, 4, 4),
            "eps": 1e-6,
            "qk_layernorm": True,
        },
        lambda c: {
            "hidden_states": _image(c, 16),
            "text_bth": _text(c, 8, 16),
            "text_lens": torch.full((c.batch,), 8, dtype=torch.long),
        },
        sizes=((4, 4), (5, 7)),
        prompts=("text_bth",),
    ),
    Tiny(
        "auto:HunyuanImageTransformer2DModel",
        "HunyuanImageTransformer2DModel",
        {
            "in_channels": 4,
            "out_channels": 4,
            "num_attention_heads": 4,
            "attention_head_dim": 8,
            "num_layers": 2,
            "num_single_layers": 2,
            "num_refiner_layers": 2,
            "patch_size": (1, 1),
            "guidance_embeds": False,
            "text_embed_dim": 32,
            "text_embed_2_dim": 32,
            "rope_axes_dim": (4, 4),
        },
        lambda c: {
            "hidden_states": _image(c),
            "encoder_hidden_states": _text(c, 8, 32),
            "encoder_attention_mask": _bool(c.batch, 8),
            "encoder_hidden_states_2": _text(c, 4, 32),
            "encoder_attention_mask_2": _bool(c.batch, 4),
        },
        sizes=((4, 4), (5, 7)),
        prompts=("encoder_hidden_states", "encoder_hidden_states_2"),
    ),
    Tiny(
        "auto:BriaFiboTransformer2DModel",
        "BriaFiboTransformer2DModel",
        {
            "patch_size": 1,
            "in_channels": 48,
            "num_layers": 2,
            "num_single_layers": 2,
            "attention_head_dim": 8,
            "num_attention_heads": 2,
            "joint_attention_dim": 64,
            "text_encoder_dim": 32,
            "pooled_projection_dim": None,
            "axes_dims_rope": [0, 4, 4],
        },
        # the pipeline's list of per-block text-encoder layers, stacked (blocks, batch, tokens, width): the model
        # iterates over it the same, and its batch dimension is then a tensor's
        lambda c: {
            "hidden_states": c.randn(c.batch, c.size[0] * c.size[1], 48),
            "encoder_hidden_states": _text(c, 12, 64),
            "text_encoder_layers": c.randn(4, c.batch, 12, 32, prompt=True),
            "img_ids": _ids(*c.size),
            "txt_ids": torch.zeros(12, 3),
        },
        sizes=((4, 4), (5, 7)),
        prompts=("encoder_hidden_states", "text_encoder_layers"),
        shared=("img_ids", "txt_ids"),
        batch_dim=(("text_encoder_layers", 1),),
    ),
    Tiny(
        "auto:PRXTransformer2DModel",
        "PRXTransformer2DModel",
        {
            "in_channels": 4,
            "patch_size": 2,
            "context_in_dim": 16,
            "hidden_size": 32,
            "mlp_ratio": 2.0,
            "num_heads": 2,
            "depth": 2,
            "axes_dim": [8, 8],
        },
        lambda c: {
            "hidden_states": _image(c),
            "encoder_hidden_states": _text(c, 8, 16),
            "attention_mask": _bool(c.batch, 8),
        },
        scale=1.0,
        sizes=((8, 8), (6, 10)),
    ),
    Tiny(
        "auto:OmniGenTransformer2DModel",
        "OmniGenTransformer2DModel",
        {
            "in_channels": 4,
            "hidden_size": 16,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "intermediate_size": 32,
            "num_layers": 2,
            "pad_token_id": 0,
            "vocab_size": 64,
            "time_step_dim": 4,
            "pos_embed_max_size": 16,
            "rope_scaling": {"long_factor": [1, 2], "short_factor": [1, 2]},
        },
        _omnigen,
        scale=1.0,  # its scheduler runs 1 train step with inverted sigmas: model time in [0, 1], 0 = noise
        sizes=((8, 8), (6, 10)),
        prompts=("input_ids",),
    ),
    Tiny(
        "auto:DreamLiteTransformer2DModel",
        "DreamLiteTransformer2DModel",
        {
            "num_attention_heads": 2,
            "attention_head_dim": 8,
            "in_channels": 16,
            "num_layers": 2,
            "norm_num_groups": 8,
            "cross_attention_dim": 16,
            "qk_norm": "rms_norm",
            "ff_mult": 2,
        },
        # a spatial transformer of the DreamLite U-Net: no timestep embedding (layer_norm blocks ignore it)
        lambda c: {"hidden_states": _image(c, 16), "encoder_hidden_states": _text(c, 8, 16)},
        sizes=((8, 8), (5, 7)),
    ),
    Tiny(
        "auto:Kandinsky6Transformer3DModel",
        "Kandinsky6Transformer3DModel",
        {
            "in_visual_dim": 4,
            "out_visual_dim": 4,
            "in_text_dim": 16,
            "in_text_dim2": 8,
            "time_dim": 16,
            "patch_size": (1, 2, 2),
            "model_dim": 32,
            "ff_dim": 64,
            "num_text_blocks": 2,
            "num_visual_blocks": 2,
            "axes_dims": (4, 6, 6),
            # without the conditioning channels ([latent | cond latent | mask]) the output has the latents' shape
            "visual_cond": False,
            "in_audio_dim": 4,
            "out_audio_dim": 4,
            "model_dim_a": 32,
            "time_dim_a": 16,
            "ff_dim_a": 64,
            # what the released checkpoints set
            "text_token_padding": True,
            "ca_rope": True,
            "cross_gates": True,
            "fix_modulation": True,
        },
        _kandinsky6,
        sizes=((4, 4), (6, 10)),
        frames=(2, 3),
        prompts=("encoder_hidden_states", "pooled_projections"),
    ),
    Tiny(
        "auto:Kandinsky6SRTransformer3DModel",
        "Kandinsky6SRTransformer3DModel",
        {
            "in_visual_dim": 4,
            # the input is [noisy latent | anchor latent | anchor mask] (2·4 + 1 channels); an output as wide keeps the
            # latents' shape (a velocity checkpoint predicts 4, a pi-Flow one n_grid·4)
            "out_visual_dim": 9,
            "time_dim": 16,
            "patch_size": (1, 1, 1),
            "model_dim": 32,
            "ff_dim": 64,
            "num_visual_blocks": 2,
            "axes_dims": (4, 6, 6),
            "nabla_window": (3, 3, 3),
        },
        lambda c: {"hidden_states": c.randn(c.batch, c.frames, *c.size, 9)},
        sizes=((8, 8), (8, 16)),  # NABLA attention: the token grid in 8×8 blocks
        frames=(1, 2),
        prompts=(),  # text-free
    ),
]

# class name -> why it has no tiny builder here
UNBUILDABLE: dict[str, str] = {}
