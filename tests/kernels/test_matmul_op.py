"""torch.ops.torchfix.matmul: the CPU reference against float64, registration,
opcheck, autograd, copy-freedom, errors and the backend fallback."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

import torchfix
from torchfix.kernels import ops as kmatmul

from ..strategies import matmul_args

LOW_OR_FP32 = (torch.float16, torch.bfloat16, torch.float32)
ALL_FLOATS = (*LOW_OR_FP32, torch.float64)
op = torch.ops.torchfix.matmul


def reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a.double(), b.double())


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)) if ref.numel() else 0.0


def dot_err(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> float:
    """The error of ``out`` against ``a @ b`` in float64, relative to ``|a| @ |b|``: a dot product's rounding error is
    bounded by the sum of its products' magnitudes, not by its result, which cancellation can make tiny (a 1x1 output
    of -0.057 from twenty products of magnitude ~1: relative to the result, fp32 accumulation errs by 5e-6)."""
    ref = reference(a, b)
    scale = (a.double().abs() @ b.double().abs()).abs().max().clamp_min(1e-30)
    return float((out.double() - ref).abs().max() / scale) if ref.numel() else 0.0


def tolerance(*dtypes: torch.dtype) -> float:
    """Relative error allowed: the output rounding of the result dtype (accumulation is fp32)."""
    eps = {torch.float16: 2**-10, torch.bfloat16: 2**-7, torch.float32: 2**-20, torch.float64: 2**-40}
    return 4 * max(eps[d] for d in dtypes)


def aten_ops(fn) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


def test_seed_shape_matches_float64_without_copies():
    torch.manual_seed(0)
    a = torch.randn(1, 1, 4096, 4096)
    b = torch.randn(1, 1, 512, 4096).transpose(-1, -2)
    assert not b.is_contiguous()
    out = op(a, b)
    assert out.shape == (1, 1, 4096, 512) and out.dtype == torch.float32
    assert rel_err(out, reference(a, b)) < 1e-5
    small_a, small_b = a[..., :256, :256], torch.randn(1, 1, 64, 256).transpose(-1, -2)
    seen = aten_ops(lambda: op(small_a, small_b))
    assert not seen & {"aten::clone", "aten::copy_", "aten::contiguous"}, seen


@pytest.mark.parametrize(
    "make",
    [
        lambda: (torch.randn(3, 4, 5).permute(1, 0, 2), torch.randn(5, 6)),  # permuted batch
        lambda: (torch.randn(4, 5), torch.randn(6, 5).t().unsqueeze(0).expand(3, 5, 6)),  # stride-0 batch of a transpose
        lambda: (torch.randn(2, 1, 4, 5), torch.randn(3, 6, 5).transpose(-1, -2)),  # broadcast batch dims
        lambda: (torch.randn(5, 4).t(), torch.randn(6, 5).t()),  # both transposed
    ],
)
def test_transposed_permuted_and_expanded_views_are_not_copied(make):
    a, b = make()
    seen = aten_ops(lambda: op(a, b))
    assert not seen & {"aten::clone", "aten::copy_", "aten::contiguous"}, seen
    assert rel_err(op(a, b), reference(a, b)) < 1e-6


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), da=st.sampled_from(ALL_FLOATS), db=st.sampled_from(ALL_FLOATS))
def test_cpu_impl_matches_float64_over_shapes_strides_dtypes(data, da, db):
    a, b = data.draw(matmul_args(da, db))
    out_dtype = data.draw(st.sampled_from([None, torch.float32, torch.bfloat16]))
    out = op(a, b, out_dtype=out_dtype)
    expected = torch.matmul(a.to(torch.promote_types(a.dtype, b.dtype)), b.to(torch.promote_types(a.dtype, b.dtype)))
    assert out.shape == expected.shape
    assert out.dtype == (out_dtype or torch.promote_types(da, db))
    assert dot_err(out, a, b) <= tolerance(out.dtype)


def test_fp32_accumulation_for_half_operands():
    # 4096 products of 1 + 2^-10: fp16 accumulation would stall at 2048 + rounding; fp32 gets it.
    a = torch.full((1, 4096), 1 + 2**-10, dtype=torch.float16)
    b = torch.ones(4096, 1, dtype=torch.bfloat16)
    out = op(a, b)
    assert out.dtype == torch.float32
    assert float(out) == pytest.approx(4096 * (1 + 2**-10), rel=1e-6)


def test_one_dimensional_operands_follow_torch_matmul():
    v, m = torch.randn(5), torch.randn(5, 3)
    assert op(v, m).shape == torch.matmul(v, m).shape == (3,)
    assert op(m.t(), v).shape == (3,)
    assert op(v, v).shape == torch.Size([])
    assert torch.allclose(op(v, v), v @ v)


def test_dispatch_table_has_cpu_cuda_and_mps_kernels():
    for key in ("CPU", "CUDA", "MPS", "Meta", "Autograd"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key("torchfix::matmul", key), key
    assert [b.device_type for b in torchfix.kernels.backends()] == ["cpu", "cuda", "mps"]
    assert all(b.registered for b in torchfix.kernels.backends())


@pytest.mark.parametrize(
    "args",
    [
        (torch.randn(4, 5), torch.randn(5, 3)),
        (torch.randn(4, 5), torch.randn(3, 5).t()),
        (torch.randn(2, 1, 4, 5), torch.randn(3, 5, 6)),
        (torch.randn(2, 4, 5, dtype=torch.float16), torch.randn(2, 6, 5, dtype=torch.bfloat16).transpose(-1, -2)),
    ],
    ids=["contiguous", "transposed", "batched-broadcast", "mixed-dtype"],
)
def test_opcheck(args):
    result = torch.library.opcheck(op.default, args)
    assert set(result.values()) == {"SUCCESS"}, result


def test_gradcheck_through_broadcast_and_transposes():
    a = torch.randn(2, 1, 4, 5, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 6, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, y: op(x, y.transpose(-1, -2)), (a, b))
    v = torch.randn(5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, y: op(x, y), (v, b.detach()[0].t().requires_grad_()))


def test_gradients_come_back_in_each_operands_dtype():
    a = torch.randn(3, 4, dtype=torch.float16, requires_grad=True)
    b = torch.randn(4, 2, dtype=torch.bfloat16, requires_grad=True)
    op(a, b).sum().backward()
    assert a.grad.dtype == torch.float16 and b.grad.dtype == torch.bfloat16
    assert torch.allclose(a.grad.float(), torch.ones(3, 2) @ b.float().t(), rtol=1e-2)


@pytest.mark.parametrize(
    "args, words",
    [
        ((torch.ones(2, 3, dtype=torch.int64), torch.ones(3, 2)), ["floating", "int64"]),
        ((torch.ones(2, 3), torch.ones(4, 2)), ["inner dimensions", "3 columns", "4 rows"]),
        ((torch.ones(2, 3), torch.ones(3, 2, device="meta")), ["different devices", "meta"]),
    ],
)
def test_bad_arguments_are_named(args, words):
    with pytest.raises(RuntimeError) as err:
        op(*args)
    for w in words:
        assert w in str(err.value)


@pytest.mark.parametrize("impl, device_type", [(kmatmul._mps, "mps"), (kmatmul._cuda, "cuda")])
def test_missing_backend_degrades_to_aten_with_one_warning(impl, device_type, monkeypatch):
    """Called with CPU tensors, the MPS impl finds no MPS (and the CUDA impl is made to find no Triton)."""
    from torchfix.kernels import triton_matmul

    monkeypatch.setattr(triton_matmul, "unavailable_reason", lambda: "Triton is not installed (test)")
    a, b = torch.randn(3, 4, dtype=torch.float16), torch.randn(5, 4).t()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = impl(a, b)
        impl(a, b)
    msgs = [w for w in caught if issubclass(w.category, torchfix.TorchfixWarning)]
    assert len(msgs) == 1 and device_type in str(msgs[0].message) and "ATen path" in str(msgs[0].message)
    assert torch.equal(first, kmatmul.aten_reference(a, b))
