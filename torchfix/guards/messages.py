"""Error and event text. The message is the product: it names the op, the
call site, the module path, every tensor involved, and the fix."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .._text import align, dtype_name
from .plan import Action, Finding

__all__ = ["action_text", "compiled_error_message", "describe_tensors", "error_message"]

_dt = dtype_name


def describe_tensors(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """One aligned line per tensor: name, dtype, device, shape, strides."""
    rows = []
    for name, t in tensors.items():
        try:
            rows.append((name, _dt(t.dtype), str(t.device), f"shape={tuple(t.shape)}", f"stride={tuple(t.stride())}"))
        except (RuntimeError, NotImplementedError):  # e.g. a tensor without strides
            rows.append((name, _dt(t.dtype), str(t.device), f"shape={tuple(t.shape)}", "stride=n/a"))
    return align(rows)


def action_text(action: Action, tensors: Mapping[str, torch.Tensor]) -> str:
    """E.g. ``weight float16→bfloat16`` or ``mat2 → contiguous copy``."""
    t = tensors.get(action.operand)
    if action.action in ("cast", "upcast", "promote"):
        return f"{action.operand} {_dt(t.dtype) if t is not None else '?'}→{_dt(action.to)}"
    if action.action in ("move", "cpu"):
        return f"{action.operand} {t.device if t is not None else '?'}→{action.to if action.action == 'move' else 'cpu'}"
    return f"{action.operand} → {action.action} ({action.to})" if action.to else f"{action.operand} → {action.action}"


def error_message(
    op: str,
    finding: Finding,
    tensors: Mapping[str, torch.Tensor],
    *,
    site: str,
    module: str | None,
    mode: str,
) -> str:
    """The full text of a torchfix error."""
    lines = [f"torchfix [{finding.guard} guard, mode={mode}]: {op}: {finding.problem}."]
    lines.append(f"  call site: {site}")
    if module:
        lines.append(f"  module:    {module}")
    lines.append("  tensors:")
    lines.extend(f"    {row}" for row in describe_tensors(tensors))
    if finding.torch_raises:
        lines.append("  plain torch raises for this call (its error is chained below).")
    elif finding.guard == "device":
        lines.append("  plain torch would NOT raise here: it returns a wrong result silently.")
    if mode == "strict" and finding.actions:
        would = ", ".join(action_text(a, tensors) for a in finding.actions)
        lines.append(f"  in mode='fix' torchfix would: {would}.")
    lines.append(f"  fix: {finding.fix}.")
    return "\n".join(lines)


def compiled_error_message(op: str, finding: Finding, operands: list[tuple[str, object, object]], *, mode: str) -> str:
    """The error text for a call inside ``torch.compile``d code: built at trace time from what
    is constant there (the operands' names, dtypes and devices; no call site or module path)."""
    lines = [f"torchfix [{finding.guard} guard, mode={mode}]: {op}: {finding.problem}."]
    lines.append("  call site: inside torch.compile'd code (run it eagerly for the file:line and module path)")
    lines.append("  tensors:")
    lines.extend(f"    {row}" for row in align([(name, _dt(dtype), str(device)) for name, dtype, device in operands]))
    if finding.torch_raises:
        lines.append("  plain torch raises for this call.")
    if finding.actions:
        lines.append(f"  in mode='fix' torchfix would: {', '.join(_action_short(a) for a in finding.actions)}.")
    lines.append(f"  fix: {finding.fix}.")
    return "\n".join(lines)


def _action_short(action: Action) -> str:
    if action.action in ("cast", "upcast", "promote"):
        return f"{action.operand} →{_dt(action.to)}"
    return f"{action.operand} → {action.action}"
