"""Does plain torch accept this mix of dtypes? Asked of torch itself, once per signature.

The rule torchfix lives by (see :mod:`torchfix.guards`) is that a call torch
accepts goes through untouched. Which mixes torch accepts differs by op,
backend, autocast state and torch version (CPU ``layer_norm`` takes bf16 input
with fp32 parameters but not fp16 ones; ``sdpa`` takes a bool, fp32 or
query-dtype mask; autocast makes ``mm`` of fp16 and bf16 valid). A hand-written
table gets some of these wrong on some backend, so instead this module runs
the op's ATen overload on tiny tensors of the call's dtypes, on the call's
device, under the call's autocast state, and caches the verdict.

It calls ``torch.ops.aten`` overloads directly, never the patched Python
callables, so probing cannot recurse into the guards. It patches nothing.

>>> import torch
>>> from torchfix.guards.plan import Operand
>>> cpu = torch.device("cpu")
>>> q = [Operand(n, torch.bfloat16, cpu) for n in ("query", "key", "value")]
>>> accepts("F.scaled_dot_product_attention", [*q, Operand("attn_mask", torch.float32, cpu)])
True
>>> accepts("F.linear", [Operand("input", torch.bfloat16, cpu), Operand("weight", torch.float16, cpu)])
False
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from .plan import Operand

__all__ = ["accepts", "clear"]

aten = torch.ops.aten
Probe = Callable[[dict[str, torch.Tensor]], object]


def _mm(op: Callable[..., object], a: str, b: str, bias: str | None = None) -> Probe:
    def probe(t: dict[str, torch.Tensor]) -> object:
        return op(t[bias], t[a], t[b]) if bias else op(t[a], t[b])

    return probe


def _sdpa(t: dict[str, torch.Tensor]) -> object:
    return aten.scaled_dot_product_attention(t["query"], t["key"], t["value"], t.get("attn_mask"))


# Shapes per operand role: the smallest that every backend's kernel accepts.
_SHAPES: dict[str, dict[str, tuple[int, ...]]] = {
    "mm": {"input": (2, 2), "self": (2, 2), "mat1": (2, 2), "mat2": (2, 2), "other": (2, 2)},
    "bmm": {"input": (1, 2, 2), "self": (1, 2, 2), "batch1": (1, 2, 2), "batch2": (1, 2, 2), "mat2": (1, 2, 2)},
    "linear": {"input": (1, 2), "weight": (2, 2), "bias": (2,)},
    "conv1d": {"input": (1, 1, 3), "weight": (1, 1, 1), "bias": (1,)},
    "conv2d": {"input": (1, 1, 3, 3), "weight": (1, 1, 1, 1), "bias": (1,)},
    "conv3d": {"input": (1, 1, 3, 3, 3), "weight": (1, 1, 1, 1, 1), "bias": (1,)},
    "sdpa": {"query": (1, 1, 2, 2), "key": (1, 1, 2, 2), "value": (1, 1, 2, 2), "attn_mask": (2, 2)},
    "layer_norm": {"input": (1, 2), "weight": (2,), "bias": (2,)},
    "group_norm": {"input": (1, 2, 1), "weight": (2,), "bias": (2,)},
}

# display name -> (shape table, probe)
_PROBES: dict[str, tuple[str, Probe]] = {
    "torch.matmul": ("mm", _mm(aten.matmul, "input", "other")),
    "Tensor.matmul": ("mm", _mm(aten.matmul, "self", "other")),
    "Tensor.__matmul__": ("mm", _mm(aten.matmul, "self", "other")),
    "Tensor.__rmatmul__": ("mm", _mm(aten.matmul, "other", "self")),
    "torch.mm": ("mm", _mm(aten.mm, "input", "mat2")),
    "Tensor.mm": ("mm", _mm(aten.mm, "self", "mat2")),
    "torch.bmm": ("bmm", _mm(aten.bmm, "input", "mat2")),
    "Tensor.bmm": ("bmm", _mm(aten.bmm, "self", "mat2")),
    "torch.addmm": ("mm", _mm(aten.addmm, "mat1", "mat2", "input")),
    "Tensor.addmm": ("mm", _mm(aten.addmm, "mat1", "mat2", "self")),
    "torch.baddbmm": ("bmm", _mm(aten.baddbmm, "batch1", "batch2", "input")),
    "Tensor.baddbmm": ("bmm", _mm(aten.baddbmm, "batch1", "batch2", "self")),
    "F.linear": ("linear", lambda t: aten.linear(t["input"], t["weight"], t.get("bias"))),
    "F.conv1d": ("conv1d", lambda t: aten.conv1d(t["input"], t["weight"], t.get("bias"))),
    "F.conv2d": ("conv2d", lambda t: aten.conv2d(t["input"], t["weight"], t.get("bias"))),
    "F.conv3d": ("conv3d", lambda t: aten.conv3d(t["input"], t["weight"], t.get("bias"))),
    "F.scaled_dot_product_attention": ("sdpa", _sdpa),
    "F.layer_norm": ("layer_norm", lambda t: aten.layer_norm(t["input"], [2], t.get("weight"), t.get("bias"))),
    "F.group_norm": ("group_norm", lambda t: aten.group_norm(t["input"], 1, t.get("weight"), t.get("bias"))),
}
for _name in ("torch.cat", "torch.concat", "torch.concatenate"):
    _PROBES[_name] = ("cat", lambda t: aten.cat(list(t.values())))
_TWINS = {"torch.linalg.matmul": "torch.matmul"}
_TWINS.update((f"torch.{n}", f"F.{n}") for n in ("conv1d", "conv2d", "conv3d", "layer_norm", "group_norm"))
for _alias, _twin in _TWINS.items():
    _PROBES[_alias] = _PROBES[_twin]  # the same builtin under another spelling

Key = tuple[str, tuple[tuple[str, torch.dtype, int | None, bool], ...], torch.device, torch.dtype | None]
_verdicts: dict[Key, bool] = {}
_lock = threading.Lock()


@contextlib.contextmanager
def _autocast(device_type: str, dtype: torch.dtype | None) -> Iterator[None]:
    """The caller's autocast state, set explicitly: under torch.compile the ambient
    state at trace time is not the traced code's."""
    try:
        ctx = torch.autocast(device_type, dtype=dtype) if dtype is not None else torch.autocast(device_type, enabled=False)
    except RuntimeError:  # a device type autocast does not know (meta): nothing to switch
        ctx = contextlib.nullcontext()
    with ctx:
        yield


def _shape(table: str, role: str, rank: int | None) -> tuple[int, ...]:
    """The role's probe shape, at the call's rank: torch's rules can differ by rank
    (``F.linear`` adds a bias of another dtype to a 1-D input's result, not to a 2-D one's)."""
    base = _SHAPES.get(table, {}).get(role, (1,))
    if rank is None or rank == len(base):
        return base
    if table == "group_norm" and role == "input":
        return (1, 2, *(1,) * (rank - 2)) if rank >= 2 else base
    if rank < len(base):
        return base[len(base) - rank :]
    return (*(1,) * (rank - len(base)), *base)


def _tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, contiguous: bool) -> torch.Tensor:
    fill = True if dtype is torch.bool else 0.5 if dtype.is_floating_point else 1
    if contiguous or not shape:
        return torch.full(shape, fill, dtype=dtype, device=device)
    # a stepped view: same shape, not contiguous (torch picks some code paths by layout)
    return torch.full((*shape[:-1], 2 * shape[-1]), fill, dtype=dtype, device=device)[..., ::2]


def _run(op: str, operands: Sequence[Operand], device: torch.device, autocast_dtype: torch.dtype | None) -> bool:
    table, probe = _PROBES[op]
    # No guard, hook or mode of the caller's may see the probe: it only asks ATen.
    with torch.no_grad(), _autocast(device.type, autocast_dtype), torch.utils._python_dispatch._disable_current_modes():
        tensors = {o.name: _tensor(_shape(table, o.role, o.rank), o.dtype, device, o.contiguous) for o in operands}
        try:
            probe(tensors)
        except (RuntimeError, TypeError, NotImplementedError, ValueError):
            return False
    return True


def accepts(op: str, operands: Sequence[Operand], autocast_dtype: torch.dtype | None = None) -> bool:
    """Whether plain torch runs ``op`` on operands of these dtypes without raising.

    Asked once per (op, operand names, dtypes, ranks and contiguity, device,
    autocast dtype) by running the op's ATen overload on tiny tensors of those
    ranks and layouts; the answer is cached. Sizes are not asked about: they are
    the caller's business, and torch reports size errors itself.

    Args:
        op: a guarded callable's display name (``F.linear``).
        operands: the call's tensor arguments, all on one device.
        autocast_dtype: autocast's dtype for that device type, or ``None``.
    """
    device = operands[0].device if operands else torch.device("cpu")
    key: Key = (op, tuple((o.name, o.dtype, o.rank, o.contiguous) for o in operands), device, autocast_dtype)
    verdict = _verdicts.get(key)
    if verdict is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return True  # nothing may be allocated while capturing; torch reports its own error if it has one
        verdict = _run(op, operands, device, autocast_dtype)
        with _lock:
            _verdicts[key] = verdict
    return verdict


def clear() -> None:
    """Forget every cached verdict (tests; a verdict never changes within a process)."""
    with _lock:
        _verdicts.clear()
