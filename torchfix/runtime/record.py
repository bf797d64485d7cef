"""What a guarded call tells: an event in :func:`torchfix.report`, a log line, a
``TorchfixWarning`` once per call site in ``warn`` mode, and the parameters a listening
``torchfix.wrap`` should cast once."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .. import _context, _frames, _warn
from .._report import FixEvent, report
from .._text import dtype_name
from ..config import Settings
from ..guards.messages import action_text
from ..guards.ops import OpSpec
from ..guards.plan import Action, Finding

__all__ = ["note", "observe", "record"]

log = logging.getLogger("torchfix")


def record(
    spec: OpSpec,
    settings: Settings,
    finding: Finding,
    before: Mapping[str, torch.Tensor],
    site: str,
    module: str | None,
    changes: str | None = None,
    internal: bool = False,
    short: tuple[str, int] | None = None,
) -> None:
    """Report what was done about ``finding`` (``changes``, else its actions on ``before``); ``internal``: a
    promotion inside a library's own code, recorded but never warned about; ``short``: the event's
    ``(change, nbytes)`` where its actions do not say (a ``noted`` promotion)."""
    if changes is None:
        changes = ", ".join(action_text(a, before) for a in finding.actions)
    detail = f"{finding.problem} → {changes}" + (f" ({finding.note})" if finding.note else "")
    action = finding.actions[0].action
    change, nbytes = short if short is not None else _short(finding, before)
    report().add(FixEvent(spec.name, finding.guard, action, site, module, detail, internal, change, nbytes))
    log.debug("torchfix %s at %s%s: %s", spec.name, site, f" [{module}]" if module else "", detail)
    if settings.mode == "warn" and not internal:
        where = f" in {module}" if module else ""
        verb = "noticed" if action == "noted" else "fixed"
        _warn.once((site, spec.name), f"torchfix {verb} {spec.name}{where}: {detail}. To fix it for good: {finding.fix}.", site=site)


def _short(finding: Finding, before: Mapping[str, torch.Tensor]) -> tuple[str, int]:
    """``(change, nbytes)`` of ``finding``'s actions: ``float32→float16`` and the bytes of the tensors
    they made (a cast, move or copy of each operand; a kernel or a CPU fallback makes none up front)."""
    changes: list[str] = []
    nbytes = 0
    for a in finding.actions:
        t = before.get(a.operand)
        if a.action in ("cast", "upcast", "promote") and isinstance(a.to, torch.dtype):
            text = f"{dtype_name(t.dtype) if t is not None else '?'}→{dtype_name(a.to)}"
            nbytes += t.numel() * a.to.itemsize if t is not None else 0
        elif a.action in ("move", "cpu"):
            text = f"{t.device if t is not None else '?'}→{a.to if a.action == 'move' else 'cpu'}"
            nbytes += t.numel() * t.element_size() if t is not None and a.action == "move" else 0
        elif a.action == "contiguous":
            text = "strided→contiguous"
            nbytes += t.numel() * t.element_size() if t is not None else 0
        else:
            text = a.action
        if text not in changes:
            changes.append(text)
    return ", ".join(changes), nbytes


def note(spec: OpSpec, settings: Settings, finding: Finding, before: Mapping[str, torch.Tensor], result: Any) -> None:
    """Record an advisory finding (the call ran as torch computes it), with the bytes it costs."""
    extra = ""
    short = ("promoted", 0)
    if isinstance(result, torch.Tensor) and result.is_floating_point():
        narrowest = min((t for t in before.values() if t.is_floating_point()), key=lambda t: t.element_size())
        size = result.numel() * result.element_size()
        over = size - result.numel() * narrowest.element_size()
        extra = f"; result {size:,} B in {dtype_name(result.dtype)}, +{over:,} B over the narrowest input"
        short = (f"{dtype_name(narrowest.dtype)}→{dtype_name(result.dtype)}", over)
    noted = dataclasses.replace(finding, actions=(Action(finding.guard, "noted", ""),), note=finding.note + extra)
    site = _frames.call_site(2)
    internal = _frames.in_library(site)
    # A library's own promotion is counted apart and never warned: its site says enough, and the module
    # chain (a walk over every frame's locals, most of this path's cost) is not read for it.
    module = None if internal else _frames.module_path(_frames.module_chain(2))
    record(spec, settings, noted, before, site, module, "left as torch computes it", internal, short)


def observe(finding: Finding, before: Mapping[str, torch.Tensor], chain: Sequence[torch.nn.Module] | None) -> None:
    """Tell a listening ``torchfix.wrap`` which parameters or buffers this dtype fix cast per call."""
    sink = _context.param_casts.get()
    if sink is None or not chain:
        return
    for action in finding.actions:
        t = before.get(action.operand)
        if t is None or not isinstance(action.to, torch.dtype):
            continue
        owner = next(((m, n) for m in chain for n, v in (*m._parameters.items(), *m._buffers.items()) if v is t), None)
        if owner is not None:
            sink.append((owner[0], owner[1], action.to))
