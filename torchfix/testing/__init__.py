"""Tiny SD1.5-like, SDXL-like (base and refiner), SD3-like and Flux-like diffusers
pipelines built offline, for tests, the demo and benchmarks: configs with random
weights, and CLIP and T5 tokenizers written on the fly. Nothing is downloaded.

Imports diffusers and transformers, so ``import torchfix`` never imports this.

>>> from torchfix.testing import tiny_sd15_pipeline
>>> pipe = tiny_sd15_pipeline()  # doctest: +SKIP
>>> image = pipe("a cat", num_inference_steps=4, height=64, width=64, output_type="latent").images  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "clip_tokenizer",
    "flops",
    "latents",
    "t5_tokenizer",
    "tiny_animatediff_pipeline",
    "tiny_cogvideox_pipeline",
    "tiny_flux_pipeline",
    "tiny_sd3_pipeline",
    "tiny_sd15_pipeline",
    "tiny_sd15_unet",
    "tiny_sdxl_pipeline",
    "tiny_sdxl_refiner_pipeline",
    "tiny_sdxl_unet",
    "tiny_svd_pipeline",
    "tiny_t5_encoder",
    "tiny_text_encoder",
    "tiny_vae",
    "tiny_wan22_pipeline",
    "wan_prompt_unavailable",
]

TEXT_DIM = 32


def _own_rng(build: Any) -> Any:
    """Run a builder that seeds torch with its own CPU RNG: the caller's global RNG state is
    the same after the build as before (a test's or a script's random numbers never depend
    on which tiny pipelines were built)."""

    @functools.wraps(build)
    def seeded(*args: Any, **kwargs: Any) -> Any:
        with torch.random.fork_rng(devices=[]):
            return build(*args, **kwargs)

    return seeded


def _byte_level_alphabet() -> list[str]:
    # The GPT-2 byte-to-unicode table that CLIP's BPE uses (transformers 5 no longer exports it).
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return [chr(c) for c in codes]


def clip_tokenizer(directory: str | Path | None = None) -> Any:
    """A CLIP tokenizer with a byte-level vocabulary (514 tokens), written to ``directory`` (a temp dir by default)."""
    from transformers import CLIPTokenizer

    chars = _byte_level_alphabet()
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    with contextlib.ExitStack() as stack:
        # The tokenizer reads both files when it is built; a temp dir of ours is gone afterwards.
        folder = Path(directory) if directory else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="torchfix-tokenizer-")))
        (folder / "vocab.json").write_text(json.dumps(vocab))
        (folder / "merges.txt").write_text("#version: 0.2\n")
        return CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=77, pad_token="<|endoftext|>")


@_own_rng
def tiny_text_encoder(with_projection: bool = False, hidden: int = TEXT_DIM, seed: int = 0) -> Any:
    """A 2-layer CLIP text encoder (optionally with ``text_projection``), random weights."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    config = CLIPTextConfig(
        vocab_size=1000,
        hidden_size=hidden,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        projection_dim=hidden,
        max_position_embeddings=77,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        hidden_act="gelu",
    )
    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    return cls(config).eval()


@_own_rng
def tiny_vae(seed: int = 0, latent_channels: int = 4) -> Any:
    """An AutoencoderKL with 3 downsamplers (latents are pixels / 8, as in SD); 16 latent channels for SD3/Flux."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    extra = {"shift_factor": 0.0} if latent_channels == 16 else {}  # SD3/Flux pipelines read it
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=32,
        **extra,
    ).eval()


_T5_PIECES = "abcdefghijklmnopqrstuvwxyz0123456789"


def t5_tokenizer() -> Any:
    """A T5 tokenizer over lowercase letters and digits, built in memory (no sentencepiece file): a Unigram
    ``tokenizers.Tokenizer`` laid out as transformers 5's ``T5Tokenizer(vocab=...)`` lays it out (``<pad>`` 0,
    ``</s>`` 1, ``<unk>`` 2, metaspace pre-tokenizer, ``</s>`` appended), handed to ``T5TokenizerFast``, which
    takes a ready tokenizer on transformers 4.57 (whose ``T5Tokenizer`` needs a sentencepiece ``vocab_file``) and
    5.x alike: the same ids on both.

    >>> t5_tokenizer()("a cat").input_ids  # doctest: +SKIP
    [39, 3, 39, 5, 3, 22, 1]
    """
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import Unigram
    from transformers import T5TokenizerFast

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [(c, -1.0) for c in _T5_PIECES] + [("▁", -1.0)]
    backend = Tokenizer(Unigram(vocab, unk_id=2, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)]
    )
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    backend.post_processor = processors.TemplateProcessing(
        single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"], special_tokens=[("</s>", 1)]
    )
    return T5TokenizerFast(tokenizer_object=backend, extra_ids=0)


@_own_rng
def tiny_t5_encoder(hidden: int = 2 * TEXT_DIM, seed: int = 0) -> Any:
    """A 2-layer T5 encoder, random weights."""
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=len(_T5_PIECES) + 4,
        d_model=hidden,
        d_kv=hidden // 4,
        d_ff=2 * hidden,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return T5EncoderModel(config).eval()


@_own_rng
def _tiny_unet(seed: int, heads: int = 4, **config: Any) -> Any:
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    # diffusers' UNet2DConditionModel reads ``attention_head_dim`` as the number of heads
    base = dict(sample_size=8, in_channels=4, out_channels=4, layers_per_block=2, attention_head_dim=heads, norm_num_groups=4)
    return UNet2DConditionModel(**{**base, **config}).eval()


def tiny_sd15_unet(seed: int = 0, cross_attention_dim: int = TEXT_DIM, heads: int = 4, layers: int = 2) -> Any:
    """SD1.5 layout: cross-attention at the highest resolution, 3 downsamplers; ``heads``
    attention heads per block (1 keeps 720x960 cheap: the softmax at the top level is
    ``heads`` x (90*120)**2 per attention); ``layers`` resnets per block (1: half the graph, for tests that compile)."""
    return _tiny_unet(
        seed,
        heads,
        layers_per_block=layers,
        block_out_channels=(8, 16, 16, 16),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=cross_attention_dim,
    )


def tiny_sdxl_unet(seed: int = 0, cross_attention_dim: int = 2 * TEXT_DIM, time_ids: int = 6, layers: int = 2) -> Any:
    """SDXL layout: no attention at the highest resolution, ``text_time`` added conditioning with
    ``time_ids`` time ids (6 for the base model; 5 for the refiner, which adds an aesthetic score); ``layers``
    resnets per block (1 halves what ``torch.compile`` traces, for tests of compiling)."""
    return _tiny_unet(
        seed,
        layers_per_block=layers,
        block_out_channels=(8, 16, 32),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 1, 2),
        cross_attention_dim=cross_attention_dim,
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=time_ids * 8 + TEXT_DIM,
    )


def _scheduler(name: str) -> Any:
    import diffusers

    cls = getattr(diffusers, name)
    kwargs: dict[str, Any] = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000)
    if name == "DDIMScheduler":
        kwargs.update(clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    if name == "DPMSolverMultistepScheduler":
        kwargs.update(algorithm_type="dpmsolver++")
    return cls(**kwargs)


def tiny_sd15_pipeline(scheduler: str = "DDIMScheduler", seed: int = 0, heads: int = 4, layers: int = 2) -> Any:
    """A StableDiffusionPipeline with tiny components (no safety checker); ``heads`` and ``layers`` as in
    :func:`tiny_sd15_unet`."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline(
        vae=tiny_vae(seed),
        text_encoder=tiny_text_encoder(seed=seed),
        tokenizer=clip_tokenizer(),
        unet=tiny_sd15_unet(seed, heads=heads, layers=layers),
        scheduler=_scheduler(scheduler),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_sdxl_pipeline(scheduler: str = "EulerDiscreteScheduler", seed: int = 0) -> Any:
    """A StableDiffusionXLPipeline with tiny components: two CLIP encoders (the second with projection)."""
    from diffusers import StableDiffusionXLPipeline

    tokenizer = clip_tokenizer()
    pipe = StableDiffusionXLPipeline(
        vae=tiny_vae(seed),
        text_encoder=tiny_text_encoder(seed=seed),
        text_encoder_2=tiny_text_encoder(with_projection=True, seed=seed + 1),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer,
        unet=tiny_sdxl_unet(seed),
        scheduler=_scheduler(scheduler),
        add_watermarker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_sdxl_refiner_pipeline(scheduler: str = "EulerDiscreteScheduler", seed: int = 0) -> Any:
    """An SDXL refiner-layout StableDiffusionXLImg2ImgPipeline: only ``text_encoder_2`` (with projection), and a
    UNet with ``requires_aesthetics_score`` conditioning (5 time ids: size, crop, aesthetic score)."""
    from diffusers import StableDiffusionXLImg2ImgPipeline

    unet = tiny_sdxl_unet(seed, cross_attention_dim=TEXT_DIM, time_ids=5)  # cross-attends to text_encoder_2 only
    pipe = StableDiffusionXLImg2ImgPipeline(
        vae=tiny_vae(seed),
        text_encoder=None,
        text_encoder_2=tiny_text_encoder(with_projection=True, seed=seed + 1),
        tokenizer=None,
        tokenizer_2=clip_tokenizer(),
        unet=unet,
        scheduler=_scheduler(scheduler),
        requires_aesthetics_score=True,
        force_zeros_for_empty_prompt=False,
        add_watermarker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


@_own_rng
def tiny_sd3_pipeline(seed: int = 0, layers: int = 4) -> Any:
    """A StableDiffusion3Pipeline: two CLIP encoders with projection (32 wide each), a T5 encoder (64 wide),
    and an SD3Transformer2DModel (4 heads x 16, ``layers`` joint blocks, up to 1536 px)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=32,
        patch_size=2,
        in_channels=16,
        num_layers=layers,
        attention_head_dim=16,
        num_attention_heads=4,
        joint_attention_dim=2 * TEXT_DIM,  # the T5 width; CLIP embeddings (32 + 32) are padded to it
        caption_projection_dim=64,
        pooled_projection_dim=2 * TEXT_DIM,  # the two CLIP projections, concatenated
        out_channels=16,
        pos_embed_max_size=96,
    ).eval()
    tokenizer = clip_tokenizer()
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=tiny_vae(seed, latent_channels=16),
        text_encoder=tiny_text_encoder(with_projection=True, seed=seed),
        tokenizer=tokenizer,
        text_encoder_2=tiny_text_encoder(with_projection=True, seed=seed + 1),
        tokenizer_2=tokenizer,
        text_encoder_3=tiny_t5_encoder(seed=seed + 2),
        tokenizer_3=t5_tokenizer(),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


@_own_rng
def tiny_flux_pipeline(seed: int = 0, layers: int = 2, single_layers: int = 4) -> Any:
    """A FluxPipeline: a CLIP encoder (pooled, 32 wide), a T5 encoder (64 wide) and a FluxTransformer2DModel
    (2 heads x 16, ``layers`` double and ``single_layers`` single blocks)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,  # 16 latent channels, packed 2x2
        num_layers=layers,
        num_single_layers=single_layers,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=2 * TEXT_DIM,
        pooled_projection_dim=TEXT_DIM,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),
    ).eval()
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15),
        vae=tiny_vae(seed, latent_channels=16),
        text_encoder=tiny_text_encoder(seed=seed),
        tokenizer=clip_tokenizer(),
        text_encoder_2=tiny_t5_encoder(seed=seed + 2),
        tokenizer_2=t5_tokenizer(),
        transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _tiny_wan_transformer(layers: int, heads: int, head_dim: int) -> Any:
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=heads,
        attention_head_dim=head_dim,
        in_channels=16,
        out_channels=16,
        text_dim=2 * TEXT_DIM,
        freq_dim=256,
        ffn_dim=2 * heads * head_dim,
        num_layers=layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    ).eval()


@_own_rng
def tiny_wan22_pipeline(seed: int = 0, boundary_ratio: float | None = 0.5, layers: int = 3, heads: int = 2, head_dim: int = 12) -> Any:
    """A Wan 2.2 WanPipeline: a T5 encoder (64 wide), a Wan VAE (8× space, 4× time) and two WanTransformer3DModel
    experts of ``layers`` blocks (``transformer`` for the high-noise steps, ``transformer_2`` below ``boundary_ratio``)
    on one UniPC flow scheduler. ``boundary_ratio=None``: Wan 2.1's single expert."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

    torch.manual_seed(seed)
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])
    pipe = WanPipeline(
        tokenizer=t5_tokenizer(),
        text_encoder=tiny_t5_encoder(seed=seed + 2),
        vae=vae.eval(),
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0),
        transformer=_tiny_wan_transformer(layers, heads, head_dim),
        transformer_2=_tiny_wan_transformer(layers, heads, head_dim) if boundary_ratio is not None else None,
        boundary_ratio=boundary_ratio,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def wan_prompt_unavailable() -> str | None:
    """Why the installed diffusers' ``WanPipeline`` cannot take a text prompt here, or ``None``: before diffusers 0.37
    its prompt cleaning calls ``ftfy`` unconditionally (a ``NameError`` where ftfy is not installed; 0.37 skips it)."""
    import importlib.util

    import diffusers
    from packaging.version import Version

    if importlib.util.find_spec("ftfy") is not None or Version(diffusers.__version__) >= Version("0.37.0"):
        return None
    return f"diffusers {diffusers.__version__}'s WanPipeline needs ftfy for a text prompt (optional from diffusers 0.37.0)"


@_own_rng
def tiny_cogvideox_pipeline(seed: int = 0, layers: int = 2) -> Any:
    """A CogVideoXPipeline: a T5 encoder (64 wide), a CogVideoX VAE (8× space, 4× time) and a
    CogVideoXTransformer3DModel taking 16 text tokens; at 32×64 px and 8 frames its latents are 16 tokens too."""
    from diffusers import AutoencoderKLCogVideoX, CogVideoXDDIMScheduler, CogVideoXPipeline, CogVideoXTransformer3DModel

    torch.manual_seed(seed)
    transformer = CogVideoXTransformer3DModel(
        num_attention_heads=4,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        time_embed_dim=2,
        text_embed_dim=2 * TEXT_DIM,
        num_layers=layers,
        sample_width=8,
        sample_height=4,
        sample_frames=9,
        patch_size=2,
        temporal_compression_ratio=4,
        max_text_seq_length=16,
    ).eval()
    blocks = ("CogVideoXDownBlock3D",) * 4
    vae = AutoencoderKLCogVideoX(
        in_channels=3,
        out_channels=3,
        down_block_types=blocks,
        up_block_types=("CogVideoXUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=2,
        temporal_compression_ratio=4,
    ).eval()
    pipe = CogVideoXPipeline(
        tokenizer=t5_tokenizer(),
        text_encoder=tiny_t5_encoder(seed=seed + 2),
        vae=vae,
        transformer=transformer,
        scheduler=CogVideoXDDIMScheduler(),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


@_own_rng
def tiny_animatediff_pipeline(seed: int = 0, scheduler: str = "DDIMScheduler") -> Any:
    """An AnimateDiffPipeline as diffusers' own test of it builds one: a two-level UNet2DConditionModel (cross-attention
    at the top level) and a MotionAdapter, which the pipeline joins into a UNetMotionModel; the CLIP encoder, tokenizer
    and VAE of :func:`tiny_sd15_pipeline` (latents are pixels / 8)."""
    from diffusers import AnimateDiffPipeline, MotionAdapter

    unet = _tiny_unet(
        seed,
        heads=2,
        block_out_channels=(8, 8),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=TEXT_DIM,
        norm_num_groups=2,
    )
    torch.manual_seed(seed + 1)
    adapter = MotionAdapter(block_out_channels=(8, 8), motion_layers_per_block=2, motion_norm_num_groups=2, motion_num_attention_heads=4)
    pipe = AnimateDiffPipeline(
        vae=tiny_vae(seed),
        text_encoder=tiny_text_encoder(seed=seed),
        tokenizer=clip_tokenizer(),
        unet=unet,
        motion_adapter=adapter,
        scheduler=_scheduler(scheduler),
    )
    pipe.unet.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe


@_own_rng
def tiny_svd_pipeline(seed: int = 0) -> Any:
    """A StableVideoDiffusionPipeline with the components of diffusers' own test of it: a two-level
    UNetSpatioTemporalConditionModel (8 input channels: the noise and the conditioning image's latents), a CLIP
    vision encoder 32 wide, a temporal-decoder VAE (latents are pixels / 2) and an EDM Euler scheduler."""
    from diffusers import (
        AutoencoderKLTemporalDecoder,
        EulerDiscreteScheduler,
        StableVideoDiffusionPipeline,
        UNetSpatioTemporalConditionModel,
    )
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(seed)
    unet = UNetSpatioTemporalConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=2,
        sample_size=32,
        in_channels=8,
        out_channels=4,
        down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
        up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
        cross_attention_dim=32,
        num_attention_heads=8,
        projection_class_embeddings_input_dim=96,
        addition_time_embed_dim=32,
    ).eval()
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        interpolation_type="linear",
        num_train_timesteps=1000,
        prediction_type="v_prediction",
        sigma_max=700.0,
        sigma_min=0.002,
        steps_offset=1,
        timestep_spacing="leading",
        timestep_type="continuous",
        use_karras_sigmas=True,
    )
    torch.manual_seed(seed)
    vae = AutoencoderKLTemporalDecoder(
        block_out_channels=[32, 64],
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
        latent_channels=4,
    ).eval()
    torch.manual_seed(seed)
    vision = CLIPVisionConfig(
        hidden_size=32, projection_dim=32, num_hidden_layers=5, num_attention_heads=4, image_size=32, intermediate_size=37, patch_size=1
    )
    pipe = StableVideoDiffusionPipeline(
        vae=vae,
        image_encoder=CLIPVisionModelWithProjection(vision).eval(),
        unet=unet,
        scheduler=scheduler,
        feature_extractor=CLIPImageProcessor(crop_size=32, size=32),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def latents(pipe: Any, prompt: str = "a cat", *, steps: int = 10, size: tuple[int, int] = (64, 64), seed: int = 0, **kwargs: Any) -> Any:
    """Run a pipeline to its final latents (no VAE decode) with a seeded CPU generator (a video pipeline's
    ``frames``; pass ``num_frames=`` for it).

    >>> out = latents(tiny_sd15_pipeline(), steps=4, size=(64, 64))  # doctest: +SKIP
    """
    out = pipe(
        prompt,
        num_inference_steps=steps,
        height=size[0],
        width=size[1],
        output_type="latent",
        generator=torch.Generator().manual_seed(seed),
        **kwargs,
    )
    return out.frames if hasattr(out, "frames") else out.images


def _cpu_flash_flops(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any) -> int:
    """torch's CPU flash attention: ``Q·Kᵀ`` and ``P·V``, 2 FLOPs a multiply-add each (torch's counter has no
    formula for it, so attention-heavy models would read as cheap)."""
    *batch, lq, e = query_shape
    lk, ev = key_shape[-2], value_shape[-1]
    n = 1
    for b in batch:
        n *= b
    return 2 * n * lq * lk * e + 2 * n * lq * lk * ev


def flops(run: Any) -> int:
    """The FLOPs ``run()`` does (matmuls, convolutions and attention, CPU flash attention included), by
    ``torch.utils.flop_counter``'s formulas: the work a cache saves, beside its wall time. Counted by a lean
    dispatch mode (each op runs as it would, its formula applied to the shapes; no module tracking, no
    decomposition), so a counted generation costs a few percent more than a plain one instead of half again as
    much; the totals equal ``FlopCounterMode``'s (tested on the demo's pipelines).

    >>> flops(lambda: torch.randn(2, 3) @ torch.randn(3, 4))
    48
    """
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry, shape_wrapper

    registry = dict(flop_registry)
    flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if flash is not None:
        registry[flash] = shape_wrapper(_cpu_flash_flops)
    total = [0]

    class Tally(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            formula = registry.get(func._overloadpacket)
            if formula is not None:
                total[0] += formula(*args, **kwargs, out_val=out)
            return out

    with Tally():
        run()
    return int(total[0])
