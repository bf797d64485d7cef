"""Shape, dtype and stride bookkeeping shared by every ``torchfix::matmul`` impl.

Pure helpers on tensor metadata: nothing here reads data or launches work.
The impls differ only in how they multiply; what they multiply is decided here.

>>> import torch
>>> p = plan(torch.ones(2, 1, 3, 4), torch.ones(5, 4, 6))
>>> p.batch, p.m, p.n, p.k, tuple(p.out_shape)
((2, 5), 3, 6, 4, (2, 5, 3, 6))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["FLOATS", "MatmulPlan", "accumulate_dtype", "collapse_batch", "pad_batch", "plan", "result_dtype"]

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fmt(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} on {t.device}"


def result_dtype(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    """``out_dtype``, else the core's "auto" policy for the matmul family: ``torch.promote_types``."""
    return out_dtype if out_dtype is not None else torch.promote_types(a.dtype, b.dtype)


def accumulate_dtype(a: torch.Tensor, b: torch.Tensor) -> torch.dtype:
    """float64 when either operand is float64, else float32."""
    return torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32


def check(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None) -> None:
    """The operator's argument rules, as ``torch._check`` calls (they also run under fake tensors)."""
    torch._check(
        a.dtype in FLOATS and b.dtype in FLOATS,
        lambda: f"torchfix::matmul takes floating tensors (float16/bfloat16/float32/float64); got a={_fmt(a)}, b={_fmt(b)}",
    )
    torch._check(
        out_dtype is None or out_dtype in FLOATS,
        lambda: f"torchfix::matmul: out_dtype must be a floating dtype, not {out_dtype}",
    )
    torch._check(
        a.dim() >= 1 and b.dim() >= 1,
        lambda: f"torchfix::matmul: both operands need at least one dimension; got a={_fmt(a)}, b={_fmt(b)}",
    )
    torch._check(
        a.device == b.device,
        lambda: f"torchfix::matmul: operands on different devices: a={_fmt(a)}, b={_fmt(b)}; move one with .to(device)",
    )
    ka = a.shape[-1]
    kb = b.shape[-2] if b.dim() >= 2 else b.shape[0]
    torch._check(
        ka == kb,
        lambda: f"torchfix::matmul: inner dimensions differ: a={_fmt(a)} has {ka} columns, b={_fmt(b)} has {kb} rows",
    )


@dataclass(frozen=True)
class MatmulPlan:
    """``a`` and ``b`` as batched matrices: views expanded to one batch shape (no copies).

    ``squeeze`` lists the result dimensions to drop again (1-D operands).
    """

    a: torch.Tensor
    b: torch.Tensor
    batch: tuple[int, ...]
    m: int
    n: int
    k: int
    squeeze: tuple[int, ...]

    @property
    def out_shape(self) -> tuple[int, ...]:
        return (*self.batch, self.m, self.n)

    def result_shape(self) -> list[int]:
        shape = list(self.out_shape)
        for d in sorted(self.squeeze, reverse=True):
            del shape[d]
        return shape


def plan(a: torch.Tensor, b: torch.Tensor) -> MatmulPlan:
    """Batched views of ``a`` and ``b`` with torch.matmul's broadcasting rules."""
    squeeze: list[int] = []
    if a.dim() == 1:
        a = a.unsqueeze(0)
        squeeze.append(-2)
    if b.dim() == 1:
        b = b.unsqueeze(-1)
        squeeze.append(-1)
    batch = tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    m, k = a.shape[-2], a.shape[-1]
    n = b.shape[-1]
    a = a.expand(*batch, m, k)
    b = b.expand(*batch, k, n)
    rank = len(batch) + 2
    return MatmulPlan(a, b, batch, m, n, k, tuple(rank + d for d in squeeze))


def collapse_batch(sizes: Sequence[int], *strides: Sequence[int]) -> tuple[list[int], list[list[int]]]:
    """Merge adjacent batch dimensions that every tensor walks as one (no copy).

    Returns the merged sizes and, per tensor, the merged strides. Size-1
    dimensions are dropped.

    >>> collapse_batch([2, 3], [12, 4], [0, 0])
    ([6], [[4], [0]])
    """
    out_sizes: list[int] = []
    out_strides: list[list[int]] = [[] for _ in strides]
    for i, size in enumerate(sizes):
        if size == 1:
            continue
        if out_sizes and all(s[-1] == st[i] * size for s, st in zip(out_strides, strides)):
            out_sizes[-1] *= size
            for s, st in zip(out_strides, strides):
                s[-1] = st[i]
            continue
        out_sizes.append(size)
        for s, st in zip(out_strides, strides):
            s.append(st[i])
    return out_sizes, out_strides


def pad_batch(sizes: Sequence[int], strides: Sequence[Sequence[int]], n: int) -> tuple[list[int], list[list[int]]]:
    """Left-pad merged batch dims to exactly ``n`` (size 1, stride 0), for kernels that take ``n``.

    >>> pad_batch([6], [[4], [0]], 3)
    ([1, 1, 6], [[0, 0, 4], [0, 0, 0]])
    """
    pad = n - len(sizes)
    return [1] * pad + list(sizes), [[0] * pad + list(s) for s in strides]
