"""Every consumer of the prompt conditioning is checked before step 0 (wrap's preflight): a ControlNet made for
another base model, a T5 of the wrong width feeding PixArt; and embeddings of two models' widths meeting in one
``torch.cat`` (a stale textual-inversion or prompt embedding) are named at the cat under ``import torchfix``."""

from __future__ import annotations

import pytest
import torch

import torchfix

pytest.importorskip("diffusers")

from diffusers import ControlNetModel, StableDiffusionXLControlNetPipeline

from torchfix.testing import TEXT_DIM, latents, tiny_sd15_pipeline, tiny_sd15_unet, tiny_sdxl_pipeline


def sdxl_with_sd15_controlnet():
    base = tiny_sdxl_pipeline()
    torch.manual_seed(1)
    controlnet = ControlNetModel.from_unet(tiny_sd15_unet(), conditioning_embedding_out_channels=(4, 8, 8, 16))
    pipe = StableDiffusionXLControlNetPipeline(**base.components, controlnet=controlnet)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_an_sd15_controlnet_on_an_sdxl_pipeline_is_refused_before_step_0_naming_both():
    pipe = sdxl_with_sd15_controlnet()
    image = torch.rand(1, 3, 64, 64)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):  # plain: deep inside the ControlNet
        latents(pipe, steps=1, image=image)
    calls = []
    pipe.controlnet.register_forward_pre_hook(lambda *a: calls.append(1))
    w = torchfix.wrap(pipe)
    (finding,) = [f for f in w.preflight() if f.component == "controlnet"]
    text = str(finding)
    assert f"controlnet reads the text embeddings at width {TEXT_DIM} (controlnet.down_blocks.0" in text
    assert f"unet at {2 * TEXT_DIM} (unet.down_blocks.1" in text and "attn2.to_k.in_features" in text
    with pytest.raises(torchfix.ModelMismatchError, match=r"controlnet reads the text embeddings at width") as info:
        latents(w, steps=1, image=image)
    assert "ControlNetModel made for this pipeline's base model" in str(info.value)
    assert not calls  # refused before any component ran


def test_a_matching_controlnet_is_no_finding():
    base = tiny_sdxl_pipeline()
    controlnet = ControlNetModel.from_unet(base.unet, conditioning_embedding_out_channels=(4, 8, 8, 16))
    pipe = StableDiffusionXLControlNetPipeline(**base.components, controlnet=controlnet)
    assert not [f for f in torchfix.wrap(pipe).preflight() if f.component == "controlnet"]


def tiny_pixart(t5_width):
    from diffusers import AutoencoderKL, DDIMScheduler, PixArtAlphaPipeline, PixArtTransformer2DModel

    from torchfix.testing import t5_tokenizer, tiny_t5_encoder

    torch.manual_seed(0)
    transformer = PixArtTransformer2DModel(
        sample_size=8,
        num_layers=2,
        patch_size=2,
        attention_head_dim=8,
        num_attention_heads=3,
        caption_channels=32,
        in_channels=4,
        cross_attention_dim=24,
        out_channels=8,
        attention_bias=True,
        activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000,
        norm_type="ada_norm_single",
        norm_elementwise_affine=False,
        norm_eps=1e-6,
    )
    vae = AutoencoderKL(
        block_out_channels=(8,),
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        latent_channels=4,
        norm_num_groups=8,
    )
    pipe = PixArtAlphaPipeline(
        tokenizer=t5_tokenizer(), text_encoder=tiny_t5_encoder(hidden=t5_width), vae=vae, transformer=transformer, scheduler=DDIMScheduler()
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_a_t5_of_another_width_feeding_pixart_is_named():
    pipe = tiny_pixart(t5_width=48)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        pipe("a cat", num_inference_steps=1, height=16, width=16, output_type="latent", use_resolution_binning=False)
    findings = torchfix.wrap(pipe).preflight()
    assert any("text_encoder (T5) output width 48 does not match transformer.config.caption_channels=32" in str(f) for f in findings)
    assert not [f for f in torchfix.wrap(tiny_pixart(t5_width=32)).preflight() if not f.advisory]


def test_embeddings_of_two_models_widths_in_one_cat_are_named_at_the_cat():
    sd15, refiner = torch.zeros(2, 77, 768), torch.zeros(2, 77, 1280)
    with pytest.raises(RuntimeError) as plain:
        torch.cat([sd15, refiner])
    with torchfix.enabled(), pytest.raises(torchfix.ModelMismatchError) as info:
        torch.cat([sd15, refiner])
    text = str(info.value)
    assert "tensor 0 (2, 77, 768) (width 768)" in text and "SD1.5" in text and "the SDXL refiner" in text
    assert "test_preflight_consumers.py" in text and "pipe.encode_prompt" in text
    assert str(info.value.__cause__) == str(plain.value)  # torch's own error, kept as the cause
    with torchfix.enabled(), pytest.raises(RuntimeError) as other:
        torch.cat([torch.zeros(2, 5), torch.zeros(2, 7)])  # widths of no known model: torch's error untouched
    assert type(other.value) is RuntimeError


def test_a_stale_prompt_embedding_in_a_pipeline_call_is_named_at_the_cat():
    from diffusers import StableDiffusionPipeline

    from torchfix.testing import tiny_text_encoder

    base = tiny_sd15_pipeline()
    pipe = StableDiffusionPipeline(
        **{**base.components, "text_encoder": tiny_text_encoder(hidden=768), "unet": tiny_sd15_unet(cross_attention_dim=768)}
    )
    pipe.set_progress_bar_config(disable=True)
    stale = torch.randn(1, 77, 1280)  # made by the SDXL refiner's text encoder
    with torchfix.enabled(), pytest.raises(torchfix.ModelMismatchError, match="width 1280") as info:
        pipe(prompt_embeds=stale, negative_prompt="ugly", num_inference_steps=1, height=64, width=64, output_type="latent")
    assert "SD1.5" in str(info.value)


def test_an_ip_adapter_for_another_image_encoder_is_named():
    from diffusers.models.embeddings import ImageProjection, MultiIPAdapterImageProjection
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    def encoder(projection_dim):
        torch.manual_seed(0)
        config = CLIPVisionConfig(
            hidden_size=16,
            projection_dim=projection_dim,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=16,
            image_size=32,
            patch_size=8,
        )
        return CLIPVisionModelWithProjection(config).eval()

    pipe = tiny_sd15_pipeline()
    projection = ImageProjection(cross_attention_dim=TEXT_DIM, image_embed_dim=24, num_image_text_embeds=4)
    pipe.unet.encoder_hid_proj = MultiIPAdapterImageProjection([projection])
    pipe.register_modules(image_encoder=encoder(projection_dim=12))  # an adapter made for another image encoder
    embeds = pipe.image_encoder(torch.rand(1, 3, 32, 32)).image_embeds
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):  # plain: inside the projection
        projection(embeds)
    (finding,) = [f for f in torchfix.wrap(pipe).preflight() if f.component == "image_encoder"]
    assert "IP-Adapter 0 (ImageProjection) takes image features of width 24, but the image encoder's projection_dim is 12" in str(finding)
    pipe.register_modules(image_encoder=encoder(projection_dim=24))
    assert not [f for f in torchfix.wrap(pipe).preflight() if f.component == "image_encoder"]


def test_a_t2i_adapter_for_another_base_is_named():
    from diffusers import StableDiffusionXLAdapterPipeline, T2IAdapter

    base = tiny_sdxl_pipeline()
    adapter = T2IAdapter(in_channels=3, channels=[8, 16, 32, 32], num_res_blocks=1, downscale_factor=8, adapter_type="full_adapter")
    pipe = StableDiffusionXLAdapterPipeline(**base.components, adapter=adapter)
    pipe.set_progress_bar_config(disable=True)
    (finding,) = [f for f in torchfix.wrap(pipe).preflight() if f.component == "adapter"]
    assert "adapter is a SD1.x/2.x T2I-Adapter (FullAdapter), unet is SDXL: it takes full_adapter_xl" in str(finding)
    assert "made for SD1.x/2.x" in finding.fix
    xl = T2IAdapter(in_channels=3, channels=[8, 16, 32, 32], num_res_blocks=1, downscale_factor=16, adapter_type="full_adapter_xl")
    pipe = StableDiffusionXLAdapterPipeline(**base.components, adapter=xl)
    assert not [f for f in torchfix.wrap(pipe).preflight() if f.component == "adapter"]


def test_under_import_torchfix_the_same_checks_run_before_step_0():
    pipe = sdxl_with_sd15_controlnet()
    calls = []
    pipe.controlnet.register_forward_pre_hook(lambda *a: calls.append(1))
    with torchfix.enabled(), pytest.raises(torchfix.ModelMismatchError, match=r"controlnet reads the text embeddings") as info:
        latents(pipe, steps=1, image=torch.rand(1, 3, 64, 64))
    assert "before step 0" in str(info.value) and not calls
    with torchfix.enabled(mode="off"), pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        latents(pipe, steps=1, image=torch.rand(1, 3, 64, 64))  # torchfix off: diffusers' own failure


def test_under_import_torchfix_a_pipeline_without_its_encoders_is_not_refused():
    # SDXL with its text encoders dropped to save memory, embeddings passed in: nothing is missing for this call
    pipe = tiny_sdxl_pipeline()
    embeds, negative, pooled, negative_pooled = pipe.encode_prompt("a cat", device="cpu", num_images_per_prompt=1)
    pipe.text_encoder, pipe.text_encoder_2 = None, None
    kwargs = dict(
        prompt_embeds=embeds,
        negative_prompt_embeds=negative,
        pooled_prompt_embeds=pooled,
        negative_pooled_prompt_embeds=negative_pooled,
        num_inference_steps=1,
        height=64,
        width=64,
        output_type="latent",
    )
    plain = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
    with torchfix.enabled():
        assert torch.equal(pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images, plain)


def test_a_config_that_disagrees_with_its_weights_decides_nothing():
    # the ControlNet's config claims another width than its weights read: diffusers runs it; torchfix must too
    base = tiny_sdxl_pipeline()
    controlnet = ControlNetModel.from_unet(base.unet, conditioning_embedding_out_channels=(4, 8, 8, 16))
    controlnet.register_to_config(cross_attention_dim=TEXT_DIM)  # wrong, the weights read 2 * TEXT_DIM
    pipe = StableDiffusionXLControlNetPipeline(**base.components, controlnet=controlnet)
    pipe.set_progress_bar_config(disable=True)
    image = torch.rand(1, 3, 64, 64)
    plain = latents(pipe, steps=1, image=image)
    assert not [f for f in torchfix.wrap(pipe).preflight() if f.component == "controlnet"]
    with torchfix.enabled():
        assert torch.equal(latents(pipe, steps=1, image=image), plain)


@pytest.mark.parametrize("builder, entry, edited", [("sd15", "cross_attention_dim", 768), ("flux", "joint_attention_dim", 4096)])
def test_a_denoiser_config_edited_apart_from_its_weights_runs_under_wrap_as_it_runs_plainly(builder, entry, edited):
    """The width a denoiser reads the text at is its first text-reading layer's (the UNet's attn2.to_k, Flux's
    context_embedder), not its config's: a config edited after loading (768 where the weights and the text encoder
    are 32 wide) runs plainly, and must run under wrap() too (it was refused: 'text_encoder output width 32 does not
    match unet.config.cross_attention_dim=768')."""
    from torchfix.testing import tiny_flux_pipeline, tiny_sd15_pipeline

    pipe = tiny_sd15_pipeline() if builder == "sd15" else tiny_flux_pipeline()
    model = pipe.unet if builder == "sd15" else pipe.transformer
    plain = latents(pipe, steps=2)
    model.register_to_config(**{entry: edited})
    assert torch.equal(latents(pipe, steps=2), plain)  # diffusers runs it as it was
    wrapped = torchfix.wrap(pipe)
    assert not [f for f in wrapped.preflight() if not f.advisory]
    assert torch.equal(latents(wrapped, steps=2), plain)
