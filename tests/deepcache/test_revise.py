"""Revising cached steps at the next full step (``DeepCacheConfig.revise``): the interpolation, the
latents landing where exact cached steps would have put them, where it applies and where it does not,
and every guarantee of the cache kept with it."""

from __future__ import annotations

import pytest
import torch

import torchfix
from torchfix import families
from torchfix.deepcache import DeepCacheConfig
from torchfix.deepcache.forecast import interpolate

pytest.importorskip("diffusers")

from torchfix import testing
from torchfix.testing import latents


def test_interpolation_is_the_polynomial_through_the_newest_full_steps():
    t = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    history = [(0, t(1.0)), (2, t(5.0)), (6, t(37.0))]  # 1 + x**2
    assert [interpolate(history, i).item() for i in (3, 4, 5)] == pytest.approx([10.0, 17.0, 26.0])
    assert interpolate(history[1:], 4).item() == pytest.approx(21.0)  # two points: the line through them
    text_less = [(0, (None, t(0.0))), (3, (None, t(3.0)))]
    assert interpolate(text_less, 1)[0] is None and interpolate(text_less, 1)[1].item() == pytest.approx(1.0)


class _TimeBlock(torch.nn.Module):
    """Adds ``a + b·t`` to the image stream (and ``kink`` at step 0): the cached blocks' residual is a line in
    the step."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, kink: torch.Tensor):
        super().__init__()
        self.register_buffer("a", a)
        self.register_buffer("b", b)
        self.register_buffer("kink", kink)

    def forward(self, hidden_states, encoder_hidden_states=None, temb=None):
        return encoder_hidden_states, hidden_states + self.a + self.b * temb + self.kink * (temb == 0)


class _NormOut(torch.nn.Module):
    def forward(self, x, conditioning_embedding):
        return 2.0 * x + conditioning_embedding


class _LineTransformer(torch.nn.Module):
    """A Flux-like layout (blocks, then ``norm_out`` and ``proj_out``) whose output depends on the latents
    only through what runs on every step, so a cached step's only error is its forecast of the residual."""

    def __init__(self, dim: int = 8, kink: float = 0.0):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
        self.x_embedder = torch.nn.Linear(dim, dim, dtype=torch.float64)
        self.transformer_blocks = torch.nn.ModuleList(_TimeBlock(r(dim), r(dim), kink * r(dim)) for _ in range(3))
        self.norm_out = _NormOut()
        self.proj_out = torch.nn.Linear(dim, dim, dtype=torch.float64)

    def forward(self, hidden_states, encoder_hidden_states=None, timestep=None, return_dict=False):
        h = 0.0 * self.x_embedder(hidden_states)
        temb = timestep.to(h.dtype).reshape(-1, 1, 1)
        for block in self.transformer_blocks:
            encoder_hidden_states, h = block(h, encoder_hidden_states, temb)
        return (self.proj_out(self.norm_out(h, 0.1 * temb)),)


# A family entry for the toy: Flux's layout (blocks, then norm_out and proj_out), so its cached steps may be revised.
families.register(
    families.Family(
        "test-line",
        "line blocks (a test's)",
        ("_LineTransformer",),
        blocks=(families.Blocks("transformer_blocks", {"image": "hidden_states", "text": "encoder_hidden_states"}, ("text", "image")),),
        tail=("norm_out", "proj_out"),
    ),
    replace=True,
)


class _Pipe:
    """The loop of diffusers' Flux pipeline: a flow-matching Euler scheduler stepping the latents."""

    def __init__(self, scheduler, kink: float = 0.0):
        self.transformer = _LineTransformer(kink=kink)
        self.scheduler = scheduler

    def __call__(self, steps: int = 10) -> torch.Tensor:
        self.scheduler.set_timesteps(steps)
        x = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        text = torch.zeros(1, 2, 8, dtype=torch.float64)
        for i, t in enumerate(self.scheduler.timesteps):
            v = self.transformer(hidden_states=x, encoder_hidden_states=text, timestep=torch.tensor([float(i)]))[0]
            x = self.scheduler.step(v, t, x, return_dict=False)[0]
        return x


def _euler(**kwargs):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(shift=3.0, **kwargs)  # unevenly spaced steps


def test_revised_cached_steps_land_the_latents_where_full_steps_would():
    """Reuse (forecast 0) is wrong at every cached step of a residual that moves on a line; at each full step
    the revision replaces every cached step's output by the exact one and moves the latents by what that
    changes, times each step's own size: the final latents are the plain ones (to float32 rounding: the
    scheduler steps in float32)."""
    pipe = _Pipe(_euler())
    plain = pipe()
    cfg = DeepCacheConfig(interval=3, forecast=0, stop=1.0, warm_up=False)  # full steps 0, 3, 6, 9
    errors = {}
    for revise in (False, None):
        torchfix.deepcache.apply(pipe, DeepCacheConfig(**{**cfg.__dict__, "revise": revise}))
        got = pipe()
        stats = torchfix.deepcache.stats(pipe)
        errors[revise] = ((got - plain).norm() / plain.norm()).item()
        torchfix.deepcache.remove(pipe)
        assert stats["last_call"]["cached_steps"] == 6
    assert stats["revise"] == "revises" and stats["revised_steps"] == 6
    assert errors[False] > 1e-2 and errors[None] < 1e-6
    assert "forward" not in vars(pipe.transformer) and not pipe.transformer.norm_out._forward_pre_hooks  # remove() exact


def test_after_a_warm_up_step_0_is_left_out_of_the_quadratic():
    """Step 0 off the line the later steps follow (a fast start): with full steps 0, 2, 5, 8, step 1 is revised on
    the line through steps 0 and 2 (off by half the kink), and steps 3 and 4 on the line through 2 and 5, not on
    the quadratic through 0, 2 and 5: they come out exact, so the final latents are off by step 1's revision
    alone, ``(σ[2] − σ[1])·W·kink`` (the output layers are ``W·(2·h + c) + b``)."""
    pipe = _Pipe(_euler(), kink=1.0)
    plain = pipe(steps=9)
    torchfix.deepcache.apply(pipe, DeepCacheConfig(interval=3, forecast=1, stop=1.0, warm_up=True))
    got = pipe(steps=9)
    stats = torchfix.deepcache.stats(pipe)
    torchfix.deepcache.remove(pipe)
    assert stats["revised_steps"] == 5 and stats["last_call"]["cached_steps"] == 5  # 1, 3, 4, 6, 7
    sigmas = pipe.scheduler.sigmas.double()
    kink = sum(block.kink for block in pipe.transformer.transformer_blocks)
    expected = plain + (sigmas[2] - sigmas[1]) * (pipe.transformer.proj_out.weight @ kink)
    assert ((got - expected).norm() / plain.norm()).item() < 1e-6 < ((got - plain).norm() / plain.norm()).item()


def test_without_a_deterministic_flow_matching_euler_step_nothing_is_revised():
    pipe = _Pipe(_euler(stochastic_sampling=True))
    cfg = DeepCacheConfig(interval=3, forecast=0, stop=1.0, warm_up=False)
    torchfix.deepcache.apply(pipe, DeepCacheConfig(**{**cfg.__dict__, "revise": False}))
    pipe.scheduler.set_timesteps(10)
    torch.manual_seed(0)
    ref = pipe()
    torchfix.deepcache.apply(pipe, cfg)
    torch.manual_seed(0)
    assert torch.equal(pipe(), ref)
    stats = torchfix.deepcache.stats(pipe)
    torchfix.deepcache.remove(pipe)
    assert stats["revised_steps"] == 0 and "FlowMatchEulerDiscreteScheduler" in stats["revise"]


def test_where_the_model_cannot_revise_it_says_why_and_revise_true_is_an_error():
    sd3 = testing.tiny_sd3_pipeline(layers=4)
    torchfix.deepcache.apply(sd3, DeepCacheConfig(interval=3))
    assert "keep_last=1" in torchfix.deepcache.stats(sd3)["revise"]  # SD3's last block drops the text stream: it runs
    torchfix.deepcache.remove(sd3)
    with pytest.raises(ValueError, match=r"revise=True.*keep_last=1"):
        torchfix.deepcache.apply(sd3, DeepCacheConfig(interval=3, revise=True))
    with pytest.raises(ValueError, match=r"revise=True.*UNet"):
        torchfix.deepcache.apply(testing.tiny_sd15_unet(), DeepCacheConfig(revise=True))
    with pytest.raises(TypeError, match="revise"):
        DeepCacheConfig(revise="yes")


def test_flux_revises_by_default_and_keeps_the_guarantees():
    pipe = testing.tiny_flux_pipeline(layers=2, single_layers=4)
    ref = latents(pipe, steps=10)
    out = {}
    for revise in (False, None):
        torchfix.deepcache.apply(pipe, DeepCacheConfig(interval=3, revise=revise))
        out[revise] = latents(pipe, steps=10)
        again = latents(pipe, steps=10)
        stats = torchfix.deepcache.stats(pipe)
        assert torch.equal(again, out[revise])  # fresh per call
    assert stats["revise"] == "revises" and stats["revised_steps"] > 0
    assert not torch.equal(out[None], out[False])
    assert all(((o - ref).norm() / ref.norm()).item() < 0.3 for o in out.values())
    torchfix.deepcache.apply(pipe, DeepCacheConfig(interval=1))
    assert torch.equal(latents(pipe, steps=10), ref)  # nothing cached, nothing revised
    torchfix.deepcache.remove(pipe)
    assert torch.equal(latents(pipe, steps=10), ref)
    assert not pipe.transformer.norm_out._forward_pre_hooks
