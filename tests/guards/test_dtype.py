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
    assert dtype_guard.decide("linear", ops(input=f16, weight=f16, bias=f16), accepted=True) is None


def test_what_torch_accepts_is_nothing_whatever_the_kind():
    for kind in ("linear", "conv", "norm", "attention", "matmul"):
        assert dtype_guard.decide(kind, ops(input=bf16, weight=f32), accepted=True) is None
    assert dtype_guard.decide("matmul", ops(input=f16, other=bf16), accepted=True, policy_dtype=bf16) is None


def test_linear_with_no_model_running_the_input_wins():
    f = dtype_guard.decide("linear", ops(input=bf16, weight=f16, bias=f16), accepted=False)
    assert [(a.operand, a.to) for a in f.actions] == [("weight", bf16), ("bias", bf16)]
    assert f.torch_raises and "per-call" in f.note and "no model running" in f.note


@pytest.mark.parametrize("kind", ["linear", "conv", "norm"])
def test_the_models_dtype_wins_over_a_stray_input(kind):
    f = dtype_guard.decide(kind, ops(input=f32, weight=f16, bias=f16), accepted=False, model_dtype=f16, model="unet")
    assert [(a.operand, a.action, a.to) for a in f.actions] == [("input", "cast", f16)]
    assert "model's own dtype (float16, unet)" in f.note and "cast input to torch.float16" in f.fix


def test_an_fp32_model_casts_its_stray_input_up():
    f = dtype_guard.decide("conv", ops(input=f16, weight=f32, bias=f32), accepted=False, model_dtype=f32, model="vae")
    assert [(a.operand, a.action, a.to) for a in f.actions] == [("input", "upcast", f32)]


def test_the_models_dtype_wins_over_a_stray_layer():
    f = dtype_guard.decide("linear", ops(input=bf16, weight=f16, bias=f16), accepted=False, model_dtype=bf16, model="text_encoder_2")
    assert [(a.operand, a.to) for a in f.actions] == [("weight", bf16), ("bias", bf16)]
    assert "module.to(torch.bfloat16)" in f.fix and "per-call cast" in f.note


def test_the_model_decides_matmul_and_attention_too_but_not_over_dtype_or_autocast():
    base = ops(input=f32, other=f16)
    assert {a.to for a in dtype_guard.decide("matmul", base, accepted=False, model_dtype=f16).actions} == {f16}
    assert {a.to for a in dtype_guard.decide("matmul", base, accepted=False, model_dtype=f16, policy_dtype=bf16).actions} == {bf16}
    assert {a.to for a in dtype_guard.decide("matmul", base, accepted=False, model_dtype=f16, autocast_dtype=bf16).actions} == {bf16}
    f = dtype_guard.decide("attention", ops(query=f32, key=f16, value=f16), accepted=False, model_dtype=f16)
    assert [(a.operand, a.to) for a in f.actions] == [("query", f16)]


def test_a_kept_module_outranks_the_model():
    f = dtype_guard.decide("linear", ops(input=f16, weight=f32), accepted=False, keep=True, model_dtype=f16)
    assert [(a.operand, a.action, a.to) for a in f.actions] == [("input", "upcast", f32)]


def test_dominant_dtype_by_bytes():
    assert dtype_guard.dominant({f16: 100, f32: 60}) == f16
    assert dtype_guard.dominant({f16: 100, f32: 100}) == f32  # a tie goes to the wider
    assert dtype_guard.dominant({torch.float8_e4m3fn: 10**6, bf16: 2}) == bf16
    assert dtype_guard.dominant({}) is None


def test_one_time_casts_never_go_up_and_never_serve_two_dtypes():
    assert dtype_guard.cast_once(f16, {bf16}) == bf16
    assert dtype_guard.cast_once(f32, {f16}) == f16
    assert dtype_guard.cast_once(f16, {f32}) is None
    assert dtype_guard.cast_once(f16, {bf16, f32}) is None
    assert dtype_guard.cast_once(f16, {f16}) is None


def test_handover_cast_only_where_the_promotion_leaves_the_receivers_dtype():
    assert dtype_guard.handover(bf16, f16) == bf16
    assert dtype_guard.handover(f16, f32) == f16
    assert dtype_guard.handover(f32, f16) is None  # torch keeps fp32: left alone
    assert dtype_guard.handover(None, f16) is None and dtype_guard.handover(f16, f16) is None


def test_kept_module_casts_input_up():
    f = dtype_guard.decide("linear", ops(input=f16, weight=f32, bias=f32), accepted=False, keep=True)
    assert [(a.operand, a.action, a.to) for a in f.actions] == [("input", "upcast", f32)]


def test_rejected_norm_casts_parameters_to_the_input():
    f = dtype_guard.decide("norm", ops(input=f32, weight=bf16, bias=bf16), accepted=False)
    assert {a.operand for a in f.actions} == {"weight", "bias"}


def test_attention_follows_query():
    f = dtype_guard.decide("attention", ops(query=f16, key=bf16, value=f32), accepted=False)
    assert [(a.operand, a.to) for a in f.actions] == [("key", f16), ("value", f16)]


def test_matmul_policy_order():
    base = ops(input=f16, other=bf16)
    assert {a.to for a in dtype_guard.decide("matmul", base, accepted=False).actions} == {f32}  # promote_types
    assert {a.to for a in dtype_guard.decide("matmul", base, accepted=False, policy_dtype=bf16).actions} == {bf16}
    assert {a.to for a in dtype_guard.decide("matmul", base, accepted=False, autocast_dtype=f16).actions} == {f16}
    assert {a.to for a in dtype_guard.decide("matmul", base, accepted=False, policy_dtype=bf16, autocast_dtype=f16).actions} == {bf16}


def test_matmul_parameters_follow_the_activation():
    operands = [Operand("input", f16, CPU, param=True), Operand("mat1", bf16, CPU), Operand("mat2", f16, CPU, param=True)]
    f = dtype_guard.decide("matmul", operands, accepted=False)
    assert [(a.operand, a.to) for a in f.actions] == [("input", bf16), ("mat2", bf16)]
    assert "activations" in f.note
    # without a parameter among the operands, torch's promotion decides
    f = dtype_guard.decide("matmul", [Operand("input", f16, CPU), Operand("other", bf16, CPU)], accepted=False)
    assert {a.to for a in f.actions} == {f32}


def test_cat_promotion_is_advisory_unless_a_dtype_is_asked_for():
    f = dtype_guard.decide("cat", ops(**{"tensors[0]": f16, "tensors[1]": bf16}), accepted=True)
    assert f.advisory and not f.actions and not f.torch_raises and "float32" in f.note
    asked = dtype_guard.decide("cat", ops(**{"tensors[0]": f16, "tensors[1]": bf16}), accepted=True, policy_dtype=bf16)
    assert not asked.advisory and [(a.operand, a.to) for a in asked.actions] == [("tensors[0]", bf16)]


def test_cat_rejected_under_autocast_goes_to_autocast_dtype():
    f = dtype_guard.decide("cat", ops(**{"tensors[0]": f16, "tensors[1]": bf16}), accepted=False, autocast_dtype=bf16)
    assert [(a.operand, a.to) for a in f.actions] == [("tensors[0]", bf16)]


def test_integers_are_ignored():
    assert dtype_guard.decide("matmul", [Operand("input", torch.int64, CPU), Operand("other", f32, CPU)], accepted=False) is None


# --- torch is asked, not guessed ----------------------------------------------------------


@pytest.mark.parametrize("a", [f16, bf16, f32, torch.float64])
@pytest.mark.parametrize("b", [f16, bf16, f32, torch.float64])
@pytest.mark.parametrize("autocast", [None, bf16])
def test_accepts_agrees_with_torch(a, b, autocast):
    from torchfix.guards.accepts import accepts

    x = torch.randn(2, 4, dtype=a)
    q = torch.randn(1, 1, 3, 4, dtype=a)
    calls = {
        "F.linear": (lambda: F.linear(x, torch.randn(3, 4, dtype=b)), ops(input=a, weight=b)),
        "F.layer_norm": (lambda: F.layer_norm(x, (4,), torch.ones(4, dtype=b), torch.zeros(4, dtype=b)), ops(input=a, weight=b, bias=b)),
        "F.group_norm": (lambda: F.group_norm(x[..., None], 2, torch.ones(4, dtype=b)), ops(input=a, weight=b)),
        "F.scaled_dot_product_attention": (
            lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(3, 3, dtype=b)),
            ops(query=a, key=a, value=a, attn_mask=b),
        ),
        "torch.addmm": (lambda: torch.addmm(torch.zeros(3, dtype=b), x, torch.randn(4, 3, dtype=a)), ops(input=b, mat1=a, mat2=a)),
        "torch.cat": (lambda: torch.cat([x, x.to(b)]), ops(**{"tensors[0]": a, "tensors[1]": b})),
    }
    ctx = torch.autocast("cpu", dtype=autocast) if autocast else torch.autocast("cpu", enabled=False)
    for op, (call, operands) in calls.items():
        with ctx:
            try:
                call()
                plain = True
            except RuntimeError:
                plain = False
        assert accepts(op, operands, autocast) is plain, (op, a, b, autocast)


# --- through the patched ops --------------------------------------------------------------


def test_bare_linear_fixed_and_equal_to_manual_cast():
    x = torch.randn(3, 4, dtype=bf16)
    w, b = torch.randn(5, 4, dtype=f16), torch.randn(5, dtype=f16)
    expected = F.linear(x, w.to(bf16), b.to(bf16))
    with torchfix.enabled():
        out = F.linear(x, w, b)
    assert out.dtype == bf16 and torch.equal(out, expected)
    (ev,) = torchfix.report().events
    assert (ev.op, ev.guard, ev.action, ev.module) == ("F.linear", "dtype", "cast", None)
    assert ev.site.startswith("tests/guards/test_dtype.py:") and "weight float16→bfloat16" in ev.detail


def test_a_module_is_its_own_model_its_input_is_cast():
    x = torch.randn(3, 4, dtype=bf16)
    lin = torch.nn.Linear(4, 5).to(f16)
    with torchfix.enabled():
        out = lin(x)
    assert out.dtype == f16 and torch.equal(out, lin(x.to(f16)))  # what `x.to(model.dtype)` returns
    (ev,) = torchfix.report().events
    assert (ev.op, ev.guard, ev.action, ev.module) == ("F.linear", "dtype", "cast", "Linear")
    assert "input bfloat16→float16" in ev.detail and "model's own dtype" in ev.detail


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
    assert "fix:" in msg and "cast input to torch.float16" in msg  # the model (text_projection alone) is fp16
    assert isinstance(info.value.__cause__, RuntimeError) and "same dtype" in str(info.value.__cause__)
    assert isinstance(info.value, RuntimeError)
    assert torchfix.report().events == []


def test_warn_mode_warns_once_per_site():
    x, w = torch.randn(2, 4, dtype=bf16), torch.randn(3, 4, dtype=f16)
    with torchfix.enabled(mode="warn"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            F.linear(x, w.clone())  # three tensors: three events (one tensor cast again is one)
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
    mask = torch.randn(5, 5, dtype=f32)
    with torchfix.enabled():
        assert conv(x).dtype == f16 and torch.equal(conv(x), conv(x.to(f16)))  # each module is its own (fp16) model
        assert gn(x).dtype == f16
        out = F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask)
        assert out.dtype == f16
    # key and value follow the query; the float32 mask, which torch accepts, stays float32
    assert torch.equal(out, F.scaled_dot_product_attention(q, kv.half(), kv.half(), attn_mask=mask))
    assert "attn_mask" not in torchfix.report().events[-1].detail.split("→", 1)[1]


def test_sdpa_with_a_float32_mask_is_left_alone_in_every_mode():
    q = torch.randn(1, 2, 5, 8, dtype=bf16)
    mask = torch.randn(5, 5, dtype=f32)
    plain = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    for mode in ("fix", "warn", "strict"):
        with torchfix.enabled(mode=mode), warnings.catch_warnings():
            warnings.simplefilter("error", torchfix.TorchfixWarning)
            assert torch.equal(F.scaled_dot_product_attention(q, q, q, attn_mask=mask), plain)
    assert torchfix.report().events == []


def test_norm_with_float32_parameters_is_left_alone():
    x = torch.randn(2, 3, 4, dtype=bf16)
    ln, gn = torch.nn.LayerNorm(4), torch.nn.GroupNorm(1, 3)
    plain = (ln(x), gn(x))
    with torchfix.enabled(mode="strict"):
        assert torch.equal(ln(x), plain[0]) and torch.equal(gn(x), plain[1])
    assert plain[0].dtype == bf16 and torchfix.report().events == []


class Conv1D(torch.nn.Module):
    """transformers' GPT-2 Conv1D: torch.addmm(bias, x, weight)."""

    def __init__(self, nx, nf):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(nx, nf))
        self.bias = torch.nn.Parameter(torch.randn(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(*x.shape[:-1], -1)


def test_one_stray_fp16_conv1d_leaves_a_bf16_model_bf16():
    import copy

    model = torch.nn.Sequential(Conv1D(4, 4), torch.nn.GELU(), Conv1D(4, 4), torch.nn.Linear(4, 4)).to(bf16)
    model[2].to(f16)
    x = torch.randn(2, 3, 4, dtype=bf16)
    with torchfix.enabled():
        out = model(x)
    fixed = copy.deepcopy(model).to(bf16)  # what the stray layer's per-call cast computes
    assert out.dtype == bf16 and torch.equal(out, fixed(x))
    (ev,) = torchfix.report().events
    assert ev.op == "torch.addmm" and ev.module == "2" and "model's own dtype (bfloat16, Sequential)" in ev.detail


def test_cat_promotion_is_noted_not_changed_and_policy_dtype_changes_it():
    a, b = torch.randn(2, dtype=f16), torch.randn(2, dtype=bf16)
    plain = torch.cat([a, b])
    for mode in ("fix", "strict"):
        with torchfix.enabled(mode=mode):
            out = torch.cat([a, b])
        assert out.dtype == f32 and torch.equal(out, plain)
    events = torchfix.report().events
    assert [e.action for e in events] == ["noted", "noted"]
    assert "float32" in events[0].detail and "+8 B" in events[0].detail  # 4 elements × (4 - 2) bytes
    with torchfix.enabled(mode="warn"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(torch.cat([a, b]), plain)
    assert any("noticed torch.cat" in str(w.message) for w in caught if issubclass(w.category, torchfix.TorchfixWarning))
    with torchfix.enabled(dtype=f16):
        assert torch.concat((a, b)).dtype == f16
        assert torch.concatenate([a, b], axis=0).dtype == f16
    with torchfix.enabled(mode="strict", dtype=f16), pytest.raises(torchfix.DtypeMismatchError, match=r"torch\.cat"):
        torch.cat([a, b])  # strict raises exactly where fix would change the call


def test_cat_under_autocast():
    f32_bf16 = (torch.randn(2, 2, dtype=f32), torch.randn(2, 2, dtype=bf16))
    f16_bf16 = (torch.randn(2, 2, dtype=f16), torch.randn(2, 2, dtype=bf16))
    with torch.autocast("cpu", dtype=bf16):
        plain = torch.cat(f32_bf16)  # torch accepts and promotes: left alone
        with pytest.raises(RuntimeError, match="prioritize"):
            torch.cat(f16_bf16)  # torch rejects: fixed to autocast's dtype
        with torchfix.enabled(mode="strict"):
            assert torch.equal(torch.cat(f32_bf16), plain) and plain.dtype == f32
        with torchfix.enabled():
            assert torch.equal(torch.cat(f32_bf16), plain)
            out = torch.cat(f16_bf16)
    assert out.dtype == bf16 and torch.equal(out, torch.cat([f16_bf16[0].to(bf16), f16_bf16[1]]))
    assert [e.action for e in torchfix.report().events if e.action != "noted"] == ["cast"]


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
