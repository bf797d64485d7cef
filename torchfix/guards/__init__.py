"""Pure policy: given an op and its arguments, decide to pass, cast, move, copy, or raise.

The rule every guard follows: torchfix changes a call only where plain torch
(with the caller's autocast state) would raise, would silently compute garbage
(a meta or foreign-device operand), or hits a known-issue row in force here,
or where the caller asked for it (``dtype=``, ``device_policy="align"``,
``keep_dtype``, ``kernels=True``). Everywhere else the call goes through
untouched, bit-identical, in every mode, eager and compiled. ``strict`` raises
exactly where ``fix`` would change something. Whether torch accepts a dtype mix
is asked of torch itself (:mod:`torchfix.guards.accepts`).
"""

from . import accepts, device, dtype, known_issues, stride
from .known_issues import KnownIssue
from .ops import SPECS, OpSpec
from .plan import Action, Finding, Operand

__all__ = [
    "SPECS",
    "Action",
    "Finding",
    "KnownIssue",
    "OpSpec",
    "Operand",
    "accepts",
    "device",
    "dtype",
    "known_issues",
    "stride",
]
