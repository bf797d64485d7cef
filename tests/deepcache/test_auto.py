"""``torchfix.deepcache.auto``: the cache on every pipeline a process runs, from its denoising loop on
(``torchfix run --deepcache``, #40): what ``apply`` before the call gives, bit for bit."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

import torchfix
from torchfix import testing

CFG = torchfix.DeepCacheConfig(interval=3)


@pytest.fixture
def guards(fix_mode):
    try:
        yield
    finally:
        torchfix.deepcache.auto(None)


def _pipe():
    pipe = testing.tiny_sd15_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_auto_equals_apply_before_the_call(guards):
    applied = _pipe()
    torchfix.deepcache.apply(applied, CFG)
    ref = [testing.latents(applied, steps=8), testing.latents(applied, steps=5, size=(72, 56))]
    expected = torchfix.deepcache.stats(applied)
    torchfix.deepcache.remove(applied)
    plain = testing.latents(applied, steps=8)

    assert torchfix.deepcache.auto(CFG) is None
    auto = _pipe()
    out = [testing.latents(auto, steps=8), testing.latents(auto, steps=5, size=(72, 56))]
    got = torchfix.deepcache.stats(auto)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    assert not torch.equal(out[0], plain)  # it did cache
    assert {k: got[k] for k in ("full_steps", "cached_steps", "generations")} == {
        k: expected[k] for k in ("full_steps", "cached_steps", "generations")
    }
    assert torchfix.deepcache.auto_applied()[-1] == ("StableDiffusionPipeline", got["full_steps"], got["cached_steps"])


def test_a_pipeline_with_its_own_cache_keeps_it(guards):
    pipe = _pipe()
    own = torchfix.DeepCacheConfig(interval=2)
    torchfix.deepcache.apply(pipe, own)
    torchfix.deepcache.auto(CFG)
    testing.latents(pipe, steps=6)
    assert torchfix.deepcache.state_of(pipe).config.interval == 2
    torchfix.deepcache.remove(pipe)


def test_auto_off_leaves_new_pipelines_plain(guards):
    torchfix.deepcache.auto(CFG)
    assert torchfix.deepcache.auto(None) is CFG
    pipe = _pipe()
    testing.latents(pipe, steps=4)
    assert torchfix.deepcache.stats(pipe) == {"applied": False}


def test_a_pipeline_of_no_known_family_is_refused_at_its_loop_start(guards):
    from diffusers import DiffusionPipeline

    class Odd(DiffusionPipeline):
        def __init__(self, unet: torch.nn.Module) -> None:
            super().__init__()
            self.register_modules(unet=unet)

        def __call__(self) -> torch.Tensor:
            with self.progress_bar(total=2):
                return self.unet(torch.randn(1, 4))

    torchfix.deepcache.auto(CFG)
    with pytest.raises(torchfix.UnsupportedModelError, match="Linear"):
        Odd(torch.nn.Linear(4, 4))()


def test_auto_takes_a_config():
    with pytest.raises(TypeError, match="DeepCacheConfig or None"):
        torchfix.deepcache.auto(3)  # type: ignore[arg-type]


def test_auto_holds_no_pipeline_across_model_switches(guards):
    """SD1.5 -> SDXL -> Flux under import torchfix with the cache on every pipeline: each dropped pipeline and its
    denoiser is garbage, and what the cache did is still reported (benchmarks/memory.py measures the RSS)."""
    import gc
    import weakref

    torchfix.deepcache.auto(CFG)
    refs = []
    for build in (testing.tiny_sd15_pipeline, testing.tiny_sdxl_pipeline, testing.tiny_flux_pipeline):
        pipe = build()
        pipe.set_progress_bar_config(disable=True)
        refs += [weakref.ref(pipe), weakref.ref(getattr(pipe, "unet", None) or pipe.transformer)]
        testing.latents(pipe, steps=6)
        del pipe
        gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
    done = torchfix.deepcache.auto_applied()[-3:]
    assert [name for name, _, _ in done] == ["StableDiffusionPipeline", "StableDiffusionXLPipeline", "FluxPipeline"]
    assert all(full > 0 and cached > 0 for _, full, cached in done)
