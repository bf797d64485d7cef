"""The vocabulary the guards answer in: an :class:`Operand` view of a call's
tensors, :class:`Action` (one change to one operand) and :class:`Finding`
(one problem, with the actions that fix it, or none when it cannot be fixed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Action", "Finding", "Operand"]


@dataclass(frozen=True)
class Operand:
    """What the dtype and device guards know of one tensor argument.

    ``name`` is the parameter name (``weight``), or ``tensors[2]`` for cat.
    """

    name: str
    dtype: torch.dtype
    device: torch.device
    scalar: bool = False  # a 0-dim tensor, which torch lets cross devices
    param: bool = False  # a parameter or buffer of a module being run: it follows the activations
    rank: int | None = None  # the tensor's dim() and
    contiguous: bool = True  # its layout: what torch accepts can depend on both (F.linear with a 1-D input)

    @property
    def role(self) -> str:
        return self.name.split("[", 1)[0]


@dataclass(frozen=True)
class Action:
    """Change one operand: ``cast``/``upcast`` to a dtype, ``move`` to a device,
    ``contiguous``, or ``cpu`` (run on the CPU and move the result back)."""

    guard: str
    action: str
    operand: str
    to: Any = None


@dataclass(frozen=True, repr=False)
class Finding:
    """A problem torchfix found: a guard's in one call, or ``torchfix.wrap``'s preflight in one
    component of a pipeline (``component``, and whether it was ``applied``).

    Attributes:
        guard: ``dtype``, ``device`` or ``stride`` (preflight also ``model``: the components do
            not fit together); which error an unfixed finding raises.
        problem: one sentence naming the operands and what is wrong.
        fix: how the user fixes it for good.
        actions: what ``fix`` mode does about it; empty when it cannot be fixed.
        torch_raises: whether plain torch raises for this call (else it runs,
            silently promoting or computing garbage).
        note: extra text for the event (e.g. the per-call cost of a weight cast).
        advisory: the call runs exactly as torch computes it; the finding is only
            recorded (and warned about in ``warn`` mode), never fixed or raised on.
        component: preflight only: the pipeline component (or module path) it is about.
        applied: preflight only: torchfix already did ``fix`` (else it is for the user to do).

    >>> print(Finding("device", "weights on the meta device", "load the weights", component="unet"))
    unet: weights on the meta device — to fix: load the weights
    >>> [Finding("device", "weights on the meta device", "load the weights", component="unet")]
    [<device finding: unet: weights on the meta device — to fix: load the weights>]
    """

    guard: str
    problem: str
    fix: str
    actions: tuple[Action, ...] = ()
    torch_raises: bool = False
    note: str = ""
    advisory: bool = False
    component: str | None = None
    applied: bool = False

    def __str__(self) -> str:
        where = f"{self.component}: " if self.component else ""
        return f"{where}{self.problem} — {'fixed: ' if self.applied else 'to fix: '}{self.fix}"

    def __repr__(self) -> str:
        """Readable in a list (``print(w.preflight())``): the kind, then what :meth:`__str__` says."""
        return f"<{'advisory ' if self.advisory else ''}{self.guard} finding: {self}>"
