"""Classes the registry refuses whatever their code reads like (torchfix.families.refuse): refused at apply with the
reason, nothing cached; an entry registered for the class wins; a subclass is not refused for its base."""

from __future__ import annotations

import pytest
import torch

import torchfix
from torchfix import families

diffusers = pytest.importorskip("diffusers")

CFG = torchfix.DeepCacheConfig(interval=3, num_steps=8)
# diffusers' own test sizes (tests/models/transformers/test_models_prior.py, test_models_transformer_temporal.py)
BUILT = {
    "Transformer2DModel": (
        {"num_attention_heads": 2, "attention_head_dim": 4, "in_channels": 4, "num_layers": 2, "norm_num_groups": 2},
        "building block",
    ),
    "TransformerTemporalModel": (
        {"num_attention_heads": 2, "attention_head_dim": 4, "in_channels": 4, "num_layers": 2, "norm_num_groups": 2},
        "building block",
    ),
    "PriorTransformer": (
        {
            "num_attention_heads": 2,
            "attention_head_dim": 4,
            "num_layers": 2,
            "embedding_dim": 8,
            "num_embeddings": 7,
            "additional_embeddings": 4,
        },
        "learned query token",
    ),
}


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return getattr(diffusers, name)(**BUILT[name][0]).eval()


@pytest.mark.parametrize("name", sorted(BUILT))
def test_refused_at_apply_with_the_reason_and_nothing_cached(name):
    model = build(name)
    assert families.refusal(model) is not None and families.find(model) is None
    with pytest.raises(torchfix.UnsupportedModelError, match=rf"{name} .*{BUILT[name][1]}.*torchfix\.families\.register"):
        torchfix.deepcache.apply(model, CFG)
    assert torchfix.deepcache.stats(model) == {"applied": False}
    assert not [m for m in model.modules() if "forward" in vars(m)]


def test_an_entry_registered_for_a_refused_class_wins():
    model = build("Transformer2DModel")
    entry = families.Family(
        "my-t2d",
        "a Transformer2DModel of my own",
        ("Transformer2DModel",),
        blocks=(families.Blocks("transformer_blocks", {"image": "hidden_states"}, ("image",)),),
    )
    families.register(entry)
    try:
        assert families.resolve(model) is entry
    finally:
        families.unregister("my-t2d")
    with pytest.raises(torchfix.UnsupportedModelError, match="building block"):
        families.resolve(model)


def test_a_subclass_is_not_refused_for_its_base():
    class MyTransformer(diffusers.Transformer2DModel):
        pass

    torch.manual_seed(0)
    model = MyTransformer(**BUILT["Transformer2DModel"][0])
    assert families.refusal(model) is None
    assert families.resolve(model).name == "auto:MyTransformer"  # read off its (inherited) code, verified on its first call
