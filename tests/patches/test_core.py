"""Patch mechanics: by handle, reversible, never stacked, polite to others."""

from __future__ import annotations

import types

import pytest
import torch

import torchfix
from torchfix.patches import PATCHES, Patch


def test_round_trip_on_module_and_inherited_attribute():
    ns = types.SimpleNamespace(f=len)
    p = Patch(ns, "f", "ns.f", lambda orig: lambda x: orig(x) * 10)
    p.install()
    p.install()  # idempotent: no wrapper over a wrapper
    assert ns.f("abc") == 30
    p.remove()
    assert ns.f is len

    class Base:
        def g(self):
            return 1

    class Child(Base):
        pass

    q = Patch(Child, "g", "Child.g", lambda orig: lambda self: orig(self) + 1)
    q.install()
    assert Child().g() == 2 and "g" in vars(Child)
    q.remove()
    assert "g" not in vars(Child) and Child.g is Base.g


def test_someone_patching_after_us_is_left_alone():
    ns = types.SimpleNamespace(f=len)
    p = Patch(ns, "f", "ns.f", lambda orig: lambda x: orig(x))
    p.install()
    theirs = lambda x: 0  # noqa: E731
    ns.f = theirs
    with pytest.warns(torchfix.TorchfixWarning, match="replaced by someone else"):
        p.remove()
    assert ns.f is theirs and not p.installed


def test_wrappers_carry_spec_and_original():
    torchfix.enable()
    for p in PATCHES:
        wrapper = getattr(p.owner, p.name)
        assert wrapper.__wrapped__ is p.original
        assert wrapper.__torchfix_spec__.name in p.label or p.label.endswith(p.name)


def test_tensor_subclasses_and_torch_function_still_dispatch():
    class Tagged(torch.Tensor):
        pass

    a = torch.randn(2, 2).as_subclass(Tagged)
    with torchfix.enabled():
        out = a @ torch.randn(2, 2)
        assert type(out) is Tagged
        assert type(torch.cat([a, a])) is Tagged


def test_non_tensor_arguments_reach_torch_unchanged():
    with torchfix.enabled():
        with pytest.raises(TypeError):
            torch.matmul(torch.randn(2, 2), [[1.0, 2.0], [3.0, 4.0]])
        assert (torch.randn(2, 2) @ torch.eye(2)).shape == (2, 2)
    with pytest.raises((RuntimeError, ValueError)) as plain:
        torch.cat([])
    with torchfix.enabled(), pytest.raises((RuntimeError, ValueError)) as guarded:
        torch.cat([])  # torch's own error, unchanged
    assert type(guarded.value) is type(plain.value) and str(guarded.value) == str(plain.value)
