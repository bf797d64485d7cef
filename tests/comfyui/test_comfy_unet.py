"""The cached step of ComfyUI's UNetModel mirrors ComfyUI's own _forward: fed a full step's feature it returns the full
step's output, with ComfyUI's patches on (FreeU changes the deep feature in place), and ComfyUI's numbering of the
spatial transformers (transformer_index, which attention patches key on) is what a full step gives them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import torchfix
from torchfix.testing import comfyui

EXACT = torchfix.DeepCacheConfig(interval=2, warm_up=False, forecast=0, stop=1.0)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.fixture(params=["sd15", "sdxl"])
def tiny(request):
    model = comfyui.tiny(request.param)
    yield model
    torchfix.deepcache.remove(model.diffusion_model)


def calls(tiny: comfyui.TinyComfy, n: int, **options) -> list[torch.Tensor]:
    x = torch.randn(tiny.latent(*tiny.sizes[1]).shape, generator=torch.Generator().manual_seed(3))
    return [tiny.call(x, 3.0, **options) for _ in range(n)]


@pytest.mark.parametrize("branch", [0, 1, 2])
def test_each_branch_fed_a_full_steps_feature_returns_its_output(tiny, branch):
    torchfix.deepcache.apply(tiny.diffusion_model, dataclasses.replace(EXACT, branch=branch))
    first, cached, full, cached_again = calls(tiny, 4)
    assert torchfix.deepcache.stats(tiny.diffusion_model)["cached_steps"] == 2
    assert rel(cached, first) < 1e-5 and rel(cached_again, full) < 1e-5


def test_freeu_changes_the_feature_in_place_and_the_cache_keeps_its_own_copy(tiny):
    comfyui.load()
    from comfy_extras.nodes_freelunch import FreeU_V2

    (freeu,) = FreeU_V2().patch(tiny.patcher, 1.3, 1.4, 0.9, 0.2)
    tiny.patcher = freeu
    options = {"patches": freeu.model_options["transformer_options"]["patches"]}
    torchfix.deepcache.apply(tiny.diffusion_model, EXACT)
    first, cached, full, cached_again = calls(tiny, 4, **options)
    assert rel(cached, first) < 1e-5 and rel(cached_again, full) < 1e-5


def test_a_feature_changed_in_place_where_torchfix_does_not_look_is_refused(tiny):
    torchfix.deepcache.apply(tiny.diffusion_model, EXACT)
    producer = tiny.diffusion_model.output_blocks[len(tiny.diffusion_model.output_blocks) - 2]
    producer[-1].register_forward_hook(lambda module, args, out: out.mul_(1.5))  # after torchfix kept a reference
    with pytest.raises(torchfix.UnsupportedModelError, match="changed in place"):
        calls(tiny, 1)
    assert torchfix.deepcache.stats(tiny.diffusion_model)["cached_steps"] == 0


def test_attention_patches_see_the_transformer_index_of_a_full_step(tiny):
    seen: list[tuple] = []

    def attn2_patch(q, k, v, extra_options):
        seen.append((tuple(extra_options["block"]), extra_options["transformer_index"]))
        return q, k, v

    # branch 2: the cached step runs an output block with attention also on the SDXL-like layout
    torchfix.deepcache.apply(tiny.diffusion_model, dataclasses.replace(EXACT, branch=2))
    calls(tiny, 1, patches={"attn2_patch": [attn2_patch]})
    full = list(seen)
    seen.clear()
    calls(tiny, 1, patches={"attn2_patch": [attn2_patch]})
    assert torchfix.deepcache.stats(tiny.diffusion_model)["cached_steps"] == 1
    assert seen and set(seen) <= set(full) and len(seen) < len(full)
