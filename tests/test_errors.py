"""Every refusal torchfix raises is a ``torchfix.TorchfixError``; where it was a ``ValueError``/``TypeError``/``KeyError``
before, it still is one (no ``except`` in user code breaks)."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import torchfix

ROOT = pathlib.Path(torchfix.__file__).parent
BUILTIN = {"ValueError", "TypeError", "RuntimeError", "KeyError", "IndexError", "LookupError", "Exception"}
# Python protocols, not refusals: a module __getattr__, wrapt's "not initialised" probe, an internal signal caught at once.
PROTOCOL = ("has no attribute", "wrapper has not been initialised", "raise TypeError(type(tensors).__name__)")


def test_no_refusal_in_torchfix_raises_a_bare_builtin_exception():
    bare = []
    for path in sorted(ROOT.rglob("*.py")):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name):
                text = ast.get_source_segment(source, node) or ""
                if node.exc.func.id in BUILTIN and not any(p in text for p in PROTOCOL):
                    bare.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text[:80]}")
    assert not bare, "\n".join(bare)


@pytest.mark.parametrize(
    "make, old",
    [
        (lambda: torchfix.DeepCacheConfig(interval=0), ValueError),
        (lambda: torchfix.DeepCacheConfig(num_steps=True), ValueError),
        (lambda: torchfix.DeepCacheConfig(interval="2"), TypeError),
        (lambda: torchfix.enable("loud"), ValueError),
        (lambda: torchfix.Settings(dtype=torch.int8), ValueError),
        (lambda: torchfix.keep_dtype("unet"), TypeError),
        (lambda: torchfix.families.get("no-such-family"), KeyError),
        (lambda: torchfix.devices.canonical("gpu:x"), ValueError),
    ],
)
def test_each_refusal_is_a_torchfix_error_and_still_what_it_was(make, old):
    with pytest.raises(torchfix.TorchfixError) as info:
        make()
    assert isinstance(info.value, old) and isinstance(info.value, RuntimeError)
    assert str(info.value)


def test_the_error_classes_keep_their_old_bases():
    assert issubclass(torchfix.InvalidCallError, torchfix.InvalidArgumentError)
    assert issubclass(torchfix.InvalidCallError, ValueError) and issubclass(torchfix.errors.UnsupportedUNetError, torchfix.TorchfixError)
