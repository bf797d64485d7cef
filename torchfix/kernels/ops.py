"""``torch.ops.torchfix.matmul``: batched matmul that reads any strides and
mixed floating dtypes, accumulating in float32 (float64 when an operand is).

One operator, registered through ``torch.library.custom_op`` with a fake
(meta) rule, autograd, and an impl per backend:

- CPU (reference): operands go to BLAS as they are; transposed, permuted and
  stride-0 expanded views are not copied (``bmm`` takes them as transposes and
  batch strides). Low-precision operands are upcast to the accumulation dtype
  first (on the CPU that is the accumulation); stepped slices that BLAS cannot
  read are copied by ``bmm`` itself.
- CUDA: a Triton kernel (:mod:`torchfix.kernels.triton_matmul`) that takes
  strides as arguments and casts in registers: no operand is copied or cast.
- MPS: a Metal kernel (:mod:`torchfix.kernels.metal`), same contract; unrun on
  Apple hardware by us.

A backend whose kernel cannot run here (no Triton, Metal unavailable) degrades
to the ATen reference (cast + ``torch.matmul``) with one warning.

>>> import torch, torchfix
>>> a = torch.randn(2, 3, 4, dtype=torch.float16)
>>> b = torch.randn(5, 4, dtype=torch.bfloat16).t()
>>> torch.ops.torchfix.matmul(a, b).dtype
torch.float32
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .. import _warn
from ._shapes import accumulate_dtype, check, collapse_batch, plan, result_dtype

__all__ = ["DECOMPOSITIONS", "aten_reference", "matmul", "raise_error"]

log = logging.getLogger("torchfix")

# The dispatcher's ops, not the torch.* functions: those may be guarded by torchfix
# itself, and the kernel must not re-enter the guards.
_aten = torch.ops.aten


# --- the CPU reference ---------------------------------------------------------------------


def _mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out[...] = a @ b`` for batched views of one batch shape, without copying operands."""
    batch = a.shape[:-2]
    if len(batch) <= 1:
        (_aten.bmm.out if batch else _aten.mm.out)(a, b, out=out)
        return
    sizes, (sa, sb, so) = collapse_batch(batch, a.stride()[:-2], b.stride()[:-2], out.stride()[:-2])
    if len(sizes) <= 1:
        views = []
        for t, s in ((a, sa), (b, sb), (out, so)):
            views.append(t.as_strided((*sizes, *t.shape[-2:]), (*s, *t.stride()[-2:]), t.storage_offset()))
        (_aten.bmm.out if sizes else _aten.mm.out)(views[0], views[1], out=views[2])
        return
    for i in range(batch[0]):  # batch dims no single stride walks: one bmm per leading index
        _mm_into(a[i], b[i], out[i])


def _cpu(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None) -> torch.Tensor:
    check(a, b, out_dtype)
    target = result_dtype(a, b, out_dtype)
    acc = accumulate_dtype(a, b)
    # Cast before broadcasting: .to keeps a dense view's strides and never materialises an expand.
    a = a if a.dtype == acc else a.to(acc)
    b = b if b.dtype == acc else b.to(acc)
    p = plan(a, b)
    out = torch.empty(p.out_shape, dtype=acc, device=a.device)
    if p.k == 0:
        out.zero_()
    elif out.numel():
        _mm_into(p.a, p.b, out)
    if target != acc:
        out = out.to(target)
    return out.reshape(p.result_shape())


def aten_reference(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The operator in aten ops: cast to the accumulation dtype, ``torch.matmul``, cast to
    the result dtype. What a backend without its kernel runs, and the decomposition
    torch-mlir lowers (to ``linalg.matmul`` / ``linalg.batch_matmul``).

    >>> import torch
    >>> aten_reference(torch.ones(2, 3), torch.ones(3, 2, dtype=torch.float16)).dtype
    torch.float32
    """
    target = result_dtype(a, b, out_dtype)
    acc = accumulate_dtype(a, b)
    out = _aten.matmul.default(a.to(acc), b.to(acc))
    return out.to(target)


# --- the operator ----------------------------------------------------------------------------


@torch.library.custom_op("torchfix::matmul", mutates_args=(), device_types="cpu")
def matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Batched matmul with torch.matmul's broadcasting, any strides, mixed floating dtypes.

    Accumulates in float32 (float64 when an operand is float64); returns
    ``out_dtype``, else ``torch.promote_types(a.dtype, b.dtype)``.

    >>> import torch
    >>> a = torch.randn(1, 1, 64, 64)
    >>> b = torch.randn(1, 1, 8, 64).transpose(-1, -2)   # a non-contiguous rhs, read in place
    >>> torch.allclose(torch.ops.torchfix.matmul(a, b), a @ b, atol=1e-5)
    True
    """
    return _cpu(a, b, out_dtype)


@matmul.register_fake
def _fake(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    check(a, b, out_dtype)
    p = plan(a, b)
    return a.new_empty(p.result_shape(), dtype=result_dtype(a, b, out_dtype))


def _fallback(device_type: str, why: str, a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None) -> torch.Tensor:
    check(a, b, out_dtype)
    _warn.once(
        ("kernel-fallback", device_type),
        f"torchfix::matmul on {device_type}: {why}; using the ATen path (each operand is cast/copied) from now on.",
        stacklevel=3,
    )
    log.debug("torchfix::matmul %s fallback: %s", device_type, why)
    return aten_reference(a, b, out_dtype)


def _on_backend(
    device_type: str, backend: Any, unsupported: str, a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None
) -> torch.Tensor:
    """Run ``backend`` (a module with ``unavailable_reason``, ``supports``, ``matmul``, which checks
    its arguments itself), or fall back to ATen."""
    why = backend.unavailable_reason()
    if why is not None or not backend.supports(a, b):
        return _fallback(device_type, why or unsupported, a, b, out_dtype)
    return backend.matmul(a, b, out_dtype)


@matmul.register_kernel("cuda")
def _cuda(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    from . import triton_matmul

    return _on_backend("cuda", triton_matmul, "float64 has no Triton path", a, b, out_dtype)


@matmul.register_kernel("mps")
def _mps(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    from . import metal

    return _on_backend("mps", metal, "float64 does not exist on MPS", a, b, out_dtype)


# --- autograd ----------------------------------------------------------------------------------


def _setup_context(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
    a, b, _ = inputs
    ctx.save_for_backward(a, b)  # type: ignore[attr-defined]


def _backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
    a, b = ctx.saved_tensors  # type: ignore[attr-defined]
    a2 = a.unsqueeze(0) if a.dim() == 1 else a
    b2 = b.unsqueeze(-1) if b.dim() == 1 else b
    g = grad
    if b.dim() == 1:
        g = g.unsqueeze(-1)
    if a.dim() == 1:
        g = g.unsqueeze(-2)
    needs_a, needs_b = ctx.needs_input_grad[:2]  # type: ignore[attr-defined]
    ga = gb = None
    if needs_a:
        ga = torch.ops.torchfix.matmul(g, b2.mT, out_dtype=a.dtype).sum_to_size(a2.shape).reshape(a.shape)
    if needs_b:
        gb = torch.ops.torchfix.matmul(a2.mT, g, out_dtype=b.dtype).sum_to_size(b2.shape).reshape(b.shape)
    return ga, gb, None


matmul.register_autograd(_backward, setup_context=_setup_context)


DECOMPOSITIONS = {torch.ops.torchfix.matmul.default: aten_reference}
"""Maps the operator to aten ops; pass to ``torch_mlir.fx.export_and_import(decomposition_table=...)``
or ``ExportedProgram.run_decompositions``."""


# --- strict mode inside compiled code ----------------------------------------------------------

_ERROR_KINDS = {"dtype": "DtypeMismatchError", "device": "DeviceMismatchError", "stride": "LayoutError"}


@torch.library.custom_op("torchfix::raise_error", mutates_args=())
def raise_error(result: torch.Tensor, message: str, guard: str) -> torch.Tensor:
    """Raise torchfix's error for ``guard`` with ``message`` when the compiled code runs.

    Strict mode under ``torch.compile`` puts this op where the guard would have
    fixed the call: the graph stays whole (also with ``fullgraph=True``) and the
    user gets :class:`torchfix.DtypeMismatchError` (or the device/layout error)
    from the compiled call, never a dynamo-internal error. ``result`` is the
    fixed call's value, so the traced shapes downstream stay right; it is never
    returned.
    """
    from .. import errors

    raise getattr(errors, _ERROR_KINDS.get(guard, "TorchfixError"))(message)


@raise_error.register_fake
def _raise_error_fake(result: torch.Tensor, message: str, guard: str) -> torch.Tensor:
    return torch.empty_like(result)


def _raise_error_backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
    return grad, None, None  # never runs (the forward raises); lets AOTAutograd trace models that need grads


raise_error.register_autograd(_raise_error_backward)
