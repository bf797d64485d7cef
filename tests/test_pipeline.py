"""torchfix.wrap: preflight, stale embeddings, model switching, component replacement, unwrap."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import warnings
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
    """Everything unwrap must leave as it was: instance attributes, hooks, and the dtype, device
    and very data (storage pointer) of every parameter and buffer of every module."""
    state = {"pipe": sorted(vars(pipe))}
    for name, comp in pipe.components.items():
        if isinstance(comp, torch.nn.Module):
            for path, m in comp.named_modules():
                tensors = {
                    n: (t.dtype, t.device, t.data_ptr(), tuple(t.shape))
                    for n, t in (*m._parameters.items(), *m._buffers.items())
                    if t is not None
                }
                state[f"{name}.{path}"] = (sorted(vars(m)), dict(m._forward_hooks), dict(m._forward_pre_hooks), tensors)
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
    stray = pipe.text_encoder_2.text_projection.weight
    original = stray.data
    with pytest.raises(RuntimeError, match="dtype"):
        run(pipe, steps=2)
    strict = torchfix.wrap(pipe, mode="strict")
    assert not [f for f in strict.preflight() if "text_projection" in f.component]  # dtypes are learned from torch, not guessed
    with pytest.raises(torchfix.DtypeMismatchError, match=r"text_encoder_2\.text_projection"):
        run(strict, steps=2)
    assert stray.dtype == torch.float16 and stray.data_ptr() == original.data_ptr()  # strict changed nothing
    strict.unwrap()

    w = torchfix.wrap(pipe)
    with warnings.catch_warnings():
        warnings.simplefilter("error", torchfix.TorchfixWarning)  # fix mode: recorded, not warned
        first = run(w, steps=2)  # the guards cast the stray weights per call, then wrap casts them once
    assert first.dtype == torch.bfloat16 and torch.isfinite(first.float()).all()
    applied = [f for f in w.findings if f.component == "text_encoder_2.text_projection"]
    assert applied and applied[0].applied and "cast to torch.bfloat16 once" in applied[0].fix and "kept for unwrap()" in applied[0].fix
    assert stray.dtype == torch.bfloat16 and w.kept_bytes == original.numel() * 2
    wrap_events = [e for e in torchfix.report().events if e.op == "torchfix.wrap"]
    assert [(e.module, e.action) for e in wrap_events] == [("text_encoder_2.text_projection", "cast")]
    assert "weight float16→bfloat16" in wrap_events[0].detail
    torchfix.report().clear()
    second = run(w, steps=2)
    assert torch.equal(second, first)  # the one-time cast is the per-call cast: bit-identical
    assert not [e for e in torchfix.report().events if e.op == "F.linear"]  # nothing left to fix per call
    assert w.unwrap() is pipe
    assert stray.dtype == torch.float16 and stray.data_ptr() == original.data_ptr()  # the very original tensor is back


def test_warn_mode_warns_about_the_one_time_cast():
    pipe = tiny_sdxl_pipeline().to(torch.bfloat16)
    pipe.text_encoder_2.text_projection.to(torch.float16)
    w = torchfix.wrap(pipe, mode="warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(w, steps=2)
    msgs = [str(m.message) for m in caught if issubclass(m.category, torchfix.TorchfixWarning)]
    assert any("torchfix.wrap cast text_encoder_2.text_projection.weight from float16 to bfloat16" in m for m in msgs), msgs
    w.unwrap()


def assert_never_a_finding_or_a_change(pipe, mode, run):
    """``wrap(pipe, mode=mode)`` flags nothing and changes nothing (no cast, no event, no warning), its output is
    plain torch's, bit for bit, and ``unwrap()`` leaves the pipeline as it was."""
    plain = run(pipe)
    before = snapshot(pipe)
    w = torchfix.wrap(pipe, mode=mode)
    assert w.preflight() == []
    with warnings.catch_warnings():
        warnings.simplefilter("error", torchfix.TorchfixWarning)
        assert torch.equal(run(w), plain)
    assert w.findings == [] and snapshot(pipe) == before and w.kept_bytes == 0
    assert not [e for e in torchfix.report().events if e.action != "noted"]
    w.unwrap()
    assert snapshot(pipe) == before


@pytest.mark.parametrize("mode", ["off", "fix", "warn", "strict"])
def test_deliberate_precision_is_never_a_finding_or_a_change(mode):
    """A bf16 pipeline whose norms stay float32 (diffusers' and transformers' _keep_in_fp32_modules): torch runs it."""
    pipe = tiny_sd15_pipeline()
    pipe.text_encoder._keep_in_fp32_modules = ["final_layer_norm"]
    pipe.to(torch.bfloat16)
    for m in (*pipe.text_encoder.modules(), *pipe.unet.modules()):
        if isinstance(m, (torch.nn.LayerNorm, torch.nn.GroupNorm)):
            m.to(torch.float32)
    assert_never_a_finding_or_a_change(pipe, mode, lambda p: run(p, steps=2))
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
torch.set_num_threads({threads})  # the test process's (a pytest-xdist worker has one): bit-identical needs the same
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
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(FRESH.format(builder=builder, threads=torch.get_num_threads())), str(path)],
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


def test_a_deepcache_branch_the_unet_lacks_is_refused_at_wrap():
    pipe = tiny_sd15_pipeline()
    with pytest.raises(ValueError, match=r"wrap\(deepcache=DeepCacheConfig\(.*branch=99.*has \d+ skip connections \(branch 0\.\.\d+\)"):
        torchfix.wrap(pipe, deepcache=torchfix.DeepCacheConfig(branch=99))
    assert torchfix.deepcache.state_of(pipe) is None  # nothing applied


def test_deepcache_on_a_pipeline_without_a_supported_denoiser_is_an_error_not_a_silent_no_op():
    class OddLike:  # a pipeline whose transformer has no block chain DeepCache knows
        transformer = torch.nn.Linear(2, 2)

    with pytest.raises(torchfix.deepcache.UnsupportedUNetError, match=r"Linear is not a model family torchfix knows"):
        torchfix.deepcache.check(OddLike(), torchfix.DeepCacheConfig())


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_device_this_machine_lacks_is_refused_at_wrap():
    with pytest.raises(ValueError, match=r"wrap\(device='cuda:0'\): that device cannot be used here: no CUDA device"):
        torchfix.wrap(tiny_sd15_pipeline(), device="cuda:0")
    assert torchfix.wrap(tiny_sd15_pipeline(), device="cpu:0") is not None


def test_sdxl_isinstance():
    assert isinstance(torchfix.wrap(tiny_sdxl_pipeline()), StableDiffusionXLPipeline)


@pytest.mark.parametrize(
    "bad, named",
    [
        ({"height": 0}, "height=0"),
        ({"width": -64}, "width=-64"),
        ({"num_inference_steps": 0}, "num_inference_steps=0"),
        ({"num_inference_steps": -1}, "num_inference_steps=-1"),
        ({"num_images_per_prompt": 0}, "num_images_per_prompt=0"),
    ],
)
def test_arguments_that_cannot_make_a_picture_are_refused_before_step_0(bad, named):
    """diffusers 0.42.1 runs height=0 silently, runs num_inference_steps=-1 without denoising and divides by zero
    in DDIM at 0: wrap() refuses each before the denoiser runs, naming the argument."""
    pipe = tiny_sd15_pipeline()
    calls = []
    pipe.unet.register_forward_pre_hook(lambda *a: calls.append(1))
    w = torchfix.wrap(pipe)
    kwargs = {"num_inference_steps": 4, "height": 64, "width": 64, "output_type": "latent", **bad}
    with pytest.raises(torchfix.InvalidCallError, match=named) as caught:
        w("a cat", **kwargs)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, torchfix.TorchfixError)
    assert calls == []
    w("a cat", num_inference_steps=2, height=64, width=64, output_type="latent")  # a good call still runs
    assert calls


def test_calls_from_several_threads_run_in_turn_and_each_returns_what_a_lone_call_returns():
    """One wrapped pipeline with DeepCache called from 3 threads at once: before, 6 of 6 outputs differed from
    serial runs (the calls shared the scheduler, the cache's streams and the hooks); now they take turns."""
    import threading

    pipe = tiny_sd15_pipeline()
    w = torchfix.wrap(pipe, deepcache=torchfix.DeepCacheConfig(interval=3))
    jobs = [("a cat", 0), ("a dog", 1), ("a bird", 2)]
    serial = [latents(w, p, steps=6, seed=seed) for p, seed in jobs]
    got: dict[int, torch.Tensor] = {}
    start = threading.Barrier(len(jobs))

    def run_one(i: int) -> None:
        start.wait()
        got[i] = latents(w, jobs[i][0], steps=6, seed=jobs[i][1])

    threads = [threading.Thread(target=run_one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert all(torch.equal(got[i], serial[i]) for i in range(len(jobs)))
    assert torchfix.deepcache.stats(pipe)["generations"] == 2 * len(jobs)


def sdxl_without_its_text_encoders():
    """SDXL with both text encoders (and tokenizers) dropped to save memory, its embeddings computed beforehand with
    the encoders loaded (diffusers' documented pattern): the pipeline and the four embeddings."""
    full = tiny_sdxl_pipeline()
    with torch.no_grad():
        embeds = full.encode_prompt("a cat", device="cpu", num_images_per_prompt=1, negative_prompt="ugly")
    pipe = StableDiffusionXLPipeline(
        vae=full.vae, unet=full.unet, scheduler=full.scheduler, text_encoder=None, text_encoder_2=None, tokenizer=None, tokenizer_2=None
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe, dict(zip(("prompt_embeds", "negative_prompt_embeds", "pooled_prompt_embeds", "negative_pooled_prompt_embeds"), embeds))


def positive(embeds):
    return {k: v for k, v in embeds.items() if not k.startswith("negative")}


@pytest.mark.parametrize(
    "call",
    [
        lambda e: e,  # all four embeddings, classifier-free guidance (guidance_scale 5.0, the default)
        lambda e: {**positive(e), "guidance_scale": 1.0},  # no guidance: no negative needed
        lambda e: positive(e),  # guidance without a negative prompt: force_zeros_for_empty_prompt makes zeros of it
    ],
    ids=["all-four", "no-guidance", "zeros-for-empty"],
)
def test_sdxl_without_its_text_encoders_runs_precomputed_embeddings_exactly_as_plainly(call):
    pipe, embeds = sdxl_without_its_text_encoders()
    kwargs = call(embeds)
    plain = run(pipe, None, steps=2, **kwargs)
    w = torchfix.wrap(pipe)
    assert torch.equal(run(w, None, steps=2, **kwargs), plain)
    (info,) = w.findings  # the missing encoder is information, never a refusal of the pipeline
    assert info.advisory and info.component == "unet" and "there is no text_encoder_2" in info.problem
    assert "refused before it runs" in info.fix and not torchfix.report().events


@pytest.mark.parametrize(
    "call, says",
    [
        (lambda e: {"prompt": "a cat"}, r"StableDiffusionXLPipeline\(prompt='a cat'\) would encode the prompt with tokenizer_2 and "
         r"text_encoder_2, but the pipeline has no tokenizer_2 or text_encoder_2 \(it was loaded with tokenizer_2=None, "
         r"text_encoder_2=None\).*Pass prompt_embeds= and pooled_prompt_embeds= instead of prompt="),
        (lambda e: {**positive(e), "negative_prompt": "ugly"}, r"with guidance_scale=5.0 \(classifier-free guidance\) and no "
         r"negative_prompt_embeds would encode the negative prompt with tokenizer_2 and text_encoder_2.*Pass "
         r"negative_prompt_embeds= and negative_pooled_prompt_embeds= as well, leave negative_prompt out .*, or guidance_scale=1"),
    ],
    ids=["prompt", "negative-prompt"],
)  # fmt: skip
def test_sdxl_without_its_text_encoders_refuses_a_call_that_needs_one_before_it_runs(call, says):
    pipe, embeds = sdxl_without_its_text_encoders()
    kwargs = call(embeds)
    prompt = kwargs.pop("prompt", None)
    with pytest.raises((AttributeError, TypeError)):  # plain diffusers: inside encode_prompt, on the missing tokenizer
        run(pipe, prompt, steps=2, **kwargs)
    calls = []
    pipe.unet.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(torchfix.InvalidCallError, match=says):
        run(torchfix.wrap(pipe), prompt, steps=2, **kwargs)
    assert calls == []


def test_without_zeros_for_an_empty_prompt_guidance_needs_the_negative_embeddings():
    pipe, embeds = sdxl_without_its_text_encoders()
    pipe.register_to_config(force_zeros_for_empty_prompt=False)  # diffusers then encodes "" as the negative prompt
    says = r"Pass negative_prompt_embeds= and negative_pooled_prompt_embeds= as well, or guidance_scale=1"
    with pytest.raises(torchfix.InvalidCallError, match=says) as info:
        run(torchfix.wrap(pipe), None, steps=2, **positive(embeds))
    assert "leave negative_prompt out" not in str(info.value)
    plain = run(pipe, None, steps=2, **embeds)
    assert torch.equal(run(torchfix.wrap(pipe), None, steps=2, **embeds), plain)


def test_sd15_without_its_text_encoder_runs_embeddings_and_refuses_a_prompt():
    full = tiny_sd15_pipeline()
    with torch.no_grad():
        embeds, negative = full.encode_prompt("a cat", "cpu", 1, True, negative_prompt="ugly")
    pipe = StableDiffusionPipeline(**{**full.components, "text_encoder": None, "tokenizer": None}, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    kwargs = {"prompt_embeds": embeds, "negative_prompt_embeds": negative}
    plain = run(pipe, None, steps=2, **kwargs)
    assert torch.equal(run(torchfix.wrap(pipe), None, steps=2, **kwargs), plain)
    with pytest.raises(torchfix.InvalidCallError, match=r"would encode the negative prompt with tokenizer and text_encoder"):
        run(torchfix.wrap(pipe), None, steps=2, prompt_embeds=embeds)  # guidance 7.5: SD1.5 encodes "" as the negative
    with pytest.raises(torchfix.InvalidCallError, match=r"StableDiffusionPipeline\(prompt='a cat'\) would encode the prompt"):
        run(torchfix.wrap(pipe), steps=2)
