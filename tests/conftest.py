"""Every test starts and ends with torchfix off and nothing patched."""

from __future__ import annotations

import os

os.environ["TORCHFIX_MODE"] = "off"  # tests switch torchfix on themselves

import pytest
import torch

import torchfix
from torchfix import _context
from torchfix.config import OFF
from torchfix.patches import ALL as PATCHES

# Under pytest-xdist (make test: two workers on two cores) each worker takes one thread; alone, up to two.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))

ORIGINALS = {p.label: getattr(p.owner, p.name) for p in PATCHES}


def leaked() -> list[str]:
    return [p.label for p in PATCHES if getattr(p.owner, p.name) is not ORIGINALS[p.label] or p.installed]


@pytest.fixture(autouse=True)
def _no_leaks():
    assert not leaked(), f"patches leaked into this test: {leaked()}"
    torchfix.report().clear()
    from torchfix import runtime

    runtime.reset_warnings()
    yield
    torchfix.disable()
    still = leaked()
    state_ok = _context.get_global() is OFF and _context.scoped.get() is None
    assert not still, f"patches left installed after the test: {still}"
    assert state_ok, "torchfix state left on after the test"


@pytest.fixture
def fix_mode():
    """torchfix switched on process-wide in fix mode for the test, off after it."""
    torchfix.disable()
    torchfix.enable("fix")
    try:
        yield
    finally:
        torchfix.disable()


# `make test-quick` (-m "not slow") leaves out what takes seconds a test: compiling (torch.compile), subprocesses
# (the CLI, the examples, the pytest plugin, fresh interpreters), ComfyUI's sampler, several processes; the rest,
# every guard, the cache's logic and wrap, runs. `make test` runs everything.
_SLOW_MODULES = ("tests/cli/", "tests/comfyui/", "tests/test_examples.py", "tests/test_pytest_plugin.py", "tests/test_seed_clip.py")
_SLOW_NAMES = ("compil", "fresh_process", "subprocess", "data_parallel", "context_parallel")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = item.nodeid.split("::")[0]
        if path.startswith(_SLOW_MODULES) or any(s in item.name for s in _SLOW_NAMES):
            item.add_marker(pytest.mark.slow)
