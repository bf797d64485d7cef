"""Backend bugs keyed on device type, op, argument layout and torch version — as data.

Each :class:`KnownIssue` row says: on this device type, for these ops, when
this predicate holds of the arguments, in these torch (and macOS) versions,
pytorch issue N gives wrong results or crashes, and this workaround avoids it.
The stride guard reads the table; adding a quirk is one reviewed row.

>>> rows = matching("mm", {"input": None}, device_type="cpu", torch_version="2.13.0")
>>> rows
[]
"""

from __future__ import annotations

import platform
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

__all__ = [
    "WORKAROUNDS",
    "KnownIssue",
    "add",
    "any_noncontiguous",
    "entries",
    "matching",
    "parse_version",
    "remove",
]

WORKAROUNDS = ("contiguous", "upcast", "cpu", "kernel")

Predicate = Callable[[Mapping[str, torch.Tensor]], tuple[str, ...]]


def parse_version(text: str | None) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` → ``(2, 13, 0)``; ``"2.1.0.dev2023"`` → ``(2, 1, 0)``."""
    if not text:
        return ()
    parts = []
    for piece in text.split("+", 1)[0].split("."):
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if digits != piece:
            break
    return tuple(parts)


def _in_range(version: tuple[int, ...], low: str | None, high: str | None) -> bool:
    if low is not None and version < parse_version(low):
        return False
    return not (high is not None and version >= parse_version(high))


# --- predicates: given the call's tensors by name, the names that trigger the bug ----------


def any_noncontiguous(tensors: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """Every tensor operand that is not contiguous."""
    return tuple(n for n, t in tensors.items() if isinstance(t, torch.Tensor) and not t.is_contiguous())


def weight_noncontiguous(tensors: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """The weight, when it is not contiguous."""
    w = tensors.get("weight")
    return ("weight",) if isinstance(w, torch.Tensor) and not w.is_contiguous() else ()


def input_noncontiguous(tensors: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """The input (first operand), when it is not contiguous."""
    name = next(iter(tensors), None)
    t = tensors.get(name) if name is not None else None
    return (name,) if isinstance(t, torch.Tensor) and not t.is_contiguous() else ()


def qkv_noncontiguous(tensors: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """Query, key or value that are not contiguous (e.g. made by ``permute``)."""
    return tuple(n for n in ("query", "key", "value") if isinstance(tensors.get(n), torch.Tensor) and not tensors[n].is_contiguous())


def large_bmm_noncontiguous(tensors: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """A non-contiguous operand of a batched matmul whose output exceeds 2**32 elements."""
    ts = [t for t in tensors.values() if isinstance(t, torch.Tensor)]
    if len(ts) < 2 or ts[-2].dim() < 2 or ts[-1].dim() < 2:
        return ()
    a, b = ts[-2], ts[-1]
    batch = 1
    for d in torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]):
        batch *= d
    if batch * a.shape[-2] * b.shape[-1] <= 2**32:
        return ()
    return any_noncontiguous(tensors)


def low_precision_input_fp32_params(tensors: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """fp16/bf16 input with float32 weight or bias."""
    x = tensors.get("input")
    params = [tensors.get(n) for n in ("weight", "bias") if isinstance(tensors.get(n), torch.Tensor)]
    if isinstance(x, torch.Tensor) and x.dtype in (torch.float16, torch.bfloat16) and any(p.dtype == torch.float32 for p in params):
        return ("input",)
    return ()


def fp16_input(tensors: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """A float16 input."""
    x = tensors.get("input")
    return ("input",) if isinstance(x, torch.Tensor) and x.dtype == torch.float16 else ()


@dataclass(frozen=True)
class KnownIssue:
    """One backend bug and its workaround.

    Args:
        device_type: ``"mps"``, ``"cuda"``, ``"cpu"``, ...
        ops: op families it affects (see ``OpSpec.family``).
        predicate: given ``{name: tensor}``, the names that trigger it (empty: no match).
        issue: reference, e.g. ``"pytorch/pytorch#78511"``.
        workaround: ``contiguous`` (copy the offending operands), ``upcast``
            (run in float32, cast back), ``cpu`` (run on CPU, move back), or ``kernel``.
        torch_min: first affected torch version (inclusive), ``None`` for all before.
        torch_max: first fixed torch version (exclusive), ``None`` while open.
        os_min, os_max: affected macOS range in the same form (``None``: any).
        description: what goes wrong, in a sentence.

    >>> KnownIssue("mps", ("mm",), any_noncontiguous, "example#1", "contiguous").workaround
    'contiguous'
    """

    device_type: str
    ops: tuple[str, ...]
    predicate: Predicate
    issue: str
    workaround: str
    torch_min: str | None = None
    torch_max: str | None = None
    os_min: str | None = None
    os_max: str | None = None
    description: str = ""
    user: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        if self.workaround not in WORKAROUNDS:
            raise ValueError(f"torchfix: known issue {self.issue}: workaround={self.workaround!r} must be one of {WORKAROUNDS}.")
        if isinstance(self.ops, str):
            object.__setattr__(self, "ops", (self.ops,))
        if not callable(self.predicate):
            raise TypeError(f"torchfix: known issue {self.issue}: predicate must be callable(tensors) -> tuple of names.")

    def applies_to(self, device_type: str, torch_version: str, os_version: str | None = None) -> bool:
        """Whether this row is in force for a device type, torch version and macOS version."""
        if device_type != self.device_type:
            return False
        if not _in_range(parse_version(torch_version), self.torch_min, self.torch_max):
            return False
        if os_version and (self.os_min or self.os_max):
            return _in_range(parse_version(os_version), self.os_min, self.os_max)
        return True


_BUILTIN: tuple[KnownIssue, ...] = (
    KnownIssue(
        "mps",
        ("matmul", "mm", "bmm"),
        any_noncontiguous,
        "pytorch/pytorch#78511",
        "contiguous",
        torch_max="1.13",
        description="matmul of a permuted (non-contiguous) tensor returned wrong values",
    ),
    KnownIssue(
        "mps",
        ("layer_norm",),
        input_noncontiguous,
        "pytorch/pytorch#80800",
        "contiguous",
        torch_max="1.13",
        description="layer_norm of a non-contiguous input was wrong (AUTOMATIC1111 mac_specific.py workaround)",
    ),
    KnownIssue(
        "mps",
        ("layer_norm",),
        fp16_input,
        "pytorch/pytorch#96113",
        "upcast",
        torch_min="2.0",
        torch_max="2.1",
        description="layer_norm crashed on float16 input (fixed by pytorch/pytorch#96430)",
    ),
    KnownIssue(
        "mps",
        ("linear",),
        weight_noncontiguous,
        "pytorch/pytorch#162730",
        "contiguous",
        torch_min="2.8",
        torch_max="2.9",
        description="F.linear read a non-contiguous weight wrongly in the no-graph fast path",
    ),
    KnownIssue(
        "mps",
        ("linear",),
        input_noncontiguous,
        "pytorch/pytorch#167154",
        "contiguous",
        torch_min="2.8",
        torch_max="2.10",
        description="F.linear on a non-contiguous (e.g. stride-0) input allocated too small a buffer and aborted",
    ),
    KnownIssue(
        "mps",
        ("sdpa",),
        qkv_noncontiguous,
        "pytorch/pytorch#181133",
        "contiguous",
        torch_max="2.14",
        description="scaled_dot_product_attention returned wrong values for permuted q/k/v",
    ),
    KnownIssue(
        "mps",
        ("layer_norm",),
        low_precision_input_fp32_params,
        "pytorch/pytorch#190054",
        "upcast",
        torch_max="2.14",
        description="layer_norm with fp16/bf16 input and fp32 weight reinterpreted the parameters' bits",
    ),
    KnownIssue(
        "mps",
        ("conv",),
        weight_noncontiguous,
        "pytorch/pytorch#192212",
        "contiguous",
        torch_max="2.14",
        description="conv2d read a non-contiguous weight (e.g. weight[:, :, k] of a 5-D kernel) wrongly, silently",
    ),
    KnownIssue(
        "mps",
        ("bmm", "matmul"),
        large_bmm_noncontiguous,
        "pytorch/pytorch#197636",
        "contiguous",
        os_min="15",
        description="bmm returned wrong values when the output exceeds 2**32 elements and an input is non-contiguous (open)",
    ),
)

_lock = threading.Lock()
_entries: list[KnownIssue] = list(_BUILTIN)
TORCH_VERSION = torch.__version__
OS_VERSION = platform.mac_ver()[0] or None

# Device types that have a row in force for this torch and OS and a backend this
# process can use; the guards' fast path reads this one frozenset, so a process
# with no such rows (Linux with CPU/CUDA today) pays nothing for the stride guard.
ACTIVE_DEVICE_TYPES: frozenset[str] = frozenset()
# The same set in a one-element list that wrappers hold directly (a closure
# index is cheaper than a module attribute on the per-call path).
ACTIVE_HOLDER: list[frozenset[str]] = [ACTIVE_DEVICE_TYPES]


def _backend_usable(device_type: str) -> bool:
    # Asks without initialising anything (no CUDA context is created).
    if device_type in ("cpu", "meta"):
        return True
    backend = getattr(torch.backends, device_type, None) if device_type == "mps" else getattr(torch, device_type, None)
    is_available = getattr(backend, "is_available", None)
    try:
        return bool(is_available()) if callable(is_available) else True
    except Exception:  # a backend that cannot answer is treated as present
        return True


def _refresh() -> None:
    global ACTIVE_DEVICE_TYPES
    in_force = {e.device_type for e in _entries if e.applies_to(e.device_type, TORCH_VERSION, OS_VERSION)}
    ACTIVE_DEVICE_TYPES = frozenset(t for t in in_force if _backend_usable(t))
    ACTIVE_HOLDER[0] = ACTIVE_DEVICE_TYPES


_refresh()


def entries() -> list[KnownIssue]:
    """Every row, built-in and user-added."""
    with _lock:
        return list(_entries)


def add(entry: KnownIssue) -> KnownIssue:
    """Add a row (e.g. a quirk of your own backend); returns it for :func:`remove`.

    >>> row = add(KnownIssue("cpu", ("mm",), any_noncontiguous, "my-tracker#1", "contiguous"))
    >>> remove(row)
    """
    if not isinstance(entry, KnownIssue):
        raise TypeError("torchfix: add() takes a torchfix.KnownIssue.")
    with _lock:
        _entries.append(entry)
        _refresh()
    return entry


def remove(entry: KnownIssue) -> None:
    """Remove a row added with :func:`add` (a missing row is ignored)."""
    with _lock:
        for i, e in enumerate(_entries):
            if e is entry:
                del _entries[i]
                break
        _refresh()


def matching(
    family: str,
    tensors: Mapping[str, torch.Tensor | None],
    *,
    device_type: str,
    torch_version: str = TORCH_VERSION,
    os_version: str | None = OS_VERSION,
    table: list[KnownIssue] | None = None,
) -> list[tuple[KnownIssue, tuple[str, ...]]]:
    """Rows in force for one call, each with the operand names that trigger it.

    Pure: device type and versions are arguments, so every row is testable on CPU.
    """
    rows = entries() if table is None else table
    found = []
    for e in rows:
        if family in e.ops and e.applies_to(device_type, torch_version, os_version):
            names = e.predicate(tensors)
            if names:
                found.append((e, tuple(names)))
    return found
