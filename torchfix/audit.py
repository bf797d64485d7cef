"""Static audit: find dtype, device and layout hazards in a model before it runs.

``torchfix.audit(model, *example_inputs, backend=None)`` exports the model with
``torch.export`` (non-strict) while the guards record: where dtypes would clash,
the guards insert their casts into the graph instead of raising, so the graph is
whole. Each graph node is then tagged with its module path, the graph is
imported into torch-mlir's torch dialect (``torch_mlir.fx.export_and_import``,
the torchfix operator through :data:`torchfix.kernels.DECOMPOSITIONS`), and the
typed IR (``!torch.vtensor<[4,8],f16>``) is read:

- ``mixed-dtype``: mm/linear/conv/sdpa fed by a cast torchfix inserted (plain
  torch raises there; torchfix fixes it at run time);
- ``fp32-promotion``: a float16/bfloat16 tensor silently widened to float32 by an
  elementwise op or cat;
- ``meta-device`` / ``device-mismatch``: parameters and buffers on ``meta`` or on
  another device than the inputs (read from the module; the IR has no devices);
- ``known-issue``: a layout (strides of the traced values) that hits a
  known-issue row for ``backend`` (e.g. ``"mps"``) and ``torch_version``.

Needs the ``audit`` extra (``pip install 'torchfix[audit]'``).

>>> import torch, torchfix
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2).half())
>>> report = torchfix.audit(model, torch.randn(3, 4))        # doctest: +SKIP
>>> [(f.module, f.op, f.hazard) for f in report.findings]    # doctest: +SKIP
[('1', 'aten.linear', 'mixed-dtype')]
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import devices
from ._state import enabled
from ._text import align
from .errors import TorchfixError
from .guards import known_issues as ki

__all__ = ["AuditError", "AuditFinding", "AuditReport", "audit"]

HAZARDS = ("mixed-dtype", "fp32-promotion", "meta-device", "device-mismatch", "known-issue", "unfixable")

# IR ops that raise on mixed dtypes (torchfix casts in front of them)
_STRICT_OPS = re.compile(r"torch\.aten\.(mm|bmm|matmul|linear|addmm|baddbmm|_?convolution|conv[123]d|scaled_dot_product_attention)$")
# IR ops that silently promote mixed floating dtypes
_PROMOTING_OPS = re.compile(r"torch\.aten\.(add|sub|mul|div|cat|where|maximum|minimum)(\.\w+)?$")
_CASTS = ("torch.aten._to_copy", "torch.prims.convert_element_type", "torch.aten.to.dtype")
_LOW = ("f16", "bf16")

# exported aten op -> (known-issue family, parameter names)
_FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "aten.mm.default": ("mm", ("input", "mat2")),
    "aten.bmm.default": ("bmm", ("input", "mat2")),
    "aten.matmul.default": ("matmul", ("input", "other")),
    "aten.linear.default": ("linear", ("input", "weight", "bias")),
    "aten.conv1d.default": ("conv", ("input", "weight", "bias")),
    "aten.conv2d.default": ("conv", ("input", "weight", "bias")),
    "aten.conv3d.default": ("conv", ("input", "weight", "bias")),
    "aten.scaled_dot_product_attention.default": ("sdpa", ("query", "key", "value", "attn_mask")),
    "aten.layer_norm.default": ("layer_norm", ("input", "normalized_shape", "weight", "bias")),
    "aten.group_norm.default": ("group_norm", ("input", "num_groups", "weight", "bias")),
}
_MODULE_OPS = {
    torch.nn.Linear: "aten.linear",
    torch.nn.Conv1d: "aten.conv1d",
    torch.nn.Conv2d: "aten.conv2d",
    torch.nn.Conv3d: "aten.conv3d",
}
_TAG = "torchfix-audit"


class AuditError(TorchfixError):
    """The model could not be audited (not exportable, or torch-mlir missing)."""


@dataclass(frozen=True)
class AuditFinding:
    """One hazard at one place in the model.

    Attributes:
        module: dotted module path (``""`` for the top-level module).
        op: the op, as the IR names it (``aten.linear``).
        hazard: one of ``mixed-dtype``, ``fp32-promotion``, ``meta-device``,
            ``device-mismatch``, ``known-issue``, ``unfixable``.
        detail: what the IR (or the module) shows.
        fix: how to fix it for good.
        fixed_at_run_time: whether torchfix in ``fix`` mode would fix it when the model runs.
    """

    module: str
    op: str
    hazard: str
    detail: str
    fix: str
    fixed_at_run_time: bool


@dataclass
class AuditReport:
    """What :func:`audit` found. ``ir`` is the torch-dialect module as text (empty if export failed)."""

    findings: list[AuditFinding] = field(default_factory=list)
    backend: str | None = None
    torch_version: str = ki.TORCH_VERSION
    ir: str = ""

    def __len__(self) -> int:
        return len(self.findings)

    def hazards(self) -> dict[str, int]:
        """Count of findings per hazard."""
        counts: dict[str, int] = {}
        for f in self.findings:
            counts[f.hazard] = counts.get(f.hazard, 0) + 1
        return counts

    def summary(self) -> str:
        """A table of the findings, one per row, each followed by its detail (indented)."""
        where = f" for backend={self.backend} (torch {self.torch_version})" if self.backend else ""
        if not self.findings:
            return f"torchfix audit{where}: no hazards found"
        rows = [("module", "op", "hazard", "fixed at run time")]
        rows += [(f.module or "<root>", f.op, f.hazard, "yes" if f.fixed_at_run_time else "no") for f in self.findings]
        header, rule, *body = align(rows, rule=True)
        lines = [f"torchfix audit{where}: {len(self.findings)} hazard(s)", header, rule]
        for line, f in zip(body, self.findings):
            lines += [line, f"    {f.detail}"]
        return "\n".join(lines)


# --- pass 1: devices, from the module ----------------------------------------------------------


def _first_tensor(values: Iterable[Any]) -> torch.Tensor | None:
    for v in values:
        if isinstance(v, torch.Tensor):
            return v
        if isinstance(v, (list, tuple)):
            t = _first_tensor(v)
            if t is not None:
                return t
    return None


def _module_op(module: torch.nn.Module) -> str:
    for cls, op in _MODULE_OPS.items():
        if isinstance(module, cls):
            return op
    return type(module).__name__


def _device_pass(model: torch.nn.Module, inputs: tuple) -> tuple[list[AuditFinding], dict[str, torch.Tensor]]:
    """Findings for meta / foreign-device tensors (one per module and hazard), and
    stand-ins on the inputs' device for tracing."""
    first = _first_tensor(inputs)
    home = first.device if first is not None else torch.device("cpu")
    grouped: dict[tuple[str, str], list[str]] = {}
    stand_ins = {}
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        if t.device.type == "meta":
            hazard = "meta-device"
        elif not devices.same(t.device, home):
            hazard = "device-mismatch"
        else:
            continue
        path, _, leaf = name.rpartition(".")
        grouped.setdefault((path, hazard), []).append(f"{leaf} {str(t.dtype).removeprefix('torch.')}{list(t.shape)} on {t.device}")
        stand_ins[name] = torch.empty(t.shape, dtype=t.dtype, device=home)
    findings = []
    for (path, hazard), what in grouped.items():
        op = _module_op(model.get_submodule(path))
        if hazard == "meta-device":
            detail = f"{', '.join(what)} (never loaded), inputs on {home}: F.linear/mm return garbage silently, other ops raise"
            fix = "load the checkpoint into it, or materialise it with module.to_empty(device=...) and initialise it"
        else:
            detail = f"{', '.join(what)}, inputs on {home}"
            fix = f"move the model with model.to({str(home)!r}), or torchfix.wrap(pipe, device=...)"
        findings.append(AuditFinding(path, op, hazard, detail, fix, False))
    return findings, stand_ins


class _WithStandIns(torch.nn.Module):
    """Runs ``model`` with some parameters/buffers replaced (for tracing only)."""

    def __init__(self, model: torch.nn.Module, stand_ins: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.stand_ins = stand_ins

    def forward(self, *args: Any) -> Any:
        return torch.func.functional_call(self.model, self.stand_ins, args, strict=False)


# --- pass 2: trace with the guards recording, tag nodes with module paths ------------------------


def _module_of(node: torch.fx.Node, wrapped: bool) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    if wrapped:
        path = path.removeprefix("model").removeprefix(".")
    return path


def _layout_findings(ep: Any, wrapped: bool, backend: str, torch_version: str, os_version: str | None) -> list[AuditFinding]:
    found = []
    for node in ep.graph.nodes:
        if node.op != "call_function" or str(node.target) not in _FAMILIES:
            continue
        family, params = _FAMILIES[str(node.target)]
        tensors = {}
        for name, arg in zip(params, node.args):
            val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
            if isinstance(val, torch.Tensor):
                tensors[name] = val
        for entry, names in ki.matching(family, tensors, device_type=backend, torch_version=torch_version, os_version=os_version):
            layout = ", ".join(f"{n} {list(tensors[n].shape)} strides {tensors[n].stride()}" for n in names if n in tensors)
            found.append(
                AuditFinding(
                    _module_of(node, wrapped), str(node.target).removesuffix(".default"), "known-issue",
                    f"{entry.issue} on {backend}: {entry.description or entry.workaround}; {layout}",
                    f"make the operand(s) contiguous before the call, or let torchfix apply '{entry.workaround}' at run time",
                    True,
                )
            )  # fmt: skip
    return found


def _tag(ep: Any, wrapped: bool) -> None:
    """Give every node a location naming its module path and whether torchfix inserted it."""
    for node in ep.graph.nodes:
        if node.op != "call_function":
            continue
        inserted = "cast" if node.target is torch.ops.aten._to_copy.default else "model"
        node.meta["stack_trace"] = f'File "{_TAG}|{node.name}|{_module_of(node, wrapped)}|{inserted}", line 1, in forward\n'


# --- pass 3: read the typed IR ----------------------------------------------------------------------

_LOC_DEF = re.compile(r'^(#loc\d*) = loc\("' + _TAG + r'\|([^|"]*)\|([^|"]*)\|(\w+)"')
_OP = re.compile(r"^\s*(%[\w.#-]+) = (torch\.[\w.]+)(.*)\sloc\((#loc\d*)\)\s*$")
_VALUE = re.compile(r"%[\w.#-]+")
_TYPE = re.compile(r"!torch\.\w+(?:<[^>]*>)?")
_VTENSOR = re.compile(r"!torch\.vtensor<\[([^\]]*)\],(\w+)>")


@dataclass
class _IrOp:
    name: str
    operands: list[tuple[str, str]]  # (value, type)
    result: str
    module: str
    inserted: bool


def _parse_ir(asm: str) -> dict[str, _IrOp]:
    """Ops with a torchfix-audit location, by result value."""
    locs = {}
    for line in asm.splitlines():
        m = _LOC_DEF.match(line)
        if m:
            locs[m.group(1)] = (m.group(3), m.group(4) == "cast")
    ops = {}
    for line in asm.splitlines():
        m = _OP.match(line)
        if not m or m.group(4) not in locs:
            continue
        value, name, rest, loc = m.groups()
        args, _, sig = rest.rpartition(" : ")
        operand_sig, _, result_sig = sig.partition(" -> ")
        module, inserted = locs[loc]
        ops[value] = _IrOp(name, list(zip(_VALUE.findall(args), _TYPE.findall(operand_sig))), result_sig.strip(), module, inserted)
    return ops


def _tensor(type_text: str) -> tuple[str, str] | None:
    m = _VTENSOR.fullmatch(type_text.strip())
    return (m.group(1), m.group(2)) if m else None


def _fmt(t: tuple[str, str]) -> str:
    return f"{t[1]}[{t[0]}]"


def _inputs(op: _IrOp, ops: dict[str, _IrOp]) -> list[tuple[tuple[str, str], _IrOp | None]]:
    """Tensor operands (lists expanded) with the torchfix cast that produced each, if any."""
    out = []
    for value, type_text in op.operands:
        producer = ops.get(value)
        if producer is not None and producer.name == "torch.prim.ListConstruct":
            out.extend(_inputs(producer, ops))
            continue
        t = _tensor(type_text)
        if t is None:
            continue
        cast = producer if producer is not None and producer.inserted and producer.name in _CASTS else None
        out.append((t, cast))
    return out


def _source(t: tuple[str, str], cast: _IrOp | None) -> tuple[str, str]:
    """The dtype an operand had before torchfix's cast."""
    if cast is None or not cast.operands:
        return t
    return _tensor(cast.operands[0][1]) or t


def _ir_findings(ops: dict[str, _IrOp]) -> list[AuditFinding]:
    found = []
    for op in ops.values():
        if op.inserted:
            continue
        short = op.name.removeprefix("torch.")
        inputs = _inputs(op, ops)
        cast = [(t, c) for t, c in inputs if c is not None]
        before = ", ".join(_fmt(_source(t, c)) for t, c in inputs)
        if _STRICT_OPS.match(op.name) and cast:
            changes = ", ".join(f"{_fmt(_source(t, c))} → {t[1]}" for t, c in cast)
            found.append(
                AuditFinding(
                    op.module, short, "mixed-dtype",
                    f"{short}({before}): plain torch raises; torchfix casts {changes}",
                    "cast the module (or the tensor) to one dtype once, e.g. module.to(dtype), or torchfix.wrap(pipe)",
                    True,
                )
            )  # fmt: skip
            continue
        result = _tensor(op.result)
        if not _PROMOTING_OPS.match(op.name) or result is None or result[1] != "f32":
            continue
        low = [_source(t, c) for t, c in inputs if _source(t, c)[1] in _LOW and _source(t, c)[0] != ""]  # rank 0 does not promote
        if low:
            found.append(
                AuditFinding(
                    op.module, short, "fp32-promotion",
                    f"{short}({before}) widens {', '.join(_fmt(t) for t in low)} to {_fmt(result)} silently (2x the memory)",
                    "cast the float32 operand to the low-precision dtype first, or pass dtype= to torchfix",
                    bool(cast),
                )
            )  # fmt: skip
    return found


def _check_arguments(model: Any, backend: str | None, torch_version: str | None, os_version: str | None) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"torchfix.audit: model must be a torch.nn.Module (it is exported with torch.export), got "
            f"{type(model).__name__}; put the function in a Module's forward to audit it."
        )
    backends = sorted({e.device_type for e in ki.entries()} | {"cpu"})
    if backend is not None and backend not in backends:
        raise ValueError(
            f"torchfix.audit: backend={backend!r} is not a device type with known-issue rows; allowed: {', '.join(map(repr, backends))}, "
            "or None to check none."
        )
    for name, value in (("torch_version", torch_version), ("os_version", os_version)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"torchfix.audit: {name} must be a version string such as '2.13.0', got {type(value).__name__}.")
        try:
            ki.parse_version(value, name)
        except ValueError as exc:
            raise ValueError(f"torchfix.audit: {str(exc).removeprefix('torchfix: ')}") from None


def audit(
    model: torch.nn.Module,
    *example_inputs: Any,
    backend: str | None = None,
    torch_version: str | None = None,
    os_version: str | None = None,
) -> AuditReport:
    """Find dtype, device and layout hazards in ``model`` for ``example_inputs``.

    Args:
        model: the module to audit; it is traced, not run.
        example_inputs: positional inputs, as for ``model(*example_inputs)``.
        backend: device type whose known-issue rows are checked (``"mps"``, ``"cuda"``, ...);
            ``None`` checks none.
        torch_version: the torch the rows are checked against (default: this one), e.g.
            ``"1.13.1"`` to audit for an older deployment.
        os_version: macOS version for rows bounded by it (default: any).

    Raises:
        TypeError: ``model`` is not a module.
        ValueError: ``backend`` has no known-issue rows, or a version is not a version.
        AuditError: torch-mlir is not installed, or the model cannot be exported (the
            export error is the cause).

    >>> import torch, torchfix
    >>> torchfix.audit(torch.nn.Linear(4, 2), torch.randn(3, 4)).findings   # doctest: +SKIP
    []
    """
    _check_arguments(model, backend, torch_version, os_version)
    try:
        from torch_mlir import fx as mlir_fx
    except ImportError as exc:
        raise AuditError("torchfix.audit needs torch-mlir: pip install 'torchfix[audit]'") from exc
    from .kernels import DECOMPOSITIONS

    version = torch_version or ki.TORCH_VERSION
    report = AuditReport(backend=backend, torch_version=version)
    device_findings, stand_ins = _device_pass(model, example_inputs)
    report.findings.extend(device_findings)
    target: torch.nn.Module = _WithStandIns(model, stand_ins) if stand_ins else model
    try:
        with enabled("fix", guards=("dtype", "device")), torch.no_grad():
            ep = torch.export.export(target, tuple(example_inputs), strict=False)
    except TorchfixError as exc:  # a hazard torchfix cannot fix: it is the finding
        report.findings.append(AuditFinding("", "", "unfixable", str(exc).splitlines()[0], "see the error text", False))
        return report
    except Exception as exc:
        raise AuditError(
            f"torchfix.audit: torch.export could not trace {type(model).__name__} with inputs "
            f"{[tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in example_inputs]}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}. Fix the export error (see the cause), "
            "or audit a submodule that exports."
        ) from exc
    wrapped = target is not model
    if backend is not None:
        report.findings.extend(_layout_findings(ep, wrapped, backend, version, os_version))
    _tag(ep, wrapped)
    try:
        module = mlir_fx.export_and_import(ep, decomposition_table=DECOMPOSITIONS)
    except Exception as exc:
        raise AuditError(f"torchfix.audit: torch-mlir could not import the exported graph: {type(exc).__name__}: {exc}") from exc
    report.ir = module.operation.get_asm(enable_debug_info=True)
    report.findings.extend(_ir_findings(_parse_ir(report.ir)))
    return report
