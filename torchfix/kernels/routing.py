"""Each routed guarded callable, written with ``torch.ops.torchfix.matmul``.

>>> import torch
>>> from torchfix.guards.ops import spec
>>> x, w = torch.randn(2, 3, dtype=torch.bfloat16), torch.randn(4, 3, dtype=torch.float16)
>>> call(spec("F.linear"), (x, w), {}, torch.bfloat16).shape
torch.Size([2, 4])
"""

from __future__ import annotations

from typing import Any

import torch

from ..guards.ops import OpSpec

__all__ = ["NOT_ROUTED", "call"]

NOT_ROUTED: Any = object()
"""Returned when this call's arguments have no kernel form (``out=``, wrong ranks): the caller falls back."""


def _named(spec: OpSpec, args: tuple, kwargs: dict) -> dict[str, Any]:
    named = dict(zip(spec.params, args))
    named.update({k: v for k, v in kwargs.items() if k in spec.params})
    return named


def _scaled(t: torch.Tensor, factor: Any) -> torch.Tensor:
    return t if factor == 1 else t * factor


def call(spec: OpSpec, args: tuple, kwargs: dict, out_dtype: torch.dtype) -> Any:
    """Compute ``spec``'s call with the kernel, or return :data:`NOT_ROUTED`."""
    mm = torch.ops.torchfix.matmul
    extra = set(kwargs) - set(spec.params)
    if "out" in extra or len(args) > len(spec.params):
        return NOT_ROUTED
    a = _named(spec, args, kwargs)
    p = spec.params
    if spec.kind == "linear":
        x, w, bias = a.get("input"), a.get("weight"), a.get("bias")
        if x is None or w is None or w.dim() != 2 or x.dim() < 1:
            return NOT_ROUTED
        y = mm(x, w.t(), out_dtype=out_dtype)
        return y if bias is None else y + bias.to(out_dtype)
    if spec.family == "matmul":
        lhs, rhs = a.get(p[0]), a.get(p[1])
        if spec.name == "Tensor.__rmatmul__":
            lhs, rhs = rhs, lhs
        return mm(lhs, rhs, out_dtype=out_dtype)
    rank = 2 if spec.family == "mm" else 3
    if len(p) == 2:
        lhs, rhs = a.get(p[0]), a.get(p[1])
        if lhs.dim() != rank or rhs.dim() != rank or (rank == 3 and lhs.shape[0] != rhs.shape[0]):
            return NOT_ROUTED  # let torch raise its own shape error
        return mm(lhs, rhs, out_dtype=out_dtype)
    # addmm / baddbmm: beta * input + alpha * (m1 @ m2); beta=0 ignores input (even NaN), as torch does
    inp, lhs, rhs = a.get(p[0]), a.get(p[1]), a.get(p[2])
    if lhs.dim() != rank or rhs.dim() != rank or (rank == 3 and lhs.shape[0] != rhs.shape[0]):
        return NOT_ROUTED
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    prod = _scaled(mm(lhs, rhs, out_dtype=out_dtype), alpha)
    if beta == 0:
        return prod
    return prod + _scaled(inp.to(out_dtype), beta)
