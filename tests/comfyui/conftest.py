"""ComfyUI's own source (../shared/vendor, or $TORCHFIX_COMFYUI), imported into the worker at the first test here;
every test here is skipped, with the reason printed, where it is absent or does not import (a user's machine
without it)."""

from __future__ import annotations

import pytest

from torchfix.testing import comfyui


def pytest_collection_modifyitems(config, items):
    here = [item for item in items if "tests/comfyui/" in str(item.fspath).replace("\\", "/")]
    if here and comfyui.find_source() is None:
        why = "no ComfyUI source: set TORCHFIX_COMFYUI or put ComfyUI-<version>.tar.gz in ../shared/vendor"
        print(f"\ntests/comfyui skipped: {why}")
        for item in here:
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(autouse=True)
def _comfyui_imported():
    nodes, why = comfyui.load()
    if nodes is None:
        pytest.skip(why)
