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
from .test_matmul_op import dot_err, reference, rel_err, tolerance

triton_matmul = pytest.importorskip("torchfix.kernels.triton_matmul")
pytestmark = pytest.mark.skipif(triton_matmul.unavailable_reason() is not None, reason="Triton is not installed")
LOW_OR_FP32 = (torch.float16, torch.bfloat16, torch.float32)
# Triton 3.6's interpreter fails on CPU tensors ("only 0-dimensional arrays can be converted to Python scalars")
# unless TRITON_INTERPRET=1 was set before triton loaded (seen on a GPU machine run with TRITON_INTERPRET=0); 3.9's
# runs either way. tests/kernels/conftest.py sets it; a GPU run that unsets it skips these.
interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter tests need TRITON_INTERPRET=1 before triton loads"
)
# The interpreter of triton 3.4, 3.5 and 3.6 (the wheels of torch 2.8, 2.9, 2.10 and 2.11) reads a loop's runtime bound
# by int() of a one-element array (``__index__``; 3.7 and 3.9 run it), which NumPy 2.4 refuses ("only 0-dimensional
# arrays can be converted to Python scalars"): the kernel's K loop cannot run on CPU tensors there. Found by running
# one tiny kernel of that shape, once; any other failure of it is left to the tests below.
_NUMPY_SCALARS = "only 0-dimensional arrays can be converted to Python scalars"


def _count(n: int) -> int:
    """A tiny interpreted kernel that adds 1 in a loop over a runtime bound ``n`` (the kernel's K loop), returned."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    def count(out_ptr, n):
        total = tl.full((1,), 0, tl.int32)
        for _ in range(0, n):
            total += 1
        tl.store(out_ptr + tl.arange(0, 1), total)

    out = torch.zeros(1, dtype=torch.int32)
    InterpretedFunction(count)[(1,)](out, n)
    return int(out.item())


def _interpreter_broken() -> str | None:
    """Why this Triton's interpreter cannot run a loop over a runtime bound, or ``None`` (it can, or fails otherwise)."""
    if triton_matmul.unavailable_reason() is not None:
        return None
    try:
        _count(3)
    except Exception as exc:
        if _NUMPY_SCALARS not in f"{exc} {exc.__cause__}":
            return None
        import numpy
        import triton

        versions = f"triton {triton.__version__}'s interpreter with numpy {numpy.__version__}"
        return f"{versions} cannot loop over a runtime bound ({_NUMPY_SCALARS})"
    return None


INTERPRETER_BROKEN = _interpreter_broken()
launches = pytest.mark.skipif(INTERPRETER_BROKEN is not None, reason=INTERPRETER_BROKEN or "")


@interpreter
@launches
def test_the_interpreter_probe_counts_where_it_runs():
    """The probe skips the kernel runs on its one known failure only: where it runs, it computes."""
    assert _count(5) == 5


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
@launches
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=small_operands(), out_dtype=st.sampled_from([None, torch.float32, torch.float16, torch.bfloat16]))
def test_interpreter_matches_float64(ops, out_dtype):
    a, b = ops
    out = triton_matmul.matmul(a, b, out_dtype)
    ref = reference(a, b)
    assert out.shape == ref.shape and out.dtype == (out_dtype or torch.promote_types(a.dtype, b.dtype))
    assert dot_err(out, a, b) <= tolerance(out.dtype)


@interpreter
@launches
def test_seed_layout_and_mixed_dtypes_in_the_interpreter():
    a = torch.randn(1, 1, 64, 96, dtype=torch.float16)
    b = torch.randn(1, 1, 48, 96, dtype=torch.bfloat16).transpose(-1, -2)  # the seed's transposed rhs, smaller
    out = triton_matmul.matmul(a, b)
    assert out.dtype == torch.float32
    assert rel_err(out, reference(a, b)) < 1e-6  # fp16 x bf16 products are exact in fp32


@interpreter
@launches
def test_bf16_result_is_rounded_to_nearest():
    torch.manual_seed(0)
    a = torch.randn(17, 20, dtype=torch.bfloat16)
    b = torch.randn(33, 20, dtype=torch.bfloat16).t()
    exact = triton_matmul.matmul(a, b, torch.float32)
    assert torch.equal(triton_matmul.matmul(a, b), exact.to(torch.bfloat16))


@interpreter
@launches
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
