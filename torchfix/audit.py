"""Static audit: find dtype, device and layout hazards in a model before it runs.

``torchfix.audit(model, *example_inputs, backend=None)`` exports the model with
``torch.export`` (non-strict) while the guards record: where dtypes would clash,
the guards insert their casts into the graph instead of raising, so the graph is
whole. Each FX node (those inside ``torch.autocast`` regions included) gets a
location key, the graph is imported into torch-mlir's torch dialect
(``torch_mlir.fx.export_and_import``, the torchfix operator through
:data:`torchfix.kernels.DECOMPOSITIONS`), and the IR is walked through
torch-mlir's Python bindings: each op's name, its operands' defining ops and
typed values (``!torch.vtensor<[4,8],f16>``), and its location, which leads back
to the FX node for the module path, whether torchfix inserted it (a torchfix cast
is ``aten._to_copy``; the model's own ``.to()`` is ``aten.to``), and the autocast
region it runs in:

- ``mixed-dtype``: mm/linear/conv/sdpa fed by a cast torchfix inserted (plain
  torch raises there; torchfix fixes it at run time);
- ``fp32-promotion``: a float16/bfloat16 tensor silently widened to float32 by an
  elementwise op or cat;
- ``meta-device`` / ``device-mismatch``: parameters and buffers on ``meta`` or on
  another device than the inputs (read from the module; the IR has no devices);
- ``known-issue``: a layout (strides of the traced values) that hits a
  known-issue row for ``backend`` (e.g. ``"mps"``) and ``torch_version``.

Needs the ``audit`` extra (``pip install 'torchfix-diffusion[audit]'``).

>>> import torch, torchfix
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2).half())
>>> report = torchfix.audit(model, torch.randn(3, 4))        # doctest: +SKIP
>>> [(f.module, f.op, f.hazard) for f in report.findings]    # doctest: +SKIP
[('1', 'aten.linear', 'mixed-dtype')]
"""

from __future__ import annotations

import contextlib
import itertools
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from . import devices
from ._state import enabled
from ._text import align
from .errors import InvalidArgumentError, InvalidArgumentTypeError, TorchfixError
from .guards import known_issues as ki

__all__ = ["AuditError", "AuditFinding", "AuditReport", "audit"]


# IR ops that raise on mixed dtypes (torchfix casts in front of them)
_STRICT_OPS = re.compile(r"torch\.aten\.(mm|bmm|matmul|linear|addmm|baddbmm|_?convolution|conv[123]d|scaled_dot_product_attention)$")
# IR ops that silently promote mixed floating dtypes
_PROMOTING_OPS = re.compile(r"torch\.aten\.(add|sub|mul|div|cat|where|maximum|minimum)(\.\w+)?$")
_CASTS = ("torch.aten._to_copy", "torch.prims.convert_element_type", "torch.aten.to.dtype")
_LOW = ("f16", "bf16")
_FLOATS = ("f16", "bf16", "f32", "f64")
# ops that raise on operands of two float dtypes (attention is left out: torch takes a float mask of another dtype)
_SAME_DTYPE_OPS = re.compile(r"torch\.aten\.(mm|bmm|matmul|linear|addmm|baddbmm|_?convolution|conv[123]d)$")

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


@dataclass(frozen=True)
class _Node:
    """What the exported FX graph says about the node an IR op came from."""

    module: str
    inserted: bool  # a cast torchfix inserted (aten._to_copy; the model's own .to() is aten.to)
    autocast: str | None  # "cpu, bfloat16" inside a torch.autocast region


def _tag(ep: Any, wrapped: bool) -> dict[str, _Node]:
    """Give every node (autocast regions' nodes included) a location torch-mlir carries into the IR:
    the FX importer's only location channel is a node's stack trace, so the trace names a key into
    the returned table, and everything else is read from the FX graph itself."""
    regions: dict[str, str] = {}
    for node in ep.graph.nodes:  # torch.autocast regions are wrap_with_autocast(device, dtype, ..., submodule, ...)
        if node.op == "call_function" and "wrap_with_autocast" in str(node.target) and len(node.args) > 4:
            sub = node.args[4]
            if isinstance(sub, torch.fx.Node) and sub.op == "get_attr":
                regions[str(sub.target)] = f"{node.args[0]}, {str(node.args[1]).removeprefix('torch.')}"
    table: dict[str, _Node] = {}
    graphs = [("", ep.graph_module)] + [(n, m) for n, m in ep.graph_module.named_modules() if n and isinstance(m, torch.fx.GraphModule)]
    for name, gm in graphs:
        autocast = regions.get(name)
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            if "wrap_with_autocast" in str(node.target):
                region = node.args[4].target if len(node.args) > 4 and isinstance(node.args[4], torch.fx.Node) else None
                node_autocast = regions.get(str(region))
            else:
                node_autocast = autocast
            key = f"{_TAG}:{len(table)}"
            inserted = node.target is torch.ops.aten._to_copy.default and autocast is None
            table[key] = _Node(_module_of(node, wrapped), inserted, node_autocast)
            node.meta["stack_trace"] = f'File "{key}", line 1, in forward\n'
    return table


# --- pass 3: walk the IR through torch-mlir's bindings --------------------------------------------

_VTENSOR = re.compile(r"!torch\.vtensor<\[([^\]]*)\],(\w+)>")  # one value's type, e.g. !torch.vtensor<[4,8],f16>


def _vtensor(value: Any) -> tuple[str, str] | None:
    """(shape, dtype) of a ``!torch.vtensor`` value (``None`` for other types)."""
    m = _VTENSOR.fullmatch(str(value.type))
    return (m.group(1), m.group(2)) if m else None


def _fmt(t: tuple[str, str]) -> str:
    return f"{t[1]}[{t[0]}]"


def _origin(op: Any, ir: Any, table: dict[str, _Node]) -> _Node | None:
    """The FX node an IR op came from, read from its location."""
    loc = op.location
    try:  # a trace of several frames is a call-site location whose callee is the innermost frame
        loc = ir.CallSiteLoc(loc).callee
    except ValueError:  # not a call site: the bindings refuse the cast
        pass
    try:
        return table.get(ir.FileLineColLoc(loc).filename)
    except ValueError:  # an unknown location: an op torch-mlir made up (none of the model's nodes)
        return None


def _producer(value: Any) -> Any | None:
    """The op that defines ``value`` (``None`` for a function argument)."""
    owner = value.owner
    return owner if hasattr(owner, "operands") and hasattr(owner, "name") else None


def _ir_findings(module: Any, ir: Any, table: dict[str, _Node]) -> list[AuditFinding]:
    ops = [op for func in module.body.operations for block in func.regions[0].blocks for op in block.operations]
    origin = {id(op): _origin(op, ir, table) for op in ops}

    def inserted_cast(op: Any | None) -> Any | None:
        if op is None or op.name not in _CASTS:
            return None
        node = origin.get(id(op)) if id(op) in origin else _origin(op, ir, table)
        return op if node is not None and node.inserted else None

    def inputs(op: Any) -> list[tuple[tuple[str, str], Any | None]]:
        """Tensor operands (lists expanded) with the torchfix cast that produced each, if any."""
        out = []
        for value in op.operands:
            producer = _producer(value)
            if producer is not None and producer.name == "torch.prim.ListConstruct":
                out.extend(inputs(producer))
                continue
            t = _vtensor(value)
            if t is not None:
                out.append((t, inserted_cast(producer)))
        return out

    def source(t: tuple[str, str], cast: Any | None) -> tuple[str, str]:
        """The dtype an operand had before torchfix's cast."""
        return (_vtensor(cast.operands[0]) or t) if cast is not None and len(cast.operands) else t

    found = []
    for op in ops:
        node = origin[id(op)]
        if node is None or node.inserted:
            continue
        short = op.name.removeprefix("torch.")
        args = inputs(op)
        cast = [(t, c) for t, c in args if c is not None]
        before = ", ".join(_fmt(source(t, c)) for t, c in args)
        where = f" (inside torch.autocast({node.autocast}))" if node.autocast else ""
        if _STRICT_OPS.match(op.name) and cast:
            changes = ", ".join(f"{_fmt(source(t, c))} → {t[1]}" for t, c in cast)
            found.append(
                AuditFinding(
                    node.module, short, "mixed-dtype",
                    f"{short}({before}): plain torch raises; torchfix casts {changes}{where}",
                    "cast the module (or the tensor) to one dtype once, e.g. module.to(dtype), or torchfix.wrap(pipe)",
                    True,
                )
            )  # fmt: skip
            continue
        floats = {t[1] for t, _ in args if t[1] in _FLOATS}
        if _SAME_DTYPE_OPS.match(op.name) and len(floats) > 1:  # traced as is (export's fake kernels may not check dtypes)
            found.append(
                AuditFinding(
                    node.module, short, "mixed-dtype",
                    f"{short}({before}): plain torch raises at run time; torchfix casts to the model's dtype{where}",
                    "cast the module (or the tensor) to one dtype once, e.g. module.to(dtype), or torchfix.wrap(pipe)",
                    True,
                )
            )  # fmt: skip
            continue
        result = _vtensor(op.results[0]) if len(op.results) else None
        if not _PROMOTING_OPS.match(op.name) or result is None or result[1] != "f32":
            continue
        low = [source(t, c) for t, c in args if source(t, c)[1] in _LOW and source(t, c)[0] != ""]  # rank 0 does not promote
        if low:
            found.append(
                AuditFinding(
                    node.module, short, "fp32-promotion",
                    f"{short}({before}) widens {', '.join(_fmt(t) for t in low)} to {_fmt(result)} silently (2x the memory){where}",
                    "cast the float32 operand to the low-precision dtype first, or pass dtype= to torchfix",
                    bool(cast),
                )
            )  # fmt: skip
    return found


def _check_arguments(model: Any, backend: str | None, torch_version: str | None, os_version: str | None) -> None:
    if not isinstance(model, torch.nn.Module):
        raise InvalidArgumentTypeError(
            f"torchfix.audit: model must be a torch.nn.Module (it is exported with torch.export), got "
            f"{type(model).__name__}; put the function in a Module's forward to audit it."
        )
    backends = sorted({e.device_type for e in ki.entries()} | {"cpu"})
    if backend is not None and backend not in backends:
        raise InvalidArgumentError(
            f"torchfix.audit: backend={backend!r} is not a device type with known-issue rows; allowed: {', '.join(map(repr, backends))}, "
            "or None to check none."
        )
    for name, value in (("torch_version", torch_version), ("os_version", os_version)):
        if value is not None and not isinstance(value, str):
            raise InvalidArgumentTypeError(f"torchfix.audit: {name} must be a version string such as '2.13.0', got {type(value).__name__}.")
        try:
            ki.parse_version(value, name)
        except ValueError as exc:
            raise InvalidArgumentError(f"torchfix.audit: {str(exc).removeprefix('torchfix: ')}") from None


@contextlib.contextmanager
def _quiet_tools() -> Iterator[None]:
    """Deprecation notices torch.export and torch-mlir raise about their own internals (torch 2.13's pytree
    ``LeafSpec`` ``FutureWarning``, attributed to ``copyreg``) are not the user's: kept out of the audit's
    output. Warnings from the user's own model code still show."""
    with warnings.catch_warnings():
        for category in (FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category, module=r"(copyreg|torch|torch_mlir)(\.|$)")
        yield


def _lift_non_persistent_buffers(ep: Any) -> None:
    """torch-mlir's importer looks every buffer up in ``state_dict``, but ``torch.export`` keeps a buffer registered
    with ``persistent=False`` (CLIP's and T5's ``position_ids``, RoPE's ``inv_freq``) in ``constants``: the import
    failed with "Could not find state mapping for buffer" (llvm/torch-mlir#4744). As the fix proposed there
    (torch-mlir#4745) does, the importer is also shown those buffers, here by putting them in the exported program's
    state dict (the program is torchfix's own, made for this audit; the model is untouched)."""
    state = getattr(ep, "state_dict", None)
    constants = getattr(ep, "constants", None)
    buffers = getattr(getattr(ep, "graph_signature", None), "inputs_to_buffers", None)
    if not isinstance(state, dict) or not isinstance(constants, Mapping) or not isinstance(buffers, Mapping):
        return
    for name in buffers.values():
        if name not in state and isinstance(constants.get(name), torch.Tensor):
            state[name] = constants[name]


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
        from torch_mlir import ir as mlir_ir
    except ImportError as exc:
        raise AuditError("torchfix.audit needs torch-mlir: pip install 'torchfix-diffusion[audit]'") from exc
    from .kernels import DECOMPOSITIONS

    version = torch_version or ki.TORCH_VERSION
    report = AuditReport(backend=backend, torch_version=version)
    device_findings, stand_ins = _device_pass(model, example_inputs)
    report.findings.extend(device_findings)
    target: torch.nn.Module = _WithStandIns(model, stand_ins) if stand_ins else model
    try:
        with enabled("fix", guards=("dtype", "device")), torch.no_grad(), _quiet_tools():
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
    table = _tag(ep, wrapped)
    try:
        with _quiet_tools():
            ep = ep.run_decompositions(DECOMPOSITIONS)  # here, not in torch-mlir: the buffers are lifted after it
            _lift_non_persistent_buffers(ep)
            module = mlir_fx.export_and_import(ep, decomposition_table={})  # {}: decomposed already
    except Exception as exc:
        raise AuditError(f"torchfix.audit: torch-mlir could not import the exported graph: {type(exc).__name__}: {exc}") from exc
    report.ir = module.operation.get_asm(enable_debug_info=True)
    report.findings.extend(_ir_findings(module, mlir_ir, table))
    return report
