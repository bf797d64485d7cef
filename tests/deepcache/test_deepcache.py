"""DeepCache on tiny SD1.5-like and SDXL-like pipelines and UNets."""

from __future__ import annotations

import inspect

import pytest
import torch

import torchfix
from torchfix.deepcache import DeepCacheConfig
from torchfix.testing import tiny_sd15_unet, tiny_sdxl_unet

from .conftest import generate

CFG = DeepCacheConfig(interval=3, branch=0)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


# --- apply / remove ----------------------------------------------------------------------


def test_apply_remove_round_trip_and_no_stacking(sd15):
    unet = sd15.unet
    cls_forward = type(unet).forward
    hooks_before = {n: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for n, m in unet.named_modules()}
    torchfix.deepcache.apply(sd15, CFG)
    torchfix.deepcache.apply(sd15, DeepCacheConfig(interval=2, warm_up=False, branch=1))  # replaces
    state = torchfix.deepcache.state_of(sd15)
    assert state.original_forward.__func__ is cls_forward  # not a wrapper over a wrapper
    assert state.config.interval == 2
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in unet.modules()) == 1
    assert inspect.signature(unet.forward) == inspect.signature(unet.forward.__wrapped__)
    torchfix.deepcache.remove(sd15)
    torchfix.deepcache.remove(sd15)  # forgiving
    assert "forward" not in vars(unet) and unet.forward.__func__ is cls_forward
    assert "set_timesteps" not in vars(sd15.scheduler)
    assert {n: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for n, m in unet.named_modules()} == hooks_before
    assert torchfix.deepcache.stats(sd15) == {"applied": False}


def test_bad_branch_and_unsupported_unets():
    unet = tiny_sd15_unet()
    with pytest.raises(ValueError, match=r"branch=12 but .* 12 skip connections"):
        torchfix.deepcache.apply(unet, DeepCacheConfig(branch=12))
    with pytest.raises(torchfix.UnsupportedModelError, match="Linear is not a model family torchfix knows"):
        torchfix.deepcache.apply(torch.nn.Linear(2, 2), CFG)
    from diffusers import UNet2DConditionModel

    odd = UNet2DConditionModel(
        block_out_channels=(8, 16),
        down_block_types=("SimpleCrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "SimpleCrossAttnUpBlock2D"),
        cross_attention_dim=8,
        attention_head_dim=4,
        norm_num_groups=4,
        layers_per_block=1,
    )
    with pytest.raises(torchfix.deepcache.UnsupportedUNetError, match=r"down_blocks\.0 is SimpleCrossAttnDownBlock2D"):
        torchfix.deepcache.apply(odd, CFG)


# --- exactness -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sd15", "sdxl"])
def test_interval_one_is_bit_identical(name, request):
    pipe = request.getfixturevalue(name)
    ref = generate(pipe)
    torchfix.deepcache.apply(pipe, DeepCacheConfig(interval=1))
    assert torch.equal(generate(pipe), ref)


def _unet_inputs(unet, size, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 4, *size, generator=g)
    ehs = torch.randn(batch, 7, unet.config.cross_attention_dim, generator=g)
    kw = {}
    if unet.config.addition_embed_type == "text_time":
        kw["added_cond_kwargs"] = {"text_embeds": torch.randn(batch, 32, generator=g), "time_ids": torch.randn(batch, 6, generator=g)}
    return x, ehs, kw


@pytest.mark.parametrize("make", [tiny_sd15_unet, tiny_sdxl_unet])
def test_full_steps_bit_identical_and_cached_steps_close(make):
    unet = make()
    x, ehs, kw = _unet_inputs(unet, (9, 11))
    with torch.no_grad():
        plain = [unet(x, t, ehs, **kw).sample for t in (900, 800, 700, 600)]
        torchfix.deepcache.apply(unet, DeepCacheConfig(interval=3, branch=1))
        cached = [unet(x, t, ehs, **kw).sample for t in (900, 800, 700, 600)]
    assert torch.equal(cached[0], plain[0]) and torch.equal(cached[2], plain[2])  # full steps 0 and 2 (a forecast warms up)
    for i in (1, 3):
        assert not torch.equal(cached[i], plain[i]) and rel(cached[i], plain[i]) < 0.5
    st = torchfix.deepcache.stats(unet)
    assert (st["full_steps"], st["cached_steps"]) == (2, 2)
    torchfix.deepcache.remove(unet)


# pixel sizes from the issue, as latents (÷8); SDXL layout: no attention at the highest resolution
SIZES = [(64, 64), (90, 120), (96, 170), (125, 125), (45, 60), (8, 8), (8, 13), (33, 17)]


@pytest.mark.parametrize("size", SIZES, ids=[f"{h}x{w}" for h, w in SIZES])
def test_every_latent_size_round_trips(size):
    unet = tiny_sdxl_unet()
    x, ehs, kw = _unet_inputs(unet, size, batch=1)
    torchfix.deepcache.apply(unet, DeepCacheConfig(interval=2, warm_up=False, branch=0))
    with torch.no_grad():
        first = unet(x, 900, ehs, **kw).sample
        second = unet(x, torch.tensor([800]), encoder_hidden_states=ehs, **kw).sample
    assert first.shape == second.shape == x.shape and torch.isfinite(second).all()
    assert torchfix.deepcache.stats(unet)["cached_steps"] == 1
    torchfix.deepcache.remove(unet)


@pytest.mark.parametrize("branch", [0, 2, 3, 5, 8, 11])
def test_every_branch_of_sd15_at_an_odd_size(branch):
    unet = tiny_sd15_unet()
    x, ehs, _ = _unet_inputs(unet, (45 // 3, 60 // 3 + 1))  # 15×21: 15→8→4→2 and back
    with torch.no_grad():
        plain = unet(x, 500, ehs).sample
        torchfix.deepcache.apply(unet, DeepCacheConfig(interval=2, warm_up=False, branch=branch))
        unet(x, 500, ehs)
        again = unet(x, 500, ehs).sample  # cached step, same input: the cached feature is exact
    torch.testing.assert_close(again, plain, rtol=1e-5, atol=1e-5)
    torchfix.deepcache.remove(unet)


# --- generations never share state -------------------------------------------------------------


@pytest.mark.parametrize("name", ["sd15", "sdxl"])
def test_resolution_change_between_calls(name, request):
    pipe = request.getfixturevalue(name)
    torchfix.deepcache.apply(pipe, CFG)
    a1 = generate(pipe, size=(64, 64))
    b = generate(pipe, size=(72, 88))
    a2 = generate(pipe, size=(64, 64))
    torchfix.deepcache.remove(pipe)
    torchfix.deepcache.apply(pipe, CFG)
    fresh_b = generate(pipe, size=(72, 88))
    assert b.shape == (1, 4, 9, 11)
    assert torch.equal(a1, a2) and torch.equal(b, fresh_b)


def test_prompt_and_seed_change_never_see_old_features(sd15):
    torchfix.deepcache.apply(sd15, CFG)
    generate(sd15, prompt="a cat", seed=0)
    dog = generate(sd15, prompt="a dog", seed=0)
    seed1 = generate(sd15, prompt="a cat", seed=1)
    torchfix.deepcache.remove(sd15)
    torchfix.deepcache.apply(sd15, CFG)
    assert torch.equal(dog, generate(sd15, prompt="a dog", seed=0))
    torchfix.deepcache.remove(sd15)
    torchfix.deepcache.apply(sd15, CFG)
    assert torch.equal(seed1, generate(sd15, prompt="a cat", seed=1))


@pytest.mark.parametrize("batch,guidance", [(1, 1.0), (2, 7.5), (4, 1.0), (3, 5.0)])
def test_batch_and_guidance(sd15, batch, guidance):
    ref = generate(sd15, num_images_per_prompt=batch, guidance_scale=guidance, steps=6)
    torchfix.deepcache.apply(sd15, DeepCacheConfig(interval=2, warm_up=False))
    out = generate(sd15, num_images_per_prompt=batch, guidance_scale=guidance, steps=6)
    assert out.shape == ref.shape == (batch, 4, 8, 8)
    assert 0 < rel(out, ref) < 0.3
    st = torchfix.deepcache.stats(sd15)
    assert (st["full_steps"], st["cached_steps"]) == (3, 3)
    features = torchfix.deepcache.state_of(sd15).feature
    assert features.shape[0] == batch * (2 if guidance > 1 else 1)


def test_img2img_starts_with_a_full_step(sd15):
    from diffusers import StableDiffusionImg2ImgPipeline

    img2img = StableDiffusionImg2ImgPipeline(**sd15.components)
    img2img.set_progress_bar_config(disable=True)
    init = torch.rand(1, 3, 64, 64)
    torchfix.deepcache.apply(sd15, CFG)  # the same UNet and scheduler serve both pipelines
    generate(sd15)
    st0 = dict(torchfix.deepcache.stats(sd15))
    out = img2img("a cat", image=init, strength=0.5, num_inference_steps=10, output_type="latent",
                  generator=torch.Generator().manual_seed(0)).images  # fmt: skip
    state = torchfix.deepcache.state_of(sd15)
    assert state.generation.current.step == 5 and torchfix.deepcache.stats(sd15)["full_steps"] - st0["full_steps"] == 2
    torchfix.deepcache.remove(sd15)
    torchfix.deepcache.apply(sd15, CFG)
    fresh = img2img("a cat", image=init, strength=0.5, num_inference_steps=10, output_type="latent",
                    generator=torch.Generator().manual_seed(0)).images  # fmt: skip
    assert torch.equal(out, fresh)


@pytest.mark.parametrize("scheduler", ["DDIMScheduler", "EulerDiscreteScheduler", "DPMSolverMultistepScheduler", "HeunDiscreteScheduler"])
def test_schedulers_count_calls_not_timesteps(sd15, scheduler):
    import diffusers

    original = sd15.scheduler
    sd15.scheduler = getattr(diffusers, scheduler).from_config(original.config)
    try:
        torchfix.deepcache.apply(sd15, CFG)
        out = generate(sd15, steps=5)
        state = torchfix.deepcache.state_of(sd15)
        calls = len(sd15.scheduler.timesteps)  # Heun: 2·5−1 UNet calls, timesteps repeated
        assert state.generation.current.step == calls == state.generation.total
        assert state.full_steps == len(torchfix.deepcache.full_steps(calls, CFG))
        assert torch.isfinite(out).all()
    finally:
        torchfix.deepcache.remove(sd15)
        sd15.scheduler = original


def test_timestep_forms_and_no_scheduler():
    unet = tiny_sd15_unet()
    x, ehs, _ = _unet_inputs(unet, (8, 8))
    torchfix.deepcache.apply(unet, DeepCacheConfig(interval=2, warm_up=False, num_steps=4))
    with torch.no_grad():
        for t in (999, torch.tensor(800), torch.tensor([600, 600]), torch.tensor(400.0)):
            unet(sample=x, timestep=t, encoder_hidden_states=ehs)
    assert torchfix.deepcache.stats(unet)["cached_steps"] == 2
    torchfix.deepcache.new_call(unet)
    with torch.no_grad():
        unet(x, 999, ehs)
    assert torchfix.deepcache.stats(unet)["full_steps"] == 3 and torchfix.deepcache.stats(unet)["generations"] == 2
    torchfix.deepcache.remove(unet)


def test_cache_holds_the_features_its_forecast_needs(sd15):
    torchfix.deepcache.apply(sd15, DeepCacheConfig(interval=3, branch=0))
    generate(sd15, size=(64, 96))
    state = torchfix.deepcache.state_of(sd15)
    # branch 0 of SD1.5: the feature entering the last resnet of the last up block
    assert state.feature.shape == (2, 8, 8, 12)
    # the last three full steps' features: a UNet's default quadratic forecast extrapolates from them
    assert torchfix.deepcache.stats(sd15)["cache_bytes"] == 3 * (2 * 8 * 8 * 12 * 4)


def _residuals(value=0.0):
    # the 12 skips of an 8×8 latent: conv_in, D0 (2 layers + downsampler), D1, D2 (same), D3 (2 layers)
    shapes = [(8, 8, 8)] * 3 + [(8, 4, 4)] + [(16, 4, 4)] * 2 + [(16, 2, 2)] * 3 + [(16, 1, 1)] * 3
    return [torch.full((2, *s), value) for s in shapes], torch.full((2, 16, 1, 1), value)


def _full_then_cached(unet, x, ehs, full_kw, cached_kw):
    """One generation: a full step with ``full_kw``, then a cached step with ``cached_kw``."""
    torchfix.deepcache.new_call(unet)
    unet(x, 500, ehs, **full_kw)
    before = torchfix.deepcache.stats(unet)["cached_steps"]
    out = unet(x, 400, ehs, **cached_kw).sample
    assert torchfix.deepcache.stats(unet)["cached_steps"] == before + 1  # the second step really was cached
    return out


def test_controlnet_residuals_reach_cached_steps():
    """Only the cached step's residuals differ between the runs: the full steps (and so the cached
    deep feature) are identical, so any difference comes from the cached step itself."""
    unet = tiny_sd15_unet()
    x, ehs, _ = _unet_inputs(unet, (8, 8))
    zero, mid = _residuals(0.0)
    bumped = [r + 1.0 for r in zero]
    deep_only = [*zero[:-1], zero[-1] + 1.0]  # the deepest skip: not on branch 0's shallow path
    full = {"down_block_additional_residuals": zero, "mid_block_additional_residual": mid}
    torchfix.deepcache.apply(unet, DeepCacheConfig(interval=2, warm_up=False, branch=0))
    try:
        with torch.no_grad():
            same = _full_then_cached(unet, x, ehs, full, full)
            again = _full_then_cached(unet, x, ehs, full, full)
            none = _full_then_cached(unet, x, ehs, full, {})
            shallow = _full_then_cached(unet, x, ehs, full, {**full, "down_block_additional_residuals": bumped})
            deep = _full_then_cached(unet, x, ehs, full, {**full, "down_block_additional_residuals": deep_only})
        assert torch.equal(same, again)
        assert torch.equal(same, none)  # zero residuals add nothing
        assert not torch.allclose(shallow, same)  # the shallow skips' residuals are added in the cached step
        assert torch.equal(deep, same)  # the deep part is the cached feature: its residuals cannot change it
    finally:
        torchfix.deepcache.remove(unet)


def test_lora_scale_reaches_cached_steps(sd15):
    """The full steps run at one LoRA scale; only the cached step's scale differs between the runs."""
    pytest.importorskip("peft")
    from peft import LoraConfig

    unet = sd15.unet
    unet.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_lora_weights=False))
    x, ehs, _ = _unet_inputs(unet, (8, 8))
    half, full_scale, zero = ({"cross_attention_kwargs": {"scale": v}} for v in (0.5, 1.0, 0.0))
    try:
        ref = generate(sd15, steps=4, cross_attention_kwargs={"scale": 0.5})
        torchfix.deepcache.apply(sd15, DeepCacheConfig(interval=1))
        assert torch.equal(generate(sd15, steps=4, cross_attention_kwargs={"scale": 0.5}), ref)
        torchfix.deepcache.apply(unet, DeepCacheConfig(interval=2, warm_up=False, branch=2))
        with torch.no_grad():
            at_half = _full_then_cached(unet, x, ehs, half, half)
            at_half_again = _full_then_cached(unet, x, ehs, half, half)
            at_one = _full_then_cached(unet, x, ehs, half, full_scale)
            unet.disable_adapters()
            no_lora = _full_then_cached(unet, x, ehs, half, half)
            unet.enable_adapters()
            at_zero = _full_then_cached(unet, x, ehs, half, zero)
        assert torch.equal(at_half, at_half_again)
        assert not torch.allclose(at_one, at_half)  # the scale reaches the cached step's LoRA layers
        assert not torch.allclose(at_zero, at_half)
        assert not torch.allclose(no_lora, at_half)  # the adapters run in the cached step at all
    finally:
        torchfix.deepcache.remove(sd15)
        torchfix.deepcache.remove(unet)
        unet.delete_adapters(unet.active_adapters())


@pytest.mark.slow
def test_compile_across_resolutions():
    unet = tiny_sdxl_unet(layers=1)  # one resnet per block: half the graph to trace, the same levels and odd sizes
    torchfix.deepcache.apply(unet, DeepCacheConfig(interval=2, warm_up=False, branch=1))
    compiled = torch.compile(unet, backend="eager", dynamic=False)
    with torch.no_grad():
        for size in ((90, 120), (90, 90), (45, 60)):  # 720×960 → 720×720 → 360×480
            x, ehs, kw = _unet_inputs(unet, size, batch=1)
            torchfix.deepcache.new_call(unet)
            full = compiled(x, 900, ehs, **kw).sample
            cached = compiled(x, 800, ehs, **kw).sample
            assert full.shape == cached.shape == x.shape
    assert torchfix.deepcache.stats(unet)["cached_steps"] == 3
    torchfix.deepcache.remove(unet)


def test_guidance_branches_called_separately_each_keep_their_own_cache():
    """Modular guiders, PAG and low-memory samplers call the UNet once per branch and step."""
    from torchfix.testing import tiny_sd15_unet

    unet = tiny_sd15_unet()
    cfg = torchfix.DeepCacheConfig(interval=3)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(1, 4, 8, 8, generator=gen) for _ in range(9)]
    cond, uncond = torch.randn(1, 77, 32, generator=gen), torch.randn(1, 77, 32, generator=gen)

    def run(prompts):
        torchfix.deepcache.apply(unet, cfg)
        outs = []
        for i, x in enumerate(xs):
            outs.append([unet(x, 999 - 100 * i, encoder_hidden_states=p).sample for p in prompts])
        s = torchfix.deepcache.stats(unet)
        torchfix.deepcache.remove(unet)
        return outs, s

    both, s = run((uncond, cond))
    assert (s["full_steps"], s["cached_steps"], s["generations"]) == (8, 10, 1)  # was 18 full, 0 cached
    alone, _ = run((cond,))
    assert all(torch.equal(b[1], a[0]) for b, a in zip(both, alone))  # the cond branch never saw the uncond feature
