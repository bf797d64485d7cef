"""Forecast instead of reuse, and refresh when the features move: the extrapolation itself, and every
guarantee of the plain cache kept with them (interval 1, fresh per call, remove, streams, compile)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import torchfix
from torchfix import families
from torchfix.deepcache import DeepCacheConfig
from torchfix.deepcache.forecast import forecast, moved, remember
from torchfix.deepcache.schedule import must_run_full

pytest.importorskip("diffusers")

from torchfix import testing
from torchfix.testing import latents

BUILDERS = {
    "sd15": lambda: testing.tiny_sd15_pipeline(),
    "sd3": lambda: testing.tiny_sd3_pipeline(layers=6),
    "flux": lambda: testing.tiny_flux_pipeline(layers=2, single_layers=4),
}
CONFIGS = {
    "forecast=1": DeepCacheConfig(interval=3, forecast=1),
    "forecast=2, stop=0.9": DeepCacheConfig(interval=3, forecast=2, stop=0.9),
    "threshold": DeepCacheConfig(interval=4, forecast=1, threshold=0.05, stop=0.9),
}


def t(*v):
    return torch.tensor(v, dtype=torch.float64)


def test_finite_differences_of_each_order_and_the_cap():
    line = [(0, t(1.0)), (3, t(4.0))]
    assert torch.equal(forecast(line, 5, 0), t(4.0))  # reuse
    assert torch.allclose(forecast(line, 5, 1), t(6.0))  # slope 1 per step
    assert torch.allclose(forecast(line, 9, 1), t(7.0))  # never further than the last gap (3 steps) past step 3
    square = [(0, t(0.0)), (2, t(4.0)), (4, t(16.0))]
    assert torch.allclose(forecast(square, 5, 2), t(25.0)) and torch.allclose(forecast(square, 6, 2), t(36.0))
    assert torch.allclose(forecast(square[1:], 5, 2), t(22.0))  # too few points: the order drops to what they allow
    pair = [(0, (None, t(0.0))), (2, (None, t(2.0)))]  # a transformer's (text, image) residual without text
    assert forecast(pair, 3, 1)[0] is None and torch.allclose(forecast(pair, 3, 1)[1], t(3.0))


def test_history_keeps_what_the_order_needs():
    history = []
    for i in range(5):
        remember(history, i, t(float(i)), order=1)
    assert [i for i, _ in history] == [3, 4]
    remember(history, 5, t(5.0), order=0)
    assert [i for i, _ in history] == [5]


def test_moved_and_the_refresh_rule():
    assert moved(t(1.0, 2.0), t(1.0, 2.0)) == 0.0 and abs(moved(t(1.1, 2.0), t(1.0, 2.0)) - 0.1 / 3) < 1e-6  # in float32
    cfg = DeepCacheConfig(interval=3, threshold=0.1, stop=0.9)
    assert must_run_full(0, 10, cfg, 0) and must_run_full(9, 10, cfg, 0)  # the first step; the full tail
    assert must_run_full(4, 10, cfg, 0) is None and must_run_full(4, 10, cfg, 2) is True  # the features decide; the cap
    with pytest.raises(ValueError, match="forecast"):
        DeepCacheConfig(forecast=3)
    with pytest.raises(ValueError, match="threshold"):
        DeepCacheConfig(threshold=0)


@pytest.fixture(params=sorted(BUILDERS))
def pipe(request):
    p = BUILDERS[request.param]()
    yield p
    torchfix.deepcache.remove(p)


def test_interval_1_stays_bit_identical_and_remove_exact(pipe):
    ref = latents(pipe, steps=5)
    torchfix.deepcache.apply(pipe, DeepCacheConfig(interval=1, forecast=2, threshold=0.05))
    assert torch.equal(latents(pipe, steps=5), ref)
    torchfix.deepcache.apply(pipe, CONFIGS["threshold"])
    latents(pipe, steps=6)
    torchfix.deepcache.remove(pipe)
    assert torch.equal(latents(pipe, steps=5), ref)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_new_prompt_seed_or_size_is_a_fresh_cache(pipe, name):
    cfg = CONFIGS[name]
    torchfix.deepcache.apply(pipe, cfg)
    latents(pipe, "a cat", steps=8, size=(64, 96))
    runs = [("a dog", 0, (64, 96)), ("a dog", 1, (96, 64))]
    after = [latents(pipe, p, steps=8, seed=seed, size=size) for p, seed, size in runs]
    for (p, seed, size), got in zip(runs, after):
        torchfix.deepcache.apply(pipe, cfg)
        assert torch.equal(latents(pipe, p, steps=8, seed=seed, size=size), got), (name, p, seed, size)


def test_forecast_changes_cached_steps_only_and_holds_order_plus_one_features(pipe):
    ref = latents(pipe, steps=9)
    outs, held = {}, {}
    model = pipe.unet if hasattr(pipe, "unet") else pipe.transformer
    for order in (0, 1, 2):
        state = torchfix.deepcache.apply(pipe, DeepCacheConfig(interval=3, forecast=order))
        seen = []  # after each call (the cache is freed when the pipeline ends)
        def kept(*a, seen=seen, state=state):  # the generation of now: a new one replaces the object
            seen.append([len(s.history) for s in state.generation.streams.values()])

        hook = model.register_forward_hook(kept)
        try:
            outs[order] = latents(pipe, steps=9)
        finally:
            hook.remove()
        held[order] = seen[-1]
        stats = torchfix.deepcache.stats(pipe)
        full = len(torchfix.deepcache.full_steps(9, state.generation.config))
        warm = stats["warm_up"]  # False with forecast=0, and on SD3's shift-3 schedule (below)
        assert (stats["full_steps"], stats["cached_steps"]) == (full, 9 - full) == ((4, 5) if warm else (3, 6))
    revises = hasattr(pipe, "transformer") and torchfix.deepcache.stats(pipe)["revise"] == "revises"
    # one stream (batched guidance), the features its order needs (three where Flux revises its cached steps)
    assert held == ({0: [3], 1: [3], 2: [3]} if revises else {0: [1], 1: [2], 2: [3]})
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])
    assert all(torch.isfinite(o).all() and ((o - ref).norm() / ref.norm()) < 0.3 for o in outs.values())


@pytest.mark.parametrize("kind", ["sd3", "sd15"])
def test_refresh_follows_the_features(kind):
    pipe = BUILDERS[kind]()
    ref = latents(pipe, steps=10)
    counts = {}
    for threshold in (1e-9, 1e9):
        torchfix.deepcache.apply(pipe, DeepCacheConfig(interval=4, threshold=threshold, stop=0.9))
        out = latents(pipe, steps=10)
        stats = torchfix.deepcache.stats(pipe)
        counts[threshold] = (stats["full_steps"], stats["cached_steps"])
        if threshold < 1:
            assert torch.equal(out, ref)  # features always "moved": every step ran in full
    torchfix.deepcache.remove(pipe)
    assert counts[1e-9] == (10, 0)
    assert counts[1e9] == (4, 6)  # never moved: cached up to the cap (3 after each full step), step 9 full (the tail)


def test_each_guidance_stream_forecasts_from_its_own_history():
    pipe = testing.tiny_flux_pipeline(layers=2, single_layers=4)
    kw = dict(negative_prompt="a dog", true_cfg_scale=3.0)
    state = torchfix.deepcache.apply(pipe, DeepCacheConfig(interval=3, forecast=1))
    seen = []  # the streams' histories after each transformer call (the cache is freed when the pipeline ends)
    hook = pipe.transformer.register_forward_hook(lambda *a: seen.append([list(s.history) for s in state.generation.streams.values()]))
    try:
        both = latents(pipe, steps=9, **kw)
    finally:
        hook.remove()
        torchfix.deepcache.remove(pipe)
    last = seen[-1]
    assert len(last) == 2 and all(len(h) == 3 for h in last)  # three full steps each: the cached steps are revised
    assert not any(torch.equal(a[1][1], b[1][1]) for a in last[0] for b in last[1])
    assert torch.isfinite(both).all()


def test_compiled_forecasts_and_refreshes_need_no_recompile_across_steps():
    from torch._dynamo.utils import counters

    pipe = testing.tiny_flux_pipeline(layers=2, single_layers=2)
    torchfix.deepcache.apply(pipe, DeepCacheConfig(interval=4, forecast=1, threshold=0.05, stop=0.9))
    eager = latents(pipe, steps=8)
    # aot_eager: recompiles are dynamo's (the backend does not change them), and AOT's functionalisation still runs;
    # inductor's code generation on the cache is test_transformer's torch.compile test
    pipe.transformer.compile(dynamic=False, backend="aot_eager")
    try:
        for _ in range(2):  # the first generations compile each kind of step (probed, forced full, cached) where it first occurs
            latents(pipe, steps=8)
        counters.clear()
        again = latents(pipe, steps=8)
        latents(pipe, "a dog", steps=8, seed=3)
        assert counters["stats"]["unique_graphs"] == 0  # then nothing new: no recompile per step, generation or prompt
        assert ((again - eager).norm() / eager.norm()).item() < 1e-4
    finally:
        torch._dynamo.reset()
        torchfix.deepcache.remove(pipe)


def test_the_defaults_are_the_best_measured_per_family():
    from torchfix.deepcache.config import FAMILY_DEFAULTS

    unet = torchfix.deepcache.apply(BUILDERS["sd15"](), DeepCacheConfig(interval=4)).config
    dit = torchfix.deepcache.apply(BUILDERS["sd3"](), DeepCacheConfig(interval=4)).config
    assert (unet.forecast, unet.stop) == (2, 1.0) and (dit.forecast, dit.stop, dit.keep_first) == (1, 0.9, 0)
    assert FAMILY_DEFAULTS["transformer"] == {"forecast": 1, "stop": 0.9, "keep_first": 0}
    flux = torchfix.deepcache.apply(BUILDERS["flux"](), DeepCacheConfig(interval=4)).config
    assert (dit.keep_last, flux.keep_last) == (1, 0)  # SD3's last block drops the text stream and must run; Flux's need not
    assert torchfix.deepcache.apply(BUILDERS["flux"](), DeepCacheConfig(interval=4, keep_last=2)).config.keep_last == 2
    explicit = torchfix.deepcache.apply(BUILDERS["sd3"](), DeepCacheConfig(interval=4, forecast=0, stop=1.0, keep_first=1)).config
    assert (explicit.forecast, explicit.stop, explicit.keep_first) == (0, 1.0, 1)  # what a user sets is kept


@pytest.mark.parametrize(("kind", "warm"), [("sd15", True), ("flux", True), ("sd3", False)])
def test_the_scheduler_decides_the_warm_up(kind, warm):
    """With a forecast the second full step comes at step 2 (at interval 2: steps 0, 1 and 2 run in full) where
    the schedule's first step moves the timestep at least half as much as its average step (SD1.5's and Flux's
    schedulers); SD3's shift-3 schedule barely moves at first and keeps DeepCache's steps. warm_up=True/False
    overrides it."""
    pipe = BUILDERS[kind]()
    state = torchfix.deepcache.apply(pipe, DeepCacheConfig(interval=3, stop=1.0))
    latents(pipe, steps=9)
    stats = torchfix.deepcache.stats(pipe)
    assert stats["warm_up"] is warm and (stats["full_steps"], stats["cached_steps"]) == ((4, 5) if warm else (3, 6))
    assert state.generation.config.warm_up is warm and state.config.warm_up is None  # decided per generation, the config untouched
    torchfix.deepcache.remove(pipe)
    torchfix.deepcache.apply(pipe, DeepCacheConfig(interval=2, stop=1.0))  # interval 2 warms up with steps 0, 1 and 2
    latents(pipe, steps=9)
    stats = torchfix.deepcache.stats(pipe)
    assert (stats["full_steps"], stats["cached_steps"]) == ((6, 3) if warm else (5, 4))
    torchfix.deepcache.remove(pipe)
    state = torchfix.deepcache.apply(pipe, DeepCacheConfig(interval=3, stop=1.0, warm_up=not warm))
    latents(pipe, steps=9)
    assert state.generation.config is state.config and torchfix.deepcache.stats(pipe)["warm_up"] is (not warm)
    torchfix.deepcache.remove(pipe)
    with pytest.raises(TypeError, match="warm_up"):
        DeepCacheConfig(warm_up="yes")


def test_sensitivity_is_the_share_of_an_input_error_the_blocks_pass_through():
    from torchfix.deepcache.forecast import sensitivity

    e_in = t(1.0, -2.0, 0.5, 3.0)
    assert abs(sensitivity(-0.7 * e_in, e_in) - 0.3) < 1e-6  # the blocks undo 70% of an input change
    assert sensitivity(torch.zeros(4, dtype=torch.float64), e_in) == 1.0  # they pass it through: the residual forecast
    assert sensitivity(-3.0 * e_in, e_in) == 0.0 and sensitivity(2.0 * e_in, e_in) == 1.0  # kept in [0, 1]
    assert sensitivity(e_in, torch.zeros(4)) is None  # an input forecast exactly (a fixed text stream): nothing measured
    orthogonal = t(2.0, 1.0, 0.0, 0.0)  # a residual error unrelated to the input's does not move the slope
    assert abs(sensitivity(-0.5 * e_in + orthogonal, e_in) - 0.5) < 1e-6
    for bad in (-0.1, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="sensitivity"):
            DeepCacheConfig(sensitivity=bad)


class _Block(torch.nn.Module):
    """An affine block, ``c·x + b``: a chain of them returns ``C·x + B`` for any input."""

    def __init__(self, c: float, b: torch.Tensor):
        super().__init__()
        self.c = c
        self.register_buffer("b", b)

    def forward(self, hidden_states, encoder_hidden_states=None, temb=None):
        return encoder_hidden_states, self.c * hidden_states + self.b


# A family entry for the toy: its blocks take and return (text, image), as SD3's and Flux's do.
families.register(
    families.Family(
        "test-affine",
        "affine blocks (a test's)",
        ("_AffineTransformer",),
        blocks=(families.Blocks("transformer_blocks", {"image": "hidden_states", "text": "encoder_hidden_states"}, ("text", "image")),),
    ),
    replace=True,
)


class _AffineTransformer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        biases = [torch.randn(4, 8, generator=g, dtype=torch.float64) for _ in range(3)]
        self.transformer_blocks = torch.nn.ModuleList(_Block(c, b) for c, b in zip((0.9, 0.5, 0.8), biases))

    def forward(self, hidden_states, encoder_hidden_states=None, timestep=None):
        for block in self.transformer_blocks:
            encoder_hidden_states, hidden_states = block(hidden_states, encoder_hidden_states, timestep)
        return hidden_states


def _affine_run(warm_up: bool, sensitivity: float | None) -> tuple[list[float], Any, frozenset[int]]:
    """Cached-step errors (by step) of the affine transformer over 12 steps at interval 3, with the state."""
    model = _AffineTransformer()
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(4, 8, generator=g, dtype=torch.float64), torch.randn(4, 8, generator=g, dtype=torch.float64)
    text = torch.zeros(2, 8, dtype=torch.float64)
    inputs = [a + b * (k / 4) ** 2 for k in range(12)]  # moves on a curve: a linear forecast of it is off
    plain = [model(x, text) for x in inputs]
    cfg = DeepCacheConfig(interval=3, num_steps=12, stop=1.0, sensitivity=sensitivity, warm_up=warm_up)
    state = torchfix.deepcache.apply(model, cfg)
    torchfix.deepcache.new_call(model)
    got = [model(x, text) for x in inputs]
    full = torchfix.deepcache.schedule.full_steps(12, state.config)
    errors = {k: ((o - p).norm() / p.norm()).item() for k, (o, p) in enumerate(zip(got, plain)) if k not in full}
    measured = (dict(state.generation.current.sensitivity), torchfix.deepcache.stats(model)["sensitivity"])
    torchfix.deepcache.remove(model)
    return errors, measured, full


def test_a_measured_sensitivity_makes_cached_steps_exact_on_affine_blocks():
    """On blocks whose output is ``C·in + B`` (C = 0.36 here), a cached step that adds the forecast residual to
    its input is off by ``(1 − C)·(in − forecast_in)`` wherever the input does not move on a line; once one full
    step has measured the sensitivity (it is C), every later cached step returns what the blocks would have."""
    errors, (per_part, reported), full = _affine_run(warm_up=False, sensitivity=None)
    residual, _, _ = _affine_run(warm_up=False, sensitivity=1.0)
    assert sorted(full) == [0, 3, 6, 9]  # measured first at step 6 (its forecast from steps 0 and 3)
    # per (run, stream) and per sample: the image stream (1) measured 0.36, the text stream (0) nothing (it does not change)
    assert float((per_part[(0, 1)] - 0.36).abs().max()) < 1e-9 and (0, 0) not in per_part and reported == pytest.approx(0.36)
    assert max(errors[k] for k in (7, 8, 10, 11)) < 1e-12  # exact
    assert min(residual[k] for k in (7, 8, 10, 11)) > 1e-3  # the residual forecast is not
    assert [errors[k] for k in (1, 2, 4, 5)] == [residual[k] for k in (1, 2, 4, 5)]  # before it both add the residual


def test_after_a_warm_up_the_sensitivity_is_not_measured_from_step_0():
    """With the second full step at 2, the forecast checked at step 5 reaches back to step 0, where a trained
    denoiser's features change fastest: it measures nothing; step 8's (from steps 2 and 5) does."""
    errors, (per_part, _), full = _affine_run(warm_up=True, sensitivity=None)
    residual, _, _ = _affine_run(warm_up=True, sensitivity=1.0)
    assert sorted(full) == [0, 2, 5, 8, 11] and float((per_part[(0, 1)] - 0.36).abs().max()) < 1e-9
    assert [errors[k] for k in (1, 3, 4, 6, 7)] == [residual[k] for k in (1, 3, 4, 6, 7)]  # no measurement at step 5
    assert max(errors[9], errors[10]) < 1e-12 < min(residual[9], residual[10])  # measured at step 8


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_pipelines_measure_the_sensitivity_and_hold_the_inputs_for_it(kind):
    pipe = BUILDERS[kind]()
    held = {}
    for s in (None, 1.0):
        state = torchfix.deepcache.apply(pipe, DeepCacheConfig(interval=3, sensitivity=s, revise=False))
        seen = []  # cache bytes after each call (the pipeline frees the cache when it ends)
        hook = pipe.transformer.register_forward_hook(lambda *a, seen=seen, state=state: seen.append(state.cache_bytes))
        try:
            latents(pipe, steps=12)
        finally:
            hook.remove()
        held[s] = max(seen)
        measured = torchfix.deepcache.stats(pipe)["sensitivity"]
        if s is None:
            assert isinstance(measured, float) and 0.0 <= measured <= 1.0  # measured on this model
        else:
            assert measured == 1.0
    torchfix.deepcache.remove(pipe)
    assert held[None] == 2 * held[1.0]  # the inputs beside the residuals
