"""Settings for the guards, and the one place the environment is read.

Precedence everywhere: explicit argument, then the ``TORCHFIX_*`` environment
variable, then the default.

>>> from torchfix.config import Settings
>>> Settings(mode="warn").mode
'warn'
"""

from __future__ import annotations

import importlib.metadata as md
import os
from dataclasses import dataclass, field

import torch

from ._text import dtype_name
from .errors import InvalidArgumentError, InvalidArgumentTypeError

__all__ = [
    "DEVICE_POLICIES",
    "GUARDS",
    "MODES",
    "Settings",
    "env_max_events",
    "env_mode",
    "env_traceback_filtering",
    "installed_version",
]


def installed_version(package: str) -> str:
    """The installed distribution's version, or ``"not installed"``.

    >>> installed_version("torch") != "not installed"
    True
    """
    try:
        return md.version(package)
    except md.PackageNotFoundError:
        return "not installed"


MODES = ("off", "fix", "warn", "strict")
GUARDS = ("dtype", "device", "stride")
DEVICE_POLICIES = ("error", "align")

_DTYPE_NAMES = {
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float64": torch.float64,
    "double": torch.float64,
}


def _check_choice(what: str, value: object, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise InvalidArgumentError(f"torchfix: {what}={value!r} is not valid; use one of {', '.join(map(repr, choices))}.")
    return value


def _parse_dtype(value: object) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        if isinstance(value, torch.dtype) and not value.is_floating_point:
            raise InvalidArgumentError(
                f"torchfix: dtype={value} is not a floating dtype; use "
                f"torch.float16, torch.bfloat16 or torch.float32."
            )
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in _DTYPE_NAMES:
        return _DTYPE_NAMES[value.removeprefix("torch.")]
    raise InvalidArgumentTypeError(
        f"torchfix: dtype={value!r} is not a torch floating dtype; pass e.g. torch.bfloat16 (or None for the automatic policy)."
    )


@dataclass(frozen=True)
class Settings:
    """What the guards do in one scope (the process, or one ``with torchfix.enabled()``).

    Args:
        mode: ``off``, ``fix``, ``warn`` or ``strict``.
        guards: which guards run, a subset of ``("dtype", "device", "stride")``.
        dtype: target dtype for the matmul family and cat when dtypes are mixed
            (``None``: autocast's dtype if active, else ``torch.promote_types``).
        device_policy: ``"error"`` (raise before the op runs) or ``"align"``
            (move inputs to the weight's, else the first tensor's, device).
        kernels: route mixed-dtype and strided matmuls to torchfix's own kernels:
            ``True`` on every device type, ``False`` never, ``None`` (default) only
            on device types with a recorded hardware run
            (:data:`torchfix.kernels.HARDWARE_RUNS`).

    >>> Settings(guards=("dtype",)).guards
    frozenset({'dtype'})
    """

    mode: str = "fix"
    guards: frozenset[str] = field(default=frozenset(GUARDS))
    dtype: torch.dtype | None = None
    device_policy: str = "error"
    kernels: bool | None = None

    def __post_init__(self) -> None:
        _check_choice("mode", self.mode, MODES)
        if self.kernels is not None and not isinstance(self.kernels, bool):
            raise InvalidArgumentTypeError(
                f"torchfix: kernels={self.kernels!r} must be True, False or None (route only where a hardware run is recorded)."
            )
        _check_choice("device_policy", self.device_policy, DEVICE_POLICIES)
        guards = self.guards
        if isinstance(guards, str):
            guards = (guards,)
        try:
            guards = frozenset(guards)
        except TypeError:
            raise InvalidArgumentTypeError(
                f"torchfix: guards={self.guards!r} is not valid; pass a name or a tuple of names from {GUARDS}, "
                f"e.g. guards=('dtype', 'device')."
            ) from None
        unknown = sorted(map(str, (g for g in guards if g not in GUARDS)))
        if unknown:
            raise InvalidArgumentError(f"torchfix: guards={self.guards!r} names unknown guard(s) {unknown}; choose from {GUARDS}.")
        if not guards and self.mode != "off":
            raise InvalidArgumentError(
                f"torchfix: guards={self.guards!r} switches every guard off with mode={self.mode!r}; "
                "name at least one of 'dtype', 'device', 'stride', or use mode='off' / torchfix.disable()."
            )
        object.__setattr__(self, "guards", guards)
        object.__setattr__(self, "dtype", _parse_dtype(self.dtype))
        # Derived once so the per-call paths read plain booleans (also what dynamo traces best).
        object.__setattr__(self, "active", self.mode != "off" and bool(guards))
        object.__setattr__(self, "dtype_on", "dtype" in guards)
        object.__setattr__(self, "device_on", "device" in guards)
        object.__setattr__(self, "stride_on", "stride" in guards)

    active: bool = field(init=False, repr=False, compare=False, default=False)
    dtype_on: bool = field(init=False, repr=False, compare=False, default=False)
    device_on: bool = field(init=False, repr=False, compare=False, default=False)
    stride_on: bool = field(init=False, repr=False, compare=False, default=False)

    def describe(self) -> str:
        """One line: mode, guards, dtype policy and device policy."""
        dtype = dtype_name(self.dtype) if self.dtype is not None else "auto"
        kernels = {None: "recorded-hardware", True: "on", False: "off"}[self.kernels]
        guards = ",".join(sorted(self.guards)) or "-"
        return f"mode={self.mode} guards={guards} dtype={dtype} device_policy={self.device_policy} kernels={kernels}"


OFF = Settings(mode="off")


def env_mode() -> str:
    """The mode named by ``TORCHFIX_MODE`` (default ``fix``), validated."""
    value = os.environ.get("TORCHFIX_MODE", "fix").strip().lower() or "fix"
    if value not in MODES:
        raise InvalidArgumentError(f"torchfix: TORCHFIX_MODE={value!r} is not valid; use one of {', '.join(MODES)}.")
    return value


def env_max_events(default: int = 10_000) -> int:
    """How many individual events the report keeps (``TORCHFIX_MAX_EVENTS``); counts are always exact."""
    raw = os.environ.get("TORCHFIX_MAX_EVENTS")
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidArgumentError(f"torchfix: TORCHFIX_MAX_EVENTS={raw!r} must be an integer.") from None
    return max(value, 0)


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_kernels() -> bool | None:
    """``TORCHFIX_KERNELS=1`` routes to torchfix's kernels on every device type, ``0`` never;
    unset (or ``auto``) routes only where a hardware run is recorded. ``TORCHFIX_DISABLE_KERNELS=1``
    is the older spelling of ``TORCHFIX_KERNELS=0`` and wins over it."""
    if os.environ.get("TORCHFIX_DISABLE_KERNELS", "").strip().lower() in _TRUE:
        return False
    raw = os.environ.get("TORCHFIX_KERNELS", "").strip().lower()
    if raw in ("", "auto"):
        return None
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise InvalidArgumentError(f"torchfix: TORCHFIX_KERNELS={raw!r} is not valid; use 1, 0 or auto.")


def env_traceback_filtering() -> bool:
    """Whether torchfix's own frames are left out of the tracebacks of errors that are not torchfix's
    (``TORCHFIX_TRACEBACK_FILTERING``: on by default; ``off`` or ``0`` shows every frame, as JAX's
    ``JAX_TRACEBACK_FILTERING=off`` does)."""
    raw = os.environ.get("TORCHFIX_TRACEBACK_FILTERING", "").strip().lower()
    if raw in ("", "auto") or raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise InvalidArgumentError(f"torchfix: TORCHFIX_TRACEBACK_FILTERING={raw!r} is not valid; use on or off.")
