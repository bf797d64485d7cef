"""The Triton kernel compiled for a real GPU: CUDA tensors, ``TRITON_INTERPRET=0``. Skipped where no CUDA device is
present (CI); run on a GPU machine with

    TRITON_INTERPRET=0 python -m pytest tests/kernels -q

and record the result in :data:`torchfix.kernels.HARDWARE_RUNS`. What the interpreter tests (test_triton.py) cannot
see is checked here: the compiled tile configs, the 16-bit and TF32 dot paths the GPU takes, masks at tile edges,
64-bit offsets, dispatch through ``torch.ops.torchfix.matmul``, autograd, ``torch.compile`` and the guard's routing.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torchfix

from ..strategies import tensor
from .test_matmul_op import reference, rel_err

triton_matmul = pytest.importorskip("torchfix.kernels.triton_matmul")
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (the GPU path runs on a GPU machine)"),
    pytest.mark.skipif(triton_matmul.unavailable_reason() is not None, reason="Triton is not installed"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 (run with 0 on a GPU)"),
]
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
op = torch.ops.torchfix.matmul


def on_gpu(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the GPU with the same sizes, strides and storage offset (overlapping and stepped views included)."""
    extent = t.untyped_storage().nbytes() // t.element_size()
    storage = torch.as_strided(t, (extent,), (1,), 0).cuda()
    return storage.as_strided(t.shape, t.stride(), t.storage_offset())


def gpu_tolerance(da: torch.dtype, db: torch.dtype, out: torch.dtype, k: int) -> float:
    """Relative error (of the largest reference entry) the GPU path may make: the dot runs in the 16-bit result
    dtype (operands of the other 16-bit dtype are rounded into it), or TF32/fp32; accumulation is fp32."""
    eps = {F16: 2**-11, BF16: 2**-8, F32: 2**-24}
    operand = max(eps[da], eps[db], eps[out] if out in (F16, BF16) and {da, db} <= {F16, BF16} else 0.0)
    if F32 in (da, db) and torch.backends.cuda.matmul.allow_tf32:
        operand = max(operand, 2**-11)
    return 4 * eps[out] + 8 * operand + k * 2**-24


def test_the_seed_shape_on_the_gpu_without_copies():
    """The seed: [1,1,4096,4096] @ a transposed [1,1,4096,512] view, read in place (no copy, no cast kernel)."""
    torch.manual_seed(0)
    a = torch.randn(1, 1, 4096, 4096, device="cuda", dtype=F16)
    b = torch.randn(1, 1, 512, 4096, device="cuda", dtype=BF16).transpose(-1, -2)
    assert not b.is_contiguous()
    op(a, b, out_dtype=F32)  # compile and autotune outside the profile
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = op(a, b, out_dtype=F32)
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    assert not names & {"aten::clone", "aten::copy_", "aten::contiguous", "aten::_to_copy"}, names
    assert torch.cuda.max_memory_allocated() - before <= out.numel() * 4 + 2**20  # the output and nothing else
    assert rel_err(out.cpu(), reference(a.cpu(), b.cpu())) < 1e-5  # fp16 x bf16 products are exact in TF32


def test_large_offsets_use_64_bit_arithmetic():
    """A batch whose last element starts past 2**31 elements: int32 offsets would wrap."""
    per = 2**31 // (256 * 256) + 1  # batches of 256x256 fp16 so the last starts beyond 2**31 elements
    a = torch.randn(per, 256, 256, device="cuda", dtype=F16)
    b = torch.randn(256, 64, device="cuda", dtype=F16)
    out = op(a[-2:], b)
    assert rel_err(out.cpu(), reference(a[-2:].cpu(), b.cpu())) <= gpu_tolerance(F16, F16, F16, 256)


def test_more_batch_dims_than_the_kernel_takes_on_the_gpu():
    a = on_gpu(torch.randn(2, 3, 1, 2, 40, 50).transpose(0, 1))
    b = on_gpu(torch.randn(1, 1, 3, 1, 50, 60).expand(3, 2, 3, 2, 50, 60))
    assert rel_err(op(a, b).cpu(), reference(a.cpu(), b.cpu())) <= gpu_tolerance(F32, F32, F32, 50)


def test_autograd_and_opcheck_on_the_gpu():
    a = torch.randn(3, 40, 24, device="cuda", dtype=F32, requires_grad=True)
    b = torch.randn(3, 48, 24, device="cuda", dtype=BF16).transpose(-1, -2).detach().requires_grad_(True)
    out = op(a, b, out_dtype=F32)
    out.square().sum().backward()
    a64, b64 = a.detach().double().requires_grad_(True), b.detach().double().requires_grad_(True)
    (a64 @ b64).square().sum().backward()
    assert a.grad.dtype == F32 and b.grad.dtype == BF16
    assert rel_err(a.grad.cpu(), a64.grad.cpu()) < 1e-2 and rel_err(b.grad.float().cpu(), b64.grad.cpu()) < 1e-2
    torch.library.opcheck(op, (torch.randn(5, 7, device="cuda"), torch.randn(9, 7, device="cuda").t()), {"out_dtype": None})


def test_compiled_call_runs_the_kernel():
    a = torch.randn(2, 128, 96, device="cuda", dtype=F16)
    b = torch.randn(2, 64, 96, device="cuda", dtype=BF16).transpose(-1, -2)
    fn = torch.compile(lambda x, y: op(x, y, out_dtype=F32) * 2, fullgraph=True)
    assert torch.equal(fn(a, b), op(a, b, out_dtype=F32) * 2)


def test_the_guard_routes_a_mixed_dtype_matmul_to_the_kernel():
    """What a user sees: plain torch refuses fp16 @ bf16; with kernels on, the guard hands both operands to the
    kernel as they are and returns what "cast, then matmul" computes."""
    a = torch.randn(64, 80, device="cuda", dtype=F16)
    b = torch.randn(96, 80, device="cuda", dtype=BF16).t()
    with pytest.raises(RuntimeError):
        torch.matmul(a, b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torchfix.enabled("fix", kernels=True):
            got = torch.matmul(a, b)
    want = torch.matmul(a.float(), b.float())
    assert got.is_cuda and got.shape == want.shape
    assert rel_err(got.float().cpu(), want.double().cpu()) <= gpu_tolerance(F16, BF16, got.dtype, 80)


@st.composite
def gpu_operands(draw):
    """Sizes across tile edges (tiles are 32-256), random layouts, broadcasting, every dtype pair."""
    m = draw(st.sampled_from([1, 7, 33, 64, 127, 128, 129, 257, 300]))
    k = draw(st.sampled_from([1, 15, 16, 31, 64, 65, 200, 512]))
    n = draw(st.sampled_from([1, 8, 63, 128, 130, 255, 384]))
    batch = tuple(draw(st.lists(st.integers(1, 3), max_size=3)))
    b_batch = tuple(1 if draw(st.booleans()) else d for d in batch)
    da, db = draw(st.sampled_from((F16, BF16, F32))), draw(st.sampled_from((F16, BF16, F32)))
    return draw(tensor((*batch, m, k), da)), draw(tensor((*b_batch, k, n), db))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ops=gpu_operands(), out_dtype=st.sampled_from([None, F32, F16, BF16]))
def test_gpu_kernel_matches_float64(ops, out_dtype):
    """Last in the module: each new shape autotunes (compiles and times) 6 tile configs, seconds per example (on an
    H200, 150 examples outran 300 s)."""
    a, b = (on_gpu(t) for t in ops)
    assert a.stride() == ops[0].stride() and b.stride() == ops[1].stride()
    out = op(a, b, out_dtype=out_dtype)
    ref = reference(*ops)
    target = out_dtype or torch.promote_types(a.dtype, b.dtype)
    assert out.is_cuda and out.shape == ref.shape and out.dtype == target
    assert rel_err(out.cpu(), ref) <= gpu_tolerance(a.dtype, b.dtype, target, a.shape[-1])
