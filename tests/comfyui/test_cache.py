"""The cache on ComfyUI's own model classes: every ComfyUI entry of the family registry held to the registry's
guarantees (a cached step fed a full step's input returns its output; a signature other than the entry's is
refused before anything is cached), and the cache node through ComfyUI's sampler: any size in a row, cond and
uncond apart, ControlNet calls in full, LoRA clones, ComfyUI's own compile, fewer blocks run."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch

import torchfix
from torchfix import families
from torchfix.comfyui import TorchfixCache, report_text
from torchfix.testing import comfyui

MODELS = sorted(comfyui.MODELS)
CFG = torchfix.DeepCacheConfig(interval=3)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.fixture(params=MODELS)
def tiny(request):
    model = comfyui.tiny(request.param)
    yield model
    torchfix.deepcache.remove(model.diffusion_model)


def latent(tiny: comfyui.TinyComfy, batch: int = 1, seed: int = 5) -> torch.Tensor:
    return torch.randn(tiny.latent(*tiny.sizes[0], batch).shape, generator=torch.Generator().manual_seed(seed))


# ComfyUI classes cached through an entry read off their code (families.infer), not a registered one
INFERRED = {"auto:NextDiT", "auto:MiniTrainDIT", "auto:CameraWanModel", "auto:OmniGen2Transformer2DModel", "auto:PixArtMS"}


def test_every_comfyui_family_has_a_tiny_model():
    built = {families.resolve(comfyui.tiny(name).diffusion_model).name for name in comfyui.MODELS}
    registered = {name for name in families.names(builtin=True) if families.get(name).host == "comfyui"}
    assert built == registered | INFERRED and len(registered) == 11


def _diffusion_model_classes() -> dict[str, type]:
    """Every class ComfyUI's BaseModel subclasses build as their ``diffusion_model`` (comfy/model_base.py's
    ``unet_model=...``), by module path."""
    import inspect
    import re

    import comfy.model_base as base

    found = {}
    for cls in vars(base).values():
        if isinstance(cls, type) and issubclass(cls, base.BaseModel):
            for path in re.findall(r"unet_model\s*=\s*([A-Za-z_][\w.]*)", inspect.getsource(cls.__init__)):
                if path != "unet_model":
                    model = eval(path, vars(base))  # a name or dotted path of comfy.model_base's namespace
                    found[f"{model.__module__}.{model.__qualname__}"] = model
    return found


def _bare(cls: type) -> torch.nn.Module:
    """An instance of ``cls`` with nothing built (what a refusal by name needs: the class)."""
    model = cls.__new__(cls)
    torch.nn.Module.__init__(model)
    return model


def test_every_diffusion_model_class_of_comfyui_is_cached_or_refused_by_name():
    """Each class comfy/model_base.py builds is cached (a registry entry or one read off its code, each with a tiny
    model sampled by the tests here) or refused by the node with its name and the reason. A ComfyUI release with a
    class of its own fails here until it is one or the other."""
    classes = _diffusion_model_classes()
    tested = {type(comfyui.tiny(name).diffusion_model) for name in [*comfyui.MODELS, *comfyui.REFUSED]}
    unclassified = [path for path, cls in classes.items() if cls not in tested and families.refusal(cls) is None]
    assert not unclassified, unclassified
    assert len(classes) >= 29 and all(c in classes.values() for c in tested)  # the enumeration found what the tests build
    present = {c.__qualname__ for c in tested if families.refusal(c) is None} & {
        "HiDreamImageTransformer2DModel", "NextDiT", "MiniTrainDIT", "QwenImageTransformer2DModel"
    }  # fmt: skip
    assert len(present) == 4  # the classes that ComfyUI 0.3.64 has are cached
    absent = {"Flux2", "Kandinsky5", "ZImage", "HunyuanVideo15"}  # released after 0.3.64 (October 2025)
    assert not {path.rsplit(".", 1)[1] for path in classes} & absent


@pytest.mark.parametrize("path", sorted(families.entries.COMFY_REFUSED))
def test_the_node_refuses_a_refused_class_by_name_with_the_reason(path):
    from types import SimpleNamespace

    cls = _diffusion_model_classes()["comfy.ldm." + path]
    model = SimpleNamespace(model=SimpleNamespace(diffusion_model=_bare(cls)))
    title, why = families.entries.COMFY_REFUSED[path]
    with pytest.raises(torchfix.UnsupportedModelError) as caught:
        TorchfixCache().patch(model, 3, 0.0, 0)
    assert f"comfy.ldm.{path} ({title}) is not cached: {why}" in str(caught.value)


def test_wan_vace_is_refused_because_its_hints_would_be_added_twice():
    """Wan VACE adds its control hints to the stream in place between blocks (``x += c_skip * strength``): read off its
    code, that is refused by name. Cached through Wan's own entry, as before, a cached step fed a full step's input
    misses the full step's output by far: the hints come back through the cached residual and are added again."""
    tiny = comfyui.tiny("wan-vace")
    with pytest.raises(torchfix.UnsupportedModelError, match=r"VaceWanModel .*x is changed in place between blocks"):
        TorchfixCache().patch(tiny.patcher, 3, 0.0, 0)
    wan = families.get("comfy-wan")
    vace = dataclasses.replace(wan, name="test-vace-as-wan", classes=("comfy.ldm.wan.model.VaceWanModel",))
    families.register(vace)
    try:
        torchfix.deepcache.apply(tiny.diffusion_model, torchfix.DeepCacheConfig(interval=2, warm_up=False, forecast=0, stop=1.0))
        x = latent(tiny)
        first, cached = (tiny.call(x, 3.0) for _ in range(2))
        assert torchfix.deepcache.stats(tiny.diffusion_model)["cached_steps"] == 1 and rel(cached, first) > 0.05
    finally:
        torchfix.deepcache.remove(tiny.diffusion_model)
        families.unregister("test-vace-as-wan")


# Registered ComfyUI entries that code reading cannot reproduce, and what it says instead
WRITTEN_BY_HAND = {
    # the text stream takes a new name between blocks (as in diffusers' HiDream)
    "comfy-hidream": "initial_encoder_hidden_states, which it does not take",
    # its blocks name the text y (y_feat in the loop): two streams that read as image
    "comfy-mochi": r"carry no image stream: blocks \(streams x, y_feat",
    # its NeRF head's blocks are called two ways (whole, and per tile at large sizes)
    "comfy-chroma-radiance": "loop over nerf_blocks: its blocks are called in several ways",
}


def test_code_reading_finds_what_every_registered_comfyui_entry_says():
    """ComfyUI's own forwards read as their hand-written entries (through ``_forward``, ``forward_orig``, the
    ``patches_replace`` branch's ``block_wrap``), except where names hide the streams (:data:`WRITTEN_BY_HAND`);
    AuraFlow's double layers name text and image ``c`` and ``x``, so its single layers alone are read."""
    for name in comfyui.MODELS:
        model = comfyui.tiny(name).diffusion_model
        entry = families.find(model)
        if entry is None or entry.kind != "transformer":
            continue
        if entry.name in WRITTEN_BY_HAND:
            with pytest.raises(torchfix.UnsupportedModelError, match=WRITTEN_BY_HAND[entry.name]):
                families.infer(model)
            continue
        read = families.infer(model)
        assert (read.host, read.latent, read.prompt) == ("comfyui", "x", None), name
        if entry.name == "comfy-auraflow":
            assert read.blocks == entry.blocks[1:]
        else:
            assert read.blocks == entry.blocks, name


def test_interval_1_is_bit_identical_and_remove_restores_the_model(tiny):
    model = tiny.diffusion_model
    before = {n for n, m in model.named_modules() if "forward" in vars(m) or "_forward" in vars(m)}
    plain = comfyui.sample(tiny)
    (cached,) = TorchfixCache().patch(tiny.patcher, 1, 0.0, 0)
    assert torch.equal(comfyui.sample(tiny, cached), plain)
    assert "0 cached" in report_text(cached)
    torchfix.deepcache.remove(model)
    assert {n for n, m in model.named_modules() if "forward" in vars(m) or "_forward" in vars(m)} == before


def test_a_cached_step_fed_a_full_steps_input_returns_its_output(tiny):
    """Interval 2, no warm-up, no forecast: the second of two identical calls is cached and must return the first's
    output. Flux's blocks update their streams in place: a cache that kept a reference to what entered a run
    instead of a copy returns a residual of zero here."""
    torchfix.deepcache.apply(tiny.diffusion_model, torchfix.DeepCacheConfig(interval=2, warm_up=False, forecast=0, stop=1.0))
    x = latent(tiny)
    first, cached, full, cached_again = (tiny.call(x, 3.0) for _ in range(4))  # the first full step verifies the blocks
    assert torchfix.deepcache.stats(tiny.diffusion_model)["cached_steps"] == 2
    assert rel(cached, first) < 1e-5 and rel(cached_again, full) < 1e-5


def test_cond_and_uncond_run_as_separate_calls_keep_their_own_cache(tiny):
    torchfix.deepcache.apply(tiny.diffusion_model, CFG)
    torchfix.deepcache.new_call(tiny.diffusion_model)
    x = latent(tiny)
    both = [[tiny.call(x * (1 - i / 10), 3.0 - i / 3, seed=p, passes=[p]) for p in (0, 1)] for i in range(6)]
    stats = torchfix.deepcache.stats(tiny.diffusion_model)
    assert len(stats["last_call"]["streams"]) == 2 and stats["last_call"]["cached_steps"] > 0
    torchfix.deepcache.apply(tiny.diffusion_model, CFG)
    torchfix.deepcache.new_call(tiny.diffusion_model)
    alone = [tiny.call(x * (1 - i / 10), 3.0 - i / 3, seed=0, passes=[0]) for i in range(6)]
    assert all(torch.equal(a[0], b) for a, b in zip(both, alone))


def test_a_controlnet_call_runs_in_full(tiny):
    """ComfyUI adds ControlNet residuals to the blocks' outputs in place, between blocks: such a call cannot be cached."""
    torchfix.deepcache.apply(tiny.diffusion_model, torchfix.DeepCacheConfig(interval=2, warm_up=False, forecast=0, stop=1.0))
    x = latent(tiny)
    tiny.call(x, 3.0)
    tiny.call(x, 3.0, control={"input": [], "middle": [], "output": []})
    assert torchfix.deepcache.stats(tiny.diffusion_model)["cached_steps"] == 0


def test_the_node_at_two_sizes_in_a_row_equals_a_fresh_cache(tiny):
    (cached,) = TorchfixCache().patch(tiny.patcher, 3, 0.0, 0)
    comfyui.sample(tiny, cached)
    height, width = tiny.sizes[1]  # 120x168 px: odd sizes down the UNet, as 720x960 is
    odd = comfyui.sample(tiny, cached, height=height, width=width, seed=2)
    (fresh,) = TorchfixCache().patch(tiny.patcher, 3, 0.0, 0)
    assert torch.equal(odd, comfyui.sample(tiny, fresh, height=height, width=width, seed=2))
    assert "cached" in report_text(fresh) and " 0 cached" not in report_text(fresh)


def test_the_node_runs_fewer_blocks_and_stays_close(tiny):
    with comfyui.BlockCounter(tiny.diffusion_model) as plain_blocks:
        plain = comfyui.sample(tiny, steps=8)
    (cached,) = TorchfixCache().patch(tiny.patcher, 3, 0.0, 0)
    with comfyui.BlockCounter(tiny.diffusion_model) as cached_blocks:
        out = comfyui.sample(tiny, cached, steps=8)
    assert cached_blocks.calls < 0.8 * plain_blocks.calls, (cached_blocks.calls, plain_blocks.calls)
    assert torch.isfinite(out).all() and rel(out, plain) < 0.25
    assert torch.equal(comfyui.sample(tiny, steps=8), plain)  # the MODEL the node was given: untouched


def test_a_lora_clone_of_the_cached_model_keeps_the_cache_and_its_own_weights(tiny):
    (cached,) = TorchfixCache().patch(tiny.patcher, 3, 0.0, 0)
    key, weight = next((k, w) for k, w in tiny.patcher.model.state_dict().items() if k.endswith(".weight") and w.ndim == 2)
    lora = cached.clone()
    lora.add_patches({key: (torch.full_like(weight, 0.01),)}, 1.0)
    with_lora = comfyui.sample(tiny, lora)
    assert "cached" in report_text(lora) and " 0 cached" not in report_text(lora)
    again = comfyui.sample(tiny, cached)
    (fresh,) = TorchfixCache().patch(tiny.patcher, 3, 0.0, 0)
    assert torch.equal(again, comfyui.sample(tiny, fresh))  # the LoRA's generation left nothing behind
    assert not torch.equal(with_lora, again)


def test_a_signature_other_than_the_entrys_is_refused_before_anything_is_cached():
    tiny = comfyui.tiny("flux")
    family = families.find(tiny.diffusion_model)
    plain = comfyui.sample(tiny)
    first = family.blocks[0]
    wrong = dataclasses.replace(first, returns=tuple(reversed(first.returns)))
    try:
        families.register(dataclasses.replace(family, blocks=(wrong, *family.blocks[1:])), replace=True)
        (cached,) = TorchfixCache().patch(tiny.patcher, 3, 0.0, 0)
        with pytest.raises(torchfix.UnsupportedModelError, match="Flux"):
            comfyui.sample(tiny, cached)
        assert torchfix.deepcache.stats(tiny.diffusion_model)["cached_steps"] == 0
    finally:
        families.register(family, replace=True)
        torchfix.deepcache.remove(tiny.diffusion_model)
    assert torch.equal(comfyui.sample(tiny), plain)


# ComfyUI's own compile of a tiny model takes 30-40 s on 2 cores (most of it its own graph breaks): make test compiles
# the UNet (its cached steps are torchfix's own code, traced); TORCHFIX_COMFYUI_COMPILE_ALL=1 adds Flux (its graph
# breaks leave blocks as frames of their own, past dynamo's recompile limit: what the order check must tolerate).
COMPILED = ["sd15", "flux"] if os.environ.get("TORCHFIX_COMFYUI_COMPILE_ALL") == "1" else ["sd15"]


@pytest.mark.slow
@pytest.mark.parametrize("name", COMPILED)
def test_the_cache_composes_with_comfyuis_compile(name):
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    tiny = comfyui.tiny(name)
    (cached,) = TorchfixCache().patch(tiny.patcher, 3, 0.0, 0)
    eager = comfyui.sample(tiny, cached)
    compiled = cached.clone()
    set_torch_compile_wrapper(compiled, backend="eager")
    try:
        out = comfyui.sample(tiny, compiled)
        assert "cached" in report_text(compiled) and " 0 cached" not in report_text(compiled)
        assert rel(out, eager) < 1e-5
    finally:
        torchfix.deepcache.remove(tiny.diffusion_model)
        torch._dynamo.reset()


# --- what a cached step calls --------------------------------------------------------------------------------------

TRANSFORMERS = [name for name in MODELS if name not in ("sd15", "sdxl")]


class BlockHooks:
    """Forward hooks on every block of a model's family lists: how often each block's module call ran."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        self.handles = [b.register_forward_hook(self._count) for b in comfyui.blocks_of(model)]

    def _count(self, *_) -> None:
        self.calls += 1

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _unswapped(monkeypatch) -> None:
    """The cached step as it was before the skipped blocks left the call path: every block called, its installed
    forward standing in (what runs under torch.compile, and for diffusers' transformers)."""
    import importlib

    blocks = importlib.import_module("torchfix.deepcache.blocks")
    monkeypatch.setattr(blocks, "_shadows", lambda state, chain, path: None)


def _cached_and_called(tiny: Any, monkeypatch: Any, interval: int, threshold: float, steps: int) -> tuple:
    """One sampling run cached as this round does (skipped blocks out of the call path), then one as before (every
    block called, its installed forward standing in): both outputs, the cache's stats, the block hooks that fired
    and the blocks that computed in the first run, and the hooks that fired in the second."""
    hooks = BlockHooks(tiny.diffusion_model)
    try:
        (cached,) = TorchfixCache().patch(tiny.patcher, interval, threshold, 0)
        with comfyui.BlockCounter(tiny.diffusion_model) as computed:
            out = comfyui.sample(tiny, cached, steps=steps)
        stats, fired = torchfix.deepcache.stats(tiny.diffusion_model), hooks.calls
        assert not any("double_blocks" in vars(m) or "blocks" in vars(m) for m in tiny.diffusion_model.modules())  # put back
        _unswapped(monkeypatch)
        hooks.calls = 0
        (before,) = TorchfixCache().patch(tiny.patcher, interval, threshold, 0)
        with comfyui.BlockCounter(tiny.diffusion_model) as computed_before:
            old = comfyui.sample(tiny, before, steps=steps)
        assert computed_before.calls == computed.calls
        return out, old, stats, fired, computed.calls, hooks.calls
    finally:
        hooks.remove()
        torchfix.deepcache.remove(tiny.diffusion_model)


@pytest.mark.parametrize("name", TRANSFORMERS)
def test_a_cached_step_calls_no_skipped_block(name, monkeypatch):
    """Under ComfyUI's sampler a block's forward hooks fire exactly where the block computed: on a cached step the
    skipped blocks are not called at all. The result is bit-identical to the cached step that called every block and
    let its installed forward hand the input on, which fired the hooks of every block on every step."""
    out, old, stats, fired, computed, fired_before = _cached_and_called(comfyui.tiny(name), monkeypatch, 3, 0.0, 8)
    assert stats["cached_steps"] > 0 and fired == computed, (fired, computed)
    assert torch.equal(out, old) and fired_before > computed


def test_a_threshold_step_decided_at_the_first_cached_block_calls_only_what_computes(monkeypatch):
    """With a refresh threshold the features entering the first cached block decide the step: the stand-in decides,
    and where the step turns full it calls the block (hooks and all), so the hooks still fire exactly where a block
    computed, and the result equals the cached steps that called every block."""
    out, old, stats, fired, computed, _ = _cached_and_called(comfyui.tiny("flux"), monkeypatch, 4, 0.05, 10)
    assert stats["cached_steps"] > 0 and stats["full_steps"] > 4 and fired == computed
    assert torch.equal(out, old)


def test_a_block_list_is_put_back_when_the_call_raises():
    tiny = comfyui.tiny("flux")
    model = tiny.diffusion_model
    torchfix.deepcache.apply(model, torchfix.DeepCacheConfig(interval=2, warm_up=False, forecast=0, stop=1.0))
    x = latent(tiny)
    tiny.call(x, 3.0)  # full: verifies the chain
    lists = (model.double_blocks, model.single_blocks)

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    handle = model.final_layer.register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            tiny.call(x, 3.0)  # cached: raises inside the forward, after the blocks
        assert (model.double_blocks, model.single_blocks) == lists and "double_blocks" not in vars(model)
    finally:
        handle.remove()
        torchfix.deepcache.remove(model)


# --- ComfyUI's block patches (transformer_options["patches_replace"]["dit"], ["patches"]["double_block"]) -------------


class AddToBlock:
    """A PuLID-style ``patches_replace["dit"]`` entry: calls the block, adds a constant (one value per channel: a
    layer norm would take away one value for all) to the image stream it returns, and counts its calls."""

    def __init__(self, value: float = 0.5) -> None:
        self.value, self.calls = value, 0

    def __call__(self, args: dict, extra: dict) -> dict:
        self.calls += 1
        out = extra["original_block"](args)
        img = out["img"]
        return {**out, "img": img + self.value * torch.linspace(-1.0, 1.0, img.shape[-1], dtype=img.dtype)}


class SkipBlock:
    """ComfyUI's SkipLayerGuidanceDiT patch (comfy_extras/nodes_slg.py): the block is not called at all."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, args: dict, extra: dict) -> dict:
        self.calls += 1
        return args


def _patched(patcher, patch, kind: str, index: int):
    clone = patcher.clone()
    clone.set_model_patch_replace(patch, "dit", kind, index)
    return clone


@pytest.mark.parametrize("name, kind, index", [("flux", "double_block", 1), ("flux", "single_block", 0), ("wan", "double_block", 2)])
def test_a_call_with_a_block_patch_on_a_skipped_block_runs_in_full(name, kind, index):
    """A patch on a block a cached step would skip: every such call runs as without the cache, so the patch runs
    exactly as often as in the plain workflow and the result is the plain one, bit for bit (a cached step would add
    PuLID's term again on top of a residual that holds it); it is said once."""
    tiny = comfyui.tiny(name)
    plain_patch = AddToBlock()
    plain = comfyui.sample(tiny, _patched(tiny.patcher, plain_patch, kind, index), steps=8)
    (cached,) = TorchfixCache().patch(tiny.patcher, 3, 0.0, 0)
    patch = AddToBlock()
    try:
        with pytest.warns(torchfix.TorchfixWarning, match=rf"block patches .* \(.*{index}.*\)\. Such calls run in full"):
            out = comfyui.sample(tiny, _patched(cached, patch, kind, index), steps=8)
        assert patch.calls == plain_patch.calls > 0 and torch.equal(out, plain)
        assert torchfix.deepcache.stats(tiny.diffusion_model)["last_call"]["cached_steps"] == 0
        unpatched = comfyui.sample(tiny, steps=8)
        assert rel(plain, unpatched) > 1e-3  # the patch does change the picture
        again = comfyui.sample(tiny, cached, steps=8)  # the same cache without the patch: cached as before
        assert torchfix.deepcache.stats(tiny.diffusion_model)["last_call"]["cached_steps"] > 0 and rel(again, unpatched) < 0.25
    finally:
        torchfix.deepcache.remove(tiny.diffusion_model)


def test_a_patch_on_a_block_that_always_runs_is_applied_on_every_step_and_the_rest_cached():
    """A patch on a block a cached step runs (``keep_first``) runs on every call, once, as in the plain workflow, and
    the other blocks are cached, once a call without patches has verified the call path (until then a patched call
    runs in full: which blocks a cached step skips is known from the verified chain)."""
    tiny = comfyui.tiny("flux")
    config = torchfix.DeepCacheConfig(interval=3, keep_first=1)
    plain_patch, patch = AddToBlock(), AddToBlock()
    plain = comfyui.sample(tiny, _patched(tiny.patcher, plain_patch, "double_block", 0), steps=8)
    torchfix.deepcache.apply(tiny.diffusion_model, config)
    try:
        comfyui.sample(tiny, steps=2)  # verifies the call path
        out = comfyui.sample(tiny, _patched(tiny.patcher, patch, "double_block", 0), steps=8)
        assert torchfix.deepcache.stats(tiny.diffusion_model)["last_call"]["cached_steps"] > 0
        assert patch.calls == plain_patch.calls > 0 and rel(out, plain) < 0.25
    finally:
        torchfix.deepcache.remove(tiny.diffusion_model)


def test_a_patch_added_after_the_chain_was_verified_runs_and_is_not_cached_through():
    """The chain is verified per call path (argument names): a patch added later rides the same path. The call that
    carries it runs in full (the patch called once, the output the plain model's with the patch); the next call
    without it is cached from the residual kept before."""
    tiny = comfyui.tiny("flux")
    model = tiny.diffusion_model
    torchfix.deepcache.apply(model, torchfix.DeepCacheConfig(interval=3, warm_up=False, forecast=0, stop=1.0))
    x = latent(tiny)
    patch = AddToBlock()
    dit = {"patches_replace": {"dit": {("single_block", 1): patch}}}
    try:
        first = tiny.call(x, 3.0)  # full: verifies
        with pytest.warns(torchfix.TorchfixWarning, match="Such calls run in full"):
            with_patch = tiny.call(x, 3.0, **dit)  # would be cached: runs in full, patched
        assert patch.calls == 1
        cached = tiny.call(x, 3.0)
        stats = torchfix.deepcache.stats(model)
        assert stats["cached_steps"] == 1 and rel(cached, first) < 1e-5
    finally:
        torchfix.deepcache.remove(model)
    assert torch.equal(with_patch, tiny.call(x, 3.0, **dit)) and patch.calls == 2  # the plain model with the patch


def test_a_skip_layer_patch_runs_in_full_without_tripping_the_chain_checks():
    """ComfyUI's own SkipLayerGuidanceDiT patch leaves its block out; with the cache such a call runs as without it
    (before, a verified chain saw a block missing and refused the model)."""
    tiny = comfyui.tiny("flux")
    model = tiny.diffusion_model
    torchfix.deepcache.apply(model, torchfix.DeepCacheConfig(interval=2, warm_up=False, forecast=0, stop=1.0))
    x = latent(tiny)
    skip = SkipBlock()
    slg = {"patches_replace": {"dit": {("double_block", 1): skip, ("single_block", 2): skip}}}
    try:
        tiny.call(x, 3.0)
        with pytest.warns(torchfix.TorchfixWarning, match="Such calls run in full"):
            out = [tiny.call(x, 3.0, **slg) for _ in range(3)]
        assert skip.calls == 6
    finally:
        torchfix.deepcache.remove(model)
    plain = tiny.call(x, 3.0, **slg)
    assert all(torch.equal(o, plain) for o in out)


def test_a_patch_between_blocks_runs_in_full():
    """Qwen-Image's ``patches["double_block"]`` (ComfyUI's DiffSynth ControlNet patch) runs after every block; a
    cached step would add it again to what the cached residual holds: such calls run in full."""
    tiny = comfyui.tiny("qwenimage")
    calls = []

    def after_block(args: dict) -> dict:
        calls.append(args["block_index"])
        return {"img": args["img"] + 0.05, "txt": args["txt"]}

    plain_clone = tiny.patcher.clone()
    plain_clone.set_model_double_block_patch(after_block)
    plain = comfyui.sample(tiny, plain_clone, steps=6)
    plain_calls, calls[:] = list(calls), []
    (cached,) = TorchfixCache().patch(tiny.patcher, 3, 0.0, 0)
    clone = cached.clone()
    clone.set_model_double_block_patch(after_block)
    try:
        with pytest.warns(torchfix.TorchfixWarning, match="Such calls run in full"):
            out = comfyui.sample(tiny, clone, steps=6)
        assert calls == plain_calls and torch.equal(out, plain)
    finally:
        torchfix.deepcache.remove(tiny.diffusion_model)
