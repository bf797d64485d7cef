"""Families through real diffusers pipelines: Wan 2.2's two experts on one scheduler, CogVideoX with as many
text tokens as image tokens (where a cache that mixes up the streams computes garbage silently), and guidance
passes told apart by the ``cache_context`` names pipelines set."""

from __future__ import annotations

import pytest
import torch

import torchfix

pytest.importorskip("diffusers")

from torchfix import testing
from torchfix.testing.families import FAMILIES, denoise

CFG = torchfix.DeepCacheConfig(interval=3)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def wan(pipe, steps: int = 10, **kw):
    args = dict(prompt="a cat", negative_prompt="a dog", num_inference_steps=steps, height=16, width=16, num_frames=5, guidance_scale=5.0)
    args.update(max_sequence_length=16, output_type="latent", generator=torch.Generator().manual_seed(0))
    return pipe(**{**args, **kw}).frames


@pytest.fixture(scope="module")
def wan22():
    if (why := testing.wan_prompt_unavailable()) is not None:
        pytest.skip(why)
    return testing.tiny_wan22_pipeline()


def test_wan22_caches_both_experts_each_with_its_streams_on_one_scheduler(wan22):
    plain = wan(wan22)
    w = torchfix.wrap(wan22, deepcache=torchfix.DeepCacheConfig(interval=1))
    assert torch.equal(wan(w), plain)
    w.unwrap()
    calls = {"transformer": [], "transformer_2": []}
    hooks = [getattr(wan22, n).register_forward_hook(lambda *a, n=n: calls[n].append(1)) for n in calls]
    w = torchfix.wrap(wan22, deepcache=CFG)
    try:
        cached = wan(w)
    finally:
        for h in hooks:
            h.remove()
    s = torchfix.deepcache.stats(wan22)
    experts = s["denoisers"]
    assert set(experts) == {"transformer", "transformer_2"} and all(e["family"] == "wan" for e in experts.values())
    for name, e in experts.items():
        streams = e["last_call"]["streams"]
        assert len(streams) == 2  # "cond" and "uncond": the cache_context names Wan's pipeline sets
        assert streams[0] == streams[1] and streams[0]["full_steps"] >= 1  # each expert's first step runs in full
        assert e["full_steps"] + e["cached_steps"] == len(calls[name])
    assert s["full_steps"] + s["cached_steps"] == 2 * 10 and s["cached_steps"] > 0
    assert rel(cached, plain) < 0.1
    w.unwrap()
    assert "set_timesteps" not in vars(wan22.scheduler)
    assert all("forward" not in vars(m) for n in calls for m in getattr(wan22, n).modules())
    assert torch.equal(wan(wan22), plain)


def test_wan22_second_expert_counts_its_steps_from_the_switch(wan22):
    """The low-noise expert starts mid-generation: its first step is full and the caching window's tail (the last
    10% of steps run in full) falls on the generation's last steps, on the scheduler's clock."""
    torchfix.deepcache.apply(wan22, torchfix.DeepCacheConfig(interval=3, stop=0.8))
    seen = []  # the second expert's counts after each of its calls
    hook = wan22.transformer_2.register_forward_hook(
        lambda *a: seen.append(torchfix.deepcache.stats(wan22)["denoisers"]["transformer_2"]["last_call"])
    )
    try:
        wan(wan22, steps=20)
    finally:
        hook.remove()
        torchfix.deepcache.remove(wan22)
    cond = [c["streams"][0] for c in seen[::2]]  # after each cond call of the second expert
    full = [b["full_steps"] - a["full_steps"] for a, b in zip([{"full_steps": 0}, *cond], cond)]
    assert full[0] == 1  # the switch: a full step
    assert full[-1] == 1  # the tail of the generation: full
    assert 0 in full  # and cached steps in between


@pytest.mark.slow
def test_cogvideox_with_as_many_text_as_image_tokens_stays_close():
    """The issue's silent case: CogVideoX blocks return (image, text); with 16 text and 16 image tokens a cache
    that subtracts across the wrong tensors raises nothing and was off by rel-L2 0.87."""
    pipe = testing.tiny_cogvideox_pipeline()
    kw = dict(prompt="a cat", negative_prompt="", num_inference_steps=12, height=32, width=64, num_frames=5, guidance_scale=6.0)
    kw.update(max_sequence_length=16, output_type="latent")
    plain = pipe(**kw, generator=torch.Generator().manual_seed(0)).frames
    assert plain.shape[1] * (plain.shape[3] // 2) * (plain.shape[4] // 2) == 16  # image tokens == text tokens
    w = torchfix.wrap(pipe, deepcache=CFG)
    cached = w(**kw, generator=torch.Generator().manual_seed(0)).frames
    s = torchfix.deepcache.stats(pipe)
    w.unwrap()
    assert s["cached_steps"] > 0 and rel(cached, plain) < 0.05


def test_guidance_passes_sharing_a_prompt_are_told_apart_by_their_cache_context():
    """LTX's spatio-temporal guidance runs a pass with the cond prompt and perturbed attention: the same prompt
    object, another ``cache_context`` name. Each name is its own stream."""
    tiny = FAMILIES["ltx"]
    model = tiny.build()
    args = tiny.arguments()

    class Named(torch.nn.Module):  # calls the model under a context name, as the pipeline does
        def __init__(self, name):
            super().__init__()
            self.name = name

        def __call__(self, **kw):
            with model.cache_context(self.name):
                return model(**kw)

    torchfix.deepcache.apply(model, torchfix.DeepCacheConfig(interval=3, num_steps=8))
    try:
        from torchfix.testing.families import _timestep, _update, output_of

        latents, outs = args[tiny.latent], {"cond": [], "uncond_stg": []}
        for i in range(8):
            t = _timestep(tiny, 1 - i / 8, 1)
            for name in outs:
                outs[name].append(output_of(Named(name)(**{**args, tiny.latent: latents, tiny.timestep: t})))
            latents = _update(latents, outs["cond"][-1], 1 / 8)
        s = torchfix.deepcache.stats(model)
        assert s["streams"] == 2 and s["last_call"]["streams"] == [{"full_steps": 3, "cached_steps": 5}] * 2
        torchfix.deepcache.apply(model, torchfix.DeepCacheConfig(interval=3, num_steps=8))
        alone = denoise(model, tiny, steps=8)[0]
        assert all(torch.equal(a, b) for a, b in zip(outs["cond"], alone))
    finally:
        torchfix.deepcache.remove(model)
