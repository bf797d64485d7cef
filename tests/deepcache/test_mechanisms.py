"""The mechanism table (torchfix.deepcache.mechanisms): every family has one, and a config that sets an option its
model's mechanism does not have is refused at apply (it was ignored silently), or left out loudly by auto()."""

from __future__ import annotations

import pytest

import torchfix
from torchfix import families
from torchfix.deepcache import mechanisms

pytest.importorskip("diffusers")

from torchfix.testing.families import FAMILIES, denoise


def test_every_registered_family_has_a_mechanism():
    for name in families.names():
        family = families.get(name)
        assert mechanisms.of(family).name in ("unet", "comfyui-unet", "blocks"), name


@pytest.mark.parametrize(
    "key, option, owner",
    [
        ("wan", {"branch": 5}, "unet"),
        ("sd15", {"keep_first": 3}, "blocks"),
        ("sd15", {"sensitivity": 0.5}, "blocks"),
        ("sd15", {"revise": True}, "blocks"),
    ],
)
def test_an_option_of_another_mechanism_is_refused_at_apply(key, option, owner):
    tiny = FAMILIES[key]
    model = tiny.build()
    name, value = next(iter(option.items()))
    with pytest.raises(torchfix.InvalidArgumentError, match=rf"{name}={value!r} set, but {type(model).__name__}.*belongs to .*{owner}"):
        torchfix.deepcache.apply(model, torchfix.DeepCacheConfig(**option))
    assert torchfix.deepcache.stats(model) == {"applied": False}


def test_an_option_of_the_models_own_mechanism_is_taken():
    model = FAMILIES["wan"].build()
    torchfix.deepcache.apply(model, torchfix.DeepCacheConfig(keep_first=1, num_steps=8))
    try:
        denoise(model, FAMILIES["wan"])
        assert "keep_first=1" in torchfix.deepcache.stats(model)["blocks"]
    finally:
        torchfix.deepcache.remove(model)


def test_auto_leaves_another_mechanisms_option_out_loudly():
    from torchfix.deepcache.api import at_loop_start
    from torchfix.testing import tiny_flux_pipeline

    pipe = tiny_flux_pipeline()
    previous = torchfix.deepcache.auto(torchfix.DeepCacheConfig(interval=3, branch=2))
    try:
        with pytest.warns(torchfix.TorchfixWarning, match=r"branch=2 left out for FluxPipeline"):
            at_loop_start(pipe)
        assert torchfix.deepcache.state_of(pipe.transformer).config.branch == 0
    finally:
        torchfix.deepcache.auto(previous)
        torchfix.deepcache.remove(pipe)


def test_each_mechanisms_options_are_the_config_fields_it_owns_with_their_defaults():
    import dataclasses

    from torchfix.deepcache.config import DeepCacheConfig

    defaults = {f.name: f.default for f in dataclasses.fields(DeepCacheConfig)}
    owned = [f.name for m in (mechanisms.UNetOptions, mechanisms.BlocksOptions) for f in dataclasses.fields(m)]
    assert len(owned) == len(set(owned))  # one owner per option
    for options in (mechanisms.UNetOptions, mechanisms.BlocksOptions):
        for f in dataclasses.fields(options):
            assert f.name in defaults and f.default == defaults[f.name], f.name
    assert set(mechanisms.OWN_OPTIONS) == set(owned)
    config = DeepCacheConfig(branch=2, keep_first=1, revise=False)
    assert mechanisms.UNET.options.of(config) == mechanisms.UNetOptions(branch=2)
    assert mechanisms.BLOCKS.options.of(config) == mechanisms.BlocksOptions(keep_first=1, revise=False)


def test_the_state_holds_its_mechanisms_options_as_applied():
    model = FAMILIES["wan"].build()
    state = torchfix.deepcache.apply(model, torchfix.DeepCacheConfig(keep_first=1))
    try:
        assert isinstance(state.options, mechanisms.BlocksOptions) and state.options.keep_first == 1
        assert state.options.keep_last == state.config.keep_last  # filled in for the family, as the state's config
    finally:
        torchfix.deepcache.remove(model)
