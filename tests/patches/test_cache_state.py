"""diffusers' cache hooks after an interrupted call (torchfix.guards.library_issues, the cache row): the next call with
latents of another size runs as a fresh one under torchfix (diffusers resets them only at the end of a call)."""

from __future__ import annotations

import pytest
import torch

import torchfix

pytest.importorskip("diffusers")

import diffusers

from torchfix.testing import tiny_flux_pipeline


def _configs():
    steps = 4
    # FasterCache and PAB read the pipeline's current timestep through a callback
    yield "FirstBlockCache", lambda pipe: diffusers.FirstBlockCacheConfig(threshold=0.2)
    yield "TaylorSeer", lambda pipe: diffusers.TaylorSeerCacheConfig()
    yield "MagCache", lambda pipe: diffusers.MagCacheConfig(mag_ratios=[1.0] * steps, num_inference_steps=steps)
    yield (
        "FasterCache",
        lambda pipe: diffusers.FasterCacheConfig(
            spatial_attention_block_skip_range=2, current_timestep_callback=lambda: pipe.current_timestep, is_guidance_distilled=True
        ),
    )
    yield (
        "PyramidAttentionBroadcast",
        lambda pipe: diffusers.PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2, current_timestep_callback=lambda: pipe.current_timestep
        ),
    )


CONFIGS = dict(_configs())
# The caches diffusers 0.35 (the oldest torchfix claims) lacks: their config class and the release that added it.
ADDED_IN = {"TaylorSeer": ("TaylorSeerCacheConfig", "0.36.0"), "MagCache": ("MagCacheConfig", "0.37.0")}


def _skip_if_newer(name):
    """Skip where the installed diffusers predates cache ``name`` (only there: a class missing from a release that
    should have it fails the test)."""
    from packaging.version import Version

    cls, added = ADDED_IN.get(name, (None, None))
    if cls is not None and not hasattr(diffusers, cls) and Version(diffusers.__version__) < Version(added):
        pytest.skip(f"diffusers {diffusers.__version__} has no {cls} (added in diffusers {added})")


def run(pipe, size, stop_at=None):
    def callback(p, i, t, kwargs):
        if i == stop_at:
            raise KeyboardInterrupt  # Ctrl-C, or a callback that stops the call
        return kwargs

    generator = torch.Generator().manual_seed(0)
    return pipe(
        "a cat", num_inference_steps=4, height=size, width=size, output_type="latent", callback_on_step_end=callback, generator=generator
    ).images


def cached(name):
    pipe = tiny_flux_pipeline()
    pipe.transformer.enable_cache(CONFIGS[name](pipe))
    return pipe


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_call_after_an_interrupted_one_runs_as_a_fresh_one_at_any_size(name):
    _skip_if_newer(name)
    fresh = run(cached(name), 96)
    with torchfix.enabled():  # import torchfix (enable_cache called while torchfix is on: watched)
        pipe = cached(name)
        with pytest.raises(KeyboardInterrupt):
            run(pipe, 64, stop_at=1)
        assert torch.equal(run(pipe, 96), fresh)  # another size (plain: FirstBlockCache crashes, MagCache/TaylorSeer differ)
        with pytest.raises(KeyboardInterrupt):
            run(pipe, 96, stop_at=2)
        assert torch.equal(run(pipe, 96), fresh)  # the same size (plain: all but FirstBlockCache differ, silently)
        assert torch.equal(run(pipe, 96), fresh)  # a call after a finished one: diffusers' own reset, nothing to do
    events = [e for e in torchfix.report().events if e.guard == "cache"]
    assert len(events) == 2 and all(e.action == "reset" and e.module == "transformer" for e in events)
    assert all("did not finish" in e.detail and "maybe_free_model_hooks" in e.detail for e in events)


def test_a_loop_of_ones_own_at_another_size_resets_the_state_first():
    pipe = cached("FirstBlockCache")
    model = pipe.transformer

    def step(size):
        tokens = (size // 16) ** 2
        with model.cache_context("cond"):
            return model(
                hidden_states=torch.randn(1, tokens, 64, generator=torch.Generator().manual_seed(0)),
                encoder_hidden_states=torch.zeros(1, 8, 64),
                pooled_projections=torch.zeros(1, 32),
                timestep=torch.tensor([0.5]),
                img_ids=torch.zeros(tokens, 3),
                txt_ids=torch.zeros(8, 3),
                return_dict=False,
            )[0]

    step(64)
    with pytest.raises(RuntimeError, match="must match the size"):  # plain diffusers: the 64² residual is still there
        step(96)
    with torchfix.enabled():
        pipe = cached("FirstBlockCache")
        model = pipe.transformer
        step(64)
        step(96)
    (event,) = [e for e in torchfix.report().events if e.guard == "cache"]
    assert "latents (1, 16, 64) → (1, 36, 64)" in event.detail


def test_plain_diffusers_crashes_there_and_a_wrapped_call_that_raises_leaves_no_state():
    pipe = cached("FirstBlockCache")  # enabled while torchfix is off: no watch of its own
    with pytest.raises(KeyboardInterrupt):
        run(pipe, 64, stop_at=1)
    with pytest.raises(RuntimeError, match="must match the size"):  # plain: the stale residual of the 64² call
        run(pipe, 96)
    pipe = cached("FirstBlockCache")
    w = torchfix.wrap(pipe)
    with pytest.raises(KeyboardInterrupt):  # wrap re-raises the call's own exception, after the reset diffusers skipped
        run(w, 64, stop_at=1)
    (event,) = [e for e in torchfix.report().events if e.guard == "cache"]
    assert event.module == "transformer" and "FBCHeadBlockHook" in event.detail and "maybe_free_model_hooks" in event.detail
    assert torch.equal(run(w, 96), run(cached("FirstBlockCache"), 96))
    with pytest.raises(KeyboardInterrupt):
        run(w, 96, stop_at=2)
    assert torch.equal(run(w, 96), run(cached("FirstBlockCache"), 96))  # the same size after an interrupted call: fresh too
    w.unwrap()
    assert not pipe.transformer._forward_pre_hooks  # wrap's check lived for its calls only


def test_strict_refuses_naming_the_change_and_disable_takes_the_watch_away():
    with torchfix.enabled():
        pipe = cached("FirstBlockCache")
        assert pipe.transformer._forward_pre_hooks
        with pytest.raises(KeyboardInterrupt):
            run(pipe, 64, stop_at=1)
        with torchfix.enabled(mode="strict"), pytest.raises(torchfix.ModelMismatchError, match=r"a call that did not finish"):
            run(pipe, 96)
        pipe.transformer.disable_cache()
        assert not pipe.transformer._forward_pre_hooks
        pipe.transformer.enable_cache(diffusers.FirstBlockCacheConfig(threshold=0.2))
        assert pipe.transformer._forward_pre_hooks
    assert not pipe.transformer._forward_pre_hooks  # torchfix off: its watch is gone


# --- a cache torchfix does not watch (the STALE_UNWATCHED row) ---------------------------------------------------


def generation(model, size, steps=3):
    """A generation of one's own: ``steps`` calls of the transformer, each in its ``cache_context``, no pipeline."""
    tokens = (size // 16) ** 2
    x = torch.randn(1, tokens, 64, generator=torch.Generator().manual_seed(0))
    for i in range(steps):
        with model.cache_context("cond"):
            out = model(
                hidden_states=x,
                encoder_hidden_states=torch.zeros(1, 8, 64),
                pooled_projections=torch.zeros(1, 32),
                timestep=torch.tensor([1.0 - i / steps]),
                img_ids=torch.zeros(tokens, 3),
                txt_ids=torch.zeros(8, 3),
                return_dict=False,
            )[0]
        x = x - out / steps
    return x


def unwatched(name, apply=False):
    """A tiny Flux transformer with cache ``name`` put on while torchfix is off (``enable_cache``, or diffusers'
    ``apply_*`` helper, which never passes through ``enable_cache``)."""
    pipe = tiny_flux_pipeline()
    config = CONFIGS[name](pipe)
    if apply:
        from diffusers.hooks import apply_first_block_cache

        apply_first_block_cache(pipe.transformer, config)
    else:
        pipe.transformer.enable_cache(config)
    return pipe.transformer


@pytest.mark.parametrize(
    "name, apply, held",
    [
        ("FirstBlockCache", False, "FBCSharedBlockState.head_block_residual (1, 16, 32)"),
        ("FirstBlockCache", True, "FBCSharedBlockState.head_block_residual (1, 16, 32)"),
        ("TaylorSeer", False, "TaylorSeerState.taylor_factors[0][0] (1, 16, 32)"),
    ],
    ids=["FirstBlockCache-enable_cache", "FirstBlockCache-apply_first_block_cache", "TaylorSeer-enable_cache"],
)
def test_an_unwatched_cache_met_by_other_latents_is_named_with_its_fix(name, apply, held):
    _skip_if_newer(name)
    model = unwatched(name, apply)
    generation(model, 64)
    with pytest.raises(RuntimeError, match="must match the size") as plain:
        generation(model, 96)  # plain diffusers: the 64² state meets the 96² call (TaylorSeer: a predicted step's shape)
    model = unwatched(name, apply)
    with torchfix.enabled():
        generation(model, 64)
        with pytest.raises(torchfix.ModelMismatchError) as info:
            generation(model, 96)
    text = str(info.value)
    assert "latents (1, 16, 64) → (1, 36, 64)" in text and held in text and "model._reset_stateful_cache()" in text
    assert isinstance(info.value.__cause__, RuntimeError) and str(info.value.__cause__) == str(plain.value)
    assert not model._forward_pre_hooks  # its look at the latents lived while torchfix was on
    with torchfix.enabled():
        model._reset_stateful_cache()  # the fix the error names
        assert torch.equal(generation(model, 96), generation(unwatched(name, apply), 96))


@pytest.mark.parametrize("name", ["FirstBlockCache", "TaylorSeer"])
def test_what_runs_with_an_unwatched_cache_is_left_as_diffusers_runs_it(name):
    """The same size twice (the state of the first generation carried into the second, as diffusers does), and
    TaylorSeer at a new size on a step it computes (diffusers 0.41+ restarts its expansion there by design,
    huggingface/diffusers#14831): bit-identical to plain diffusers, and no event."""
    _skip_if_newer(name)

    def both(model):
        if name == "TaylorSeer":  # its fifth call computes: the new size meets a restart, not a predicted shape
            return [generation(model, 64, steps=4), generation(model, 96, steps=4)]
        return [generation(model, 64), generation(model, 64)]

    plain, model = both(unwatched(name)), unwatched(name)  # put on while torchfix is off: not watched
    with torchfix.enabled():
        guarded = both(model)
    assert len(guarded) == len(plain) and all(torch.equal(a, b) for a, b in zip(guarded, plain))
    assert not [e for e in torchfix.report().events if e.guard == "cache"]
