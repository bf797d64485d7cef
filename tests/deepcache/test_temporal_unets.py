"""DeepCache on the video UNets: AnimateDiff's ``UNetMotionModel`` (motion modules mix the frames of each sample
after every layer) and Stable Video Diffusion's ``UNetSpatioTemporalConditionModel`` (spatio-temporal resnets and
attentions), at any latent size and frame count.

A cached step is DeepCache's definition, computed here by diffusers' own forward: the model run in full with the
tensor that enters skip ``branch``'s consumer replaced by the deep feature a full step kept. The cached step must
equal it, bit for bit, for every branch, at even and odd sizes, for a batch of two (frames folded into the batch
dimension), with the conditioning the video pipelines pass. A new frame count starts a new generation: its first
step runs in full and never meets the old frame count's features.
"""

from __future__ import annotations

import pytest
import torch

import torchfix

pytest.importorskip("diffusers")

from torchfix import testing
from torchfix.deepcache.layout import analyse
from torchfix.deepcache.unet import _last_of_layer
from torchfix.testing.families import FAMILIES, denoise, output_of

MODELS = ("animatediff", "svd")
CFG = torchfix.DeepCacheConfig(interval=3, num_steps=8)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module", params=MODELS)
def tiny(request):
    return FAMILIES[request.param]


@pytest.fixture(scope="module")
def model(tiny):
    m = tiny.build()
    yield m
    torchfix.deepcache.remove(m)


def by_definition(model: torch.nn.Module, branch: int, feature: torch.Tensor, arguments: dict) -> torch.Tensor:
    """DeepCache's cached step, by diffusers' own forward: what enters consumer ``branch`` replaced by ``feature``."""
    i, j = analyse(model).consumers[branch]
    up = model.up_blocks[i]
    feature = feature.clone()  # FreeU scales what enters a resnet in place
    if j == 0:
        handle = up.register_forward_pre_hook(lambda m, args, kwargs: (args, {**kwargs, "hidden_states": feature}), with_kwargs=True)
    else:
        handle = _last_of_layer(up, j - 1).register_forward_hook(
            lambda m, args, out: (feature, *out[1:]) if isinstance(out, tuple) else feature
        )
    try:
        with torch.no_grad():
            return output_of(model(**arguments))
    finally:
        handle.remove()


def step_arguments(tiny, size, frames, seed, t, batch=2, **extra):
    return {
        **tiny.arguments(batch=batch, size=size, frames=frames, seed=seed),
        tiny.timestep: torch.full((batch,), t * tiny.scale),
        **extra,
    }


def cached_against_definition(model, tiny, branch, size, frames, **extra) -> None:
    """A full step at one input, then a cached step at another (other latents, another timestep): the cached step
    equals the model run in full around the full step's deep feature."""
    torchfix.deepcache.apply(model, torchfix.DeepCacheConfig(interval=2, warm_up=False, forecast=0, stop=1.0, branch=branch))
    try:
        full = step_arguments(tiny, size, frames, 0, 0.9, **extra)
        later = {**step_arguments(tiny, size, frames, 1, 0.6, **extra), tiny.prompts[0]: full[tiny.prompts[0]]}  # one stream
        with torch.no_grad():
            model(**full)
            feature = torchfix.deepcache.state_of(model).feature
            cached = output_of(model(**later))
        s = torchfix.deepcache.stats(model)
        assert (s["full_steps"], s["cached_steps"]) == (1, 1)
    finally:
        torchfix.deepcache.remove(model)
    expected = by_definition(model, branch, feature, later)
    with torch.no_grad():
        plain = output_of(model(**later))
    assert cached.shape == plain.shape
    assert torch.equal(cached, expected), (branch, size, frames, (cached - expected).abs().max().item())
    assert not torch.equal(cached, plain)  # the feature is reused, not recomputed


@pytest.mark.parametrize("size", [(8, 8), (9, 12)])
def test_a_cached_step_is_deepcache_at_every_branch_size_and_frame_count(tiny, model, size):
    for frames in tiny.frames:
        for branch in range(analyse(model).n_skips):
            cached_against_definition(model, tiny, branch, size, frames)


def test_animatediff_conditioning_freeu_and_controlnet_residuals_follow_the_definition():
    """AnimateDiff SDXL's text_time conditioning, FreeU, and ControlNet residuals (added to the skips; the mid
    block's is deep, in the feature)."""
    tiny = FAMILIES["animatediff"]
    config = {
        **tiny.config,
        "addition_embed_type": "text_time",
        "addition_time_embed_dim": 4,
        "projection_class_embeddings_input_dim": 6 * 4 + 8,
    }
    model = testing.families.replace(tiny, config=config).build()
    model.enable_freeu(s1=0.9, s2=0.2, b1=1.2, b2=1.4)
    added = {"text_embeds": torch.randn(2, 8), "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64]] * 2)}
    for (h, w), frames in (((8, 8), 4), ((9, 12), 3)):
        rows, half = 2 * frames, ((h + 1) // 2, (w + 1) // 2)
        # the skips: conv_in, down_blocks.0's layer and downsampler, down_blocks.1's layer; then the mid block
        residuals = (torch.randn(rows, 16, h, w), torch.randn(rows, 16, h, w), torch.randn(rows, 16, *half), torch.randn(rows, 32, *half))
        extra = {
            "added_cond_kwargs": added,
            "down_block_additional_residuals": residuals,
            "mid_block_additional_residual": torch.randn(rows, 32, *half),
        }
        for branch in range(4):
            cached_against_definition(model, tiny, branch, (h, w), frames, **extra)


def test_animatediff_under_freenoise_split_inference_follows_the_definition():
    """FreeNoise's split inference (``pipe.enable_free_noise_split_inference``) wraps the resnets, attentions and
    samplers in modules that split the tensors passed by keyword: the cached step calls them as the blocks do."""
    from diffusers.pipelines.free_noise_utils import AnimateDiffFreeNoiseMixin

    class Host(AnimateDiffFreeNoiseMixin):
        def __init__(self, unet):
            self.unet = unet

    tiny = FAMILIES["animatediff"]
    model = tiny.build()
    Host(model).enable_free_noise_split_inference(spatial_split_size=16, temporal_split_size=3)
    assert type(model.down_blocks[0].resnets[0]).__name__ == "SplitInferenceModule"
    for branch in range(analyse(model).n_skips):
        cached_against_definition(model, tiny, branch, (9, 12), 4)


def test_a_new_frame_count_starts_a_new_generation(tiny, model):
    """Mid-generation (its next step would be cached), a call with another frame count at the same size runs in
    full as a new generation's first step: the model's own output, bit for bit."""
    size = tiny.sizes[0]
    other = step_arguments(tiny, size, tiny.frames[1], 5, 0.5, batch=1)
    with torch.no_grad():
        plain = output_of(model(**other))
    torchfix.deepcache.apply(model, CFG)
    try:
        denoise(model, tiny, steps=4, frames=tiny.frames[0])  # full 0 and 2; step 4 would be cached
        assert torchfix.deepcache.stats(model)["last_call"]["full_steps"] == 2
        with torch.no_grad():
            out = output_of(model(**other))
        s = torchfix.deepcache.stats(model)
        assert s["generations"] == 2 and (s["last_call"]["full_steps"], s["last_call"]["cached_steps"]) == (1, 0)
        assert torch.equal(out, plain)
        # and the generation at the new frame count caches as a fresh one would
        again = denoise(model, tiny, steps=8, frames=tiny.frames[1], seed=2)
        torchfix.deepcache.apply(model, CFG)
        fresh = denoise(model, tiny, steps=8, frames=tiny.frames[1], seed=2)
        assert all(torch.equal(a, b) for a, b in zip(again[0], fresh[0]))
    finally:
        torchfix.deepcache.remove(model)


def work_and_error(model, tiny, size, frames) -> tuple[float, float, dict]:
    """Interval 3 over 8 steps: the plain run's UNet FLOPs ÷ the cached run's, rel-L2 of the final latents, stats."""
    runs = {}
    plain = testing.flops(lambda: runs.setdefault("plain", denoise(model, tiny, size=size, frames=frames)))
    torchfix.deepcache.apply(model, CFG)
    try:
        cached = testing.flops(lambda: runs.setdefault("cached", denoise(model, tiny, size=size, frames=frames)))
        s = torchfix.deepcache.stats(model)
    finally:
        torchfix.deepcache.remove(model)
    return plain / cached, rel(runs["cached"].latents, runs["plain"].latents), s


@pytest.mark.parametrize("size", [(8, 8), (9, 12)])
def test_interval_3_over_8_steps_saves_work_at_small_error(tiny, model, size):
    """Measured (random weights, CPU): AnimateDiff 2.08x less UNet work at rel-L2 0.007-0.010 of the final latents,
    SVD 2.20-2.21x at 0.0021-0.0024, at both sizes and both frame counts (SD1.5's builder: 2.26x at 0.005)."""
    for frames in tiny.frames:
        work, error, s = work_and_error(model, tiny, size, frames)
        assert (s["full_steps"], s["cached_steps"]) == (3, 5)
        assert work >= 1.9, (size, frames, work)
        assert error <= 0.02, (size, frames, error)


def test_unsupported_blocks_are_refused_at_apply_naming_the_path_and_why():
    model = FAMILIES["animatediff"].build()
    model.up_blocks[1].motion_modules = torch.nn.ModuleList(list(model.up_blocks[1].motion_modules)[:1])
    with pytest.raises(torchfix.UnsupportedModelError, match=r"UNetMotionModel\.up_blocks\.1 has 2 resnets but 1 motion_modules"):
        torchfix.deepcache.apply(model, CFG)
    assert torchfix.deepcache.stats(model) == {"applied": False}
    svd = FAMILIES["svd"].build()
    svd.down_blocks[0] = FAMILIES["animatediff"].build().down_blocks[0]  # a motion block in the spatio-temporal UNet
    with pytest.raises(
        torchfix.UnsupportedModelError, match=r"UNetSpatioTemporalConditionModel\.down_blocks\.0 is CrossAttnDownBlockMotion"
    ):
        torchfix.deepcache.apply(svd, CFG)
    assert torchfix.deepcache.stats(svd) == {"applied": False}


def test_the_preflight_reads_a_motion_unets_prompt_width_off_its_cross_attention_not_a_motion_module():
    """An SDXL-like motion UNet's first block has no cross-attention: the first ``attn2`` is a motion module's, which
    attends across frames and reads the channels, not the prompt."""
    from torchfix import preflight

    tiny = FAMILIES["animatediff"]
    config = {
        **tiny.config,
        "down_block_types": ("DownBlockMotion", "CrossAttnDownBlockMotion"),
        "up_block_types": ("CrossAttnUpBlockMotion", "UpBlockMotion"),
    }
    model = testing.families.replace(tiny, config=config).build()
    path, layer = preflight._reader(model, "cross_attention_dim")
    assert path == "down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k" and layer.in_features == 16


# --- real pipelines -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def animatediff():
    return testing.tiny_animatediff_pipeline()


def animate(pipe, frames=4, steps=10, seed=0, **kw):
    return testing.latents(pipe, "a cat", steps=steps, size=(64, 64), seed=seed, num_frames=frames, guidance_scale=7.5, **kw)


def test_animatediff_pipeline_is_cached_close_to_the_plain_one(animatediff):
    assert type(animatediff.unet).__name__ == "UNetMotionModel"
    plain = {f: animate(animatediff, frames=f) for f in (4, 3)}
    torchfix.deepcache.apply(animatediff, torchfix.DeepCacheConfig(interval=1))
    assert torch.equal(animate(animatediff), plain[4])
    torchfix.deepcache.apply(animatediff, torchfix.DeepCacheConfig(interval=3))
    try:
        cached = animate(animatediff)
        s = torchfix.deepcache.stats(animatediff)
        assert s["family"] == "animatediff" and (s["last_call"]["full_steps"], s["last_call"]["cached_steps"]) == (4, 6)
        assert rel(cached, plain[4]) < 0.05
        fewer = animate(animatediff, frames=3)  # another frame count: a new generation, as a fresh cache would run it
        assert torchfix.deepcache.stats(animatediff)["generations"] == 2
        torchfix.deepcache.apply(animatediff, torchfix.DeepCacheConfig(interval=3))
        assert torch.equal(animate(animatediff, frames=3), fewer) and rel(fewer, plain[3]) < 0.05
    finally:
        torchfix.deepcache.remove(animatediff)
    assert torch.equal(animate(animatediff), plain[4])


def test_animatediff_pipeline_through_wrap(animatediff):
    plain = animate(animatediff, steps=8)
    w = torchfix.wrap(animatediff, deepcache=torchfix.DeepCacheConfig(interval=3))
    try:
        cached = animate(w, steps=8)
        s = torchfix.deepcache.stats(animatediff)
        assert s["cached_steps"] > 0 and rel(cached, plain) < 0.05
    finally:
        w.unwrap()
    assert torch.equal(animate(animatediff, steps=8), plain)


def test_stable_video_diffusion_pipeline_is_cached_close_to_the_plain_one():
    """Its own 25 EDM steps (Karras sigmas 700 → 0.002), guidance batched per frame, the conditioning image's latents
    joined to the noise (8 input channels). At 10 steps the first cached steps bridge σ 700 → 20 and rel-L2 is ~0.1
    (0.07-0.11 for every interval, forecast and branch tried): the coarse schedule, not the cache's mechanism."""
    pipe = testing.tiny_svd_pipeline()
    image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))

    def run(frames=3):
        kw = dict(height=16, width=16, num_frames=frames, num_inference_steps=25, min_guidance_scale=1.0, max_guidance_scale=2.5)
        return pipe(image, **kw, output_type="latent", generator=torch.Generator().manual_seed(0)).frames

    plain = run()
    torchfix.deepcache.apply(pipe, torchfix.DeepCacheConfig(interval=1))
    assert torch.equal(run(), plain)
    torchfix.deepcache.apply(pipe, torchfix.DeepCacheConfig(interval=3))
    try:
        cached = run()
        s = torchfix.deepcache.stats(pipe)
        assert s["family"] == "svd" and (s["last_call"]["full_steps"], s["last_call"]["cached_steps"]) == (9, 16)
        assert rel(cached, plain) < 0.05
        fewer = run(frames=2)
        torchfix.deepcache.apply(pipe, torchfix.DeepCacheConfig(interval=3))
        assert torch.equal(run(frames=2), fewer)
    finally:
        torchfix.deepcache.remove(pipe)
    assert torch.equal(run(), plain)


def test_animatediff_pipeline_with_freenoise_and_split_inference():
    """FreeNoise (overlapping context windows in the motion modules) with its split inference, as its docs enable it
    for long videos: the cached steps run the wrapped layers as the UNet does."""
    pipe = testing.tiny_animatediff_pipeline()
    pipe.enable_free_noise(context_length=4, context_stride=2)
    pipe.enable_free_noise_split_inference(spatial_split_size=32, temporal_split_size=4)
    plain = animate(pipe, frames=6)
    torchfix.deepcache.apply(pipe, torchfix.DeepCacheConfig(interval=3))
    try:
        cached = animate(pipe, frames=6)
        assert torchfix.deepcache.stats(pipe)["last_call"]["cached_steps"] == 6
    finally:
        torchfix.deepcache.remove(pipe)
    assert rel(cached, plain) < 0.05
