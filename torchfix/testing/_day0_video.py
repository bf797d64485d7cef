"""Tiny offline builders for diffusers 0.42.1 denoisers torchfix's family registry does not know yet (video,
audio and omni models), in the form of :mod:`torchfix.testing.families`: random weights from small configs (the
sizes diffusers' own tests use, at least two blocks in every block list), nothing downloaded.

:data:`TINY` holds one :class:`~torchfix.testing.families.Tiny` per class that runs under
:func:`~torchfix.testing.families.denoise`, each named ``"auto:<class>"``; :data:`UNBUILDABLE` says, per class, why
no builder here can drive it through that loop.

Two builders step against a cache filled before the loop (Wan-Animate-2's reference K/V, the SANA-WM refiner's
attention sink and history): the cache is an argument holding one object per layer, so they are
:class:`_Prefilled` (a ``Tiny`` whose :meth:`~_Prefilled.sample` also takes one sample's rows of the cache). The
cache's contents are random K/V of the right shapes, standing in for the reference pass a pipeline runs first.

Audio models (1-D latents) read the size ``(1, L)`` as ``L`` latent frames.

>>> from torchfix.testing._day0_video import TINY
>>> sorted(t.model for t in TINY)[0]
'AceStepTransformer1DModel'
"""

from __future__ import annotations

import copy
import importlib
import inspect
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from .tiny import JOYIMAGE, LTX2, WAN, Call, Tiny, _text, _video

__all__ = ["TINY", "UNBUILDABLE"]


@dataclass(frozen=True)
class _Prefilled(Tiny):
    """A tiny denoiser whose step reads a cache a pipeline fills before its loop (``cache``: the argument holding
    it, a diffusers cache object with ``layer_caches``): :meth:`sample` takes one sample's rows of its tensors too."""

    cache: str = "kv_cache"

    def sample(self, arguments: dict[str, Any], index: int) -> dict[str, Any]:
        out = super().sample(arguments, index)
        out[self.cache] = _cache_rows(arguments[self.cache], index)
        return out


def _cache_rows(cache: Any, index: int) -> Any:
    """A copy of ``cache`` holding sample ``index`` of every per-layer tensor (their batch is the first dimension);
    what every layer shares (the SANA-WM refiner's ``sink_pe``, batch 1) is kept as it is."""
    rows = copy.copy(cache)
    rows.layer_caches = []
    for layer in cache.layer_caches:
        layer = copy.copy(layer)
        for name, value in vars(layer).items():
            if isinstance(value, torch.Tensor):
                setattr(layer, name, value.narrow(0, index, 1))
        rows.layer_caches.append(layer)
    return rows


def _length(c: Call) -> int:
    """An audio model's latent length: the size ``(1, L)`` read as ``L`` frames."""
    return c.size[0] * c.size[1]


def _defaults(model: str, config: dict[str, Any]) -> dict[str, Any]:
    """``config`` over the class's constructor defaults (what the built model's ``config`` holds)."""
    cls = getattr(importlib.import_module("diffusers"), model)
    params = inspect.signature(cls.__init__).parameters.values()
    return {**{p.name: p.default for p in params if p.default is not inspect.Parameter.empty}, **config}


# --- Wan-Animate (Wan 2.2 Animate 14B) ---------------------------------------------------------------------------

_WAN_ANIMATE = {
    **WAN,
    "in_channels": 12,  # 2 * latent_channels + 4
    "latent_channels": 4,
    "num_layers": 4,  # the test's 2, doubled so that face_adapter (one per inject_face_latents_blocks) holds two
    "image_dim": 16,
    "motion_encoder_channel_sizes": {"4": 16, "8": 16, "16": 16},
    "motion_encoder_size": 16,
    "motion_style_dim": 8,
    "motion_dim": 4,
    "motion_encoder_dim": 16,
    "face_encoder_hidden_dim": 16,
    "face_encoder_num_heads": 2,
    "inject_face_latents_blocks": 2,  # a face adapter after blocks 0 and 2
}


def _wan_animate_inputs(c: Call) -> dict[str, Any]:
    """One step of a Wan-Animate segment: ``frames`` latent frames (the reference image's slot, then the segment's),
    the noisy latents stacked with the conditioning (12 channels, 4 predicted), pose latents for the segment's frames,
    and the face video in pixels, ``4·(frames − 2) + 1`` frames so the face encoder's two stride-2 convolutions leave
    one motion frame per latent frame (its attention needs them to divide the token count)."""
    h, w = c.size
    return {
        "hidden_states": _video(c, 12),
        "encoder_hidden_states": _text(c, 12, 16),
        "encoder_hidden_states_image": c.randn(c.batch, 12, 16, prompt=True),
        "pose_hidden_states": c.randn(c.batch, 4, c.frames - 1, h, w),
        "face_pixel_values": c.randn(c.batch, 3, 4 * (c.frames - 2) + 1, 16, 16),
    }


# --- Wan-Animate-2 -----------------------------------------------------------------------------------------------

_WAN_ANIMATE_2 = {
    "patch_size": (1, 2, 2),
    "text_len": 16,
    "in_dim": 36,  # 16 latent channels + 20 conditioning (the conditioning latents and a 4-channel mask)
    "dim": 128,
    "ffn_dim": 256,
    "freq_dim": 64,
    "text_dim": 32,
    "out_dim": 16,
    "num_heads": 4,
    "num_layers": 2,
    "cross_attn_norm": True,
    "use_img_emb": True,
}


def _wan_animate_2_inputs(c: Call) -> dict[str, Any]:
    """One denoising step of a Wan-Animate-2 segment (``kv_cache_mode="cached"``): per-sample lists of the noisy
    latents (``frames`` latent frames: the reference slot, then the segment), their conditioning and the text; the CLIP
    image tokens (1280 wide: ``MLPProj`` fixes it); and the reference pass's per-layer K/V (pre-RoPE, one frame fewer
    than the segment), here random. The full video's geometry (``origin_len``, ``origin_area``) is the segment's, so
    the flex block mask the step builds (once per geometry, ``torch.compile``d) covers exactly these tokens."""
    config = c.config
    h, w = c.size
    heads, head_dim = config["num_heads"], config["dim"] // config["num_heads"]
    tokens = (h // 2) * (w // 2)
    module = importlib.import_module("diffusers.models.transformers.transformer_wan_animate_2")
    cache = module.WanAnimate2KVCache(config["num_layers"])
    for layer in cache.layer_caches:
        layer.store(
            c.randn(c.batch, (c.frames - 1) * tokens, heads, head_dim, prompt=True),
            c.randn(c.batch, (c.frames - 1) * tokens, heads, head_dim, prompt=True),
        )
    return {
        "hidden_states": [c.randn(16, c.frames, h, w) for _ in range(c.batch)],
        "condition_latents": [c.randn(20, c.frames, h, w) for _ in range(c.batch)],
        "encoder_hidden_states": [c.randn(8, config["text_dim"], prompt=True) for _ in range(c.batch)],
        "encoder_hidden_states_image": c.randn(c.batch, 4, 1280, prompt=True),
        "kv_cache": cache,
        "kv_cache_mode": "cached",
        "seq_len": c.frames * tokens,
        "reference_grid_sizes": torch.tensor([[c.frames - 1, h // 2, w // 2]] * c.batch),  # a row per sample
        "origin_len": 4 * (c.frames - 2) + 1,  # the pipeline's (len - 1) // 4 + 1 latent frames: the reference's
        "origin_area": [8 * h, 8 * w],  # pixels: 8x the latent, so origin_latent_hw = (h / 2) * (w / 2)
    }


# --- HunyuanVideo FramePack --------------------------------------------------------------------------------------

_FRAMEPACK_HISTORY = (4, 2, 1)  # history frames at 4x, 2x, 1x (the pipeline's 16, 2, 1 with fewer 4x frames)


def _framepack_inputs(c: Call) -> dict[str, Any]:
    """One FramePack step as the pipeline's vanilla sampling packs it: the window's latents, the clean history at
    1x (with the image's prefix frame), 2x and 4x, their frame indices (shared by the batch), text, pooled text, the
    SigLIP image tokens and the distilled guidance (guidance_scale 10 · 1000)."""
    h, w = c.size
    four, two, one = _FRAMEPACK_HISTORY
    indices = torch.arange(1 + four + two + one + c.frames)
    prefix, i4x, i2x, i1x, latents = indices.split([1, four, two, one, c.frames])
    return {
        "hidden_states": _video(c),
        "encoder_hidden_states": _text(c, 12, 16),
        "encoder_attention_mask": torch.ones(c.batch, 12),
        "pooled_projections": c.randn(c.batch, 8, prompt=True),
        "image_embeds": c.randn(c.batch, 4, 16, prompt=True),
        "guidance": torch.full((c.batch,), 10_000.0),
        "indices_latents": latents,
        "latents_clean": c.randn(c.batch, 4, 1 + one, h, w),
        "indices_latents_clean": torch.cat([prefix, i1x]),
        "latents_history_2x": c.randn(c.batch, 4, two, h, w),
        "indices_latents_history_2x": i2x,
        "latents_history_4x": c.randn(c.batch, 4, four, h, w),
        "indices_latents_history_4x": i4x,
    }


_FRAMEPACK_SHARED = ("indices_latents", "indices_latents_clean", "indices_latents_history_2x", "indices_latents_history_4x")


# --- Helios --------------------------------------------------------------------------------------------------------

_HELIOS_HISTORY = (4, 2, 1)  # long, mid, short history frames (the pipeline's 16, 2, 1 with fewer long frames)


def _helios_inputs(c: Call) -> dict[str, Any]:
    """One Helios step as its pipeline packs it (``keep_first_frame``): the chunk's latents, the long / mid / short
    history (short: the first frame's prefix and the 1x history) and their frame indices, ``(1, n)`` as the pipeline
    passes them (shared by the batch)."""
    h, w = c.size
    long, mid, one = _HELIOS_HISTORY
    indices = torch.arange(1 + long + mid + one + c.frames)
    prefix, i_long, i_mid, i_1x, i_latents = indices.split([1, long, mid, one, c.frames])
    return {
        "hidden_states": _video(c),
        "encoder_hidden_states": _text(c, 12, 16),
        "indices_hidden_states": i_latents.unsqueeze(0),
        "indices_latents_history_short": torch.cat([prefix, i_1x]).unsqueeze(0),
        "indices_latents_history_mid": i_mid.unsqueeze(0),
        "indices_latents_history_long": i_long.unsqueeze(0),
        "latents_history_short": c.randn(c.batch, 4, 1 + one, h, w),
        "latents_history_mid": c.randn(c.batch, 4, mid, h, w),
        "latents_history_long": c.randn(c.batch, 4, long, h, w),
    }


_HELIOS_SHARED = ("indices_hidden_states", "indices_latents_history_short", "indices_latents_history_mid", "indices_latents_history_long")


# --- JoyImage Edit Plus ------------------------------------------------------------------------------------------


def _joyimage_edit_plus_inputs(c: Call) -> dict[str, Any]:
    """One JoyImage-Edit-Plus step: the target's noise patches (``[1, 2, 2]``, from the latent size) then one
    reference image's (a 4 x 4 latent: 4 patches), as ``[B, patches, C, pt, ph, pw]``; each sample's component grids
    (``shape_list``, a list per sample), text and its mask."""
    h, w = c.size
    patches = (h // 2) * (w // 2) + 4
    return {
        "hidden_states": c.randn(c.batch, patches, 16, 1, 2, 2),
        "encoder_hidden_states": _text(c, 12, 16),
        "encoder_hidden_states_mask": torch.ones(c.batch, 12),
        "shape_list": [[(1, h // 2, w // 2), (1, 2, 2)] for _ in range(c.batch)],
    }


# --- ConsisID ------------------------------------------------------------------------------------------------------

_CONSISID = {
    "num_attention_heads": 2,
    "attention_head_dim": 8,
    "in_channels": 4,
    "out_channels": 4,
    "time_embed_dim": 2,
    "text_embed_dim": 8,
    "num_layers": 2,  # the test's 1 (two blocks, and with cross_attn_interval 1 two perceiver cross-attentions)
    "sample_width": 8,
    "sample_height": 8,
    "sample_frames": 8,
    "patch_size": 2,
    "temporal_compression_ratio": 4,
    "max_text_seq_length": 8,
    "cross_attn_interval": 1,
    "is_kps": False,
    "is_train_face": True,
    "cross_attn_dim_head": 1,
    "cross_attn_num_heads": 1,
    "LFE_id_dim": 2,
    "LFE_vit_dim": 2,
    "LFE_depth": 5,
    "LFE_dim_head": 8,
    "LFE_num_heads": 2,
    "LFE_num_id_token": 1,
    "LFE_num_querie": 1,
    "LFE_output_dim": 10,
    "LFE_ff_mult": 1,
    "LFE_num_scale": 1,
}


def _consisid_inputs(c: Call) -> dict[str, Any]:
    """One ConsisID step: ``[B, F, C, H, W]`` latents, 8 text tokens (``max_text_seq_length``), the face embedding
    (``id_cond``) and the face ViT's hidden states, one per scale (``LFE_num_scale``), stacked as a
    ``[scales, B, tokens, dim]`` tensor rather than the pipeline's list so that a sample's rows can be taken (the model
    iterates it either way)."""
    return {
        "hidden_states": c.randn(c.batch, c.frames, 4, *c.size),
        "encoder_hidden_states": _text(c, 8, 8),
        "id_cond": c.randn(c.batch, 2),
        "id_vit_hidden": c.randn(1, c.batch, 2, 2),
    }


# --- SANA-WM stage-2 refiner (LTX-2 layout) ----------------------------------------------------------------------

_SANA_WM_REFINER = LTX2  # the LTX-2 layout


def _refiner_rope(config: dict[str, Any], frames: list[int], h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The video RoPE of ``frames`` (absolute latent-frame indices), batch 1, as the model's
    ``build_rotary_emb_for_absolute_positions`` builds it (from a rope module made as its ``__init__`` makes it)."""
    module = importlib.import_module("diffusers.models.transformers.transformer_sana_wm_refiner")
    config = _defaults("SanaWMLTX2RefinerTransformer3DModel", config)
    rope = module.SanaWMLTX2AudioVideoRotaryPosEmbed(
        dim=config["num_attention_heads"] * config["attention_head_dim"],
        patch_size=config["patch_size"],
        patch_size_t=config["patch_size_t"],
        base_num_frames=config["pos_embed_max_pos"],
        base_height=config["base_height"],
        base_width=config["base_width"],
        scale_factors=config["vae_scale_factors"],
        theta=config["rope_theta"],
        causal_offset=config["causal_offset"],
        modality="video",
        double_precision=config["rope_double_precision"],
        rope_type=config["rope_type"],
        num_attention_heads=config["num_attention_heads"],
    )
    build = module.SanaWMLTX2RefinerTransformer3DModel.build_rotary_emb_for_absolute_positions
    return build(SimpleNamespace(rope=rope), 1, frames, h, w, torch.device("cpu"), 24.0)


def _sana_wm_refiner_inputs(c: Call) -> dict[str, Any]:
    """One denoising step of an AR block of the SANA-WM refiner (``kv_cache_mode="inject"``): the block's packed
    latent tokens (``frames x h x w``, patch 1), text and its mask, the block's RoPE at its absolute frames, and the
    sliding-window cache: one sink frame (pre-RoPE K/V and its shifted ``sink_pe``) and one frame of refined history
    (post-RoPE K/V), here random. The RoPEs are batch 1 (shared by the batch)."""
    config = c.config
    h, w = c.size
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    module = importlib.import_module("diffusers.models.transformers.transformer_sana_wm_refiner")
    cache = module.SanaWMRefinerKVCache(config["num_layers"])
    for layer in cache.layer_caches:
        layer.store_sink(c.randn(c.batch, h * w, inner, prompt=True), c.randn(c.batch, h * w, inner, prompt=True))
        layer.store_history(c.randn(c.batch, h * w, inner, prompt=True), c.randn(c.batch, h * w, inner, prompt=True))
    cache.sink_pe = _refiner_rope(config, [0], h, w)
    return {
        "hidden_states": c.randn(c.batch, c.frames * h * w, config["in_channels"]),
        "encoder_hidden_states": _text(c, 16, config["caption_channels"]),
        "encoder_attention_mask": torch.ones(c.batch, 16),
        "video_rotary_emb": _refiner_rope(config, list(range(2, 2 + c.frames)), h, w),  # after sink and history
        "kv_cache": cache,
        "kv_cache_mode": "inject",
    }


# --- AnyFlow and SANA-WM (timesteps per frame) ---------------------------------------------------------------------


def _per_frame(frames_dim: int, layout: tuple[int, ...]) -> Any:
    """A ``timestep_as``: the step's one timestep per sample repeated over the latents' frames (dimension
    ``frames_dim``), viewed as ``layout`` with ``-1`` for the frames (AnyFlow: ``(batch, frames)``; SANA-WM:
    ``(batch, 1, frames)``), as their pipelines pass it."""

    def layout_of(t: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        frames = latents.shape[frames_dim]
        return t[:, None].repeat(1, frames).view(*(t.shape[0] if d == 0 else frames if d == -1 else d for d in layout))

    return layout_of


def _anyflow_inputs(c: Call) -> dict[str, Any]:
    """AnyFlow's step: latents ``(batch, frames, channels, h, w)``, text, and the flow map's target timestep
    ``r_timestep`` per frame, 0 here (the map to the clean end: the loop moves one timestep argument; AnyFlow's
    pipeline passes the next sigma's, or the step's own timestep without mean velocity)."""
    return {
        "hidden_states": c.randn(c.batch, c.frames, 4, *c.size),
        "encoder_hidden_states": _text(c, 12, 16),
        "r_timestep": torch.zeros(c.batch, c.frames),
    }


_SANA_WM = {  # diffusers' test sizes (tests/models/transformers/test_models_transformer_sana_wm.py; 0.42.1 takes no model_max_length)
    "in_channels": 4,
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 2,
    "patch_size": (1, 1, 1),
    "softmax_every_n": 2,  # block 0 the GDN attention, block 1 the softmax one
    "linear_head_dim": 16,
    "t_kernel_size": 3,
    "conv_kernel_size": 4,
    "caption_channels": 8,
    "mlp_ratio": 2.0,
    "chunk_plucker_channels": 8,
    "chunk_plucker_post_attn_blocks": 2,
}


def _sana_wm_inputs(c: Call) -> dict[str, Any]:
    """SANA-WM's step as its test calls it: latents ``(batch, channels, frames, h, w)``, text ``(batch, 1, L, D)`` and
    its mask, the camera (a flat 4x4 camera-to-world moving forward, then pinhole intrinsics ``fx, fy, cx, cy``: one
    row of 20 per frame) and the Plucker ray embeddings."""
    h, w = c.size
    c2w = torch.eye(4).repeat(c.batch, c.frames, 1, 1)
    c2w[..., 2, 3] = torch.arange(c.frames, dtype=torch.float32) * 0.1
    intrinsics = torch.tensor([float(w), float(h), w / 2, h / 2]).expand(c.batch, c.frames, 4)
    return {
        "hidden_states": _video(c),
        "encoder_hidden_states": c.randn(c.batch, 1, 16, 8, prompt=True),
        "encoder_attention_mask": torch.ones(c.batch, 16, dtype=torch.long),
        "camera_conditions": torch.cat([c2w.flatten(start_dim=-2), intrinsics], dim=-1),
        "chunk_plucker": c.randn(c.batch, 8, c.frames, h, w),
    }


# --- MiniMax-H3 (joint video + audio) ----------------------------------------------------------------------------

_H3_TEXT, _H3_AUDIO = 4, 6


def _minimax_h3_inputs(c: Call) -> dict[str, Any]:
    """One MiniMax-H3 step: the packed sequence's rows as the test lays them out (text, then audio, then the video's
    patch rows, ``frames x h/2 x w/2`` of them), each row's modality tag, rotary ``(t, h, w)`` coordinates (the
    video rows' from their grid) and timestep index (all 0: the loop gives every row the step's one timestep; the
    ``timestep`` it passes, one entry per sample, is read as the list of distinct noise levels). The layout tensors
    have no batch dimension."""
    h, w = c.size[0] // 2, c.size[1] // 2
    video = c.frames * h * w
    length = _H3_TEXT + _H3_AUDIO + video
    text = torch.arange(_H3_TEXT)
    audio = torch.arange(_H3_TEXT, _H3_TEXT + _H3_AUDIO)
    rows = torch.arange(_H3_TEXT + _H3_AUDIO, length)
    tags = torch.empty(length, dtype=torch.long)
    tags[text], tags[audio], tags[rows] = 1, 2, 0
    positions = torch.zeros(length, 3)
    positions[: _H3_TEXT + _H3_AUDIO, 0] = torch.arange(_H3_TEXT + _H3_AUDIO, dtype=torch.float32)
    t, y, x = torch.meshgrid(torch.arange(c.frames), torch.arange(h), torch.arange(w), indexing="ij")
    positions[rows] = torch.stack([t.flatten() + _H3_TEXT + _H3_AUDIO, y.flatten(), x.flatten()], dim=-1).float()
    return {
        "hidden_states": c.randn(c.batch, video, 16),
        "audio_hidden_states": c.randn(c.batch, _H3_AUDIO, 6),
        "encoder_hidden_states": _text(c, _H3_TEXT, 8),
        "timestep_indices": torch.zeros(length, dtype=torch.long),
        "token_tags": tags,
        "position_ids": positions,
        "video_indices": rows,
        "audio_indices": audio,
        "text_indices": text,
    }


_H3_SHARED = ("timestep_indices", "token_tags", "position_ids", "video_indices", "audio_indices", "text_indices")


# --- the builders --------------------------------------------------------------------------------------------------

TINY: list[Tiny] = [
    Tiny(
        "auto:WanAnimateTransformer3DModel",
        "WanAnimateTransformer3DModel",
        _WAN_ANIMATE,
        _wan_animate_inputs,
        sizes=((4, 4), (6, 8)),  # patch (1, 2, 2): even sides
        frames=(2, 3),  # the reference slot + 1 or 2 segment frames
    ),
    _Prefilled(
        "auto:WanAnimate2Transformer3DModel",
        "WanAnimate2Transformer3DModel",
        _WAN_ANIMATE_2,
        _wan_animate_2_inputs,
        sizes=((4, 4), (6, 8)),
        frames=(2, 3),
        per_sample=("hidden_states", "condition_latents", "encoder_hidden_states"),
    ),
    Tiny(
        "auto:HunyuanVideoFramepackTransformer3DModel",
        "HunyuanVideoFramepackTransformer3DModel",
        {
            "in_channels": 4,
            "out_channels": 4,
            "num_attention_heads": 2,
            "attention_head_dim": 10,
            "num_layers": 2,
            "num_single_layers": 2,
            "num_refiner_layers": 1,
            "patch_size": 2,
            "patch_size_t": 1,
            "guidance_embeds": True,
            "text_embed_dim": 16,
            "pooled_projection_dim": 8,
            "rope_axes_dim": (2, 4, 4),
            "image_condition_type": None,
            "has_image_proj": True,
            "image_proj_dim": 16,
            "has_clean_x_embedder": True,
        },
        _framepack_inputs,
        sizes=((4, 4), (6, 8)),
        frames=(2, 3),
        prompts=("encoder_hidden_states", "pooled_projections"),
        shared=_FRAMEPACK_SHARED,
    ),
    Tiny(
        "auto:HeliosTransformer3DModel",
        "HeliosTransformer3DModel",
        {
            **{k: v for k, v in WAN.items() if k != "rope_max_seq_len"},  # Wan's layout, its own rope
            "rope_dim": (4, 4, 4),
            "has_multi_term_memory_patch": True,
            "guidance_cross_attn": True,
            "zero_history_timestep": True,
            "is_amplify_history": False,
        },
        _helios_inputs,
        sizes=((4, 4), (6, 8)),
        frames=(2, 3),
        shared=_HELIOS_SHARED,
    ),
    Tiny(
        "auto:JoyImageEditPlusTransformer3DModel",
        "JoyImageEditPlusTransformer3DModel",
        JOYIMAGE,
        _joyimage_edit_plus_inputs,
        sizes=((4, 4), (6, 8)),
        per_sample=("shape_list",),
    ),
    Tiny(
        "auto:ConsisIDTransformer3DModel",
        "ConsisIDTransformer3DModel",
        _CONSISID,
        _consisid_inputs,
        sizes=((8, 8), (8, 12)),
        frames=(1, 2),
        batch_dim=(("id_vit_hidden", 1),),
    ),
    _Prefilled(
        "auto:SanaWMLTX2RefinerTransformer3DModel",
        "SanaWMLTX2RefinerTransformer3DModel",
        _SANA_WM_REFINER,
        _sana_wm_refiner_inputs,
        sizes=((4, 4), (5, 6)),
        frames=(1, 2),
        shared=("video_rotary_emb",),
    ),
    Tiny(
        "auto:MiniMaxH3Transformer3DModel",
        "MiniMaxH3Transformer3DModel",
        {
            "num_attention_heads": 2,
            "attention_head_dim": 16,
            "hidden_size": 24,
            "num_layers": 2,
            "num_refiner_layers": 2,
            "ffn_dim": 32,
            "in_channels": 4,
            "audio_in_channels": 6,
            "patch_size": (1, 2, 2),
            "text_dim": 8,
            "freq_dim": 8,
            "time_embed_hidden_dim": 24,
            "time_embed_dim": 16,
            "rope_freq_dim": 2,
        },
        _minimax_h3_inputs,
        scale=1.0,
        sizes=((4, 4), (6, 8)),
        frames=(1, 2),
        shared=_H3_SHARED,
    ),
    Tiny(
        "auto:AceStepTransformer1DModel",
        "AceStepTransformer1DModel",
        {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "in_channels": 24,  # acoustic dim x 3: the latents and the context latents (source + chunk mask)
            "audio_acoustic_hidden_dim": 8,
            "patch_size": 2,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6,
            "sliding_window": 16,
        },
        # timestep_r: the pipeline passes the step's timestep again (t − r = 0); the loop sets one argument only,
        # so it is 0 here (t − r = t).
        lambda c: {
            "hidden_states": c.randn(c.batch, _length(c), 8),
            "encoder_hidden_states": _text(c, 10, 32),
            "context_latents": c.randn(c.batch, _length(c), 16),
            "timestep_r": torch.zeros(c.batch),
        },
        scale=1.0,
        sizes=((1, 16), (1, 23)),  # odd: padded to the patch size and cut back
    ),
    Tiny(
        "auto:MiniMaxMusic3Transformer1DModel",
        "MiniMaxMusic3Transformer1DModel",
        {
            "in_channels": 8,
            "condition_dim": 16,
            "num_layers": 2,
            "num_attention_heads": 2,
            "attention_head_dim": 8,
            "ff_inner_dim": 32,
            "rotary_dim": 4,
            "fourier_embedding_dim": 8,
        },
        # the conditioning is frame-aligned: one row per latent frame
        lambda c: {"hidden_states": c.randn(c.batch, 8, _length(c)), "encoder_hidden_states": _text(c, _length(c), 16)},
        scale=1.0,  # flow-matching time in [0, 1], 0 = noise (the loop runs it 1 -> 0)
        sizes=((1, 16), (1, 23)),
    ),
    Tiny(
        "auto:LongCatAudioDiTTransformer",
        "LongCatAudioDiTTransformer",
        {"dit_dim": 64, "dit_depth": 2, "dit_heads": 4, "dit_text_dim": 32, "latent_dim": 8, "text_conv": False},
        lambda c: {
            "hidden_states": c.randn(c.batch, _length(c), 8),
            "encoder_hidden_states": _text(c, 10, 32),
            "encoder_attention_mask": torch.ones(c.batch, 10, dtype=torch.bool),
            "attention_mask": torch.ones(c.batch, _length(c), dtype=torch.bool),
            "latent_cond": torch.zeros(c.batch, _length(c), 8),  # the pipeline's (text-to-audio: zeros)
        },
        scale=1.0,
        sizes=((1, 16), (1, 23)),
    ),
    Tiny(
        "auto:AnyFlowTransformer3DModel",
        "AnyFlowTransformer3DModel",
        {  # diffusers' test sizes (tests/models/transformers/test_models_transformer_anyflow.py): Wan's, and its gate
            **{k: v for k, v in WAN.items() if k != "qk_norm"},
            "gate_value": 0.25,
            "deltatime_type": "r",
        },
        _anyflow_inputs,
        sizes=((4, 4), (6, 8)),  # patch (1, 2, 2): even sides
        frames=(2, 3),
        timestep_as=_per_frame(1, (0, -1)),
    ),
    Tiny(
        "auto:SanaWMTransformer3DModel",
        "SanaWMTransformer3DModel",
        _SANA_WM,
        _sana_wm_inputs,
        sizes=((4, 4), (5, 6)),
        frames=(4, 3),
        prompts=("encoder_hidden_states",),
        timestep_as=_per_frame(2, (0, 1, -1)),
    ),
]


UNBUILDABLE: dict[str, str] = {
    "AnyFlowFARTransformer3DModel": (
        "its timestep and r_timestep are per frame, (batch, frames) (the condition embedder slices "
        "`timestep[:, -num_full_frames:]`), which families.denoise's (batch,) timestep cannot be; its denoising step "
        "(`kv_cache` given, not a cache step) also reads a per-block list of K/V dicts filled by a prefill call, "
        "and its causal self-attention runs on the flex backend only"
    ),
    "Cosmos3OmniTransformer": (
        "one packed sequence per call, no batch dimension: the vision timesteps are per noisy patch "
        "(`vision_timesteps`, scatter-added one per patch, so the (batch,) timestep families.denoise passes only "
        "fits a one-patch latent), the latents are a list of items packed into one sequence whose items attend to "
        "each other (rows of a batch are not independent), and its pipeline runs each guidance pass as its own call"
    ),
}
