"""The dtype guard: pure policy, then through the patched ops."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import torchfix
from torchfix.guards import dtype as dtype_guard
from torchfix.guards.plan import Operand

CPU = torch.device("cpu")
f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32


def ops(**dtypes):
    return [Operand(name, dt, CPU) for name, dt in dtypes.items()]


# --- pure policy --------------------------------------------------------------------------


def test_same_dtype_is_nothing():
    assert dtype_guard.decide("linear", ops(input=f16, weight=f16, bias=f16)) is None


def test_linear_activations_win():
    f = dtype_guard.decide("linear", ops(input=bf16, weight=f16, bias=f16))
    assert [(a.operand, a.to) for a in f.actions] == [("weight", bf16), ("bias", bf16)]
    assert f.torch_raises and "per-call" in f.note


def test_kept_module_casts_input_up():
    f = dtype_guard.decide("linear", ops(input=f16, weight=f32, bias=f32), keep=True)
    assert [(a.operand, a.action, a.to) for a in f.actions] == [("input", "upcast", f32)]


def test_norm_accepts_low_precision_input_with_fp32_params():
    assert dtype_guard.decide("norm", ops(input=bf16, weight=f32, bias=f32)) is None
    f = dtype_guard.decide("norm", ops(input=f32, weight=bf16, bias=bf16))
    assert {a.operand for a in f.actions} == {"weight", "bias"}


def test_attention_follows_query():
    f = dtype_guard.decide("attention", ops(query=f16, key=bf16, value=f32))
    assert [(a.operand, a.to) for a in f.actions] == [("key", f16), ("value", f16)]


def test_matmul_policy_order():
    base = ops(input=f16, other=bf16)
    assert {a.to for a in dtype_guard.decide("matmul", base).actions} == {f32}  # promote_types
    assert {a.to for a in dtype_guard.decide("matmul", base, policy_dtype=bf16).actions} == {bf16}
    assert {a.to for a in dtype_guard.decide("matmul", base, policy_dtype=bf16, autocast_dtype=f16).actions} == {f16}


def test_autocast_handles_everything_but_cat():
    assert dtype_guard.decide("linear", ops(input=bf16, weight=f16), autocast_dtype=bf16) is None
    f = dtype_guard.decide("cat", ops(**{"tensors[0]": f16, "tensors[1]": bf16}), autocast_dtype=bf16)
    assert [(a.operand, a.to) for a in f.actions] == [("tensors[0]", bf16)]


def test_cat_promotion_is_not_a_torch_error_but_is_reported():
    f = dtype_guard.decide("cat", ops(**{"tensors[0]": f16, "tensors[1]": bf16}))
    assert not f.torch_raises and "more memory" in f.note


def test_integers_are_ignored():
    assert dtype_guard.decide("matmul", [Operand("input", torch.int64, CPU), Operand("other", f32, CPU)]) is None


# --- predictions match torch --------------------------------------------------------------


@pytest.mark.parametrize("a,b", [(f16, bf16), (bf16, f32), (f32, f16)])
def test_torch_raises_where_the_guard_says(a, b):
    x, w = torch.randn(2, 4, dtype=a), torch.randn(3, 4, dtype=b)
    assert not dtype_guard.torch_accepts("linear", ops(input=a, weight=b))
    with pytest.raises(RuntimeError):
        F.linear(x, w)
    for kind, call in (("norm", lambda: F.layer_norm(x, (4,), torch.ones(4, dtype=b))),):
        accepts = dtype_guard.torch_accepts(kind, ops(input=a, weight=b))
        if accepts:
            call()
        else:
            with pytest.raises(RuntimeError):
                call()


# --- through the patched ops --------------------------------------------------------------


def test_linear_fixed_and_equal_to_manual_cast():
    x = torch.randn(3, 4, dtype=bf16)
    lin = torch.nn.Linear(4, 5).to(f16)
    expected = F.linear(x, lin.weight.to(bf16), lin.bias.to(bf16))
    with torchfix.enabled():
        out = lin(x)
    assert out.dtype == bf16 and torch.equal(out, expected)
    (ev,) = torchfix.report().events
    assert (ev.op, ev.guard, ev.action, ev.module) == ("F.linear", "dtype", "cast", "Linear")
    assert ev.site.startswith("tests/guards/test_dtype.py:") and "weight float16→bfloat16" in ev.detail


def test_module_path_inside_a_model():
    model = torch.nn.Sequential()
    model.add_module("encoder", torch.nn.Sequential(torch.nn.Linear(4, 4)))
    model.add_module("text_projection", torch.nn.Linear(4, 2).to(f16))
    with torchfix.enabled():
        model(torch.randn(1, 4))
    assert [e.module for e in torchfix.report().events] == ["text_projection"]


def test_strict_raises_with_cause_and_full_message():
    model = torch.nn.Sequential()
    model.add_module("text_projection", torch.nn.Linear(4, 2).to(f16))
    with torchfix.enabled(mode="strict"), pytest.raises(torchfix.DtypeMismatchError) as info:
        model(torch.randn(1, 4, dtype=bf16))
    msg = str(info.value)
    assert "F.linear" in msg and "text_projection" in msg and "test_dtype.py:" in msg
    assert "input" in msg and "bfloat16" in msg and "float16" in msg and "shape=(2, 4)" in msg and "stride=(4, 1)" in msg
    assert "fix:" in msg and "module.to(torch.bfloat16)" in msg
    assert isinstance(info.value.__cause__, RuntimeError) and "same dtype" in str(info.value.__cause__)
    assert isinstance(info.value, RuntimeError)
    assert torchfix.report().events == []


def test_warn_mode_warns_once_per_site():
    x, w = torch.randn(2, 4, dtype=bf16), torch.randn(3, 4, dtype=f16)
    with torchfix.enabled(mode="warn"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            F.linear(x, w)
    ours = [w for w in caught if issubclass(w.category, torchfix.TorchfixWarning)]
    assert len(ours) == 1 and "F.linear" in str(ours[0].message)
    assert ours[0].filename.endswith("test_dtype.py")
    assert len(torchfix.report().events) == 3


def test_kept_module_runs_in_its_precision():
    norm = torchfix.keep_dtype(torch.nn.Linear(4, 4))
    x = torch.randn(2, 4, dtype=bf16)
    with torchfix.enabled():
        out = norm(x)
    assert out.dtype == f32 and torch.equal(out, norm(x.float()))


def test_keep_in_fp32_modules_attribute_is_respected():
    class Model(torch.nn.Module):
        _keep_in_fp32_modules = ("proj",)

        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.proj(x)

    m = Model()
    with torchfix.enabled():
        assert m(torch.randn(2, 4, dtype=f16)).dtype == f32


def test_matmul_family_and_operator():
    a, b = torch.randn(2, 3, dtype=f16), torch.randn(3, 4, dtype=bf16)
    with torchfix.enabled():
        for out in (torch.matmul(a, b), a @ b, a.matmul(b), torch.mm(a, b), a.mm(b)):
            assert out.dtype == f32 and torch.equal(out, a.float() @ b.float())
    with torchfix.enabled(dtype=bf16):
        assert (a @ b).dtype == bf16
        assert torch.bmm(a[None], b[None]).dtype == bf16
        assert torch.addmm(torch.zeros(2, 4, dtype=f16), a, b).dtype == bf16
        assert torch.baddbmm(torch.zeros(1, 2, 4), a[None], b[None]).dtype == bf16


def test_rmatmul_with_tensor_subclass_order():
    a, b = torch.randn(2, 3, dtype=f16), torch.randn(3, 4, dtype=bf16)
    with torchfix.enabled():
        assert torch.equal(b.__rmatmul__(a), a.float() @ b.float())


def test_conv_and_sdpa_and_group_norm():
    x = torch.randn(1, 4, 8, 8, dtype=bf16)
    conv = torch.nn.Conv2d(4, 4, 3, padding=1).to(f16)
    gn = torch.nn.GroupNorm(2, 4).to(f16)
    q = torch.randn(1, 2, 5, 8, dtype=f16)
    kv = torch.randn(1, 2, 5, 8, dtype=bf16)
    with torchfix.enabled():
        assert conv(x).dtype == bf16
        assert gn(x).dtype == bf16
        out = F.scaled_dot_product_attention(q, kv, kv, attn_mask=torch.zeros(5, 5, dtype=f32))
        assert out.dtype == f16
    assert torch.equal(out, F.scaled_dot_product_attention(q, kv.half(), kv.half(), attn_mask=torch.zeros(5, 5, dtype=f16)))


def test_cat_promotion_recorded_and_policy_dtype():
    a, b = torch.randn(2, dtype=f16), torch.randn(2, dtype=bf16)
    with torchfix.enabled():
        out = torch.cat([a, b])
        assert out.dtype == f32 and torch.equal(out, torch.cat([a.float(), b.float()]))
        (ev,) = torchfix.report().events
        assert ev.action == "promote" and "more memory" in ev.detail
    with torchfix.enabled(dtype=f16):
        assert torch.concat((a, b)).dtype == f16
        assert torch.concatenate([a, b], axis=0).dtype == f16
    with torchfix.enabled(mode="strict"), pytest.raises(torchfix.DtypeMismatchError, match=r"torch\.cat"):
        torch.cat([a, b])


def test_cat_under_autocast_which_torch_rejects():
    a, b = torch.randn(2, 2, dtype=f16), torch.randn(2, 2, dtype=f32)
    with torch.autocast("cpu", dtype=bf16):
        try:
            torch.cat([a, b])
            plain_raises = False
        except RuntimeError:
            plain_raises = True
        with torchfix.enabled():
            out = torch.cat([a, b])
    assert out.dtype == bf16
    assert plain_raises or out.dtype == bf16


def test_gradients_flow_through_casts():
    a = torch.randn(3, 4, dtype=f32, requires_grad=True)
    with torchfix.enabled(dtype=torch.float64):
        # the float32 operand is cast up exactly, so gradcheck in float64 is meaningful
        b0 = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda b: torch.matmul(a.detach(), b), (b0,))
        b = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
        (a @ b).sum().backward()
    assert a.grad is not None and a.grad.dtype == f32
    assert torch.allclose(a.grad.double(), b.sum(1).expand(3, 4).detach())
    lin = torch.nn.Linear(4, 2).to(bf16)
    with torchfix.enabled():
        lin(a).sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.dtype == bf16


def test_dtype_guard_can_be_switched_off():
    x, w = torch.randn(2, 4, dtype=bf16), torch.randn(3, 4, dtype=f16)
    with torchfix.enabled(guards=("device",)), pytest.raises(RuntimeError, match="same dtype"):
        F.linear(x, w)


def test_user_code_errors_are_not_swallowed():
    x, w = torch.randn(2, 4), torch.randn(3, 5)
    with torchfix.enabled(), pytest.raises(RuntimeError, match="cannot be multiplied"):
        F.linear(x, w)
