from __future__ import annotations

import pytest

pytest.importorskip("diffusers")

from torchfix.testing import latents, tiny_sd15_pipeline, tiny_sdxl_pipeline


@pytest.fixture(scope="module")
def sd15():
    return tiny_sd15_pipeline()


@pytest.fixture(scope="module")
def sdxl():
    return tiny_sdxl_pipeline()


@pytest.fixture(autouse=True)
def _no_deepcache_left(request):
    yield
    import torchfix

    for name in ("sd15", "sdxl"):
        if name in request.fixturenames:
            pipe = request.getfixturevalue(name)
            torchfix.deepcache.remove(pipe)
            assert "forward" not in vars(pipe.unet)


def generate(pipe, prompt="a cat", seed=0, steps=10, size=(64, 64), **kwargs):
    return latents(pipe, prompt, steps=steps, size=size, seed=seed, **kwargs)
