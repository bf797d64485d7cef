"""Pure policy: given an op and its arguments, decide to pass, cast, move, copy, or raise."""

from . import device, dtype, known_issues, stride
from .engine import is_kept, keep_dtype
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
    "device",
    "dtype",
    "is_kept",
    "keep_dtype",
    "known_issues",
    "stride",
]
