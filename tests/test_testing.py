"""torchfix.testing: the tiny offline pipelines the tests, the demo and the benchmarks build."""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers")

from torchfix import testing


def test_sd15_heads_reach_every_attention_block():
    one, four = testing.tiny_sd15_unet(heads=1), testing.tiny_sd15_unet()
    assert {m.heads for n, m in one.named_modules() if n.endswith(("attn1", "attn2"))} == {1}
    assert {m.heads for n, m in four.named_modules() if n.endswith(("attn1", "attn2"))} == {4}
    assert testing.tiny_sd15_pipeline(heads=1).unet.config.attention_head_dim == 1
