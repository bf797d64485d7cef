"""Every docstring example in the package runs as written (an example that rots fails here, as two in the
cache's schedule had)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import torchfix

MODULES = sorted(m.name for m in pkgutil.walk_packages(torchfix.__path__, "torchfix.") if not m.name.endswith("__main__"))


def test_the_package_has_examples_to_run():
    finder = doctest.DocTestFinder()
    examples = sum(len(t.examples) for name in MODULES for t in finder.find(importlib.import_module(name)))
    assert examples > 100


@pytest.mark.parametrize("name", MODULES)
def test_the_docstring_examples_run(name):
    module = importlib.import_module(name)
    filtering = torchfix.traceback_filtering()
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False, report=False)
    where = name.replace(".", "/")
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (pytest --doctest-modules {where}.py)"
    assert torchfix.traceback_filtering() == filtering, f"{name}'s examples left traceback filtering changed"
