"""The cached step's shallow forward (deepcache/shallow.py) against the installed diffusers' own
``UNet2DConditionModel.forward``, for every conditioning kind and argument it handles.

A cached step fed exactly the inputs of the full step before it reuses a deep feature computed from
those very inputs, so its output must be the UNet's own output, bit for bit. Anything diffusers adds
to or changes in its forward (an embedding kind, an argument, a block's signature) shows up here as a
difference (or an error) instead of a silently different image.
"""

from __future__ import annotations

import pytest
import torch

import torchfix
from torchfix import DeepCacheConfig

pytest.importorskip("diffusers")

from torchfix import testing

TEXT = 32
SHAPE = dict(  # three levels, attention in the first two, 2 heads (testing._tiny_unet gives the rest)
    block_out_channels=(8, 16, 16),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=TEXT,
)


def _ehs(batch: int = 1, width: int = TEXT) -> torch.Tensor:
    return torch.randn(batch, 5, width)


# name -> (config changes, call kwargs builder)
CASES = {
    "sd15": ({}, lambda size: {}),
    "class_labels timestep": ({"class_embed_type": "timestep"}, lambda size: {"class_labels": torch.tensor([7])}),
    "class_labels concat": (
        {"class_embed_type": "timestep", "class_embeddings_concat": True},
        lambda size: {"class_labels": torch.tensor([7])},
    ),
    "class_labels projection": (
        {"class_embed_type": "projection", "projection_class_embeddings_input_dim": 6},
        lambda size: {"class_labels": torch.randn(1, 6)},
    ),
    "sdxl text_time": (
        {"addition_embed_type": "text_time", "addition_time_embed_dim": 4, "projection_class_embeddings_input_dim": 6 * 4 + TEXT},
        lambda size: {"added_cond_kwargs": {"text_embeds": torch.randn(1, TEXT), "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64]])}},
    ),
    "addition text": ({"addition_embed_type": "text", "addition_embed_type_num_heads": 2}, lambda size: {}),
    "addition image": (
        {"addition_embed_type": "image", "encoder_hid_dim": 24},
        lambda size: {"_ehs_width": 24, "added_cond_kwargs": {"image_embeds": torch.randn(1, 24)}},
    ),
    "addition image_hint": (
        {"addition_embed_type": "image_hint", "encoder_hid_dim": 24, "in_channels": 8},
        lambda size: {
            "_ehs_width": 24,
            "added_cond_kwargs": {"image_embeds": torch.randn(1, 24), "hint": torch.randn(1, 3, 8 * size[0], 8 * size[1])},
        },
    ),
    "encoder_hid_dim text_proj": ({"encoder_hid_dim": 24, "encoder_hid_dim_type": "text_proj"}, lambda size: {"_ehs_width": 24}),
    "timestep_cond (LCM)": ({"time_cond_proj_dim": 8}, lambda size: {"timestep_cond": torch.randn(1, 8)}),
    "attention masks": (
        {},
        lambda size: {"encoder_attention_mask": torch.tensor([[1.0, 1, 1, 0, 0]])},
    ),
    "gligen": (
        {"attention_type": "gated"},
        lambda size: {
            "cross_attention_kwargs": {
                "gligen": {"boxes": torch.rand(1, 2, 4), "positive_embeddings": torch.randn(1, 2, TEXT), "masks": torch.ones(1, 2)}
            }
        },
    ),
    "center_input_sample": ({"center_input_sample": True}, lambda size: {}),
    "scale_shift resnets": ({"resnet_time_scale_shift": "scale_shift"}, lambda size: {}),
    "linear projection, 2 transformer layers": ({"use_linear_projection": True, "transformer_layers_per_block": 2}, lambda size: {}),
}


def _unet(changes: dict):
    return testing._tiny_unet(0, 2, **{**SHAPE, **changes})


@pytest.mark.parametrize("size", [(8, 8), (9, 7)])
@pytest.mark.parametrize("case", list(CASES))
def test_cached_step_on_the_full_steps_inputs_is_the_unets_own_output(case, size):
    changes, make_kwargs = CASES[case]
    unet = _unet(changes)
    torch.manual_seed(1)
    kwargs = make_kwargs(size)
    width = kwargs.pop("_ehs_width", TEXT)
    x, ehs = torch.randn(1, 4, *size), _ehs(width=width)
    with torch.no_grad():
        plain = unet(x, 500, ehs, **kwargs).sample
        branches = torchfix.deepcache.check(unet, DeepCacheConfig()).n_skips
        for branch in (0, branches // 2, branches - 1):
            torchfix.deepcache.apply(unet, DeepCacheConfig(interval=2, warm_up=False, branch=branch))
            try:
                torchfix.deepcache.new_call(unet)
                full = unet(x, 500, ehs, **kwargs).sample
                cached = unet(x, 500, ehs, **kwargs).sample
                assert torchfix.deepcache.stats(unet)["cached_steps"] == 1, case
            finally:
                torchfix.deepcache.remove(unet)
            assert torch.equal(full, plain)
            assert torch.equal(cached, plain), f"{case}, branch {branch}: max diff {(cached - plain).abs().max():.3g}"


def test_freeu_is_applied_in_cached_steps_as_the_unet_does():
    unet = _unet({})
    unet.enable_freeu(s1=0.9, s2=0.2, b1=1.2, b2=1.4)
    x, ehs = torch.randn(1, 4, 9, 7), _ehs()
    with torch.no_grad():
        plain = unet(x, 500, ehs).sample
        torchfix.deepcache.apply(unet, DeepCacheConfig(interval=2, warm_up=False, branch=1))
        try:
            torchfix.deepcache.new_call(unet)
            unet(x, 500, ehs)
            cached = unet(x, 500, ehs).sample
        finally:
            torchfix.deepcache.remove(unet)
    assert torch.equal(cached, plain)


def test_freeu_at_every_branch_leaves_the_kept_feature_as_it_was():
    """diffusers' FreeU scales what enters an up block's resnets in place (at resolutions 0 and 1): the full step's kept
    feature must not be scaled by it after it was kept, nor a cached step's reuse of it scale it for the next one.
    (Before: off by up to 0.1 at the branches that re-enter up_blocks.0 and .1, and more with each cached step.)"""
    unet = _unet({})
    unet.enable_freeu(s1=0.9, s2=0.2, b1=1.2, b2=1.4)
    x, ehs = torch.randn(1, 4, 9, 7), _ehs()
    with torch.no_grad():
        plain = unet(x, 500, ehs).sample
        for branch in range(torchfix.deepcache.check(unet, DeepCacheConfig()).n_skips):
            torchfix.deepcache.apply(unet, DeepCacheConfig(interval=3, warm_up=False, forecast=0, branch=branch))
            try:
                torchfix.deepcache.new_call(unet)
                outs = [unet(x, 500, ehs).sample for _ in range(3)]
                assert torchfix.deepcache.stats(unet)["cached_steps"] == 2
            finally:
                torchfix.deepcache.remove(unet)
            assert all(torch.equal(out, plain) for out in outs), branch


@pytest.mark.parametrize("scale", [0.5, 0.0])
def test_a_lora_scale_reaches_the_cached_step_as_the_unets_own_forward_takes_it(scale):
    """``cross_attention_kwargs={"scale": s}`` scales the PEFT LoRA layers in the cached step as the installed UNet's
    forward does (diffusers 0.37+ by its ``apply_lora_scale`` decorator, 0.35 and 0.36 inline), and the layers are
    left unscaled after it."""
    pytest.importorskip("peft")
    from peft import LoraConfig

    unet = _unet({})
    unet.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_lora_weights=False))
    x, ehs = torch.randn(1, 4, 9, 7), _ehs()
    kwargs = {"cross_attention_kwargs": {"scale": scale}}
    with torch.no_grad():
        plain, unscaled = unet(x, 500, ehs, **kwargs).sample, unet(x, 500, ehs).sample
        assert not torch.equal(plain, unscaled)  # the scale matters here
        torchfix.deepcache.apply(unet, DeepCacheConfig(interval=2, warm_up=False, branch=1))
        try:
            torchfix.deepcache.new_call(unet)
            unet(x, 500, ehs, **kwargs)
            cached = unet(x, 500, ehs, **kwargs).sample
            assert torchfix.deepcache.stats(unet)["cached_steps"] == 1
        finally:
            torchfix.deepcache.remove(unet)
        after = unet(x, 500, ehs).sample
    assert torch.equal(cached, plain)
    assert torch.equal(after, unscaled)  # the cached step put the layers' scale back
    assert kwargs == {"cross_attention_kwargs": {"scale": scale}}  # the caller's dict is left as it was
