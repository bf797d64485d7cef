"""torchfix.wrap: preflight, stale embeddings, model switching, component replacement, unwrap."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch

import torchfix

pytest.importorskip("diffusers")

from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

from torchfix.testing import latents, tiny_sd15_pipeline, tiny_sd15_unet, tiny_sdxl_pipeline

CFG = torchfix.DeepCacheConfig(interval=3, branch=0)


def run(pipe, prompt="a cat", seed=0, steps=6, size=(64, 64), **kw):
    return latents(pipe, prompt, steps=steps, size=size, seed=seed, **kw)


def snapshot(pipe):
    """Everything unwrap must leave as it was: instance attributes and hooks of every module."""
    state = {"pipe": sorted(vars(pipe))}
    for name, comp in pipe.components.items():
        if isinstance(comp, torch.nn.Module):
            for path, m in comp.named_modules():
                state[f"{name}.{path}"] = (sorted(vars(m)), dict(m._forward_hooks), dict(m._forward_pre_hooks))
        elif comp is not None:
            state[name] = sorted(vars(comp))
    return state


def test_proxy_passes_through_and_never_touches_the_class():
    pipe = tiny_sd15_pipeline()
    other = tiny_sd15_pipeline()
    ref = run(pipe)
    w = torchfix.wrap(pipe)
    assert isinstance(w, StableDiffusionPipeline) and w.unet is pipe.unet and w.vae_scale_factor == pipe.vae_scale_factor
    assert torch.equal(run(w), ref)  # valid pipeline: bit-identical
    assert type(pipe).__call__ is StableDiffusionPipeline.__call__ and "__call__" not in vars(other)
    assert torch.equal(run(other), ref)
    assert w.unwrap() is pipe


def test_sd35_incident_through_sdxl_text_projection():
    pipe = tiny_sdxl_pipeline().to(torch.bfloat16)
    pipe.text_encoder_2.text_projection.to(torch.float16)  # the stray layer
    with pytest.raises(RuntimeError, match="dtype"):
        run(pipe, steps=2)
    strict = torchfix.wrap(pipe, mode="strict")
    findings = strict.preflight()
    stray = [f for f in findings if f.component == "text_encoder_2.text_projection"]
    assert len(stray) == 1 and not stray[0].applied and "torch.float16" in stray[0].problem
    with pytest.raises(torchfix.DtypeMismatchError, match=r"text_encoder_2\.text_projection"):
        run(strict, steps=2)
    assert pipe.text_encoder_2.text_projection.weight.dtype == torch.float16  # strict changed nothing
    strict.unwrap()

    w = torchfix.wrap(pipe)
    out = run(w, steps=2)  # preflight runs before the first call
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    applied = [f for f in w.findings if f.component == "text_encoder_2.text_projection"]
    assert applied and applied[0].applied and "cast to torch.bfloat16 once" in applied[0].fix
    assert pipe.text_encoder_2.text_projection.weight.dtype == torch.bfloat16  # fixed once, up front
    # nothing left to fix per call (diffusers' own bf16+fp32 concat in get_aug_embed is still reported)
    assert not [e for e in torchfix.report().events if e.op == "F.linear"]
    w.unwrap()


def test_keep_in_fp32_modules_are_respected():
    pipe = tiny_sd15_pipeline()
    pipe.text_encoder._keep_in_fp32_modules = ["final_layer_norm"]
    pipe.to(torch.bfloat16)
    path = next(n for n, _ in pipe.text_encoder.named_modules() if n.endswith("final_layer_norm"))
    norm = pipe.text_encoder.get_submodule(path)
    norm.to(torch.float32)
    findings = torchfix.wrap(pipe).preflight()
    kept = [f for f in findings if f.component == f"text_encoder.{path}"]
    assert kept and kept[0].applied and "_keep_in_fp32_modules" in kept[0].fix
    assert norm.weight.dtype == torch.float32
    del pipe.text_encoder._keep_in_fp32_modules


def test_meta_weights_are_found_before_running():
    pipe = tiny_sd15_pipeline()
    with torch.device("meta"):
        pipe.unet.conv_out = torch.nn.Conv2d(8, 4, 3, padding=1)
    w = torchfix.wrap(pipe)
    findings = w.preflight()
    assert any(f.component == "unet" and "unet.conv_out.weight" in f.problem and "meta" in f.problem for f in findings)
    with pytest.raises(torchfix.DeviceMismatchError, match=r"unet\.conv_out\.weight"):
        run(w)


@pytest.mark.parametrize("guidance", [7.5, 1.0])
def test_stale_embeddings_from_another_model(guidance):
    sdxl = tiny_sdxl_pipeline()
    embeds, negative, pooled, negative_pooled = sdxl.encode_prompt("a cat", do_classifier_free_guidance=True)
    sd15 = tiny_sd15_pipeline()
    kwargs = {"prompt_embeds": embeds, "guidance_scale": guidance}
    if guidance > 1:
        kwargs["negative_prompt_embeds"] = negative
    with pytest.raises(RuntimeError, match="cannot be multiplied"):  # what plain diffusers says, mid-run
        sd15(num_inference_steps=2, height=64, width=64, output_type="latent", **kwargs)
    w = torchfix.wrap(sd15)
    with pytest.raises(torchfix.ModelMismatchError) as info:
        w(num_inference_steps=2, height=64, width=64, output_type="latent", **kwargs)
    msg = str(info.value)
    assert "prompt_embeds" in msg and "width 64" in msg and "cross_attention_dim=32" in msg and "another model" in msg
    # and the other direction, for SDXL's pooled embeddings
    xw = torchfix.wrap(sdxl)
    with pytest.raises(torchfix.ModelMismatchError, match="pooled_prompt_embeds"):
        xw(prompt_embeds=embeds, pooled_prompt_embeds=pooled[:, :16], negative_prompt_embeds=negative,
           negative_pooled_prompt_embeds=negative_pooled, num_inference_steps=2, height=64, width=64, output_type="latent")  # fmt: skip


def test_mismatched_components_are_a_preflight_error():
    pipe = tiny_sd15_pipeline()
    pipe.unet = tiny_sd15_unet(cross_attention_dim=48)
    with pytest.raises(torchfix.ModelMismatchError, match="cross_attention_dim=48"):
        run(torchfix.wrap(pipe))


FRESH = """
import sys, torch
from torchfix.testing import {builder}
import torchfix
pipe = {builder}()
w = torchfix.wrap(pipe, deepcache=torchfix.DeepCacheConfig(interval=3, branch=0))
out = w("a cat", num_inference_steps=6, height=64, width=64, output_type="latent", generator=torch.Generator().manual_seed(0)).images
torch.save(out, sys.argv[1])
"""


def _fresh(builder, tmp_path):
    path = tmp_path / f"{builder}.pt"
    env = {k: v for k, v in os.environ.items() if k != "TORCHFIX_MODE"}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(FRESH.format(builder=builder)), str(path)],
                       capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return torch.load(path)


def test_switch_sd15_sdxl_sd15_matches_fresh_processes(tmp_path):
    outs = []
    refs = []
    for builder in (tiny_sd15_pipeline, tiny_sdxl_pipeline, tiny_sd15_pipeline):
        pipe = builder()
        refs.append(weakref.ref(pipe.unet))
        w = torchfix.wrap(pipe, deepcache=CFG)
        outs.append(run(w))
        w.unwrap()
        del w, pipe
        gc.collect()
    assert all(r() is None for r in refs)  # every old UNet is garbage after unwrap
    fresh15, freshxl = _fresh("tiny_sd15_pipeline", tmp_path), _fresh("tiny_sdxl_pipeline", tmp_path)
    assert torch.equal(outs[0], fresh15) and torch.equal(outs[2], fresh15) and torch.equal(outs[1], freshxl)


def test_replacing_a_component_invalidates_its_state():
    pipe = tiny_sd15_pipeline()
    w = torchfix.wrap(pipe, deepcache=CFG)
    run(w)
    old = pipe.unet
    assert torchfix.deepcache.state_of(old) is not None
    w.unet = tiny_sd15_unet(seed=1)  # passes through to the pipeline
    assert pipe.unet is w.unet is not old
    out = run(w)
    assert torchfix.deepcache.state_of(old) is None and "forward" not in vars(old)
    assert torchfix.deepcache.state_of(pipe.unet) is not None
    fresh = tiny_sd15_pipeline()
    fresh.unet = tiny_sd15_unet(seed=1)
    torchfix.deepcache.apply(fresh, CFG)
    assert torch.equal(out, run(fresh))
    torchfix.deepcache.remove(fresh)
    w.unwrap()


def test_unwrap_leaves_the_pipeline_exactly_as_before():
    pipe = tiny_sdxl_pipeline()
    run(pipe, steps=2)  # transformers adds its own hooks lazily on the first forward
    before = snapshot(pipe)
    forwards = {n: type(c).forward for n, c in pipe.components.items() if isinstance(c, torch.nn.Module)}
    w = torchfix.wrap(pipe, deepcache=CFG, mode="warn")
    run(w, steps=4)
    assert w.unwrap() is pipe
    assert snapshot(pipe) == before
    for n, c in pipe.components.items():
        if isinstance(c, torch.nn.Module):
            assert c.forward.__func__ is forwards[n]
    from torchfix import _frames

    assert not any(m in _frames._ROOT_NAMES for m in pipe.components.values() if isinstance(m, torch.nn.Module))


def test_event_module_paths_use_component_names():
    pipe = tiny_sdxl_pipeline()
    w = torchfix.wrap(pipe, mode="fix")
    w.preflight()  # names the components
    x = torch.randn(1, 5, 32, dtype=torch.bfloat16)
    with torchfix.enabled():
        pipe.text_encoder_2.text_projection(x)
    assert [e.module for e in torchfix.report().events] == ["text_encoder_2.text_projection"]
    w.unwrap()


@pytest.mark.parametrize("how", ["cpu_offload", "cpu_offload_with_hook", "dispatch_model"])
def test_accelerate_offload_hooks_are_not_flagged(how):
    accelerate = pytest.importorskip("accelerate")
    pipe = tiny_sd15_pipeline()
    ref = run(pipe)
    cpu = torch.device("cpu")
    if how == "cpu_offload":  # what enable_sequential_cpu_offload uses: weights on meta, hooks load them
        accelerate.cpu_offload(pipe.unet, execution_device=cpu)
        assert any(p.device.type == "meta" for p in pipe.unet.parameters())
    elif how == "cpu_offload_with_hook":  # what enable_model_cpu_offload uses
        for name in ("text_encoder", "unet", "vae"):
            accelerate.cpu_offload_with_hook(getattr(pipe, name), execution_device=cpu)
    else:  # accelerate device_map hooks
        accelerate.dispatch_model(pipe.unet, device_map={"": "cpu"}, force_hooks=True)
    w = torchfix.wrap(pipe, deepcache=torchfix.DeepCacheConfig(interval=1))
    assert not [f for f in w.preflight() if "meta" in f.problem]
    assert torch.equal(run(w), ref)
    w.unwrap()


def test_bad_arguments():
    with pytest.raises(TypeError, match="DiffusionPipeline"):
        torchfix.wrap(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="DeepCacheConfig"):
        torchfix.wrap(tiny_sd15_pipeline(), deepcache={"interval": 3})
    assert isinstance(torchfix.wrap(torchfix.wrap(tiny_sd15_pipeline())), StableDiffusionPipeline)


def test_sdxl_isinstance():
    assert isinstance(torchfix.wrap(tiny_sdxl_pipeline()), StableDiffusionXLPipeline)
