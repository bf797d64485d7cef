"""DeepCache inside diffusers' hook system: a named ModelHook that composes with layerwise casting, group
offloading and diffusers' own caches, in either order, and leaves nothing behind."""

from __future__ import annotations

import pytest
import torch

import torchfix

pytest.importorskip("diffusers")
hooks = pytest.importorskip("diffusers.hooks")

from torchfix import testing  # noqa: E402
from torchfix.deepcache.unet import HOOK_NAME  # noqa: E402
from torchfix.testing import latents  # noqa: E402

CFG = torchfix.DeepCacheConfig(interval=3)


def registry(module):
    return getattr(module, "_diffusers_hook", None)


def test_it_is_a_named_hook_and_remove_leaves_the_model_as_it_was():
    pipe = testing.tiny_sd15_pipeline()
    torchfix.deepcache.apply(pipe, CFG)
    assert registry(pipe.unet).get_hook(HOOK_NAME) is not None
    torchfix.deepcache.remove(pipe)
    assert registry(pipe.unet) is None and "forward" not in vars(pipe.unet)


@pytest.mark.parametrize("order", ["deepcache first", "casting first"])
def test_composes_with_layerwise_casting_in_either_order(order):
    pipe = testing.tiny_sd15_pipeline()
    cast_only = testing.tiny_sd15_pipeline()
    cast_only.unet.enable_layerwise_casting(storage_dtype=torch.bfloat16, compute_dtype=torch.float32)
    ref = latents(cast_only, steps=6)
    steps = [
        lambda: torchfix.deepcache.apply(pipe, CFG),
        lambda: pipe.unet.enable_layerwise_casting(storage_dtype=torch.bfloat16, compute_dtype=torch.float32),
    ]
    for step in steps if order == "deepcache first" else steps[::-1]:
        step()
    assert pipe.unet.conv_in.weight.dtype == torch.bfloat16
    out = latents(pipe, steps=6)
    assert torchfix.deepcache.stats(pipe)["cached_steps"] == 3 and torch.isfinite(out).all()
    torchfix.deepcache.remove(pipe)
    assert registry(pipe.unet) is None or registry(pipe.unet).get_hook(HOOK_NAME) is None
    assert pipe.unet.conv_in.weight.dtype == torch.bfloat16 and registry(pipe.unet.conv_in) is not None  # casting's own hooks
    assert torch.equal(latents(pipe, steps=6), ref)  # casting alone, as if DeepCache had never been there


def test_composes_with_group_offloading():
    pipe = testing.tiny_sd15_pipeline()
    ref = latents(pipe, steps=6)
    pipe.unet.enable_group_offload(onload_device=torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1)
    torchfix.deepcache.apply(pipe, torchfix.DeepCacheConfig(interval=1))
    assert torch.equal(latents(pipe, steps=6), ref)
    torchfix.deepcache.apply(pipe, CFG)
    latents(pipe, steps=6)
    assert torchfix.deepcache.stats(pipe)["cached_steps"] == 3
    torchfix.deepcache.remove(pipe)
    assert torch.equal(latents(pipe, steps=6), ref)


def test_composes_with_a_diffusers_cache_on_a_transformer():
    from diffusers import PyramidAttentionBroadcastConfig

    pipe = testing.tiny_flux_pipeline(layers=2, single_layers=4)
    pab = PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2,
        spatial_attention_timestep_skip_range=(0, 1000),
        current_timestep_callback=lambda: pipe.current_timestep,
    )
    hooks.apply_pyramid_attention_broadcast(pipe.transformer, pab)
    pab_only = latents(pipe, steps=6)
    torchfix.deepcache.apply(pipe, CFG)
    both = latents(pipe, steps=6)
    assert torchfix.deepcache.stats(pipe)["cached_steps"] == 3 and torch.isfinite(both).all()
    torchfix.deepcache.remove(pipe)
    assert registry(pipe.transformer) is not None and registry(pipe.transformer).get_hook(HOOK_NAME) is None
    assert torch.equal(latents(pipe, steps=6), pab_only)  # PAB's hooks are untouched


def test_blocks_and_models_under_other_hooks_are_read_by_their_own_signature():
    """diffusers before 0.40 points a hooked module's ``forward`` at its hook's ``new_forward(module, *args,
    **kwargs)``: torchfix reads the parameters beneath the registry's hooks (else a hooked block "takes no
    hidden_states" and the cache refuses it), on every release."""
    import inspect

    from torchfix.patches.instance import forward_source
    from torchfix.testing.families import FAMILIES, denoise

    class Passing(hooks.ModelHook):
        def new_forward(self, module, *args, **kwargs):
            return self.fn_ref.original_forward(*args, **kwargs)

    tiny = FAMILIES["flux"]
    model = tiny.build()
    ref = denoise(model, tiny).latents
    for module in (model, model.transformer_blocks[0]):
        hooks.HookRegistry.check_if_exists_or_initialize(module).register_hook(Passing(), "passing")
        own = list(inspect.signature(type(module).forward).parameters)[1:]  # less self
        assert list(inspect.signature(forward_source(module)).parameters) == own
    torchfix.deepcache.apply(model, torchfix.DeepCacheConfig(interval=1))  # refused before, on diffusers < 0.40
    try:
        assert torch.equal(denoise(model, tiny).latents, ref)
        assert torchfix.deepcache.stats(model)["full_steps"] > 0
    finally:
        torchfix.deepcache.remove(model)
