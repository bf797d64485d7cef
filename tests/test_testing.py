"""torchfix.testing: the tiny offline pipelines the tests, the demo and the benchmarks build."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from torchfix import testing


def test_sd15_heads_reach_every_attention_block():
    one, four = testing.tiny_sd15_unet(heads=1), testing.tiny_sd15_unet()
    assert {m.heads for n, m in one.named_modules() if n.endswith(("attn1", "attn2"))} == {1}
    assert {m.heads for n, m in four.named_modules() if n.endswith(("attn1", "attn2"))} == {4}
    assert testing.tiny_sd15_pipeline(heads=1).unet.config.attention_head_dim == 1


def test_builders_leave_the_global_rng_and_no_temp_dirs_behind(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    pipe = testing.tiny_sd15_pipeline()
    testing.tiny_sd3_pipeline(layers=1)
    assert torch.equal(torch.rand(3), expected)  # the caller's random stream is untouched
    assert list(tmp_path.iterdir()) == []  # the tokenizer's files are gone once it is built
    assert pipe.tokenizer("a cat").input_ids[0] == pipe.tokenizer.bos_token_id
    again = testing.tiny_sd15_pipeline()
    assert all(torch.equal(a, b) for a, b in zip(pipe.unet.parameters(), again.unet.parameters()))  # still seeded


def test_flops_count_attention_on_the_cpu_flash_path():
    import torch.nn.functional as F

    from torchfix.testing import flops

    q = torch.randn(1, 2, 16, 8)
    assert flops(lambda: F.scaled_dot_product_attention(q, q, q)) == 4 * 2 * 16 * 16 * 8  # torch's counter alone: 0
    assert flops(lambda: torch.randn(2, 3) @ torch.randn(3, 4)) == 2 * 2 * 3 * 4


def test_flops_equal_torchs_flop_counter_on_the_demos_pipelines():
    """The lean count (no module tracking, no decomposition) adds up to FlopCounterMode's, cached steps included."""
    from torch.utils.flop_counter import FlopCounterMode

    import torchfix
    from torchfix import testing

    def counted(run):
        mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: testing._cpu_flash_flops}
        with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
            run()
        return int(counter.get_total_flops())

    pipe = testing.tiny_sdxl_pipeline()
    pipe.set_progress_bar_config(disable=True)

    def generate():
        return testing.latents(pipe, steps=4, size=(64, 96))

    assert testing.flops(generate) == counted(generate) > 0
    torchfix.deepcache.apply(pipe, torchfix.DeepCacheConfig(interval=3, branch=0))
    try:
        assert testing.flops(generate) == counted(generate) > 0
    finally:
        torchfix.deepcache.remove(pipe)


def test_the_t5_tokenizer_builds_offline_with_the_same_ids_on_every_transformers():
    """transformers 4.57's ``T5Tokenizer`` needs a sentencepiece file, 5.x's builds from a vocabulary: the builder
    gives one tokenizer on both (these ids are 5.x's ``T5Tokenizer(vocab=...)``'s)."""
    tokenizer = testing.t5_tokenizer()
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    assert len(tokenizer) == testing.tiny_t5_encoder().config.vocab_size
    assert tokenizer("a cat").input_ids == [39, 3, 39, 5, 3, 22, 1]  # ▁ a ▁ c a t </s>
    assert tokenizer("A cat!", padding="max_length", max_length=8).input_ids == [39, 2, 39, 5, 3, 22, 2, 1]  # unknowns: <unk>
    assert tokenizer.batch_decode(tokenizer(["a cat"]).input_ids, skip_special_tokens=True) == ["a cat"]
