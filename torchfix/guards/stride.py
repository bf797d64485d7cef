"""The stride guard: turn known-issue matches into a finding.

>>> import torch
>>> from torchfix.guards import known_issues as ki
>>> a, b = torch.ones(4, 4), torch.ones(4, 4).t()
>>> f = decide("mm", {"input": a, "mat2": b}, device_type="mps", torch_version="1.12.1")
>>> [x.operand for x in f.actions]
['mat2']
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from . import known_issues as ki
from .plan import Action, Finding

__all__ = ["decide"]


def decide(
    family: str,
    tensors: Mapping[str, torch.Tensor | None],
    *,
    device_type: str,
    torch_version: str = ki.TORCH_VERSION,
    os_version: str | None = ki.OS_VERSION,
    rows: Sequence[ki.KnownIssue] | None = None,
) -> Finding | None:
    """The stride finding for one call: the workarounds of every matching row.

    ``rows``: rows already known to be in force (:func:`known_issues.in_force`); only their
    predicates are evaluated, which is all that runs while torch.compile traces.
    """
    if rows is None:
        matches = ki.matching(family, tensors, device_type=device_type, torch_version=torch_version, os_version=os_version)
    else:
        matches = []
        for e in rows:  # a plain loop: dynamo cannot read a comprehension's walrus cell
            names = tuple(e.predicate(tensors))
            if names:
                matches.append((e, names))
    if not matches:
        return None
    actions: list[Action] = []
    seen: set[tuple[str, str]] = set()
    for entry, names in matches:
        if entry.workaround == "contiguous":
            targets = names
        elif entry.workaround == "cpu":  # every operand goes to the CPU (an out= tensor stays)
            targets = tuple(n for n, t in tensors.items() if isinstance(t, torch.Tensor) and n != "out")
        else:  # upcast / kernel act on every floating operand
            targets = tuple(n for n, t in tensors.items() if isinstance(t, torch.Tensor) and t.is_floating_point() and n != "out")
        for n in targets:
            if (entry.workaround, n) not in seen:
                seen.add((entry.workaround, n))
                actions.append(Action("stride", entry.workaround, n, entry.issue))
    issues = "; ".join(f"{e.issue} ({e.description or e.workaround}) via {', '.join(n)}" for e, n in matches)
    fix = "; ".join(f"{e.workaround} for {e.issue}" for e, _ in matches)
    return Finding(
        "stride",
        f"known {device_type} issue(s) for this layout on torch {torch_version}: {issues}",
        f"apply the workaround yourself ({fix}) or upgrade torch once the issue is fixed",
        tuple(actions),
        torch_raises=False,
    )
