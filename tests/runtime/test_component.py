"""A side component's whole call in the pipeline's dtype (torchfix.runtime.component; the decision is
torchfix.guards.dtype.whole_call): the weights cast for the call only, kept modules kept, and every call plain torch
accepts left alone."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

import torchfix
from torchfix.guards.dtype import whole_call
from torchfix.runtime import component

f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32


def test_whole_call_only_where_torch_rejects_the_first_layer():
    assert whole_call(f32, f16, f16) == f16  # huggingface/diffusers#4860: an fp32 ControlNet handed fp16 latents
    assert whole_call(f16, f32, f32) == f32  # an fp16 ControlNet beside an fp32 UNet
    assert whole_call(f32, f32, f16) is None  # kept higher on purpose (force_upcast): runs in its own dtype
    assert whole_call(f32, f16, f32) is None  # handed its own dtype: torch accepts the call, it is left alone
    assert whole_call(f32, f16, f16, autocast=True) is None  # autocast: torch accepts it
    assert whole_call(None, f16, f16) is None and whole_call(f32, None, f16) is None


class Kept(torch.nn.Module):
    _keep_in_fp32_modules: ClassVar[list[str]] = ["norm"]

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("steps", torch.arange(4))

    def forward(self, x):
        return self.norm(self.proj(x)) * self.scale


def test_weights_in_casts_for_the_block_only_and_keeps_what_is_kept_on_purpose():
    m = Kept()
    before = {n: (t.dtype, t.data_ptr()) for n, t in (*m.named_parameters(), *m.named_buffers())}
    with component.weights_in(m, f16) as cast:
        assert m.proj.weight.dtype == f16 and m.scale.dtype == f16
        assert m.norm.weight.dtype == f32 and m.steps.dtype == torch.int64  # _keep_in_fp32_modules, integers: as they are
        assert set(cast) == {"proj.weight", "proj.bias", "scale"}
    assert {n: (t.dtype, t.data_ptr()) for n, t in (*m.named_parameters(), *m.named_buffers())} == before
    with pytest.raises(ValueError), component.weights_in(m, f16):
        raise ValueError("the call's own error")
    assert {n: (t.dtype, t.data_ptr()) for n, t in (*m.named_parameters(), *m.named_buffers())} == before


def test_no_plan_outside_a_pipeline():
    m = Kept()
    assert component.plan(m, (torch.randn(1, 4, dtype=f16),), {}) is None  # a bare model: the guards' rule, op by op
    with torchfix.enabled():
        out = m(torch.randn(1, 4).half())
    assert out.dtype == f32 and not [e for e in torchfix.report().events if e.op == "torchfix"]  # its own dtype wins
