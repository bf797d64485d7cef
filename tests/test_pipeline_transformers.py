"""torchfix.wrap on transformer pipelines (SD3, Flux) and on the UNet layouts that were refused wrongly
(the SDXL refiner's 5 time ids, a UNet with ``encoder_hid_dim``)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import torchfix

pytest.importorskip("diffusers")

from torchfix import testing
from torchfix.testing import latents

from .test_pipeline import assert_never_a_finding_or_a_change

KW = dict(num_inference_steps=2, height=64, width=64, output_type="latent")


def test_tiny_transformer_pipelines_run_offline_at_odd_sizes():
    for build in (testing.tiny_sd3_pipeline, testing.tiny_flux_pipeline):
        out = latents(build(), steps=2, size=(80, 112))
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("builder", ["tiny_sd3_pipeline", "tiny_flux_pipeline"])
def test_stale_embeddings_are_refused_before_running_naming_both_widths(builder):
    pipe = getattr(testing, builder)()
    embeds, pooled = torch.randn(1, 77, 32), torch.randn(1, 64 if builder == "tiny_sd3_pipeline" else 32)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):  # plain diffusers: mid-run
        pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, guidance_scale=1.0, **KW)
    calls = []
    hook = pipe.transformer.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(torchfix.ModelMismatchError) as info:
            torchfix.wrap(pipe)(prompt_embeds=embeds, pooled_prompt_embeds=pooled, guidance_scale=1.0, **KW)
    finally:
        hook.remove()
    msg = str(info.value)
    assert "prompt_embeds has width 32" in msg and "joint_attention_dim=64" in msg and calls == []
    good_pooled = pipe.transformer.config.pooled_projection_dim
    with pytest.raises(torchfix.ModelMismatchError, match=rf"pooled_prompt_embeds has width 7 .*pooled_projection_dim={good_pooled}"):
        torchfix.wrap(pipe)(prompt_embeds=torch.randn(1, 77, 64), pooled_prompt_embeds=torch.randn(1, 7), guidance_scale=1.0, **KW)


def test_preflight_finds_a_t5_of_another_model():
    pipe = testing.tiny_sd3_pipeline()
    pipe.text_encoder_3 = testing.tiny_t5_encoder(hidden=48)
    with pytest.raises(torchfix.ModelMismatchError, match=r"text_encoder_3 \(T5\) output width 48 does not match .*joint_attention_dim=64"):
        latents(torchfix.wrap(pipe), steps=2)
    flux = testing.tiny_flux_pipeline()
    flux.text_encoder = testing.tiny_text_encoder(hidden=16)
    with pytest.raises(
        torchfix.ModelMismatchError, match=r"text_encoder \(CLIP\) pooled width 16 does not match .*pooled_projection_dim=32"
    ):
        latents(torchfix.wrap(flux), steps=2)


def test_the_sdxl_refiner_layout_with_pooled_embeddings_is_valid():
    pipe = testing.tiny_sdxl_refiner_pipeline()
    image = torch.rand(1, 3, 64, 64)
    embeds, negative, pooled, negative_pooled = pipe.encode_prompt("a cat", do_classifier_free_guidance=True)
    args = dict(image=image, strength=0.5, num_inference_steps=4, output_type="latent")
    embeddings = dict(
        prompt_embeds=embeds, negative_prompt_embeds=negative, pooled_prompt_embeds=pooled, negative_pooled_prompt_embeds=negative_pooled
    )
    plain = pipe(**args, **embeddings, generator=torch.Generator().manual_seed(0)).images
    w = torchfix.wrap(pipe)
    assert w.preflight() == []
    assert torch.equal(w(**args, **embeddings, generator=torch.Generator().manual_seed(0)).images, plain)
    with pytest.raises(torchfix.ModelMismatchError, match=r"minus 5 time ids"):
        w(**args, **{**embeddings, "pooled_prompt_embeds": pooled[:, :16]})


def test_a_unet_with_encoder_hid_dim_is_valid():
    from diffusers import UNet2DConditionModel

    pipe = testing.tiny_sd15_pipeline()
    config = {k: v for k, v in pipe.unet.config.items() if not k.startswith("_")}
    config.update(encoder_hid_dim=testing.TEXT_DIM, encoder_hid_dim_type="text_proj", cross_attention_dim=24)
    torch.manual_seed(0)
    pipe.unet = UNet2DConditionModel(**config).eval()
    assert pipe.unet.encoder_hid_proj is not None
    plain = latents(pipe, steps=2)
    w = torchfix.wrap(pipe)
    assert w.preflight() == [] and torch.equal(latents(w, steps=2), plain)


def test_switch_sd15_sdxl_sd3_flux_sd15_ends_where_it_began():
    outs, refs = [], []
    for build in (
        testing.tiny_sd15_pipeline,
        testing.tiny_sdxl_pipeline,
        testing.tiny_sd3_pipeline,
        testing.tiny_flux_pipeline,
        testing.tiny_sd15_pipeline,
    ):
        pipe = build()
        refs.append(weakref.ref(getattr(pipe, "unet", None) or pipe.transformer))
        w = torchfix.wrap(pipe)
        outs.append(latents(w, steps=3))
        w.unwrap()
        del w, pipe
        gc.collect()
    assert torch.equal(outs[0], outs[-1])
    assert all(r() is None for r in refs), "an old denoiser is still referenced after unwrap"


def test_deepcache_on_an_unsupported_denoiser_is_never_silent():
    pipe = testing.tiny_sd15_pipeline()
    pipe.register_modules(unet=torch.nn.Linear(2, 2))  # no UNet layout DeepCache knows
    with pytest.raises(torchfix.deepcache.UnsupportedUNetError, match=r"wrap\(deepcache=.*Linear is not a model family"):
        torchfix.wrap(pipe, deepcache=torchfix.DeepCacheConfig(interval=3))
    with pytest.warns(torchfix.TorchfixWarning, match="deepcache= is ignored: .*Linear is not a model family"):
        torchfix.wrap(pipe, mode="warn", deepcache=torchfix.DeepCacheConfig(interval=3))
    with pytest.raises(ValueError, match=r"keep_first=4 \+ keep_last=1 leaves nothing to cache .* allowed: keep_first \+ keep_last <= 3"):
        torchfix.wrap(testing.tiny_sd3_pipeline(), deepcache=torchfix.DeepCacheConfig(keep_first=4))


def test_deepcache_functions_accept_the_wrapped_proxy():
    pipe = testing.tiny_sd15_pipeline()
    w = torchfix.wrap(pipe, deepcache=torchfix.DeepCacheConfig(interval=3))
    latents(w, steps=3)
    assert torchfix.deepcache.stats(w)["cached_steps"] == 1 and torchfix.deepcache.state_of(w) is torchfix.deepcache.state_of(pipe)
    torchfix.deepcache.new_call(w)
    torchfix.deepcache.remove(w)
    assert torchfix.deepcache.state_of(pipe) is None
    torchfix.deepcache.apply(w, torchfix.DeepCacheConfig(interval=2))
    assert torchfix.deepcache.state_of(pipe).config.interval == 2
    torchfix.deepcache.remove(pipe)


def test_events_name_the_component_under_plain_import_torchfix():
    """SD3 has two CLIP encoders with a text_projection and a T5: an event must say which (no wrap needed)."""
    pipe = testing.tiny_sd3_pipeline().to(torch.bfloat16)
    pipe.text_encoder_2.text_projection.half()
    pipe.text_encoder_3.encoder.block[0].layer[1].DenseReluDense.wi.half()
    with torchfix.enabled():
        latents(pipe, steps=1)
        modules = {e.module for e in torchfix.report().events}
    assert "text_encoder_2.text_projection" in modules
    assert "text_encoder_3.encoder.block.0.layer.1.DenseReluDense.wi" in modules


def test_a_t5_sequence_length_beyond_the_tokenizer_is_refused_before_running():
    pipe = testing.tiny_sd3_pipeline()
    pipe.tokenizer_3.model_max_length = 64
    with pytest.raises(ValueError, match=r"max_sequence_length=128 is longer than tokenizer_3.model_max_length=64"):
        torchfix.wrap(pipe)("a cat", max_sequence_length=128, **KW)
    assert torch.isfinite(torchfix.wrap(pipe)("a cat", max_sequence_length=64, **KW).images).all()


@pytest.mark.parametrize("mode", ["off", "fix", "warn", "strict"])
def test_t5_wo_kept_in_float32_in_a_bf16_sd3_is_never_a_finding_or_a_change(mode):
    """What from_pretrained(torch_dtype=bfloat16) gives: T5EncoderModel._keep_in_fp32_modules == ["wo"], and T5
    casts its hidden states to wo's dtype itself, so torch runs it; torchfix must neither flag nor change it."""
    pipe = testing.tiny_sd3_pipeline(layers=2)
    pipe.to(torch.bfloat16)
    t5 = pipe.text_encoder_3
    assert "wo" in type(t5)._keep_in_fp32_modules
    kept = [m for n, m in t5.named_modules() if n.rsplit(".", 1)[-1] == "wo"]
    assert kept
    for m in kept:
        m.to(torch.float32)
    assert_never_a_finding_or_a_change(pipe, mode, lambda p: latents(p, steps=2))
    if mode == "fix":  # compiled (dynamo adds attributes of its own), with the wrap's marks on wo: still torch's T5
        w = torchfix.wrap(pipe)
        w.preflight()
        torch._dynamo.reset()
        ids = pipe.tokenizer_3("a cat", return_tensors="pt").input_ids
        with torch.no_grad():
            plain_t5 = t5(ids).last_hidden_state
        with torchfix.enabled(), torch.no_grad():
            assert torch.equal(torch.compile(t5, backend="eager")(ids).last_hidden_state, plain_t5)
        torch._dynamo.reset()
        w.unwrap()


def without_text_encoders(builder, *dropped):
    """A tiny SD3 or Flux pipeline with the named tokenizers and text encoders dropped (loaded with ``=None`` to save
    memory), and its embeddings computed beforehand with them loaded: the pipeline and the embeddings by keyword."""
    full = getattr(testing, builder)()
    with torch.no_grad():
        if builder == "tiny_sd3_pipeline":
            out = full.encode_prompt("a cat", None, None, device="cpu", negative_prompt="ugly")
            names = ("prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds", "negative_pooled_prompt_embeds")
            embeds = dict(zip(names, out))
        else:
            (e, p, _), (ne, np_, _) = full.encode_prompt("a cat", None, device="cpu"), full.encode_prompt("ugly", None, device="cpu")
            embeds = {"prompt_embeds": e, "pooled_prompt_embeds": p, "negative_prompt_embeds": ne, "negative_pooled_prompt_embeds": np_}
    pipe = type(full)(**{**full.components, **dict.fromkeys(dropped)})
    pipe.set_progress_bar_config(disable=True)
    return pipe, embeds


SD3_ENCODERS = ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2", "tokenizer_3", "text_encoder_3")
FLUX_ENCODERS = ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2")


def positive(embeds):
    return {k: v for k, v in embeds.items() if not k.startswith("negative")}


@pytest.mark.parametrize(
    "builder, dropped, call",
    [
        ("tiny_sd3_pipeline", SD3_ENCODERS, lambda e: e),  # guidance 7.0 with both negatives
        ("tiny_sd3_pipeline", SD3_ENCODERS, lambda e: {**positive(e), "guidance_scale": 1.0}),
        ("tiny_sd3_pipeline", ("tokenizer_3", "text_encoder_3"), lambda e: {"prompt": "a cat"}),  # SD3 pads without its T5
        ("tiny_flux_pipeline", FLUX_ENCODERS, lambda e: positive(e)),  # true_cfg_scale 1.0: no negative
        ("tiny_flux_pipeline", FLUX_ENCODERS, lambda e: {**e, "true_cfg_scale": 2.0}),
    ],
    ids=["sd3-guided", "sd3-unguided", "sd3-no-t5", "flux", "flux-true-cfg"],
)
def test_a_transformer_pipeline_without_its_encoders_runs_precomputed_embeddings_exactly_as_plainly(builder, dropped, call):
    pipe, embeds = without_text_encoders(builder, *dropped)
    kwargs = call(embeds)
    prompt = kwargs.pop("prompt", None)
    plain = latents(pipe, prompt, steps=2, **kwargs)
    assert torch.equal(latents(torchfix.wrap(pipe), prompt, steps=2, **kwargs), plain)
    assert not torchfix.report().events


@pytest.mark.parametrize(
    "builder, call, says",
    [
        ("tiny_sd3_pipeline", lambda e: {"prompt": "a cat"}, r"StableDiffusion3Pipeline\(prompt='a cat'\) would encode the "
         r"prompt with tokenizer, text_encoder, tokenizer_2 and text_encoder_2, but the pipeline has no tokenizer, "
         r"text_encoder, tokenizer_2 or text_encoder_2 .*Pass prompt_embeds= and pooled_prompt_embeds= instead of prompt="),
        ("tiny_sd3_pipeline", positive, r"with guidance_scale=7.0 \(classifier-free guidance\) and no negative_prompt_embeds "
         r"would encode the negative prompt .*Pass negative_prompt_embeds= and negative_pooled_prompt_embeds= as well, or "
         r"guidance_scale=1 \(no guidance\)"),
        ("tiny_flux_pipeline", lambda e: {"prompt": "a cat"}, r"FluxPipeline\(prompt='a cat'\) would encode the prompt"),
        ("tiny_flux_pipeline", lambda e: {**positive(e), "negative_prompt": "ugly", "true_cfg_scale": 2.0},
         r"with true_cfg_scale=2.0 \(true CFG\), negative_prompt='ugly' and no negative_prompt_embeds would encode the negative "
         r"prompt .*or true_cfg_scale=1 \(no true CFG\)"),
    ],
    ids=["sd3-prompt", "sd3-negative", "flux-prompt", "flux-negative"],
)  # fmt: skip
def test_a_transformer_pipeline_without_its_encoders_refuses_a_call_that_needs_one_before_it_runs(builder, call, says):
    pipe, embeds = without_text_encoders(builder, *(SD3_ENCODERS if builder == "tiny_sd3_pipeline" else FLUX_ENCODERS))
    kwargs = call(embeds)
    prompt = kwargs.pop("prompt", None)
    with pytest.raises((AttributeError, TypeError)):  # plain diffusers: inside encode_prompt, on a missing tokenizer
        latents(pipe, prompt, steps=2, **kwargs)
    calls = []
    pipe.transformer.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(torchfix.InvalidCallError, match=says):
        latents(torchfix.wrap(pipe), prompt, steps=2, **kwargs)
    assert calls == []
