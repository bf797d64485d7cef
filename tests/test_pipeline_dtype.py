"""torchfix.wrap and the model's own dtype: components in different dtypes, hand-overs between
them, a VAE kept in fp32, a non-finite fp16 decode, and sizes a transformer pipeline cannot patch."""

from __future__ import annotations

import warnings

import pytest
import torch

import torchfix

pytest.importorskip("diffusers")

from diffusers import ControlNetModel, StableDiffusionControlNetPipeline

from torchfix.testing import latents, tiny_flux_pipeline, tiny_sd3_pipeline, tiny_sd15_pipeline, tiny_vae

f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32


def tensors(module):
    return {n: (t.dtype, t.data_ptr()) for n, t in (*module.named_parameters(), *module.named_buffers())}


def rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def controlnet_pipeline(controlnet_dtype, dtype=bf16):
    pipe = tiny_sd15_pipeline()
    torch.manual_seed(1)
    controlnet = ControlNetModel.from_unet(pipe.unet, conditioning_embedding_out_channels=(4, 8, 8, 16))
    pipe = StableDiffusionControlNetPipeline(**pipe.components, controlnet=controlnet, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    pipe.to(dtype)
    pipe.controlnet.to(controlnet_dtype)
    return pipe


def run_controlnet(pipe, steps=3):
    image = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(3))
    return latents(pipe, steps=steps, image=image)


def test_a_controlnet_in_another_dtype_runs_in_the_pipelines_dtype():
    pipe = controlnet_pipeline(f16)
    with pytest.raises(RuntimeError):
        run_controlnet(pipe)  # plain torch: the bf16 latents meet the fp16 ControlNet
    unet, controlnet = tensors(pipe.unet), tensors(pipe.controlnet)
    # the maintainers' fix (diffusers #9527): the ControlNet loaded in the pipeline's dtype
    fixed = controlnet_pipeline(f16)
    fixed.controlnet.to(bf16)
    reference = run_controlnet(fixed)
    with torchfix.enabled():  # import torchfix: the same rule, per call
        assert torch.equal(run_controlnet(pipe), reference)
    assert tensors(pipe.controlnet) == controlnet
    torchfix.report().clear()
    w = torchfix.wrap(pipe)
    out = run_controlnet(w)
    again = run_controlnet(w)
    assert torch.equal(out, reference) and torch.equal(again, reference)
    assert tensors(pipe.unet) == unet  # the denoiser is the pipeline's dtype: never touched
    # cast once after the first call: every layer torch rejected (the conditioning embedding runs on the control image,
    # which the pipeline prepares in the ControlNet's own fp16: torch accepts that, so it is left alone)
    assert {dt for n, (dt, _) in tensors(pipe.controlnet).items() if not n.startswith("controlnet_cond_embedding")} == {bf16}
    assert w.kept_bytes > 0
    events = torchfix.report().events
    assert events and all(e.module.startswith("controlnet") for e in events if e.action != "noted")
    assert any("controlnet (pipeline dtype)" in e.detail for e in events)
    info = [f for f in w.findings if f.component == "controlnet" and f.advisory]
    assert info and "pipeline's dtype" in info[0].fix
    w.unwrap()
    assert tensors(pipe.controlnet) == controlnet  # the very originals back
    assert not pipe.unet._forward_pre_hooks  # the hand-over hook lived for the wrapped calls only


def test_an_fp16_controlnet_beside_an_fp32_unet_runs_in_fp32_without_a_lasting_upcast():
    pipe = controlnet_pipeline(f16, dtype=f32)
    with pytest.raises(RuntimeError, match="same dtype"):
        run_controlnet(pipe)  # plain: the fp32 latents meet the fp16 ControlNet
    unet, controlnet = tensors(pipe.unet), tensors(pipe.controlnet)
    fixed = controlnet_pipeline(f16, dtype=f32)
    fixed.controlnet.to(f32)  # the maintainers' fix: the pipeline's dtype
    out = run_controlnet(torchfix.wrap(pipe))
    assert torch.equal(out, run_controlnet(fixed))
    assert tensors(pipe.unet) == unet and tensors(pipe.controlnet) == controlnet  # a one-time cast never goes up
    fixes = [e for e in torchfix.report().events if e.action != "noted"]
    assert fixes and all(e.module.startswith("controlnet") and "float16→float32" in e.detail for e in fixes)


def live_controlnet(controlnet):
    """Seeded values in a ControlNet's zero-initialised convolutions (its conditioning output and the residual
    projections), so that its residuals, and their dtype, reach the UNet as a trained ControlNet's do."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in controlnet.named_parameters():
            if name.startswith(("controlnet_down_blocks", "controlnet_mid_block", "controlnet_cond_embedding.conv_out")):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return controlnet


def residuals_seen(pipe):
    """The mid-block residual the pipeline's ControlNet hands the UNet at each step (a hook to remove)."""
    seen = []

    def grab(module, args, kwargs):
        seen.append(kwargs["mid_block_additional_residual"].clone())

    return seen, pipe.unet.register_forward_pre_hook(grab, with_kwargs=True)


def fp32_controlnet_in_fp16(fix=False):
    """huggingface/diffusers#4860: a ControlNet loaded without torch_dtype (fp32) in an fp16 pipeline; the maintainers'
    fix (``fix``): the ControlNet in the pipeline's dtype."""
    pipe = controlnet_pipeline(f32, dtype=f16)
    live_controlnet(pipe.controlnet)
    if fix:
        pipe.controlnet.to(f16)
    return pipe


def test_an_fp32_controlnet_in_an_fp16_pipeline_hands_fp16_residuals_as_the_fix_does():
    pipe = fp32_controlnet_in_fp16()
    with pytest.raises(RuntimeError, match="same dtype"):
        run_controlnet(pipe)  # plain: "mat1 and mat2 must have the same dtype" at time_embedding.linear_1 (#4860)
    fixed = fp32_controlnet_in_fp16(fix=True)
    seen, hook = residuals_seen(fixed)
    reference = run_controlnet(fixed)
    hook.remove()
    controlnet = tensors(pipe.controlnet)
    with torchfix.enabled():  # import torchfix
        got, hook = residuals_seen(pipe)
        out = run_controlnet(pipe)
        hook.remove()
    # op by op, the fp32 control image would be added to the fp16 latents inside the ControlNet (torch promotes,
    # silently) and fp32 residuals handed on; run whole in the pipeline's dtype, the call is the fix's, bit for bit
    assert [r.dtype for r in got] == [f16] * 3 and all(torch.equal(a, b) for a, b in zip(got, seen))
    assert torch.equal(out, reference)
    assert tensors(pipe.controlnet) == controlnet  # the component itself is never changed
    events = [e for e in torchfix.report().events if e.action != "noted"]
    assert len(events) == 3 and all(e.module == "controlnet" and e.change == "float32→float16" for e in events)
    assert "controlnet (pipeline dtype)" in events[0].detail and "torch_dtype=torch.float16" in events[0].detail
    torchfix.report().clear()
    w = torchfix.wrap(pipe)
    got, hook = residuals_seen(pipe)
    first, again = run_controlnet(w), run_controlnet(w)
    hook.remove()
    assert torch.equal(first, reference) and torch.equal(again, reference)
    assert [r.dtype for r in got] == [f16] * 6 and all(torch.equal(a, b) for a, b in zip(got, seen + seen))
    assert {t.dtype for t in pipe.controlnet.parameters()} == {f16}  # cast once after the first call (a cast down)
    w.unwrap()
    assert tensors(pipe.controlnet) == controlnet


def test_each_net_of_a_multi_controlnet_left_fp32_runs_in_the_pipelines_dtype_and_warns_once():
    def build(fix=False):
        one = fp32_controlnet_in_fp16()
        torch.manual_seed(4)
        other = live_controlnet(ControlNetModel.from_unet(one.unet, conditioning_embedding_out_channels=(4, 8, 8, 16)))
        pipe = StableDiffusionControlNetPipeline(
            **{**one.components, "controlnet": [one.controlnet, other.float()]}, requires_safety_checker=False
        )
        pipe.set_progress_bar_config(disable=True)
        if fix:
            pipe.controlnet.to(f16)
        return pipe

    def run(pipe):
        image = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(3))
        return latents(pipe, steps=2, image=[image, image])

    reference = run(build(fix=True))
    pipe = build()
    with torchfix.enabled(mode="warn"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(run(pipe), reference)
    texts = [str(c.message) for c in caught if issubclass(c.category, torchfix.TorchfixWarning)]
    assert sorted(t.split(" is float32")[0] for t in texts) == ["torchfix: controlnet.nets.0", "torchfix: controlnet.nets.1"]
    assert all("To fix it for good: load it with torch_dtype=torch.float16" in t for t in texts)


def test_the_whole_call_reaches_a_controlnet_hooked_by_cpu_offload_before_torchfix_was_on():
    """accelerate's offload hook replaces the ControlNet's forward with one that calls the forward it saw then:
    torchfix's whole call lives in module hooks, which run whatever the forward is."""
    reference = run_controlnet(fp32_controlnet_in_fp16(fix=True))
    pipe = fp32_controlnet_in_fp16()
    pipe.enable_model_cpu_offload(device="cpu")
    with torchfix.enabled():
        assert torch.equal(run_controlnet(pipe), reference)
    assert not pipe.controlnet._forward_pre_hooks and not pipe.controlnet._forward_hooks  # gone with torchfix


def test_a_controlnet_call_interrupted_inside_gets_its_own_weights_back():
    """torch runs an ``always_call`` forward hook after an Exception only: a KeyboardInterrupt inside the ControlNet
    leaves its call to be ended at its next call, or when torchfix is removed."""
    pipe = fp32_controlnet_in_fp16()
    controlnet = tensors(pipe.controlnet)

    def interrupt(module, args, output):
        raise KeyboardInterrupt

    hook = pipe.controlnet.mid_block.register_forward_hook(interrupt)
    with torchfix.enabled():
        with pytest.raises(KeyboardInterrupt):
            run_controlnet(pipe)
        hook.remove()
        assert torch.equal(run_controlnet(pipe), run_controlnet(fp32_controlnet_in_fp16(fix=True)))
        assert tensors(pipe.controlnet) == controlnet  # ended at the next call
        hook = pipe.controlnet.mid_block.register_forward_hook(interrupt)
        with pytest.raises(KeyboardInterrupt):
            run_controlnet(pipe)
        hook.remove()
    assert tensors(pipe.controlnet) == controlnet  # ended when torchfix went off


def test_a_vae_kept_fp32_as_documented_is_left_as_it_runs():
    """diffusers' Wan docs load the VAE in fp32 beside a bf16 transformer, and the pipeline hands it latents in its
    dtype: torch accepts every call, so the decode is the plain one, bit for bit (no whole call, no event)."""
    from torchfix.testing import tiny_wan22_pipeline

    def build():
        pipe = tiny_wan22_pipeline().to(bf16)
        pipe.vae.float()
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def run(pipe):
        return pipe("a cat", num_inference_steps=2, height=32, width=32, num_frames=5, output_type="pt",
                    generator=torch.Generator().manual_seed(0)).frames

    plain = run(build())
    with torchfix.enabled():
        out = run(build())
    assert out.dtype == f32 and torch.equal(out, plain)
    assert not [e for e in torchfix.report().events if e.action != "noted"]


def test_strict_mode_raises_where_the_whole_call_would_run_in_the_pipelines_dtype():
    pipe = fp32_controlnet_in_fp16()
    with torchfix.enabled(mode="strict"), pytest.raises(torchfix.DtypeMismatchError, match="controlnet"):
        run_controlnet(pipe)  # strict raises where fix would change something: at the ControlNet's first layer


def test_an_asymmetric_vae_left_fp32_in_an_fp16_controlnet_pipeline_decodes_in_fp16():
    """huggingface/diffusers#7572: ``AsymmetricAutoencoderKL.from_pretrained(...)`` without torch_dtype in an fp16
    ControlNet pipeline ("Input type (c10::Half) and bias type (float)"); its config says ``force_upcast=False``: it is
    not kept in fp32 on purpose. The fix: the VAE loaded in fp16."""
    from diffusers import AsymmetricAutoencoderKL

    def build(fix=False):
        pipe = controlnet_pipeline(f16, dtype=f16)
        torch.manual_seed(2)
        blocks = {"down_block_types": ("DownEncoderBlock2D",) * 4, "up_block_types": ("UpDecoderBlock2D",) * 4}
        vae = AsymmetricAutoencoderKL(**blocks, down_block_out_channels=(8,) * 4, up_block_out_channels=(8,) * 4, norm_num_groups=4)
        pipe.vae = vae.eval().to(f16 if fix else f32)
        return pipe

    def image(pipe):
        control = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(3))
        return pipe("a cat", image=control, num_inference_steps=2, height=64, width=64, output_type="pt",
                    generator=torch.Generator().manual_seed(0)).images

    pipe = build()
    assert pipe.vae.config.force_upcast is False
    with pytest.raises(RuntimeError, match="should be the same"):
        image(pipe)
    reference = image(build(fix=True))
    vae = tensors(pipe.vae)
    with torchfix.enabled():
        out = image(pipe)
    # op by op, MaskConditionDecoder casts its mid-block output to its up blocks' fp32 and decodes in fp32
    assert reference.dtype == out.dtype == f16 and torch.equal(out, reference)
    assert tensors(pipe.vae) == vae
    w = torchfix.wrap(pipe)
    assert torch.equal(image(w), reference) and torch.equal(image(w), reference)
    w.unwrap()
    assert tensors(pipe.vae) == vae


def first_noise(pipe, run):
    """What ``run()`` returns, and the latents the pipeline's transformer was handed at its first call: the initial
    noise as the pipeline drew it (its dtype decides the draw on torch 2.11's CPU, whose bf16 ``randn`` is not its
    fp32 draw rounded)."""
    seen = []
    hook = pipe.transformer.register_forward_pre_hook(lambda m, a, k: seen.append(k["hidden_states"].clone()), with_kwargs=True)
    try:
        out = run()
    finally:
        hook.remove()
    return seen[0], out


def import_mode_hands_embeddings_over():
    """Under plain ``import torchfix`` the prompt embeddings reach the denoiser in its dtype through diffusers'
    ``encode_prompt`` patched (torchfix/patches/libraries.py, calling ``torchfix.preflight.embeddings_for_denoiser``)."""
    from torchfix import patches

    assert any("encode_prompt" in label for label in patches.installed()), patches.installed()


def sd3_with_fp16_clip_bodies():
    """transformers#36679 (diffusers#11117, SD3.5 medium in bf16): CLIPTextModelWithProjection built its text model from
    the config's fp16 while its text_projection loaded in the asked-for bf16."""
    pipe = tiny_sd3_pipeline(layers=2).to(bf16)
    for encoder in (pipe.text_encoder, pipe.text_encoder_2):
        encoder.text_model.half()
    return pipe


def sd3_maintainers_fix():
    """The maintainers' fix (transformers#36679): every part of the text encoders in the pipeline's dtype."""
    fixed = sd3_with_fp16_clip_bodies()
    fixed.text_encoder.to(bf16), fixed.text_encoder_2.to(bf16)
    return fixed


def test_clip_bodies_in_fp16_beside_a_bf16_sd3_run_in_bf16():
    pipe = sd3_with_fp16_clip_bodies()
    with pytest.raises(RuntimeError, match="same dtype"):
        latents(pipe, steps=2)
    fixed = sd3_maintainers_fix()
    noise_fixed, reference = first_noise(fixed, lambda: latents(fixed, steps=2))
    w = torchfix.wrap(pipe)
    noise, out = first_noise(pipe, lambda: latents(w, steps=2))
    # the prompt embeddings (the fp16 bodies' hidden states cat with the bf16 T5's: torch promotes them to fp32) reach
    # the transformer in bf16 before the pipeline draws its noise in their dtype: the very noise of the maintainers' fix
    assert noise.dtype == bf16 and torch.equal(noise, noise_fixed)
    assert out.dtype == bf16 and rel_l2(out, reference) < 0.02  # the rest is the fp16 bodies' rounding
    with torchfix.enabled():
        pooled = pipe.encode_prompt("a cat", "a cat", "a cat")[2]
    # the pooled output through text_projection: bf16, as the maintainers' (was cast down to fp16)
    assert pooled.dtype == bf16 and pipe.text_encoder.text_projection.weight.dtype == bf16
    casts = [e for e in torchfix.report().events if e.action != "noted"]
    encoders = [e for e in casts if e.module.startswith("text_encoder")]
    assert encoders and all(e.module.endswith(".text_projection") and "input float16→bfloat16" in e.detail for e in encoders)
    handed = [e for e in casts if e not in encoders]
    assert handed and all(e.module == "transformer.context_embedder" and e.change == "float32→bfloat16" for e in handed)
    assert "text_encoder is float16, text_encoder_2 is float16" in handed[0].detail and "before the noise is drawn" in handed[0].detail
    assert "encode_prompt" not in vars(pipe)  # the hand-over lived for the wrapped call only


def test_clip_bodies_in_fp16_beside_a_bf16_sd3_under_import_torchfix():
    pipe = sd3_with_fp16_clip_bodies()
    fixed = sd3_maintainers_fix()
    noise_fixed, reference = first_noise(fixed, lambda: latents(fixed, steps=2))
    with torchfix.enabled():
        import_mode_hands_embeddings_over()
        noise, out = first_noise(pipe, lambda: latents(pipe, steps=2))
    assert noise.dtype == bf16 and torch.equal(noise, noise_fixed) and rel_l2(out, reference) < 0.02


def flux_with_an_fp32_t5():
    """diffusers#9677: a bf16 Flux pipeline whose T5 (text_encoder_2) is kept in fp32 on purpose."""
    pipe = tiny_flux_pipeline().to(bf16)
    pipe.text_encoder_2.float()
    return pipe


def flux_maintainers_fix(pipe, **kwargs):
    """The maintainers' fix (diffusers#9677, #9097): encode with the fp32 T5, cast its output to the transformer's dtype
    and pass it in."""
    with torch.no_grad():  # as the pipeline's own call encodes (the fp32 T5 takes another kernel path with grad on)
        embeds, pooled, _ = pipe.encode_prompt("a cat", "a cat")
    return latents(pipe, None, steps=2, prompt_embeds=embeds.to(bf16), pooled_prompt_embeds=pooled, **kwargs)


def test_a_flux_pipeline_with_an_fp32_t5_keeps_its_transformer_bf16():
    pipe = flux_with_an_fp32_t5()
    with pytest.raises(RuntimeError, match="same dtype"):
        latents(pipe, steps=2)
    before, t5 = tensors(pipe.transformer), tensors(pipe.text_encoder_2)
    reference = flux_maintainers_fix(pipe)
    torchfix.report().clear()
    w = torchfix.wrap(pipe)
    out = latents(w, steps=2)
    # the T5 output in bf16 before the noise is drawn, as the maintainers': the same noise for the seed on every torch,
    # and so the same picture, bit for bit
    assert out.dtype == bf16 and torch.equal(out, reference)
    assert tensors(pipe.transformer) == before and tensors(pipe.text_encoder_2) == t5 and w.kept_bytes == 0
    (event,) = [e for e in torchfix.report().events if e.action != "noted"]  # nothing left to cast inside the transformer
    assert event.module == "transformer.context_embedder" and event.change == "float32→bfloat16"
    assert "text_encoder_2 is float32" in event.detail and "before the noise is drawn" in event.detail
    assert torch.equal(latents(w, steps=2), reference) and "encode_prompt" not in vars(pipe)
    with torch.no_grad():  # the user's own encode_prompt call returns what the fp32 T5 makes, as plainly
        assert w.encode_prompt("a cat", "a cat")[0].dtype == torch.float32


def test_a_flux_pipeline_with_an_fp32_t5_under_import_torchfix():
    pipe = flux_with_an_fp32_t5()
    reference = flux_maintainers_fix(pipe)
    with torchfix.enabled():
        with torch.no_grad():  # the user's own encode_prompt call returns what the fp32 T5 makes, as plainly
            assert pipe.encode_prompt("a cat", "a cat")[0].dtype == torch.float32
        import_mode_hands_embeddings_over()
        assert torch.equal(latents(pipe, steps=2), reference)


def test_the_hand_over_warns_once_in_warn_mode_and_is_refused_in_strict_mode():
    pipe = flux_with_an_fp32_t5()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        latents(torchfix.wrap(pipe, mode="warn"), steps=2)
    said = [str(c.message) for c in caught if issubclass(c.category, torchfix.TorchfixWarning) and "encode_prompt" in str(c.message)]
    assert len(said) == 1 and "pipe.text_encoder_2.to(torch.bfloat16)" in said[0] and "diffusers#9677" in said[0]
    calls = []
    hook = pipe.transformer.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(torchfix.DtypeMismatchError) as info:
            latents(torchfix.wrap(pipe, mode="strict"), steps=2)
    finally:
        hook.remove()
    msg = str(info.value)
    assert "FluxPipeline.encode_prompt returned prompt embeddings in float32 (text_encoder_2 is float32)" in msg
    assert "transformer.context_embedder reads them in bfloat16" in msg and "To fix:" in msg and calls == []


def sd15_with_an_fp32_text_encoder(lora=False):
    pipe = tiny_sd15_pipeline().to(bf16)
    pipe.text_encoder.float()
    if lora:  # a LoRA on the UNet's attention: attn2.to_k (which reads the embeddings) is peft's wrapper of the Linear
        from peft import LoraConfig

        torch.manual_seed(3)
        pipe.unet.add_adapter(LoraConfig(r=4, target_modules=["to_k", "to_q", "to_v"], init_lora_weights=False))
    return pipe


@pytest.mark.parametrize("lora", [False, True], ids=["plain-unet", "lora-unet"])
def test_a_unet_pipeline_with_an_fp32_text_encoder_draws_the_noise_of_the_encoder_output_cast(lora):
    """SD1.5 casts even precomputed prompt_embeds to its text encoder's dtype, so the fix is at the encoder's output:
    the reference casts what encode_prompt returns to the UNet's dtype, and runs plainly."""
    if lora:
        pytest.importorskip("peft")
    pipe = sd15_with_an_fp32_text_encoder(lora)
    with pytest.raises(RuntimeError, match="same dtype"):
        latents(pipe, steps=2)
    fixed = sd15_with_an_fp32_text_encoder(lora)
    encode = fixed.encode_prompt
    fixed.encode_prompt = lambda *a, **k: tuple(t.to(bf16) for t in encode(*a, **k))
    reference = latents(fixed, steps=2)
    out = latents(torchfix.wrap(pipe), steps=2)
    assert torch.equal(out, reference)
    (event,) = [e for e in torchfix.report().events if e.action != "noted"]
    assert event.module.startswith("unet.") and event.module.endswith("attn2.to_k") and event.change == "float32→bfloat16"
    assert "2 prompt embedding tensor(s)" in event.detail  # the prompt's and the negative prompt's (guidance 7.5)


def test_embeddings_torch_takes_under_autocast_are_left_alone():
    """Under autocast torch runs the fp32 T5's embeddings through the bf16 transformer: a plain run that works, so
    torchfix changes nothing (bit-identical, no cast)."""
    pipe = flux_with_an_fp32_t5()
    with torch.autocast("cpu", dtype=bf16):
        plain = latents(pipe, steps=2)
        torchfix.report().clear()
        assert torch.equal(latents(torchfix.wrap(pipe), steps=2), plain)
    assert not [e for e in torchfix.report().events if e.action != "noted"]


def fp16_pipeline_with_vae(vae_dtype, scale=2e5):
    pipe = tiny_sd15_pipeline().to(f16)
    vae = tiny_vae()
    with torch.no_grad():
        vae.decoder.conv_in.weight.mul_(scale)  # decoder activations beyond fp16's range (why SDXL's VAE is kept fp32)
    pipe.vae = vae.to(vae_dtype)
    return pipe


def decode_reference(pipe, lat):
    image = pipe.vae.float().decode(lat.float() / pipe.vae.config.scaling_factor).sample
    return pipe.image_processor.postprocess(image, output_type="pt")


def run_image(pipe, steps=2):
    generator = torch.Generator().manual_seed(0)
    return pipe("a cat", num_inference_steps=steps, height=64, width=64, output_type="pt", generator=generator).images


def test_an_fp32_vae_in_an_fp16_pipeline_stays_fp32_and_decodes_finite():
    pipe = fp16_pipeline_with_vae(f32)
    vae = tensors(pipe.vae)
    w = torchfix.wrap(pipe)
    lat = latents(w, steps=2)
    image = run_image(w)
    assert tensors(pipe.vae) == vae and w.kept_bytes == 0  # a VAE kept in fp32 is never cast down
    assert torch.isfinite(image).all()
    assert (image - decode_reference(pipe, lat)).abs().max() <= 1e-3  # the latents cast up, as diffusers does
    (ev,) = [e for e in torchfix.report().events if e.module and e.module.startswith("vae")]
    assert ev.action == "upcast" and ev.module == "vae.post_quant_conv"


def test_an_fp32_vae_without_force_upcast_runs_in_the_pipelines_dtype():
    def build():
        pipe = fp16_pipeline_with_vae(f32, scale=1.0)
        pipe.vae.register_to_config(force_upcast=False)  # not kept in fp32 on purpose (an asymmetric VAE's config)
        return pipe

    pipe = build()
    with pytest.raises(RuntimeError):
        run_image(pipe)  # plain: fp16 latents into the fp32 VAE
    fixed = build()
    fixed.vae.half()  # the maintainers' fix: the VAE in the pipeline's dtype
    with torchfix.enabled():
        image = run_image(pipe)
    # the whole decode runs in the pipeline's fp16, as the maintainers' fix runs it (its group norms, and on diffusers
    # < 0.36 its up blocks, which the Decoder casts to, included): the fix's image, bit for bit
    assert image.dtype == f16 and torch.equal(image, run_image(fixed))
    assert {e.module.split(".")[0] for e in torchfix.report().events if e.action != "noted"} == {"vae"}
    assert all("vae (pipeline dtype)" in e.detail for e in torchfix.report().events if e.action != "noted")


def test_a_non_finite_fp16_decode_is_re_run_in_fp32_and_reported():
    pipe = fp16_pipeline_with_vae(f16)
    assert not torch.isfinite(run_image(pipe)).all()  # plain: a black (NaN) image
    vae = tensors(pipe.vae)
    w = torchfix.wrap(pipe, mode="warn")
    lat = latents(w, steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        image = run_image(w)
    assert torch.isfinite(image).all() and tensors(pipe.vae) == vae
    reference = decode_reference(fp16_pipeline_with_vae(f16), lat)
    assert (image - reference).abs().max() <= 2e-3  # fp32 decode, returned in fp16
    (ev,) = [e for e in torchfix.report().events if e.module == "vae.decoder"]
    assert ev.action == "upcast" and "NaN/inf" in ev.detail and "re-ran in float32" in ev.detail
    assert any("vae.decoder" in str(c.message) for c in caught if issubclass(c.category, torchfix.TorchfixWarning))
    w.unwrap()
    assert not pipe.vae.decoder._forward_hooks
    with pytest.raises(torchfix.NonFiniteError, match=r"vae\.decoder in float16 produced NaN/inf"):
        run_image(torchfix.wrap(pipe, mode="strict"))


def test_a_finite_decode_is_not_touched():
    pipe = tiny_sd15_pipeline().to(f16)
    plain = run_image(pipe)
    assert torch.equal(run_image(torchfix.wrap(pipe)), plain)
    assert not torchfix.report().events


def test_a_stray_fp16_layer_in_an_fp32_component_is_never_cast_up_for_good():
    pipe = tiny_sd15_pipeline()
    norm = getattr(pipe.text_encoder, "text_model", pipe.text_encoder).final_layer_norm.half()  # transformers 4.x nests it
    plain_dtype = norm.weight.dtype
    w = torchfix.wrap(pipe)
    first = latents(w, steps=2)
    assert torch.equal(latents(w, steps=2), first)
    assert norm.weight.dtype == plain_dtype == f16 and w.kept_bytes == 0  # per-call casts only: an upcast would grow memory
    assert any(e.module in ("text_encoder.final_layer_norm", "text_encoder.text_model.final_layer_norm") for e in torchfix.report().events)


def test_an_sd3_controlnet_size_that_does_not_patch_is_refused_before_anything_runs():
    from diffusers import SD3ControlNetModel, StableDiffusion3ControlNetPipeline

    base = tiny_sd3_pipeline(layers=2)
    torch.manual_seed(2)
    controlnet = SD3ControlNetModel.from_transformer(base.transformer, num_layers=1, num_extra_conditioning_channels=0)
    pipe = StableDiffusion3ControlNetPipeline(**base.components, controlnet=controlnet)
    pipe.set_progress_bar_config(disable=True)
    control = torch.rand(1, 3, 72, 64)
    with pytest.raises(RuntimeError, match="must match the size"):  # plain: deep inside the transformer
        latents(pipe, size=(72, 64), steps=1, control_image=control)
    refused = r"height=72 \(use 64 or 80\) is not a multiple of 16 \(vae_scale_factor 8 × patch 2\)"
    with pytest.raises(torchfix.InvalidCallError, match=refused):
        latents(torchfix.wrap(pipe), size=(72, 64), steps=1, control_image=control)
    latents(torchfix.wrap(pipe), size=(64, 64), steps=1, control_image=torch.rand(1, 3, 64, 64))  # a valid size runs


def test_a_plain_sd3_size_that_does_not_patch_gets_diffusers_own_error():
    pipe = tiny_sd3_pipeline(layers=2)
    with pytest.raises(ValueError, match="have to be divisible by 16") as plain:  # diffusers 0.42.1 checks it up front
        latents(pipe, size=(72, 64), steps=1)
    with pytest.raises(ValueError) as wrapped:
        latents(torchfix.wrap(pipe), size=(72, 64), steps=1)
    assert str(wrapped.value) == str(plain.value) and not isinstance(wrapped.value, torchfix.TorchfixError)
