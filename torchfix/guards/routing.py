"""When a guarded call goes to ``torch.ops.torchfix.matmul`` instead of being
cast or copied. Pure policy: findings and device types in, a decision out.

Rules:
- only the matmul family and linear (the ops the kernel expresses);
- on CUDA and MPS, wherever the dtype guard would cast or the stride guard would
  copy (``contiguous``): the kernel reads the operands as they are;
- on any device, wherever a known-issue row's workaround is ``kernel``;
- never in ``strict`` mode (that raises first), never for rows that ask for
  ``upcast`` or ``cpu``;
- only where routing is allowed (``enabled``): ``kernels=True`` /
  ``TORCHFIX_KERNELS=1`` allows every device type, ``kernels=False`` none, and
  the default only device types with a recorded hardware run
  (:data:`torchfix.kernels.HARDWARE_RUNS`); a kernel that failed once is off;
- a device with no usable kernel keeps the cast/copy (see :func:`decide`'s ``missing``).

>>> from torchfix.guards.plan import Action, Finding
>>> cast = Finding("dtype", "mixed", "fix", (Action("dtype", "promote", "other", None),), True)
>>> decide("matmul", "cuda", [cast], enabled=True, available=True)
Routing(route=True, missing=False)
>>> decide("matmul", "cpu", [cast], enabled=True, available=True).route
False
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from .plan import Finding

__all__ = ["KERNEL_DEVICES", "ROUTED_KINDS", "Routing", "decide"]

ROUTED_KINDS = frozenset({"matmul", "linear"})
KERNEL_DEVICES = frozenset({"cuda", "mps"})


class Routing(NamedTuple):
    """``route``: call the kernel. ``missing``: it would have, but no kernel is usable here."""

    route: bool
    missing: bool


def decide(kind: str, device_type: str, findings: Sequence[Finding], *, enabled: bool, available: bool) -> Routing:
    """Whether a call with these findings goes to the kernel (``enabled``: routing is allowed on this device type)."""
    if not enabled or kind not in ROUTED_KINDS or not findings:
        return Routing(False, False)
    wanted = False
    for f in findings:
        kinds = {a.action for a in f.actions}
        if not kinds:
            return Routing(False, False)
        if f.guard == "device":
            continue  # moves happen first either way
        if f.guard == "stride":
            if kinds - {"contiguous", "kernel"}:
                return Routing(False, False)  # upcast / cpu rows keep their own workaround
            wanted = wanted or "kernel" in kinds or device_type in KERNEL_DEVICES
        elif f.guard == "dtype":
            wanted = wanted or device_type in KERNEL_DEVICES
    if not wanted:
        return Routing(False, False)
    return Routing(available, not available)
