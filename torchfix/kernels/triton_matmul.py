"""The CUDA impl of ``torchfix::matmul``: one Triton kernel that takes every
operand's strides as arguments and loads each operand in its own dtype,
casting in registers. No operand is copied or cast into a new tensor.

Compute dtype of the dot (accumulation is always float32):

- both operands float32: float32 (TF32 when ``torch.backends.cuda.matmul.allow_tf32``);
- float16/bfloat16 operands with a 16-bit result: the result dtype (what a user's
  "cast, then matmul" computes, at tensor-core speed);
- float16 × bfloat16 with a float32 result: TF32, which holds every float16 and
  bfloat16 value exactly, so the products are exact;
- under ``TRITON_INTERPRET=1`` (CPU tensors): float32 "ieee" always, because the
  interpreter computes ``tl.dot`` on bfloat16 wrongly (triton issue #11584) and
  rejects ``tl.dot(fp16, bf16)``.

>>> from torchfix.kernels import triton_matmul
>>> triton_matmul.unavailable_reason() is None or "Triton" in triton_matmul.unavailable_reason()
True
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..errors import TorchfixError
from ._shapes import check, collapse_batch, pad_batch, plan, result_dtype

__all__ = ["interpreting", "matmul", "supports", "unavailable_reason"]

try:  # Triton is the optional `triton` extra
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None
    tl = None

_MAX_BATCH_DIMS = 3


def unavailable_reason() -> str | None:
    """Why the Triton kernel cannot run in this process, or ``None``."""
    if triton is None:
        return "Triton is not installed (pip install 'torchfix-diffusion[triton]')"
    return None


def supports(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the kernel handles these operand dtypes (float64 is left to ATen)."""
    return torch.float64 not in (a.dtype, b.dtype)


def interpreting(device: torch.device) -> bool:
    """Whether a launch on ``device`` runs in Triton's interpreter (CPU tensors, or TRITON_INTERPRET=1)."""
    return device.type == "cpu" or os.environ.get("TRITON_INTERPRET", "0") == "1"


if triton is not None:

    def _matmul_kernel(
        a_ptr, b_ptr, c_ptr,
        M, N, K, D1, D2,
        sa0, sa1, sa2, sam, sak,
        sb0, sb1, sb2, sbk, sbn,
        sc0, sc1, sc2, scm, scn,
        COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):  # fmt: skip
        # Tiles in groups of GROUP_M rows so neighbouring programs share rhs tiles in L2.
        pid = tl.program_id(0)
        pid_b = tl.program_id(1)
        # Plain integer arithmetic, no tl.cdiv/tl.minimum: those are @jit helpers, and the
        # interpreter cannot call them unless TRITON_INTERPRET=1 was set before triton loaded.
        num_m = (M + BLOCK_M - 1) // BLOCK_M
        num_n = (N + BLOCK_N - 1) // BLOCK_N
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        group_size = num_m - first_m
        if group_size > GROUP_M:
            group_size = GROUP_M
        pid_m = first_m + ((pid % per_group) % group_size)
        pid_n = (pid % per_group) // group_size
        # Up to three batch dims, each with its own stride per operand (0 = broadcast).
        i2 = pid_b % D2
        i1 = (pid_b // D2) % D1
        i0 = pid_b // (D2 * D1)
        a_ptr += i0.to(tl.int64) * sa0 + i1.to(tl.int64) * sa1 + i2.to(tl.int64) * sa2
        b_ptr += i0.to(tl.int64) * sb0 + i1.to(tl.int64) * sb1 + i2.to(tl.int64) * sb2
        c_ptr += i0.to(tl.int64) * sc0 + i1.to(tl.int64) * sc1 + i2.to(tl.int64) * sc2

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * sam + offs_k[None, :] * sak
        b_ptrs = b_ptr + offs_k[:, None] * sbk + offs_n[None, :].to(tl.int64) * sbn
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # tl.zeros is a @jit helper too
        for k0 in range(0, (K + BLOCK_K - 1) // BLOCK_K):
            k_left = K - k0 * BLOCK_K
            a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
            acc = tl.dot(a.to(COMPUTE), b.to(COMPUTE), acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K * sak
            b_ptrs += BLOCK_K * sbk
        c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * scm + offs_n[None, :] * scn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))

    _GPU_CONFIGS = [
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=3, num_warps=8),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=3, num_warps=8),
        triton.Config({"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=3, num_warps=8),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}, num_stages=4, num_warps=4),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}, num_stages=4, num_warps=4),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=4),
    ]

_kernels: dict[bool, Any] = {}


def _kernel(interpret: bool) -> Any:
    """The jitted kernel: autotuned on a GPU, plain in the interpreter (one small config)."""
    fn = _kernels.get(interpret)
    if fn is None:
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction

            fn = InterpretedFunction(_matmul_kernel)
        else:
            fn = triton.autotune(_GPU_CONFIGS, key=["M", "N", "K", "COMPUTE"])(triton.jit(_matmul_kernel))
        _kernels[interpret] = fn
    return fn


def _compute(a: torch.Tensor, b: torch.Tensor, target: torch.dtype, interpret: bool) -> tuple[Any, str]:
    if interpret:
        return tl.float32, "ieee"
    low = (torch.float16, torch.bfloat16)
    if a.dtype in low and b.dtype in low:
        if target in low:
            return (tl.float16 if target == torch.float16 else tl.bfloat16), "ieee"
        return tl.float32, "tf32"  # fp16 and bf16 values are exact in tf32
    return tl.float32, ("tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee")


def matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Launch the kernel on ``a`` and ``b`` as they are (CUDA tensors, or CPU tensors
    in the interpreter). Same contract as ``torch.ops.torchfix.matmul``.

    >>> import torch
    >>> from torchfix.kernels import triton_matmul
    >>> a, b = torch.randn(16, 16), torch.randn(16, 16).t()
    >>> torch.allclose(triton_matmul.matmul(a, b), a @ b, atol=1e-4)  # doctest: +SKIP
    True
    """
    why = unavailable_reason()
    if why is not None:
        raise TorchfixError(f"torchfix: {why}")
    check(a, b, out_dtype)
    torch._check(supports(a, b), lambda: "torchfix: the Triton matmul does not take float64; use the CPU/ATen path")
    target = result_dtype(a, b, out_dtype)
    p = plan(a, b)
    out = torch.empty(p.out_shape, dtype=target, device=a.device)
    if out.numel() == 0:
        return out.reshape(p.result_shape())
    interpret = interpreting(a.device)
    if interpret and target != torch.float32:
        # The interpreter truncates float32 -> bfloat16 instead of rounding to nearest even
        # (the GPU rounds): store float32 and let torch round the result.
        result = matmul(a, b, torch.float32)
        return result.to(target)
    sizes, (sa, sb, sc) = collapse_batch(p.batch, p.a.stride()[:-2], p.b.stride()[:-2], out.stride()[:-2])
    if len(sizes) > _MAX_BATCH_DIMS:  # rare: more independent batch strides than the kernel takes
        lead = len(sizes) - _MAX_BATCH_DIMS
        for idx in torch.cartesian_prod(*[torch.arange(s) for s in sizes[:lead]]).reshape(-1, lead).tolist():
            _launch(p, out, sizes[lead:], sa, sb, sc, idx, lead, target, interpret)
        return out.reshape(p.result_shape())
    _launch(p, out, sizes, sa, sb, sc, [], 0, target, interpret)
    return out.reshape(p.result_shape())


def _launch(p: Any, out: torch.Tensor, sizes: list[int], sa: list[int], sb: list[int], sc: list[int],
            idx: list[int], lead: int, target: torch.dtype, interpret: bool) -> None:  # fmt: skip
    offset_a = sum(i * s for i, s in zip(idx, sa[:lead]))
    offset_b = sum(i * s for i, s in zip(idx, sb[:lead]))
    offset_c = sum(i * s for i, s in zip(idx, sc[:lead]))
    sizes3, (sa3, sb3, sc3) = pad_batch(sizes, [sa[lead:], sb[lead:], sc[lead:]], _MAX_BATCH_DIMS)
    a = p.a.as_strided((p.m, p.k), p.a.stride()[-2:], p.a.storage_offset() + offset_a)
    b = p.b.as_strided((p.k, p.n), p.b.stride()[-2:], p.b.storage_offset() + offset_b)
    c = out.as_strided((p.m, p.n), out.stride()[-2:], out.storage_offset() + offset_c)
    compute, precision = _compute(p.a, p.b, target, interpret)
    batch = sizes3[0] * sizes3[1] * sizes3[2]
    args = (
        a, b, c, p.m, p.n, p.k, sizes3[1], sizes3[2],
        *sa3, *a.stride(), *sb3, *b.stride(), *sc3, *c.stride(),
    )  # fmt: skip
    if interpret:
        blocks = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}
        grid = (triton.cdiv(p.m, 32) * triton.cdiv(p.n, 32), batch)
        _kernel(True)[grid](*args, COMPUTE=compute, PRECISION=precision, **blocks)
        return

    def grid(meta: dict[str, int]) -> tuple[int, int]:
        return (triton.cdiv(p.m, meta["BLOCK_M"]) * triton.cdiv(p.n, meta["BLOCK_N"]), batch)

    with torch.cuda.device(out.device):
        _kernel(False)[grid](*args, COMPUTE=compute, PRECISION=precision)
