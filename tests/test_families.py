"""The family registry: one entry per model family, looked up by class, loud on duplicates."""

from __future__ import annotations

import pytest
import torch

import torchfix
from torchfix import families
from torchfix.families import Blocks, Family


def test_every_builtin_entry_is_well_formed():
    for name in families.names(builtin=True):
        family = families.get(name)
        assert family.name == name and family.classes and family.title
        for blocks in family.blocks:
            assert "image" in blocks.inputs and set(blocks.returns) == set(blocks.inputs)
        assert family.describe()


def test_lookup_is_by_class_or_its_bases():
    class Custom(torch.nn.Module):
        pass

    Custom.__name__ = "WanTransformer3DModel"
    assert families.find(Custom()) is families.get("wan")

    class Subclass(Custom):  # a user's subclass of a registered model is the same family (its blocks are checked anyway)
        pass

    assert families.find(Subclass) is families.get("wan")
    assert families.find(torch.nn.Linear(2, 2)) is None


def test_registering_is_loud_on_a_taken_name_or_class():
    with pytest.raises(ValueError, match="registered already"):
        families.register(Family("wan", "again", ("SomethingElse",), blocks=(Blocks("blocks", {"image": "x"}, ("image",)),)))
    with pytest.raises(ValueError, match="already belongs to family 'wan'"):
        families.register(Family("wan-copy", "again", ("WanTransformer3DModel",), blocks=(Blocks("blocks", {"image": "x"}, ("image",)),)))
    with pytest.raises(ValueError, match="must be the streams taken"):
        Blocks("blocks", {"image": "x"}, ("image", "text"))
    with pytest.raises(KeyError, match="no family 'nope'"):
        families.get("nope")


def test_the_error_for_an_unknown_model_is_a_torchfix_error_and_a_value_error_under_both_names():
    assert torchfix.UnsupportedModelError is torchfix.deepcache.UnsupportedUNetError
    assert issubclass(torchfix.UnsupportedModelError, torchfix.TorchfixError)
    assert issubclass(torchfix.UnsupportedModelError, ValueError)
    with pytest.raises(torchfix.TorchfixError, match=r"Linear is not a model family torchfix knows.*Wan 2\.1/2\.2"):
        torchfix.deepcache.apply(torch.nn.Linear(2, 2))


def test_supported_lists_every_family_with_its_title():
    text = families.supported()
    for name in families.names(builtin=True):
        assert f"({name})" in text
