"""The MPS impl of ``torchfix::matmul``: a Metal kernel compiled with
``torch.mps.compile_shader``, with the same contract as the Triton one: every
operand is read in place through its strides and in its own dtype, products are
accumulated in float32, nothing is copied or cast into a new tensor.

UNRUN: no Apple hardware was available when this was written; on Linux
``torch.mps.compile_shader`` raises "MPS is not available". What is tested
here: the registration for the MPS dispatch key, the fallback, and the index
arithmetic (:func:`launch_meta` against an emulation in the tests).

One thread per output element: simple and readable, not tuned.

>>> from torchfix.kernels import metal
>>> "torchfix_matmul_half_bfloat_float" in metal.SOURCE
True
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import torch

from ..errors import TorchfixError
from ._shapes import check, collapse_batch, pad_batch, plan, result_dtype

__all__ = ["SOURCE", "kernel_name", "launch_meta", "matmul", "supports", "unavailable_reason"]

_METAL_TYPES = {torch.float32: "float", torch.float16: "half", torch.bfloat16: "bfloat"}

_HEADER = """
#include <metal_stdlib>
using namespace metal;

// meta: M, N, K, D1, D2, then per tensor (a, b, c) five strides:
// three batch strides, then row and column strides. Strides are in elements.
template <typename TA, typename TB, typename TC>
kernel void torchfix_matmul(device const TA* a [[buffer(0)]],
                            device const TB* b [[buffer(1)]],
                            device TC* c [[buffer(2)]],
                            device const long* meta [[buffer(3)]],
                            uint3 gid [[thread_position_in_grid]]) {
  const long M = meta[0], N = meta[1], K = meta[2], D1 = meta[3], D2 = meta[4];
  const long col = gid.x, row = gid.y, z = gid.z;
  if (row >= M || col >= N) {
    return;
  }
  const long i2 = z % D2, i1 = (z / D2) % D1, i0 = z / (D2 * D1);
  device const long* sa = meta + 5;
  device const long* sb = meta + 10;
  device const long* sc = meta + 15;
  const long oa = i0 * sa[0] + i1 * sa[1] + i2 * sa[2] + row * sa[3];
  const long ob = i0 * sb[0] + i1 * sb[1] + i2 * sb[2] + col * sb[4];
  float acc = 0.0f;
  for (long k = 0; k < K; ++k) {
    acc = fma(float(a[oa + k * sa[4]]), float(b[ob + k * sb[3]]), acc);
  }
  c[i0 * sc[0] + i1 * sc[1] + i2 * sc[2] + row * sc[3] + col * sc[4]] = TC(acc);
}
"""

_INSTANCE = """template [[host_name("{name}")]] kernel void torchfix_matmul<{ta}, {tb}, {tc}>(
    device const {ta}* a [[buffer(0)]], device const {tb}* b [[buffer(1)]], device {tc}* c [[buffer(2)]],
    device const long* meta [[buffer(3)]], uint3 gid [[thread_position_in_grid]]);
"""


def kernel_name(a: torch.dtype, b: torch.dtype, c: torch.dtype) -> str:
    """The Metal function for one dtype triple, e.g. ``torchfix_matmul_half_bfloat_float``."""
    return f"torchfix_matmul_{_METAL_TYPES[a]}_{_METAL_TYPES[b]}_{_METAL_TYPES[c]}"


def _source() -> str:
    parts = [_HEADER]
    for ta, tb, tc in itertools.product(_METAL_TYPES, repeat=3):
        text = _INSTANCE.format(name=kernel_name(ta, tb, tc), ta=_METAL_TYPES[ta], tb=_METAL_TYPES[tb], tc=_METAL_TYPES[tc])
        if torch.bfloat16 in (ta, tb, tc):  # bfloat is Metal 3.1 (macOS 14)
            text = f"#if __METAL_VERSION__ >= 310\n{text}#endif\n"
        parts.append(text)
    return "\n".join(parts)


SOURCE = _source()

_lib: Any = None
_lib_error: str | None = None
_lock = threading.Lock()


def unavailable_reason() -> str | None:
    """Why the Metal kernel cannot run in this process, or ``None`` (compiles once, lazily)."""
    global _lib, _lib_error
    if not torch.backends.mps.is_available():
        return "MPS is not available on this machine"
    with _lock:
        if _lib is None and _lib_error is None:
            try:
                _lib = torch.mps.compile_shader(SOURCE)
            except Exception as exc:  # a compile error is reported, and the ATen path used
                _lib_error = f"the Metal shader did not compile ({type(exc).__name__}: {exc})"
    return _lib_error


def supports(a: torch.Tensor, b: torch.Tensor) -> bool:
    """float16/bfloat16/float32 operands (MPS has no float64)."""
    return a.dtype in _METAL_TYPES and b.dtype in _METAL_TYPES


def launch_meta(p: Any, out: torch.Tensor) -> tuple[list[int], int]:
    """The ``meta`` array the kernel reads, and the number of batch entries.

    ``p`` is a :class:`torchfix.kernels._shapes.MatmulPlan`; batch dims are merged
    where every tensor walks them with one stride (at most three may remain).
    """
    sizes, strides = collapse_batch(p.batch, p.a.stride()[:-2], p.b.stride()[:-2], out.stride()[:-2])
    torch._check(len(sizes) <= 3, lambda: f"torchfix::matmul (Metal): at most 3 independent batch dims, got {len(sizes)}")
    sizes, (sa, sb, sc) = pad_batch(sizes, strides, 3)
    meta = [p.m, p.n, p.k, sizes[1], sizes[2]]
    meta += [*sa, *p.a.stride()[-2:], *sb, *p.b.stride()[-2:], *sc, *out.stride()[-2:]]
    return meta, sizes[0] * sizes[1] * sizes[2]


def matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Run the Metal kernel on MPS tensors, reading them in place."""
    why = unavailable_reason()
    if why is not None:
        raise TorchfixError(f"torchfix: {why}")
    check(a, b, out_dtype)
    target = result_dtype(a, b, out_dtype)
    torch._check(supports(a, b) and target in _METAL_TYPES, lambda: "torchfix::matmul (Metal): float16/bfloat16/float32 only")
    p = plan(a, b)
    out = torch.empty(p.out_shape, dtype=target, device=a.device)
    if out.numel():
        meta, batch = launch_meta(p, out)
        fn = getattr(_lib, kernel_name(a.dtype, b.dtype, target))
        # The kernel indexes from each view's first element; compile_shader binds a tensor at its storage offset.
        fn(p.a, p.b, out, torch.tensor(meta, dtype=torch.int64, device=a.device), threads=(p.n, p.m, batch), group_size=(8, 8, 1))
    return out.reshape(p.result_shape())
