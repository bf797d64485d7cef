"""Streams that change shape within one generation (Qwen-Image 2.1's KV cache: the first step prefills the text and
runs text and image tokens, later steps the image's alone): the step whose streams no longer fit what the cache kept
runs in full and the stream starts again there, never meeting a residual of another shape."""

from __future__ import annotations

import pytest
import torch

import torchfix

pytest.importorskip("diffusers")

from torchfix.testing.families import FAMILIES

KEY = "auto:QwenImage21Transformer2DModel"


def _run(model, tiny, kv: bool, steps: int = 8) -> torch.Tensor:
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    arguments = tiny.arguments()
    x = arguments["hidden_states"]
    cache = QwenImage21KVCache(len(model.transformer_blocks)) if kv else None
    with torch.no_grad():
        for i in range(steps):
            mode = ("extract" if i == 0 else "cached") if kv else None  # as QwenImage21Pipeline's loop
            with model.cache_context("cond"):
                out = model(
                    **{**arguments, "hidden_states": x},
                    timestep=torch.full((1,), 1 - i / steps),
                    kv_cache=cache,
                    kv_cache_mode=mode,
                    return_dict=False,
                )[0]
            x = x - out[:, -x.shape[1] :] / steps
    return x


def test_qwen_image_21_with_its_kv_cache_is_cached_after_the_prefill():
    tiny = FAMILIES[KEY]
    if (why := tiny.unavailable()) is not None:
        pytest.skip(why)
    model = tiny.build()
    plain = _run(model, tiny, kv=True)
    assert torch.equal(plain, _run(model, tiny, kv=False))  # the KV cache itself changes nothing
    torchfix.deepcache.apply(model, torchfix.DeepCacheConfig(interval=3, num_steps=8))
    try:
        cached = _run(model, tiny, kv=True)
        s = torchfix.deepcache.stats(model)["last_call"]
    finally:
        torchfix.deepcache.remove(model)
    # step 0 (the prefill) in full; step 1, cached by the schedule, meets streams of another shape: in full, and the
    # stream starts again there (then full at 2 and 5 as the warm-up schedule says)
    assert (s["full_steps"], s["cached_steps"]) == (4, 4)
    assert ((cached - plain).norm() / plain.norm()).item() < 0.05
