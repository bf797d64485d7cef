"""The model families torchfix knows: one entry each (see :class:`torchfix.families.Family`).

Each signature was read off the family's forward in diffusers 0.42.1 and is checked again on the first call of
every model (``torchfix.deepcache.blocks``): a block list that returns other streams, in another order, or
passes them elsewhere is refused. Adding a family is one entry here and one tiny builder in
``torchfix.testing.FAMILIES`` (docs/families.md).
"""

from __future__ import annotations

from typing import Any

from .spec import Blocks, Family, Width, builtin_done, refuse, register

__all__ = [
    "COMFY_REFUSED",
    "CONDITIONING_WEIGHTS",
    "IMAGE_ENCODER_WEIGHTS",
    "IMAGE_PROJECTION_DEFAULT",
    "IMAGE_PROJECTION_READS",
    "LIKELY",
    "SHARED_CONDITIONING",
    "T2I_XL_LAYOUT",
    "T2I_XL_MODULE",
]

IMAGE_TEXT = {"image": "hidden_states", "text": "encoder_hidden_states"}


def joint(attr: str, order: tuple[str, str] = ("text", "image")) -> Blocks:
    """A list of blocks that update the image and the text stream (MMDiT); ``order``: what they return."""
    return Blocks(attr, IMAGE_TEXT, order)


def single(attr: str, param: str = "hidden_states") -> Blocks:
    """A list of blocks that update one stream (image tokens, or image and text tokens joined)."""
    return Blocks(attr, {"image": param}, ("image",))


# Widths of well-known checkpoints' conditioning, for the hint of an error about embeddings of another width.
LIKELY = {
    ("text", 768): "SD1.5",
    ("text", 1024): "SD2.x",
    ("text", 2048): "SDXL",
    ("text", 1280): "the SDXL refiner",
    ("text", 4096): "SD3/SD3.5 or Flux",
    ("pooled", 1280): "SDXL",
    ("pooled", 2048): "SD3/SD3.5",
    ("pooled", 768): "Flux",
}

# Config entries in which a side model that consumes the prompt conditioning (a ControlNet) must agree with the
# denoiser it feeds: both read the same prompt_embeds / pooled_prompt_embeds. (entry, which conditioning)
SHARED_CONDITIONING = (
    ("cross_attention_dim", "text"),
    ("joint_attention_dim", "text"),
    ("caption_channels", "text"),
    ("projection_class_embeddings_input_dim", "pooled"),
    ("pooled_projection_dim", "pooled"),
)

# Where the weights show each of those widths (a Linear's in_features at the path; "*name": the first module whose
# path ends so): read before the config, which can disagree with the weights it came with.
CONDITIONING_WEIGHTS = {
    "cross_attention_dim": ("encoder_hid_proj", "*attn2.to_k"),
    "joint_attention_dim": ("context_embedder",),
    "caption_channels": ("caption_projection.linear_1",),
    "projection_class_embeddings_input_dim": ("add_embedding.linear_1",),
    "pooled_projection_dim": ("time_text_embed.text_embedder.linear_1",),
}
# An image encoder's widths as its weights show them: (module path, attribute).
IMAGE_ENCODER_WEIGHTS = {
    "projection_dim": ("visual_projection", "out_features"),
    "hidden_size": ("vision_model.embeddings.patch_embedding", "out_channels"),
}

# An IP-Adapter's image projection reads the image encoder's `image_embeds` (its config's projection_dim) where it is
# diffusers' ImageProjection, else the penultimate hidden states (hidden_size), as the pipelines'
# prepare_ip_adapter_image_embeds choose; FaceID projections read face embeddings, not the image encoder.
IMAGE_PROJECTION_READS = {"ImageProjection": "projection_dim"}
IMAGE_PROJECTION_DEFAULT = "hidden_size"

# A T2I-Adapter's layout and the UNets it fits: full_adapter_xl for SDXL-family UNets (text_time conditioning), the
# others for SD1.x/2.x; the module diffusers builds for it says so whatever the config claims.
T2I_XL_LAYOUT = "full_adapter_xl"
T2I_XL_MODULE = "FullAdapterXL"

# --- UNets ---------------------------------------------------------------------------------------------------


def _time_ids(pipe: Any) -> int:
    """How many time ids an SDXL-family UNet's ``text_time`` conditioning takes: 6 (size, crop, target size),
    5 for the refiner layout (size, crop, aesthetic score)."""
    config = getattr(pipe, "config", None)
    aesthetics = (
        config.get("requires_aesthetics_score", False) if isinstance(config, dict) else getattr(config, "requires_aesthetics_score", False)
    )
    return 5 if aesthetics else 6


def _unet_text(pipe: Any) -> tuple[int, str] | None:
    """The text width a diffusers UNet takes: its ``encoder_hid_dim`` where it projects the text, else its
    ``cross_attention_dim``."""
    c = pipe.unet.config
    if isinstance(c.get("encoder_hid_dim"), int) and c.get("encoder_hid_dim_type") in (None, "text_proj", "text_image_proj"):
        return c.encoder_hid_dim, f"unet.config.encoder_hid_dim={c.encoder_hid_dim}, projected to cross_attention_dim"
    if isinstance(c.cross_attention_dim, int):
        return c.cross_attention_dim, f"unet.config.cross_attention_dim={c.cross_attention_dim}"
    return None


def _unet_pooled(pipe: Any) -> tuple[int, str] | None:
    """The pooled text width an SDXL-family UNet's ``text_time`` conditioning takes: what remains of its added
    conditioning after the time ids."""
    c = pipe.unet.config
    if c.addition_embed_type != "text_time" or not isinstance(c.projection_class_embeddings_input_dim, int):
        return None
    ids, dim, total = _time_ids(pipe), c.addition_time_embed_dim or 0, c.projection_class_embeddings_input_dim
    return total - ids * dim, f"projection_class_embeddings_input_dim={total} minus {ids} time ids × addition_time_embed_dim={dim}"


register(
    Family(
        "unet",
        "SD1.x/2.x/SDXL (UNet)",
        ("UNet2DConditionModel",),
        kind="unet",
        latent="sample",
        full_only=("down_intrablock_additional_residuals",),
        defaults={"forecast": 2, "stop": 1.0, "keep_first": 1, "keep_last": 1},
        widths=(
            Width("text", _unet_text, ("text_encoder", "text_encoder_2"), label="text encoder"),
            Width("pooled", _unet_pooled, ("text_encoder_2",), attr="projection_dim", label="CLIP", required=True),
        ),
        pipelines=(
            "StableDiffusionPipeline",
            "StableDiffusionXLPipeline",
            "StableDiffusionXLImg2ImgPipeline",
            "StableDiffusionControlNetPipeline",
        ),
        noise="embeddings",
    )
)

# The video UNets: AnimateDiff's (an SD1.5/SDXL UNet with motion modules after each layer, mixing the frames of a
# sample) and Stable Video Diffusion's (spatio-temporal resnets and attentions). Both fold the frames into the batch
# dimension between conv_in and conv_out; the cache reuses the deep feature of a full step as the image UNet's does,
# and a new frame count (a new latent shape) starts a new generation. Read off diffusers 0.42.1's
# UNetMotionModel.forward and UNetSpatioTemporalConditionModel.forward (the same since 0.35).
register(
    Family(
        "animatediff",
        "AnimateDiff (UNetMotionModel)",
        ("UNetMotionModel",),
        kind="unet",
        latent="sample",
        defaults={"forecast": 2, "stop": 1.0, "keep_first": 1, "keep_last": 1},
        widths=(
            Width("text", _unet_text, ("text_encoder", "text_encoder_2"), label="text encoder"),
            Width("pooled", _unet_pooled, ("text_encoder_2",), attr="projection_dim", label="CLIP", required=True),
        ),
        pipelines=(
            "AnimateDiffPipeline",
            "AnimateDiffSDXLPipeline",
            "AnimateDiffVideoToVideoPipeline",
            "AnimateDiffControlNetPipeline",
            "AnimateDiffVideoToVideoControlNetPipeline",
            "AnimateDiffSparseControlNetPipeline",
            "AnimateDiffPAGPipeline",
            "PIAPipeline",
        ),
        noise="embeddings",
    )
)
register(
    Family(
        "svd",
        "Stable Video Diffusion (UNetSpatioTemporalConditionModel)",
        ("UNetSpatioTemporalConditionModel",),
        kind="unet",
        latent="sample",
        defaults={"forecast": 2, "stop": 1.0, "keep_first": 1, "keep_last": 1},
        pipelines=("StableVideoDiffusionPipeline",),
        # its pipeline draws the noise in the CLIP image embeddings' dtype, not a prompt's: nothing for the preflight
    )
)

# --- Image transformers --------------------------------------------------------------------------------------

register(
    Family(
        "sd3",
        "SD3/SD3.5",
        ("SD3Transformer2DModel",),
        blocks=(joint("transformer_blocks"),),
        keep_last=1,  # its last block drops the text stream (context_pre_only): it must run
        widths=(
            Width("text", "joint_attention_dim", ("text_encoder_3",), label="T5"),
            Width("text", "joint_attention_dim", ("text_encoder", "text_encoder_2"), label="CLIP", padded=True),
            Width("pooled", "pooled_projection_dim", ("text_encoder", "text_encoder_2"), attr="projection_dim", label="CLIP"),
        ),
        pipelines=("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline", "StableDiffusion3ControlNetPipeline"),
        noise="embeddings as given",
    )
)
register(
    Family(
        "flux",
        "Flux.1 (dev, schnell, Kontext)",
        ("FluxTransformer2DModel",),
        blocks=(joint("transformer_blocks"), joint("single_transformer_blocks")),
        tail=("norm_out", "proj_out"),
        widths=(
            Width("text", "joint_attention_dim", ("text_encoder_2",), label="T5"),
            Width("pooled", "pooled_projection_dim", ("text_encoder",), label="CLIP"),  # the CLIP text model's pooler output
        ),
        packed=2,
        pipelines=("FluxPipeline", "FluxImg2ImgPipeline", "FluxKontextPipeline", "FluxControlNetPipeline"),
        noise="embeddings as given",
    )
)
register(
    Family(
        "flux2",
        "Flux.2",
        ("Flux2Transformer2DModel",),
        blocks=(joint("transformer_blocks"), single("single_transformer_blocks")),
        pipelines=("Flux2Pipeline",),
    )
)
register(
    Family(
        "chroma",
        "Chroma",
        ("ChromaTransformer2DModel",),
        blocks=(joint("transformer_blocks"), single("single_transformer_blocks")),
        pipelines=("ChromaPipeline", "ChromaImg2ImgPipeline"),
    )
)
register(
    Family(
        "qwenimage",
        "Qwen-Image (+Edit, +Layered)",
        ("QwenImageTransformer2DModel",),
        blocks=(joint("transformer_blocks"),),
        pipelines=("QwenImagePipeline", "QwenImageEditPipeline", "QwenImageEditPlusPipeline", "QwenImageLayeredPipeline"),
    )
)
register(
    Family(
        "hidream",
        "HiDream-I1/E1",
        ("HiDreamImageTransformer2DModel",),
        blocks=(joint("double_stream_blocks", ("image", "text")), single("single_stream_blocks")),
        prompt="encoder_hidden_states_t5",
        pipelines=("HiDreamImagePipeline",),
    )
)
register(
    Family(
        "sana",
        "Sana (+Sprint)",
        ("SanaTransformer2DModel",),
        blocks=(single("transformer_blocks"),),
        widths=(Width("text", "caption_channels", ("text_encoder",), label="Gemma"),),
        pipelines=("SanaPipeline", "SanaSprintPipeline", "SanaPAGPipeline"),
    )
)
register(
    Family(
        "pixart",
        "PixArt-α/Σ",
        ("PixArtTransformer2DModel",),
        blocks=(single("transformer_blocks"),),
        widths=(Width("text", "caption_channels", ("text_encoder",), label="T5"),),
        pipelines=("PixArtAlphaPipeline", "PixArtSigmaPipeline"),
        noise="embeddings",
    )
)
register(
    Family(
        "lumina2",
        "Lumina-Image 2.0",
        ("Lumina2Transformer2DModel",),
        blocks=(single("layers"),),
        pipelines=("Lumina2Pipeline",),
    )
)
register(
    Family(
        "cogview4",
        "CogView4",
        ("CogView4Transformer2DModel",),
        blocks=(joint("transformer_blocks", ("image", "text")),),
        pipelines=("CogView4Pipeline", "CogView4ControlPipeline"),
    )
)
register(
    Family(
        "auraflow",
        "AuraFlow",
        ("AuraFlowTransformer2DModel",),
        blocks=(joint("joint_transformer_blocks"), single("single_transformer_blocks")),
        pipelines=("AuraFlowPipeline",),
    )
)
register(
    Family(
        "zimage",
        "Z-Image",
        ("ZImageTransformer2DModel",),
        blocks=(single("layers", "x"),),
        latent="x",
        prompt="cap_feats",
        prompt_only=("cap_embedder", "context_refiner"),  # the caption's refiner takes no timestep
        # Reuse the cached residual as it was (no forecast). Its blocks' updates are gated by tanh(W·t_emb) of a
        # 1000-scaled time embedding alone (no pooled text in the modulation, as Flux's and SD3's have), so a residual a
        # full step cached carries that step's gates: a modulation kept stale. On random weights the embedding is white
        # noise between steps (it moves 1.0 a step of 8; 0.17 on a tiny Z-Image trained here), and holding the cached
        # layers' modulation fixed takes the drift from 0.056 to 0.030 (trained: 0.051 to 0.044). Extrapolating a residual
        # that jumps so overshoots. benchmarks/zimage_forecast.py, mean of 6 seeds, held (0) against linear (1): at 8
        # steps, Z-Image-Turbo's schedule, interval 3, the same work: trained 0.039 against 0.051, random 0.044 against
        # 0.056; at 20 steps, interval 4, the same work: trained 0.0178 against 0.0168 (6% more), random 0.040 against
        # 0.048; interval 3 over 20 steps skips the warm-up's extra full step (8 full instead of 9): 0.0135 against 0.0119.
        defaults={"forecast": 0},
        pipelines=("ZImagePipeline", "ZImageImg2ImgPipeline"),
    )
)

# Bria FIBO 2: Z-Image's block (diffusers' BriaFibo2TransformerBlock) behind a noise refiner and a Perceiver that
# squeezes the text into gist tokens. Read off its code, it caches `layers` as this entry does; the entry adds what the
# code does not say. The Perceiver reads the text encoder's first bundle alone (no timestep): prompt-only. The time
# embedder runs twice a step, on the step's timestep and on t = 0 for the clean tokens: a cached step reuses the t = 0
# call's output (prompt_only checks its input every call, so the reuse is exact; the timestep's call runs). On the tiny
# builder the two are 44% of a step (the embedder's 256 -> 1024 MLP 32%), and reusing them takes the cache from 1.28x to
# 1.66x less work, bit-identical. The forecast: Z-Image's (its block's tanh gates of a 1000-scaled time embedding
# alone; see zimage above): 0.067 -> 0.036 at interval 3 over 8 steps (seeds 1 and 2: 0.049 -> 0.041, 0.053 -> 0.039).
register(
    Family(
        "bria-fibo2",
        "Bria FIBO 2",
        ("BriaFibo2Transformer2DModel",),
        blocks=(single("layers", "x"),),
        prompt_only=("perceiver", "t_embedder"),
        defaults={"forecast": 0},
        pipelines=("BriaFibo2Pipeline",),
    )
)

# --- Video transformers --------------------------------------------------------------------------------------

register(
    Family(
        "wan",
        "Wan 2.1/2.2 (T2V, I2V; both experts of 2.2)",
        ("WanTransformer3DModel",),
        blocks=(single("blocks"),),
        pipelines=("WanPipeline", "WanImageToVideoPipeline", "WanVideoToVideoPipeline"),
    )
)
register(
    Family(
        "wan-vace",
        "Wan VACE",
        ("WanVACETransformer3DModel",),
        blocks=(single("blocks"),),  # the control branch (vace_blocks) runs on every step; its hints split the chain
        pipelines=("WanVACEPipeline",),
    )
)
register(
    Family(
        "skyreels-v2",
        "SkyReels-V2",
        ("SkyReelsV2Transformer3DModel",),
        blocks=(single("blocks"),),
        pipelines=("SkyReelsV2Pipeline", "SkyReelsV2DiffusionForcingPipeline"),
    )
)
register(
    Family(
        "kandinsky5",
        "Kandinsky 5",
        ("Kandinsky5Transformer3DModel",),
        blocks=(single("visual_transformer_blocks", "visual_embed"),),  # the text blocks run on every step
        pipelines=("Kandinsky5T2VPipeline", "Kandinsky5T2IPipeline"),
    )
)
register(
    Family(
        "hunyuanvideo",
        "HunyuanVideo",
        ("HunyuanVideoTransformer3DModel",),
        blocks=(joint("transformer_blocks", ("image", "text")), joint("single_transformer_blocks", ("image", "text"))),
        pipelines=("HunyuanVideoPipeline", "HunyuanVideoImageToVideoPipeline"),
    )
)
register(
    Family(
        "hunyuanvideo15",
        "HunyuanVideo 1.5",
        ("HunyuanVideo15Transformer3DModel",),
        blocks=(joint("transformer_blocks", ("image", "text")),),
        prompt_only=("context_embedder_2", "image_embedder"),  # the ByT5 text and the image projections
        pipelines=("HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline"),
    )
)
register(
    Family(
        "ltx",
        "LTX-Video",
        ("LTXVideoTransformer3DModel",),
        blocks=(single("transformer_blocks"),),
        pipelines=("LTXPipeline", "LTXImageToVideoPipeline", "LTXConditionPipeline"),
    )
)
register(
    Family(
        "ltx2",
        "LTX-2 (video and audio)",
        ("LTX2VideoTransformer3DModel",),
        blocks=(Blocks("transformer_blocks", {"image": "hidden_states", "audio": "audio_hidden_states"}, ("image", "audio")),),
        pipelines=("LTX2Pipeline", "LTX2ImageToVideoPipeline"),
    )
)
register(
    Family(
        "cogvideox",
        "CogVideoX",
        ("CogVideoXTransformer3DModel",),
        blocks=(joint("transformer_blocks", ("image", "text")),),
        pipelines=("CogVideoXPipeline", "CogVideoXImageToVideoPipeline", "CogVideoXVideoToVideoPipeline"),
    )
)
register(
    Family(
        "mochi",
        "Mochi",
        ("MochiTransformer3DModel",),
        blocks=(joint("transformer_blocks", ("image", "text")),),
        keep_last=1,  # its last block drops the text stream (context_pre_only): it must run
        pipelines=("MochiPipeline",),
    )
)
register(
    Family(
        "cosmos",
        "Cosmos (Predict)",
        ("CosmosTransformer3DModel",),
        blocks=(single("transformer_blocks"),),
        pipelines=("CosmosTextToWorldPipeline", "CosmosVideoToWorldPipeline", "Cosmos2TextToImagePipeline"),
    )
)

# --- More denoisers of diffusers 0.42.1's pipelines ---------------------------------------------------------

register(
    Family(
        "bria",
        "Bria 3.x",
        ("BriaTransformer2DModel",),
        blocks=(joint("transformer_blocks"), joint("single_transformer_blocks")),
        pipelines=("BriaPipeline",),
    )
)
register(
    Family(
        "longcat-image",
        "LongCat-Image (+Edit)",
        ("LongCatImageTransformer2DModel",),
        blocks=(joint("transformer_blocks"), joint("single_transformer_blocks")),
        pipelines=("LongCatImagePipeline", "LongCatImageEditPipeline"),
    )
)
register(
    Family(
        "ovis-image",
        "Ovis-Image",
        ("OvisImageTransformer2DModel",),
        blocks=(joint("transformer_blocks"), joint("single_transformer_blocks")),
        pipelines=("OvisImagePipeline",),
    )
)
register(
    Family(
        "cogview3plus",
        "CogView3-Plus",
        ("CogView3PlusTransformer2DModel",),
        blocks=(joint("transformer_blocks", ("image", "text")),),
        pipelines=("CogView3PlusPipeline",),
    )
)
register(
    Family(
        "nucleus-moe",
        "Nucleus-MoE-Image",
        ("NucleusMoEImageTransformer2DModel",),
        blocks=(single("transformer_blocks"),),
        pipelines=("NucleusMoEImagePipeline",),
    )
)
register(
    Family(
        "joyimage",
        "JoyImage-Edit",
        ("JoyImageEditTransformer3DModel",),
        blocks=(joint("double_blocks", ("image", "text")),),
        pipelines=("JoyImageEditPipeline",),
    )
)
register(
    Family(
        "dit",
        "DiT (class-conditional)",
        ("DiTTransformer2DModel",),
        blocks=(single("transformer_blocks"),),
        prompt="class_labels",
        pipelines=("DiTPipeline",),
    )
)
register(
    Family(
        "chronoedit",
        "ChronoEdit",
        ("ChronoEditTransformer3DModel",),
        blocks=(single("blocks"),),
        pipelines=("ChronoEditPipeline",),
    )
)
register(
    Family(
        "sana-video",
        "Sana-Video",
        ("SanaVideoTransformer3DModel",),
        blocks=(single("transformer_blocks"),),
        pipelines=("SanaVideoPipeline",),
    )
)
register(
    Family(
        "allegro",
        "Allegro",
        ("AllegroTransformer3DModel",),
        blocks=(single("transformer_blocks"),),
        pipelines=("AllegroPipeline",),
    )
)
register(
    Family(
        "easyanimate",
        "EasyAnimate",
        ("EasyAnimateTransformer3DModel",),
        blocks=(joint("transformer_blocks", ("image", "text")),),
        pipelines=("EasyAnimatePipeline", "EasyAnimateControlPipeline", "EasyAnimateInpaintPipeline"),
    )
)
register(
    Family(
        "motif-video",
        "Motif-Video",
        ("MotifVideoTransformer3DModel",),
        blocks=(joint("transformer_blocks", ("image", "text")), joint("single_transformer_blocks", ("image", "text"))),
        pipelines=("MotifVideoPipeline", "MotifVideoImage2VideoPipeline"),
    )
)
register(
    Family(
        "latte",
        "Latte",
        ("LatteTransformer3DModel",),
        # spatial and temporal blocks alternate, the tokens regrouped between them: each block is its own run
        blocks=(single("transformer_blocks"), single("temporal_transformer_blocks")),
        pipelines=("LattePipeline",),
    )
)

# --- ComfyUI's own model classes (comfy.ldm, read off ComfyUI 0.3.64) ------------------------------------------
# Named by module path: ComfyUI's Qwen-Image class has diffusers' class name. Its models take the latents as ``x``
# and tell guidance passes apart in ``transformer_options["cond_or_uncond"]`` (the conditioning tensors are built
# anew each step). ``control`` carries ControlNet residuals, added to the blocks' outputs in place between blocks:
# such a call runs in full. Its Flux-style blocks update their streams in place (``x += ...``); the cache checks
# that on the first call and keeps copies of what enters each run (torchfix.deepcache.blocks).


def comfy_passes(arguments: Any) -> str | None:
    """The guidance passes of a ComfyUI denoiser call, from ``transformer_options["cond_or_uncond"]`` (0: cond,
    1: uncond, in batch order): ``"cond_or_uncond=1,0"``; ``None`` where the call does not say.

    >>> comfy_passes({"transformer_options": {"cond_or_uncond": [1, 0]}})
    'cond_or_uncond=1,0'
    >>> comfy_passes({"x": None, "kwargs": {"transformer_options": {"cond_or_uncond": [0]}}})
    'cond_or_uncond=0'
    """
    options = arguments.get("transformer_options") if hasattr(arguments, "get") else None
    if options is None and hasattr(arguments, "get") and isinstance(arguments.get("kwargs"), dict):
        options = arguments["kwargs"].get("transformer_options")  # a forward that takes it in **kwargs (Lumina 2, Cosmos)
    passes = options.get("cond_or_uncond") if isinstance(options, dict) else None
    return None if passes is None else "cond_or_uncond=" + ",".join(str(p) for p in passes)


# ComfyUI's block patches (comfy/model_patcher.py): ``patches_replace["dit"][("double_block", i)]`` is called in place of
# block i of a model's first block list (Wan, LTX, Qwen-Image, Mochi: their only list), ``("single_block", i)`` of its
# second, with the block as ``extra["original_block"]`` (SkipLayerGuidance's patch returns its input: the block is
# skipped; PuLID-Flux's adds its ID attention to what the block returns, between start_at and end_at);
# ``patches["double_block"]`` runs after every block of the first list (Qwen-Image's DiffSynth ControlNet patch).
COMFY_BLOCK_LISTS = {"double_block": 0, "single_block": 1}


def comfy_patched(arguments: Any) -> frozenset[tuple[int, int]]:
    """The blocks a ComfyUI call's block patches take the place of or follow, as ``(list, index)`` (``index`` -1:
    every block of the list; ``(-1, -1)``: a ``patches_replace["dit"]`` key torchfix cannot place).

    >>> dit = {("double_block", 1): print, ("single_block", 0): print}
    >>> sorted(comfy_patched({"transformer_options": {"patches_replace": {"dit": dit}}}))
    [(0, 1), (1, 0)]
    >>> sorted(comfy_patched({"kwargs": {"transformer_options": {"patches": {"double_block": [print]}}}}))
    [(0, -1)]
    """
    options = arguments.get("transformer_options") if hasattr(arguments, "get") else None
    if options is None and hasattr(arguments, "get") and isinstance(arguments.get("kwargs"), dict):
        options = arguments["kwargs"].get("transformer_options")
    if not isinstance(options, dict):
        return frozenset()
    found = set()
    for key in (options.get("patches_replace") or {}).get("dit") or {}:
        kind, index = key if isinstance(key, tuple) and len(key) == 2 else (None, None)
        placed = kind in COMFY_BLOCK_LISTS and isinstance(index, int)
        found.add((COMFY_BLOCK_LISTS[kind], index) if placed else (-1, -1))
    for kind, patches in (options.get("patches") or {}).items():
        if kind in COMFY_BLOCK_LISTS and patches:
            found.add((COMFY_BLOCK_LISTS[kind], -1))
    return frozenset(found)


COMFY = "comfy.ldm."
COMFY_IMAGE_TEXT = {"image": "img", "text": "txt"}


def comfy(name: str, title: str, cls: str, **fields: Any) -> Family:
    """A ComfyUI family: latents ``x``, passes from ``transformer_options``, ``control`` calls in full."""
    return Family(
        name,
        title,
        (COMFY + cls,),
        latent="x",
        prompt=None,
        host="comfyui",
        context=comfy_passes,
        patched=comfy_patched,
        full_only=("control",),
        **fields,
    )


register(
    comfy(
        "comfy-unet",
        "SD1.x/2.x/SDXL in ComfyUI (UNetModel)",
        "modules.diffusionmodules.openaimodel.UNetModel",
        kind="unet",
        defaults={"forecast": 2, "stop": 1.0, "keep_first": 1, "keep_last": 1},
    )
)
register(
    comfy(
        "comfy-flux",
        "Flux.1 in ComfyUI",
        "flux.model.Flux",
        blocks=(Blocks("double_blocks", COMFY_IMAGE_TEXT, ("image", "text")), single("single_blocks", "x")),
    )
)
register(
    comfy(
        "comfy-chroma",
        "Chroma in ComfyUI",
        "chroma.model.Chroma",
        blocks=(Blocks("double_blocks", COMFY_IMAGE_TEXT, ("image", "text")), single("single_blocks", "x")),
    )
)
register(
    comfy(
        "comfy-hunyuanvideo",
        "HunyuanVideo in ComfyUI",
        "hunyuan_video.model.HunyuanVideo",
        blocks=(Blocks("double_blocks", COMFY_IMAGE_TEXT, ("image", "text")), single("single_blocks", "x")),
    )
)
register(comfy("comfy-wan", "Wan 2.1/2.2 in ComfyUI", "wan.model.WanModel", blocks=(single("blocks", "x"),)))
register(
    comfy(
        "comfy-qwenimage",
        "Qwen-Image in ComfyUI",
        "qwen_image.model.QwenImageTransformer2DModel",
        blocks=(joint("transformer_blocks"),),
    )
)
register(comfy("comfy-ltx", "LTX-Video in ComfyUI", "lightricks.model.LTXVModel", blocks=(single("transformer_blocks", "x"),)))
# HiDream's double blocks take the text as ``text_tokens`` (the kept text joined with this block's Llama layer) and
# return it longer than what the loop keeps (it cuts the Llama part off): code reading sees no stream handed on, so
# the entry says it; the first call checks it, and each block whose text or image is rebuilt between blocks is a run
# of its own. Its class has diffusers' class name: matched by module path only (families.find).
register(
    comfy(
        "comfy-hidream",
        "HiDream-I1 in ComfyUI",
        "hidream.model.HiDreamImageTransformer2DModel",
        blocks=(
            Blocks("double_stream_blocks", {"image": "image_tokens", "text": "text_tokens"}, ("image", "text")),
            single("single_stream_blocks", "image_tokens"),
        ),
    )
)

# Chroma Radiance: Chroma's blocks (its own forward_orig), then a pixel-space NeRF head whose blocks run on every step
# (once per tile at large sizes: code reading sees two ways of calling them and refuses the class).
register(
    comfy(
        "comfy-chroma-radiance",
        "Chroma Radiance in ComfyUI",
        "chroma_radiance.model.ChromaRadiance",
        blocks=(Blocks("double_blocks", COMFY_IMAGE_TEXT, ("image", "text")), single("single_blocks", "x")),
    )
)

# AuraFlow's double layers take the text as ``c`` and the image as ``x``: names code reading cannot tell apart.
register(
    comfy(
        "comfy-auraflow",
        "AuraFlow in ComfyUI",
        "aura.mmdit.MMDiT",
        blocks=(Blocks("double_layers", {"image": "x", "text": "c"}, ("text", "image")), single("single_layers", "cx")),
    )
)

# Mochi's blocks name the text ``y`` (its loop ``y_feat``): read as a second image stream. Its last block leaves the
# text as it was (update_y=False): it runs on every step, as diffusers' Mochi's last block does.
register(
    comfy(
        "comfy-mochi",
        "Mochi in ComfyUI",
        "genmo.joint_model.asymm_models_joint.AsymmDiTJoint",
        blocks=(Blocks("blocks", {"image": "x", "text": "y"}, ("image", "text")),),
        keep_last=1,
    )
)

# ComfyUI 0.3.64's other diffusion-model classes (comfy/model_base.py's BaseModel subclasses -> comfy.ldm): refused by
# name with the reason. Those not named here and not registered above are read off their code (families.infer:
# Lumina 2's NextDiT, Cosmos Predict2's MiniTrainDIT, OmniGen2, PixArt, Wan's camera model), verified at the first
# call; a class whose loop changes a stream in place between blocks (Wan VACE: ``x += hint``) is refused by that
# reading itself. tests/comfyui/test_cache.py enumerates the classes and fails on any that is neither.
UNVERIFIED = "not verified under ComfyUI's sampler yet (torchfix's tests have no tiny model of it)"
COMFY_REFUSED = {
    "wan.model.WanModel_S2V": (
        "Wan 2.2 S2V in ComfyUI",
        "its audio injector adds the audio to the video tokens in place between blocks (AudioInjector.forward: "
        "x[:, :seq_len] = ...), which a cached step would add twice",
    ),
    "hydit.models.HunYuanDiT": (
        "HunyuanDiT in ComfyUI",
        "its blocks are joined by long skip connections (skips.append(x), consumed by the later blocks): a cached "
        "block's output is used outside the blocks cached with it",
    ),
    "hunyuan3dv2_1.hunyuandit.HunYuanDiTPlain": (
        "Hunyuan3D 2.1 in ComfyUI",
        "its blocks are joined by long skip connections (skip_stack.append(combined)): a cached block's output is used "
        "outside the blocks cached with it",
    ),
    "cascade.stage_c.StageC": (
        "Stable Cascade stage C in ComfyUI",
        "its levels of residual and attention blocks are joined by skip connections (a UNet of its own, not a chain of "
        "blocks), and torchfix's UNet mechanism knows ComfyUI's UNetModel only",
    ),
    "cascade.stage_b.StageB": (
        "Stable Cascade stage B in ComfyUI",
        "its levels of residual and attention blocks are joined by skip connections (a UNet of its own, not a chain of "
        "blocks), and torchfix's UNet mechanism knows ComfyUI's UNetModel only",
    ),
    "cosmos.model.GeneralDIT": (
        "Cosmos 1 (Predict1) in ComfyUI",
        "its blocks sit in a ModuleDict called by name, which the code reading does not follow; " + UNVERIFIED,
    ),
    "audio.dit.AudioDiffusionTransformer": ("Stable Audio in ComfyUI", "audio latents; " + UNVERIFIED),
    "ace.model.ACEStepTransformer2DModel": ("ACE-Step in ComfyUI", "audio latents; " + UNVERIFIED),
    "hunyuan3d.model.Hunyuan3Dv2": ("Hunyuan3D 2.0 in ComfyUI", "3D shape latents; " + UNVERIFIED),
    "modules.diffusionmodules.mmdit.OpenAISignatureMMDITWrapper": (
        "SD3/SD3.5 in ComfyUI",
        "its joint blocks take *args and **kwargs (JointBlock.forward), so no parameter names which argument is the "
        "image and which the text stream, and the transformer cache reads the streams by parameter name",
    ),
    "wan.model.HumoWanModel": (
        "Wan HuMo in ComfyUI",
        "its audio projection has fixed widths (AudioProjModel: 1280 channels in, 1536 out) whatever the model's size; "
        + UNVERIFIED,
    ),
    "wan.model_animate.AnimateWanModel": (
        "Wan 2.2 Animate in ComfyUI",
        "its motion encoder has fixed widths (a 512-wide Generator) whatever the model's size; " + UNVERIFIED,
    ),
}
for _path, (_title, _why) in COMFY_REFUSED.items():
    refuse(COMFY + _path, _title, _why)

# --- Refused: classes whose forward reads like a denoiser's, that the cache must not drive ----------------------

# diffusers' generic transformer: the attention layers inside UNet2DConditionModel's cross-attention blocks (every
# SD1.x/2.x/SDXL UNet holds several), and the denoiser of the deprecated VQ-Diffusion pipeline only. DiT and PixArt
# checkpoints saved under this class name load as DiTTransformer2DModel / PixArtTransformer2DModel
# (diffusers' model_loading_utils._CLASS_REMAPPING_DICT), which the cache drives as `dit` and `pixart`.
refuse(
    "diffusers.models.transformers.transformer_2d.Transformer2DModel",
    "diffusers' generic transformer",
    "it is diffusers' generic transformer building block: the attention layers nested inside UNet2DConditionModel "
    "(SD1.x/2.x/SDXL) and other UNets, called on a UNet's features rather than on latents, so it has no denoising step "
    "of its own to cache. Cache the model that holds it (the UNet: family 'unet'); DiT and PixArt checkpoints saved as "
    "Transformer2DModel load as DiTTransformer2DModel and PixArtTransformer2DModel, which the cache supports ('dit', "
    "'pixart')",
    subclasses=False,
)
# The temporal layers of UNet3DConditionModel and I2VGenXLUNet (unet_3d_blocks: `temp_attn(hidden_states,
# num_frames=...)`, no timestep): no pipeline runs it as its denoiser.
refuse(
    "diffusers.models.transformers.transformer_temporal.TransformerTemporalModel",
    "diffusers' temporal transformer",
    "it is a building block: the temporal attention layers inside UNet3DConditionModel and I2VGenXLUNet, called on a "
    "UNet's features (no timestep passed) rather than on latents, so it has no denoising step of its own to cache; "
    "no diffusers pipeline runs it as its denoiser",
    subclasses=False,
)
# Kandinsky 2.x's and unCLIP's prior: it denoises one CLIP image embedding per sample, which enters as one token of a
# sequence otherwise made of the prompt's tokens, the projected text embedding and the time token, and its output is
# read at a learned query token (`prd_embedding`: `hidden_states[:, -1]`) whose input is the same at every step. With
# its blocks cached, a cached step's output would be computed from nothing of that step's own input: the latent and
# the timestep reach the output only through the blocks a cached step skips.
refuse(
    "diffusers.models.transformers.prior_transformer.PriorTransformer",
    "Kandinsky 2.x / unCLIP prior",
    "it is a prior over CLIP image embeddings, not a denoiser of latents: the embedding it denoises is one token of a "
    "sequence of prompt tokens, and its output is read at a learned query token (prd_embedding, as Kandinsky 2.x's "
    "and unCLIP's priors have it) whose input is the same at every step, so with its transformer_blocks cached a "
    "cached step's output would not depend on that step's latent or timestep at all (they reach the output only "
    "through the skipped blocks)",
    subclasses=False,
)

builtin_done()
