"""Backend bugs keyed on device type, op, argument layout and torch version — as data.

Each :class:`KnownIssue` row says: on this device type, for these ops, when
this predicate holds of the arguments, in these torch (and macOS) versions,
pytorch issue N gives wrong results or crashes, and this workaround avoids it.
The stride guard reads the table; adding a quirk is one reviewed row.

Version ranges are half-open: ``torch_min`` is the first affected release
(inclusive), ``torch_max`` the first fixed one (exclusive). Versions compare
as :class:`packaging.version.Version` does, so a nightly or source build of a
fixing release (``2.14.0a0+git…``, ``2.14.0.dev20260901``) sorts *below*
``2.14`` and keeps the guard. Each row's ``basis`` says where its range comes
from, and says so where a bound is an estimate.

>>> rows = matching("mm", {"input": None}, device_type="cpu", torch_version="2.13.0")
>>> rows
[]
"""

from __future__ import annotations

import functools
import platform
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .. import devices
from ..errors import InvalidArgumentError, InvalidArgumentTypeError

if TYPE_CHECKING:
    from packaging.version import Version

__all__ = [
    "WORKAROUNDS",
    "KnownIssue",
    "add",
    "any_noncontiguous",
    "entries",
    "holder",
    "in_force",
    "in_force_here",
    "matching",
    "parse_version",
    "remove",
    "states",
]

WORKAROUNDS = ("contiguous", "upcast", "cpu", "kernel")

Predicate = Callable[[Mapping[str, torch.Tensor]], tuple[str, ...]]


@functools.lru_cache(maxsize=256)
def parse_version(text: str | None, what: str = "version") -> Version | None:
    """``"2.13.0+cpu"`` → ``Version('2.13.0+cpu')``; ``None`` or ``""`` → ``None``.

    Pre-releases sort below their release: ``parse_version("2.14.0a0+git12") < parse_version("2.14")``.

    Raises:
        ValueError: ``text`` is not a version (PEP 440), naming ``what`` it was meant to be.

    >>> parse_version("2.1.0.dev20230306") < parse_version("2.1")
    True
    """
    if not text:
        return None
    from packaging.version import InvalidVersion, Version  # on first use: `import torchfix` stays lean

    try:
        return Version(str(text))
    except InvalidVersion:
        raise InvalidArgumentError(
            f"torchfix: {what}={text!r} is not a version; expected something like '2.13.0', '2.14.0a0+git1234' or '15.6'."
        ) from None


def _in_range(version: Version | None, low: str | None, high: str | None) -> bool:
    if version is None:
        return True
    if low is not None and version < parse_version(low, "lower bound"):
        return False
    return not (high is not None and version >= parse_version(high, "upper bound"))


def _span(low: str | None, high: str | None, name: str) -> str:
    if low and high:
        return f"{low} ≤ {name} < {high}"
    if high:
        return f"{name} < {high}"
    if low:
        return f"{name} ≥ {low}, not fixed yet"
    return f"every {name}, not fixed yet"


# --- predicates: given the call's tensors by name, the names that trigger the bug ----------


def _t(tensors: Mapping[str, torch.Tensor | None], name: str) -> torch.Tensor | None:
    t = tensors.get(name)
    return t if isinstance(t, torch.Tensor) else None


def any_noncontiguous(tensors: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """Every tensor operand that is not contiguous."""
    return tuple(n for n, t in tensors.items() if isinstance(t, torch.Tensor) and not t.is_contiguous())


def weight_noncontiguous(tensors: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """The weight, when it is not contiguous."""
    w = _t(tensors, "weight")
    return ("weight",) if w is not None and not w.is_contiguous() else ()


def input_noncontiguous(tensors: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """The input (first operand), when it is not contiguous."""
    name = next(iter(tensors), None)
    t = tensors.get(name) if name is not None else None
    return (name,) if isinstance(t, torch.Tensor) and not t.is_contiguous() else ()


def input_storage_offset(tensors: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """The input, when it starts past the beginning of its storage (``x[1:3]``): such a
    row slice is contiguous, so only its storage offset tells (the workaround copies it)."""
    x = _t(tensors, "input")
    return ("input",) if x is not None and x.storage_offset() != 0 else ()


def qkv_noncontiguous(tensors: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """Query, key or value that are not contiguous (e.g. made by ``permute``)."""
    return tuple(n for n in ("query", "key", "value") if (t := _t(tensors, n)) is not None and not t.is_contiguous())


def qkv_noncontiguous_batched(tensors: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """Non-contiguous query, key or value with a batch dimension larger than 1."""
    q = _t(tensors, "query")
    if q is None or q.dim() < 4 or q.shape[0] < 2:
        return ()
    return qkv_noncontiguous(tensors)


def query_noncontiguous_fast_path(tensors: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """A non-contiguous query on MPS's vector attention kernel: at most 8 query rows and
    a head dimension of 64, 96 or 128."""
    q = _t(tensors, "query")
    if q is None or q.dim() < 2 or q.is_contiguous() or q.shape[-2] > 8 or q.shape[-1] not in (64, 96, 128):
        return ()
    return ("query",)


def qkv_noncontiguous_with_mask(tensors: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """Non-contiguous query, key or value together with an ``attn_mask``."""
    return qkv_noncontiguous(tensors) if _t(tensors, "attn_mask") is not None else ()


def _broadcast(t: torch.Tensor) -> bool:
    return any(s == 0 and n > 1 for s, n in zip(t.stride(), t.shape))


def stride_zero_operand(tensors: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """Operands with a stride-0 dimension of size > 1 (made by ``expand``)."""
    return tuple(n for n, t in tensors.items() if isinstance(t, torch.Tensor) and _broadcast(t))


def broadcast_kv_len_1_mod_32(tensors: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """Key or value broadcast with a stride 0 (GQA/KV sharing), a key length ≡ 1 (mod 32),
    and an ``attn_mask``."""
    if tensors.get("attn_mask") is None:  # first: most attention calls (diffusers' UNets and DiTs) pass no mask
        return ()
    k = _t(tensors, "key")
    if k is None or k.dim() < 2 or k.shape[-2] % 32 != 1:
        return ()
    return tuple(n for n in ("key", "value") if (t := _t(tensors, n)) is not None and _broadcast(t))


def channel_slice_of_channels_last(tensors: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """A 4-D input whose channels are innermost (stride 1) but which is not contiguous in
    channels_last either: a channel slice ``x[:, :k]`` of a channels_last tensor."""
    x = _t(tensors, "input")
    if x is None or x.dim() != 4 or x.stride(1) != 1 or x.is_contiguous():
        return ()
    return () if x.is_contiguous(memory_format=torch.channels_last) else ("input",)


def channels_last_3d_input(tensors: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """A 5-D input in ``channels_last_3d`` memory format."""
    x = _t(tensors, "input")
    if x is None or x.dim() != 5 or x.is_contiguous():
        return ()
    return ("input",) if x.is_contiguous(memory_format=torch.channels_last_3d) else ()


def strided_out(tensors: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """An ``out=`` tensor that is not contiguous (a slice of a larger buffer)."""
    out = _t(tensors, "out")
    return ("out",) if out is not None and not out.is_contiguous() else ()


def large_bmm_noncontiguous(tensors: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """A non-contiguous operand of a batched matmul whose output exceeds 2**32 elements."""
    ts = [t for n, t in tensors.items() if isinstance(t, torch.Tensor) and n != "out"]
    if len(ts) < 2 or ts[-2].dim() < 2 or ts[-1].dim() < 2:
        return ()
    a, b = ts[-2], ts[-1]
    batch = 1
    for d in torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]):
        batch *= d
    if batch * a.shape[-2] * b.shape[-1] <= 2**32:
        return ()
    return tuple(n for n in any_noncontiguous(tensors) if n != "out")


def cat_over_2_31_elements(tensors: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """Every operand of a cat whose output has 2**31 elements or more."""
    named = [(n, t) for n, t in tensors.items() if isinstance(t, torch.Tensor) and n != "out"]
    return tuple(n for n, _ in named) if sum(t.numel() for _, t in named) >= 2**31 else ()


def low_precision_input_fp32_params(tensors: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """fp16/bf16 input with float32 weight or bias."""
    x = _t(tensors, "input")
    params = [t for n in ("weight", "bias") if (t := _t(tensors, n)) is not None]
    if x is not None and x.dtype in (torch.float16, torch.bfloat16) and any(p.dtype == torch.float32 for p in params):
        return ("input",)
    return ()


def fp16_input(tensors: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    """A float16 input."""
    x = _t(tensors, "input")
    return ("input",) if x is not None and x.dtype == torch.float16 else ()


@dataclass(frozen=True)
class KnownIssue:
    """One backend bug and its workaround.

    Args:
        device_type: ``"mps"``, ``"cuda"``, ``"cpu"``, ...
        ops: op families it affects (see ``OpSpec.family``).
        predicate: given ``{name: tensor}``, the names that trigger it (empty: no match).
        issue: reference, e.g. ``"pytorch/pytorch#78511"``.
        workaround: ``contiguous`` (copy the offending operands into fresh contiguous
            memory; an ``out=`` operand is computed into a fresh tensor and copied in),
            ``upcast`` (run in float32, cast back), ``cpu`` (run on CPU, move back), or ``kernel``.
        torch_min: first affected torch version (inclusive), ``None`` for all before.
        torch_max: first fixed torch version (exclusive), ``None`` while open.
        os_min, os_max: affected macOS range, same form (``None``: any). A row with an
            OS range is in force only on macOS.
        description: what goes wrong, in a sentence.
        basis: where the range comes from (the fixing PR, the release it landed in), and
            which bound is an estimate.

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
    basis: str = ""

    def __post_init__(self) -> None:
        if self.workaround not in WORKAROUNDS:
            raise InvalidArgumentError(f"torchfix: known issue {self.issue}: workaround={self.workaround!r} must be one of {WORKAROUNDS}.")
        if isinstance(self.ops, str):
            object.__setattr__(self, "ops", (self.ops,))
        if not callable(self.predicate):
            raise InvalidArgumentTypeError(f"torchfix: known issue {self.issue}: predicate must be callable(tensors) -> tuple of names.")

    def validate(self) -> KnownIssue:
        """Check the version bounds (:func:`add` does; the built-in rows are checked by the tests).

        Raises:
            ValueError: a bound is not a version, or a range is empty (the upper end is exclusive).
        """
        names = ("torch_min", "torch_max", "os_min", "os_max")
        bounds = {n: parse_version(getattr(self, n), f"known issue {self.issue}: {n}") for n in names}
        for low, high in (("torch_min", "torch_max"), ("os_min", "os_max")):
            a, b = bounds[low], bounds[high]
            if a is not None and b is not None and a >= b:
                raise InvalidArgumentError(
                    f"torchfix: known issue {self.issue}: {low}={getattr(self, low)!r} must be below "
                    f"{high}={getattr(self, high)!r} (the upper end is exclusive)."
                )
        return self

    @property
    def torch_range(self) -> str:
        """The affected torch versions, e.g. ``"2.8 ≤ torch < 2.13"`` (upper end exclusive)."""
        return _span(self.torch_min, self.torch_max, "torch")

    @property
    def os_range(self) -> str:
        """The affected macOS versions (``"any OS"`` for a row without one)."""
        if self.os_min is None and self.os_max is None:
            return "any macOS" if self.device_type == "mps" else "any OS"
        return _span(self.os_min, self.os_max, "macOS").replace(", not fixed yet", "")

    def explain(self, device_type: str, torch_version: str | None, os_version: str | None) -> tuple[bool, str]:
        """Whether the row is in force for a device type, torch and macOS version, and why.

        ``os_version=None`` means "not macOS": rows with an OS range, and MPS rows, are then
        not in force. Invalid versions raise ``ValueError``.

        >>> row = KnownIssue("mps", ("mm",), any_noncontiguous, "x#1", "contiguous", torch_max="2.0")
        >>> row.explain("mps", "2.13.0", "15.1")
        (False, 'torch 2.13.0 is not in torch < 2.0')
        """
        if device_type != self.device_type:
            return False, f"a {self.device_type} row; the device is {device_type}"
        v = parse_version(torch_version, "torch_version")
        if not _in_range(v, self.torch_min, self.torch_max):
            return False, f"torch {torch_version} is not in {self.torch_range}"
        needs_mac = self.device_type == "mps" or self.os_min is not None or self.os_max is not None
        if needs_mac:
            if not os_version:
                return False, f"needs macOS ({self.os_range}); this is {platform.system() or 'not macOS'}"
            if not _in_range(parse_version(os_version, "os_version"), self.os_min, self.os_max):
                return False, f"macOS {os_version} is not in {self.os_range}"
        where = f"; macOS {os_version} in {self.os_range}" if needs_mac else ""
        return True, f"torch {torch_version} in {self.torch_range}{where}"

    def applies_to(self, device_type: str, torch_version: str, os_version: str | None = None) -> bool:
        """Whether this row is in force for a device type, torch version and macOS version.

        Pure, for tests and the audit: ``os_version=None`` means "unknown" here, so an OS
        range is not checked (use :meth:`explain` for a real machine).
        """
        if device_type != self.device_type:
            return False
        if not _in_range(parse_version(torch_version, "torch_version"), self.torch_min, self.torch_max):
            return False
        if os_version and (self.os_min or self.os_max):
            return _in_range(parse_version(os_version, "os_version"), self.os_min, self.os_max)
        return True


_M128393 = "the strided MPSNDArray path came with pytorch/pytorch#128393 (macOS 15+), opened after the 2.4 branch cut, so torch 2.5"
_ERRS_HIGH = "the upper bound errs high (a copy is always a correct result, only a slower one)"

_BUILTIN: tuple[KnownIssue, ...] = (
    KnownIssue(
        "mps", ("matmul", "mm", "bmm"), any_noncontiguous, "pytorch/pytorch#78511", "contiguous", torch_max="1.13",
        description="matmul of a permuted (non-contiguous) tensor returned wrong values",
        basis="reported on 1.12 nightlies; fixed before the 1.13 release",
    ),
    KnownIssue(
        "mps", ("layer_norm",), input_noncontiguous, "pytorch/pytorch#80800", "contiguous", torch_max="1.13",
        description="layer_norm of a non-contiguous input was wrong (AUTOMATIC1111 mac_specific.py workaround)",
        basis="reported on 1.12; fixed before the 1.13 release",
    ),
    KnownIssue(
        "mps", ("layer_norm",), fp16_input, "pytorch/pytorch#96113", "upcast", torch_min="2.0", torch_max="2.1",
        description="layer_norm crashed on float16 input",
        basis="reported on 2.0; fixed by pytorch/pytorch#96430, in 2.1",
    ),
    KnownIssue(
        "mps", ("linear",), any_noncontiguous, "pytorch/pytorch#162730", "contiguous", torch_min="2.8", torch_max="2.9", os_min="15",
        description="F.linear's no-graph path (macOS 15+) read a non-contiguous input, weight or bias wrongly "
        "(also pytorch/pytorch#161640)",
        basis="the no-graph path came with pytorch/pytorch#152210 (2.8); the fix (main, then backported to 2.8 by "
        "pytorch/pytorch#162779) checks input, weight and bias and is in 2.9",
    ),
    KnownIssue(
        "mps", ("linear",), input_noncontiguous, "pytorch/pytorch#167154", "contiguous", torch_min="2.8", torch_max="2.10",
        description="F.linear on a non-contiguous (e.g. stride-0) input allocated too small a buffer and aborted",
        basis="ESTIMATE: the thread names no fixing release; 2.8 is the no-graph path's first release and 2.10 the first "
        "release after the issue was closed",
    ),
    KnownIssue(
        "mps", ("sdpa",), query_noncontiguous_fast_path, "pytorch/pytorch#163597", "contiguous", torch_min="2.8", torch_max="2.9",
        description="scaled_dot_product_attention's vector kernel ignored the strides of a transposed query (≤ 8 query rows, "
        "head dim 64/96/128)",
        basis="a regression from pytorch/pytorch#152781 (2.8); fixed by pytorch/pytorch#163598, a 2.9 milestone",
    ),
    KnownIssue(
        "mps", ("sdpa",), qkv_noncontiguous_batched, "pytorch/pytorch#181133", "contiguous", torch_min="2.8", torch_max="2.13",
        description="scaled_dot_product_attention returned wrong values for permuted q/k/v with a batch larger than 1",
        basis="the Metal kernel came with pytorch/pytorch#152781 (2.8); fixed by pytorch/pytorch#181151 (merged 2026-04-23); "
        "its cherry-pick onto release/2.12 was requested on 2026-04-29 but is not confirmed, so 2.12.x stays covered and "
        + _ERRS_HIGH,
    ),
    KnownIssue(
        "mps", ("layer_norm",), low_precision_input_fp32_params, "pytorch/pytorch#190054", "upcast", torch_max="2.14",
        description="layer_norm with fp16/bf16 input and fp32 weight reinterpreted the parameters' bits",
        basis="ESTIMATE: the first release after the issue was closed; " + _ERRS_HIGH,
    ),
    KnownIssue(
        "mps", ("conv",), weight_noncontiguous, "pytorch/pytorch#192212", "contiguous", torch_min="2.5", torch_max="2.15", os_min="15",
        description="conv2d read a non-contiguous weight (e.g. weight[:, :, k] of a 5-D kernel) wrongly, silently",
        basis=f"a regression: {_M128393}; fixed by pytorch/pytorch#192303 (merged 2026-08-06, close to the 2.14 branch cut "
        "and not confirmed in 2.14.0), so " + _ERRS_HIGH,
    ),
    KnownIssue(
        "mps", ("mm", "matmul", "bmm"), stride_zero_operand, "pytorch/pytorch#180201", "contiguous",
        torch_min="2.5", torch_max="2.13", os_min="15.0", os_max="26.4",
        description="mm with a stride-0 (expanded) operand computed only every 16th output row; the rest were zeros",
        basis=f"{_M128393}; fixed by pytorch/pytorch#180236 (merged 2026-04-14, a month before 2.12.0 and not confirmed in it), "
        "which keeps the strided path on macOS ≥ 26.4 where MPSGraph is fixed; " + _ERRS_HIGH,
    ),
    KnownIssue(
        "mps", ("layer_norm",), input_storage_offset, "pytorch/pytorch#131750", "contiguous", torch_max="2.5",
        description="layer_norm on a row slice (contiguous, storage offset > 0) normalised the storage's first rows instead",
        basis="ESTIMATE: reported on 2.4; the thread names no fix; the same gather logic was fixed for batch_norm by "
        "pytorch/pytorch#133610 in 2.5",
    ),
    KnownIssue(
        "mps", ("batch_norm",), input_storage_offset, "pytorch/pytorch#133520", "contiguous", torch_min="2.4", torch_max="2.5",
        description="batch_norm on a sliced input (storage offset > 0) read the wrong data (a regression in 2.4); "
        "batch_norm is not a guarded call, so this row is checked by torchfix.audit only",
        basis="labelled a 2.4 regression; fixed by pytorch/pytorch#133610, moved to the 2.5.0 milestone",
    ),
    KnownIssue(
        "mps", ("conv",), channel_slice_of_channels_last, "pytorch/pytorch#180984", "contiguous", torch_max="2.13",
        description="conv2d on a channel slice of a channels_last tensor read the channels of the whole tensor",
        basis="fixed by pytorch/pytorch#180992 (merged 2026-04-21, weeks before 2.12.0 and not confirmed in it); the first "
        "affected release is not named, so every earlier release is covered; " + _ERRS_HIGH,
    ),
    KnownIssue(
        "mps", ("conv",), channels_last_3d_input, "pytorch/pytorch#141471", "contiguous", torch_max="2.6",
        description="conv3d on a channels_last_3d input returned wrong values",
        basis="fixed by pytorch/pytorch#141780 (merged 2024-12-01, before the 2.6 branch cut)",
    ),
    KnownIssue(
        "mps", ("cat",), any_noncontiguous, "pytorch/pytorch#85675", "contiguous",
        description="cat ignored the strides of a non-contiguous input and placed its data wrongly",
        basis="reported on 1.13 nightlies; still open in the tracker",
    ),
    KnownIssue(
        "mps", ("matmul", "mm", "bmm"), strided_out, "pytorch/pytorch#104832", "contiguous", torch_max="2.14",
        description="matmul into a non-contiguous out= left out unchanged and could corrupt memory",
        basis="ESTIMATE: reported on 2.0.1; the thread names no fix; pytorch/pytorch#187255 (merged 2026-06-15, three weeks before the "
        "2.13 release date) reworked strided out= for mm/addmm, so 2.14",
    ),
    KnownIssue(
        "mps", ("cat",), cat_over_2_31_elements, "pytorch/pytorch#189960", "cpu", torch_max="2.15",
        description="cat with an output of 2**31 elements or more wrote out of bounds and left the tail unwritten",
        basis="fixed by pytorch/pytorch#189965 (opened 2026-07-15, after 2.13.0; not confirmed in 2.14.0), so " + _ERRS_HIGH,
    ),
    KnownIssue(
        "mps", ("bmm", "matmul"), large_bmm_noncontiguous, "pytorch/pytorch#197636", "contiguous", os_min="15",
        description="bmm returned wrong values when the output exceeds 2**32 elements and an input is non-contiguous",
        basis="reported on 2.13 (macOS 15+); open",
    ),
    KnownIssue(
        "cuda", ("sdpa",), qkv_noncontiguous_with_mask, "pytorch/pytorch#112577", "contiguous", torch_min="2.1", torch_max="2.2",
        description="scaled_dot_product_attention's mem-efficient kernel returned garbage for non-contiguous q/k/v with an attn_mask",
        basis="a 2.1.0 regression, present in 2.1.2 too (the 2.1.1 change was reworked); fixed in 2.2.0 "
        "(transformers dropped its workaround for torch ≥ 2.2)",
    ),
    KnownIssue(
        "cuda", ("sdpa",), broadcast_kv_len_1_mod_32, "pytorch/pytorch#191937", "contiguous", torch_max="2.15",
        description="scaled_dot_product_attention's efficient kernel corrupted the output for stride-0 (broadcast) k/v when the "
        "key length is 1 mod 32 and an attn_mask is given",
        basis="reported on 2.13 (2026-08-03); fixed in the mem-efficient kernel by pytorch/pytorch#191984 and "
        "pytorch/pytorch#192138 (August 2026, not confirmed in 2.14.0), so " + _ERRS_HIGH,
    ),
)  # fmt: skip

_lock = threading.Lock()
_entries: list[KnownIssue] = list(_BUILTIN)
TORCH_VERSION = torch.__version__
OS_VERSION = platform.mac_ver()[0] or None

# Per op family, the device types that have a row in force for this torch and OS and a
# backend this process can use, each with the predicates of those rows (computed when the first
# wrapper asks for its family's holder: nothing is read at import), in a one-element list the
# wrappers hold directly (a closure index is cheaper than a module attribute on the per-call path).
# A process with no row in force for a family (Linux with CPU/CUDA today, bar sdpa on CUDA) pays
# nothing; one with a row in force pays what the row's predicate costs on the calls of that device.
_HOLDERS: dict[str, list[dict[str, tuple[Predicate, ...]]]] = {}
# (family, device type) -> the rows in force here, decided eagerly so that a traced call only runs predicates.
_IN_FORCE: dict[tuple[str, str], tuple[KnownIssue, ...]] = {}
_read = False  # whether the table was read for this process (by the first holder asked for)


def in_force_here(entry: KnownIssue) -> tuple[bool, str]:
    """Whether ``entry`` is in force in this process, with the exact reason.

    >>> ok, why = in_force_here(entries()[0])
    >>> ok, why.startswith("torch")
    (False, True)
    """
    ok, why = entry.explain(entry.device_type, TORCH_VERSION, OS_VERSION)
    if ok and not devices.backend_usable(entry.device_type):
        return False, f"{why}; but no usable {entry.device_type} device in this process"
    return ok, why


@dataclass(frozen=True)
class RowState:
    """One row as it stands in this process (see :func:`states`)."""

    issue: str
    device_type: str
    ops: tuple[str, ...]
    torch_range: str
    os_range: str
    in_force: bool
    reason: str

    def __str__(self) -> str:
        state = "IN FORCE" if self.in_force else "not in force"
        return f"{self.device_type} {self.issue} ({', '.join(self.ops)}; {self.torch_range}; {self.os_range}): {state}: {self.reason}"


def states() -> list[RowState]:
    """Every row with its torch range, macOS range and why it is or is not in force here.

    >>> any(s.in_force for s in states() if s.device_type == "mps") == (OS_VERSION is not None and devices.backend_usable("mps"))
    True
    """
    out = []
    for e in entries():
        ok, why = in_force_here(e)
        out.append(RowState(e.issue, e.device_type, e.ops, e.torch_range, e.os_range, ok, why))
    return out


def in_force(family: str, device_type: str) -> tuple[KnownIssue, ...]:
    """The rows in force in this process for an op family on a device type (computed when the
    first wrapper asks for its holder, and again on :func:`add` / :func:`remove`)."""
    return _IN_FORCE.get((family, device_type), ())


def _refresh() -> None:
    global _read
    _read = True
    in_force_rows: dict[tuple[str, str], list[KnownIssue]] = {}
    for e in _entries:
        if in_force_here(e)[0]:
            for family in e.ops:
                in_force_rows.setdefault((family, e.device_type), []).append(e)
    _IN_FORCE.clear()
    _IN_FORCE.update({k: tuple(v) for k, v in in_force_rows.items()})
    by_family: dict[str, dict[str, tuple[Predicate, ...]]] = {}
    for (family, device_type), rows in _IN_FORCE.items():
        by_family.setdefault(family, {})[device_type] = tuple(e.predicate for e in rows)
    for family, cell in _HOLDERS.items():
        cell[0] = by_family.get(family, {})
    for family, predicates in by_family.items():
        _HOLDERS.setdefault(family, [predicates])


def holder(family: str) -> list[dict[str, tuple[Predicate, ...]]]:
    """The one-element list holding, for ``family``, each device type with a row in force and
    the predicates of its rows (kept current by :func:`add` and :func:`remove`; empty, and so
    false, where no row is in force).

    >>> "cpu" in holder("mm")[0]
    False
    """
    with _lock:
        if not _read:
            _refresh()  # once: every family with a row in force gets its cell
        cell = _HOLDERS.get(family)
        if cell is None:
            cell = _HOLDERS[family] = [{}]
        return cell


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
        raise InvalidArgumentTypeError("torchfix: add() takes a torchfix.KnownIssue.")
    entry.validate()
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


def table_markdown() -> str:
    """The built-in rows as the Markdown table in docs/guide.md, followed by where each
    range comes from (a test keeps the guide equal to this)."""
    lines = ["| device | ops | when | torch (upper end exclusive) | macOS | issue | workaround |", "|---|---|---|---|---|---|---|"]
    basis = ["", "Where each range comes from:", ""]
    for e in _BUILTIN:
        when = " ".join((e.predicate.__doc__ or e.predicate.__name__).split("\n\n")[0].split()).replace("``", "`")
        lines.append(f"| {e.device_type} | {', '.join(e.ops)} | {when} | {e.torch_range} | {e.os_range} | {e.issue} | {e.workaround} |")
        basis.append(f"- {e.issue}: {e.basis}.")
    return "\n".join(lines + basis)
