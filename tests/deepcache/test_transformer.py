"""DeepCache for diffusion transformers (SD3, Flux): the UNet version's guarantees, and one cache per stream."""

from __future__ import annotations

import pytest
import torch

import torchfix

pytest.importorskip("diffusers")

from torchfix import testing
from torchfix.testing import latents

BUILDERS = {
    "sd3": lambda: testing.tiny_sd3_pipeline(layers=6),
    "flux": lambda: testing.tiny_flux_pipeline(layers=2, single_layers=4),
}
CFG = torchfix.DeepCacheConfig(interval=3)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(params=sorted(BUILDERS))
def pipe(request):
    p = BUILDERS[request.param]()
    yield p
    torchfix.deepcache.remove(p)


def test_interval_1_is_bit_identical_and_remove_restores(pipe):
    ref = latents(pipe, steps=5)
    torchfix.deepcache.apply(pipe, torchfix.DeepCacheConfig(interval=1))
    assert torch.equal(latents(pipe, steps=5), ref)
    assert torchfix.deepcache.stats(pipe)["cached_steps"] == 0
    torchfix.deepcache.apply(pipe, CFG)
    cached = latents(pipe, steps=6)
    torchfix.deepcache.remove(pipe)
    assert not hasattr(pipe.transformer.forward, "__torchfix_deepcache__")
    assert not any(hasattr(b.forward, "__torchfix_deepcache__") for b in pipe.transformer.transformer_blocks)
    assert torch.equal(latents(pipe, steps=5), ref) and torch.isfinite(cached).all()


def test_cached_steps_skip_the_middle_blocks_and_stay_close(pipe):
    ref = latents(pipe, steps=9)
    calls = []
    middle = torchfix.deepcache.analyse_transformer(pipe.transformer).blocks[2]
    handle = middle.attn.register_forward_pre_hook(lambda *a: calls.append(1))  # runs only when the block computes
    torchfix.deepcache.apply(pipe, CFG)
    try:
        out = latents(pipe, steps=9)
    finally:
        handle.remove()
    s = torchfix.deepcache.stats(pipe)
    full = (0, 2, 5, 8) if s["warm_up"] else (0, 3, 6)  # Flux's schedule warms up, SD3's shift-3 one does not
    assert (s["full_steps"], s["cached_steps"], s["streams"]) == (len(full), 9 - len(full), 1)
    assert len(calls) == len(full)  # the middle block ran on the full steps only
    assert rel(out, ref) < 0.05


def test_a_new_prompt_seed_or_size_never_sees_old_features(pipe):
    torchfix.deepcache.apply(pipe, CFG)
    latents(pipe, "a cat", steps=6, size=(64, 96))
    runs = [("a dog", 0, (64, 96)), ("a dog", 1, (64, 96)), ("a dog", 1, (96, 48))]
    after = [latents(pipe, p, steps=6, seed=seed, size=size) for p, seed, size in runs]
    for (p, seed, size), got in zip(runs, after):
        torchfix.deepcache.apply(pipe, CFG)  # a fresh cache
        assert torch.equal(latents(pipe, p, steps=6, seed=seed, size=size), got), (p, seed, size)


def test_each_guidance_stream_keeps_its_own_cache():
    """Flux's true CFG runs the negative prompt as a separate transformer call every step."""
    pipe = testing.tiny_flux_pipeline(layers=2, single_layers=4)
    kw = dict(negative_prompt="a dog", true_cfg_scale=3.0)
    ref = latents(pipe, steps=9, **kw)
    state = torchfix.deepcache.apply(pipe, CFG)
    seen = []
    streams = lambda: state.generation.streams.values()  # noqa: E731  (a new generation replaces the object)
    hook = pipe.transformer.register_forward_hook(lambda *a: seen.append([st.residual[1] for st in streams() if st.residual]))
    try:
        out = latents(pipe, steps=9, **kw)
    finally:
        hook.remove()
    s = torchfix.deepcache.stats(pipe)
    assert (s["streams"], s["full_steps"], s["cached_steps"]) == (2, 8, 10)
    assert rel(out, ref) < 0.05
    # one stream keyed by the text alone would hand the positive residual to the negative call
    both = [r for r in seen if len(r) == 2]
    assert both and not torch.equal(both[-1][0], both[-1][1])
    assert state.cache_bytes == 0  # the pipeline's end-of-call reset (diffusers' stateful hooks) freed the cache
    call = s["last_call"]  # and what the call did is still reported
    assert (call["full_steps"], call["cached_steps"], len(call["streams"])) == (8, 10, 2)


def test_wrap_applies_it_to_transformer_pipelines():
    pipe = testing.tiny_sd3_pipeline(layers=6)
    w = torchfix.wrap(pipe, deepcache=torchfix.DeepCacheConfig(interval=3, keep_first=2, keep_last=1))
    latents(w, steps=6)
    s = torchfix.deepcache.stats(w)
    assert s["applied"] and s["cached_steps"] == 4 and "transformer_blocks.2 .. transformer_blocks.4" in s["blocks"]
    w.unwrap()
    assert torchfix.deepcache.state_of(pipe) is None


def test_controlnet_style_calls_run_in_full():
    pipe = testing.tiny_sd3_pipeline(layers=6)
    torchfix.deepcache.apply(pipe, CFG)
    model = pipe.transformer
    torchfix.deepcache.new_call(model)
    x, text, pooled = torch.randn(1, 16, 8, 8), torch.randn(1, 10, 64), torch.randn(1, 64)
    for _ in range(3):
        model(hidden_states=x, encoder_hidden_states=text, pooled_projections=pooled, timestep=torch.tensor([1.0]), skip_layers=[3])
    assert torchfix.deepcache.stats(model)["cached_steps"] == 0


def test_img2img_strength_starts_a_new_generation():
    from diffusers import StableDiffusion3Img2ImgPipeline

    pipe = StableDiffusion3Img2ImgPipeline(**testing.tiny_sd3_pipeline(layers=6).components)
    image = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    torchfix.deepcache.apply(pipe, CFG)
    got = [latents(pipe, steps=8, image=image, strength=s) for s in (0.5, 0.9)]
    for strength, out in zip((0.5, 0.9), got):
        torchfix.deepcache.apply(pipe, CFG)
        assert torch.equal(latents(pipe, steps=8, image=image, strength=strength), out)
    torchfix.deepcache.remove(pipe)


def test_img2img_keeps_its_last_steps_full_and_follows_the_steps_it_runs():
    """An img2img pipeline sets 20 timesteps and runs the last 10 (strength 0.5, ``set_begin_index(10)``): the
    schedule is that of 10 steps, the window's tail (``stop=0.9``) on the last of them, as for a 10-step
    text-to-image call (before, the tail fell on steps the call never reached)."""
    from diffusers import FluxImg2ImgPipeline

    base = testing.tiny_flux_pipeline(layers=2, single_layers=2)
    pipe = FluxImg2ImgPipeline(**base.components)
    cfg = torchfix.DeepCacheConfig(interval=3, stop=0.9)
    counts = {}
    for name, p, kw in (("img2img", pipe, dict(steps=20, image=torch.rand(1, 3, 64, 64), strength=0.5)), ("txt2img", base, dict(steps=10))):
        torchfix.deepcache.apply(p, cfg)
        seen = []  # full steps so far, after each call
        full_so_far = lambda *a, seen=seen, p=p: seen.append(torchfix.deepcache.stats(p)["last_call"]["full_steps"])  # noqa: E731
        hook = p.transformer.register_forward_hook(full_so_far)
        try:
            latents(p, **kw)
        finally:
            hook.remove()
            torchfix.deepcache.remove(p)
        counts[name] = [b - a for a, b in zip([0, *seen], seen)]  # 1 where a call ran in full
    assert counts["img2img"] == counts["txt2img"] == [1, 0, 1, 0, 0, 1, 0, 0, 1, 1]  # 0, 2, 5, 8 and the tail: 9


def test_torch_compile_needs_no_recompile_across_steps_or_generations():
    from torch._dynamo.utils import counters

    pipe = testing.tiny_flux_pipeline(layers=2, single_layers=2)
    torchfix.deepcache.apply(pipe, CFG)
    eager = latents(pipe, steps=6)
    pipe.transformer.compile(dynamic=False)
    try:
        counters.clear()
        first = latents(pipe, steps=6)
        graphs = counters["stats"]["unique_graphs"]
        counters.clear()
        second = latents(pipe, steps=6)
        # each kind of step compiles once in the first generation (full, cached; the forecast and the kept residual
        # run eagerly between graphs: 3 graphs with forecast=0); then nothing new
        assert graphs <= 12 and counters["stats"]["unique_graphs"] == 0
        assert torch.equal(first, second) and rel(first, eager) < 1e-5
        assert torchfix.deepcache.stats(pipe)["cached_steps"] == 9  # decisions still made per call
    finally:
        torch._dynamo.reset()


def test_latents_whose_dtype_changes_after_step_0_stay_one_generation():
    """SD3 with a bf16 transformer, fp32 text encoders and its context embedder kept in fp32 on purpose
    (``torchfix.keep_dtype``: else the guards hand the prompt embeddings over in bf16, and the latents are bf16 from
    the start): the pipeline hands the transformer fp32 latents at step 0 and bf16 ones after. One call is one
    generation (before: two, and stats() reported 7 of 8 steps)."""
    from torchfix.testing import latents, tiny_sd3_pipeline

    pipe = tiny_sd3_pipeline()
    pipe.transformer.to(torch.bfloat16)
    torchfix.keep_dtype(pipe.transformer.context_embedder.float())
    seen = []
    pipe.transformer.register_forward_pre_hook(lambda m, a, k: seen.append(k["hidden_states"].dtype), with_kwargs=True)
    torchfix.deepcache.apply(pipe, torchfix.DeepCacheConfig(interval=3))
    try:
        with torchfix.enabled():
            out = latents(pipe, "a cat", steps=8)
            assert seen[0] == torch.float32 and set(seen[1:]) == {torch.bfloat16}
            s = torchfix.deepcache.stats(pipe)
            assert s["generations"] == 1
            assert s["last_call"]["full_steps"] + s["last_call"]["cached_steps"] == 8 and s["last_call"]["cached_steps"] > 0
            assert out.dtype == torch.bfloat16 and bool(torch.isfinite(out).all())
            latents(pipe, "a cat", steps=8)  # the next call is a new generation, as before
            assert torchfix.deepcache.stats(pipe)["generations"] == 2
    finally:
        torchfix.deepcache.remove(pipe)
