"""diffusers' bugs around the denoiser (torchfix.guards.library_issues) and their patches: in force where the row
says, installed with torchfix (or when diffusers is imported after it), gone after disable()."""

from __future__ import annotations

import os
import sys

import pytest

import torchfix
from torchfix.guards import library_issues

pytest.importorskip("diffusers")


def test_the_cpu_build_row_and_its_patch_come_and_go_with_torchfix():
    import diffusers
    from diffusers.models.modeling_utils import ModelMixin
    from packaging.version import Version

    row = library_issues.ROWS[0]
    in_force, why = library_issues.explain(row, diffusers.__version__)
    assert in_force == (library_issues.cpu_build() and Version(diffusers.__version__) >= Version("0.42.0")), why
    assert not library_issues.explain(row, "0.35.0")[0]
    assert not library_issues.explain(row, "0.41.0")[0]  # torch.cpu.device_count() (1) there: no ZeroDivisionError
    was_on = torchfix.status().enabled
    torchfix.disable()
    try:
        raw = vars(ModelMixin).get("_resolve_parallel_config")  # diffusers 0.41+
        assert getattr(raw, "__torchfix_patch__", None) is None  # torchfix off: diffusers' own
        torchfix.enable()
        patched = vars(ModelMixin).get("_resolve_parallel_config")
        assert (getattr(patched, "__torchfix_patch__", None) is not None) == in_force
        assert ("diffusers ModelMixin._resolve_parallel_config" in torchfix.status().patched) == in_force
        torchfix.disable()
        assert vars(ModelMixin).get("_resolve_parallel_config") is raw
    finally:
        if was_on:
            torchfix.enable()


def test_the_patch_waits_for_diffusers_to_be_imported():
    """torchfix enabled first, diffusers imported after (the usual script): patched on import, in a fresh process."""
    import subprocess

    code = (
        "import torchfix, sys; assert 'diffusers.models.modeling_utils' not in sys.modules; "
        "from diffusers.models.modeling_utils import ModelMixin as M; "
        "p = vars(M).get('_resolve_parallel_config'); "
        "import diffusers; from torchfix.guards.library_issues import CP_ON_CPU, explain; "
        "assert (getattr(p, '__torchfix_patch__', None) is not None) == explain(CP_ON_CPU, diffusers.__version__)[0]; "
        "torchfix.disable(); assert getattr(vars(M).get('_resolve_parallel_config'), '__torchfix_patch__', None) is None; print('ok')"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCHFIX_MODE"}  # the default: `import torchfix` enables
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_every_autoencoder_decode_is_patched_on_import_and_put_back_by_disable():
    """import torchfix, then diffusers (a fresh process): each autoencoder class's own decode is wrapped as its module
    loads, and after disable() every one ``is`` diffusers' function again."""
    import subprocess

    code = (
        "import torchfix, sys, inspect; assert 'diffusers' not in sys.modules; "
        "import diffusers; from diffusers import AutoencoderKL, AutoencoderKLWan, AutoencoderKLQwenImage; "
        "classes = [AutoencoderKL, AutoencoderKLWan, AutoencoderKLQwenImage]; "
        "assert all(getattr(vars(c)['decode'], '__torchfix_patch__', None) is not None for c in classes); "
        "originals = [vars(c)['decode'].__torchfix_patch__.original for c in classes]; "
        "torchfix.disable(); "
        "assert all(getattr(vars(c)['decode'], '__torchfix_patch__', None) is None for c in classes); "
        # diffusers' own: before 0.42 its apply_forward_hook wrapper, whose __module__ is diffusers.utils.accelerate_utils
        "assert all(vars(c)['decode'] is o and o.__module__.startswith('diffusers.') for c, o in zip(classes, originals)); "
        "print('ok')"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCHFIX_MODE"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def _overflowing_fp16_pipeline():
    import torch

    from torchfix.testing import tiny_sd15_pipeline, tiny_vae

    pipe = tiny_sd15_pipeline().to(torch.float16)
    vae = tiny_vae()
    with torch.no_grad():
        vae.decoder.conv_in.weight.mul_(2e5)  # activations beyond fp16's range (why SDXL's VAE is kept fp32)
    pipe.vae = vae.half()
    return pipe


def _image(pipe):
    import torch

    generator = torch.Generator().manual_seed(0)
    return pipe("a cat", num_inference_steps=2, height=64, width=64, output_type="pt", generator=generator).images


def test_a_non_finite_fp16_decode_is_rescued_under_import_torchfix():
    import torch

    pipe = _overflowing_fp16_pipeline()
    assert not torch.isfinite(_image(pipe)).all()  # plain: a black (NaN) image
    latents = pipe(
        "a cat", num_inference_steps=2, height=64, width=64, output_type="latent", generator=torch.Generator().manual_seed(0)
    ).images
    with torchfix.enabled():
        image = _image(pipe)
        decoded = pipe.vae.decode(latents / pipe.vae.config.scaling_factor, return_dict=False)[0]
    assert torch.isfinite(image).all() and all(p.dtype == torch.float16 for p in pipe.vae.parameters())  # the VAE unchanged
    reference = pipe.vae.float().decode(latents.float() / pipe.vae.config.scaling_factor).sample  # the maintainers': fp32
    pipe.vae.half()
    assert decoded.dtype == torch.float16 and (decoded.float() - reference).abs().max() <= 2e-3
    events = [e for e in torchfix.report().events if e.module.endswith(".decode")]
    assert events and events[0].module == "vae.decode" and "re-ran in float32" in events[0].detail
    with torchfix.enabled(mode="strict"), pytest.raises(torchfix.NonFiniteError, match=r"vae\.decode in float16"):
        _image(pipe)
    with torchfix.enabled(guards=("device", "stride")):  # the dtype guard turned off: as plain diffusers
        assert not torch.isfinite(_image(pipe)).all()


def test_a_finite_decode_is_bit_identical_under_import_torchfix():
    import torch

    from torchfix.testing import tiny_sd15_pipeline

    pipe = tiny_sd15_pipeline().to(torch.float16)
    plain = _image(pipe)
    with torchfix.enabled():
        assert torch.equal(_image(pipe), plain)
    assert not torchfix.report().events
