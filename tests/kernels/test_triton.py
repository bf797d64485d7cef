"""The Triton kernel, run by Triton's interpreter on CPU tensors (TRITON_INTERPRET=1;
no GPU in CI). Covered here: the interpreter path, which upcasts both operands to
float32 before ``tl.dot`` (the interpreter's bf16 dot is wrong, triton#11584, and it
rejects fp16 x bf16). The GPU path's compute-dtype choice is tested as a pure
function; the GPU path itself runs only on a CUDA machine."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ..strategies import tensor
from .test_matmul_op import reference, rel_err, tolerance

triton_matmul = pytest.importorskip("torchfix.kernels.triton_matmul")
pytestmark = pytest.mark.skipif(triton_matmul.unavailable_reason() is not None, reason="Triton is not installed")
LOW_OR_FP32 = (torch.float16, torch.bfloat16, torch.float32)
# Triton 3.6's interpreter fails on CPU tensors ("only 0-dimensional arrays can be converted to Python scalars")
# unless TRITON_INTERPRET=1 was set before triton loaded (seen on a GPU machine run with TRITON_INTERPRET=0); 3.9's
# runs either way. tests/kernels/conftest.py sets it; a GPU run that unsets it skips these.
interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter tests need TRITON_INTERPRET=1 before triton loads"
)


@interpreter
def test_runs_in_the_interpreter_on_cpu_tensors():
    assert triton_matmul.interpreting(torch.device("cpu"))


@st.composite
def small_operands(draw):
    """Small sizes (the interpreter takes milliseconds per block), random layouts, broadcasting."""
    m, k, n = draw(st.integers(1, 40)), draw(st.integers(1, 40)), draw(st.integers(1, 40))
    batch = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    b_batch = tuple(1 if draw(st.booleans()) else d for d in batch)
    da, db = draw(st.sampled_from(LOW_OR_FP32)), draw(st.sampled_from(LOW_OR_FP32))
    return draw(tensor((*batch, m, k), da)), draw(tensor((*b_batch, k, n), db))


@interpreter
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=small_operands(), out_dtype=st.sampled_from([None, torch.float32, torch.float16, torch.bfloat16]))
def test_interpreter_matches_float64(ops, out_dtype):
    a, b = ops
    out = triton_matmul.matmul(a, b, out_dtype)
    ref = reference(a, b)
    assert out.shape == ref.shape and out.dtype == (out_dtype or torch.promote_types(a.dtype, b.dtype))
    assert rel_err(out, ref) <= tolerance(out.dtype)


@interpreter
def test_seed_layout_and_mixed_dtypes_in_the_interpreter():
    a = torch.randn(1, 1, 64, 96, dtype=torch.float16)
    b = torch.randn(1, 1, 48, 96, dtype=torch.bfloat16).transpose(-1, -2)  # the seed's transposed rhs, smaller
    out = triton_matmul.matmul(a, b)
    assert out.dtype == torch.float32
    assert rel_err(out, reference(a, b)) < 1e-6  # fp16 x bf16 products are exact in fp32


@interpreter
def test_bf16_result_is_rounded_to_nearest():
    torch.manual_seed(0)
    a = torch.randn(17, 20, dtype=torch.bfloat16)
    b = torch.randn(33, 20, dtype=torch.bfloat16).t()
    exact = triton_matmul.matmul(a, b, torch.float32)
    assert torch.equal(triton_matmul.matmul(a, b), exact.to(torch.bfloat16))


@interpreter
def test_more_batch_dims_than_the_kernel_takes():
    a = torch.randn(2, 3, 1, 2, 4, 5).transpose(0, 1)  # no two batch dims merge
    b = torch.randn(1, 1, 3, 1, 5, 6).expand(3, 2, 3, 2, 5, 6)
    out = triton_matmul.matmul(a, b)
    assert rel_err(out, reference(a, b)) < 1e-6


@interpreter
def test_float64_is_left_to_aten():
    a = torch.randn(4, 4, dtype=torch.float64)
    assert not triton_matmul.supports(a, a)
    with pytest.raises(RuntimeError, match="float64"):
        triton_matmul.matmul(a, a)


@pytest.mark.parametrize(
    "da, db, target, expected",
    [
        (torch.float16, torch.bfloat16, torch.float32, ("fp32", "tf32")),  # exact products in tf32
        (torch.float16, torch.bfloat16, torch.bfloat16, ("bf16", "ieee")),  # what "cast, then matmul" computes
        (torch.float16, torch.float16, torch.float16, ("fp16", "ieee")),
    ],
)
def test_gpu_compute_dtype_choice(da, db, target, expected):
    compute, precision = triton_matmul._compute(torch.empty(1, dtype=da), torch.empty(1, dtype=db), target, interpret=False)
    assert (str(compute), precision) == expected
    assert triton_matmul._compute(torch.empty(1, dtype=da), torch.empty(1, dtype=db), target, interpret=True)[1] == "ieee"
