"""Which settings are in force where: one process-wide switch plus a
``ContextVar`` for scoped ``with torchfix.enabled()`` blocks.

Wrappers are installed while anything needs them (the global switch, or any
scoped block in any thread) and removed when nothing does, so that after
``disable()`` and leaving every block each patched attribute ``is`` the original.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from . import _context, patches
from ._context import current
from .config import GUARDS, OFF, Settings, env_kernels
from .guards import known_issues as ki

__all__ = ["Status", "current", "disable", "enable", "enabled", "is_enabled", "status"]

log = logging.getLogger("torchfix")

_lock = threading.RLock()
_holders = 0  # the global switch (0/1) plus scoped blocks alive in any thread


def _hold() -> None:
    """Count one more holder; the first installs every wrapper. A failed install counts
    nothing and leaves nothing installed."""
    global _holders
    with _lock:
        if _holders == 0:
            try:
                patches.install()
            except BaseException:
                patches.remove()
                raise
        _holders += 1


def _release() -> None:
    global _holders
    with _lock:
        _holders -= 1
        if _holders == 0:
            patches.remove()


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Keep torchfix's wrappers installed through this block, switched on nowhere by it: ``enabled()`` blocks inside
    then cost a context-variable switch, not an install and a removal each (ComfyUI's guards node holds them for a
    sampling run and enables them per denoiser call). Outside every ``enabled()`` the wrappers call straight through."""
    _hold()
    try:
        yield
    finally:
        _release()


def enable(
    mode: str = "fix",
    *,
    guards: Iterable[str] = GUARDS,
    dtype: torch.dtype | str | None = None,
    device_policy: str = "error",
    kernels: bool | None = None,
) -> Settings:
    """Switch the guards on for the whole process (every thread).

    Calling it again reconfigures; it never stacks wrappers.

    Args:
        mode: ``fix`` (fix and record), ``warn`` (also warn once per call site),
            ``strict`` (raise instead of fixing) or ``off``.
        guards: any of ``"dtype"``, ``"device"``, ``"stride"``.
        dtype: target dtype for the matmul family and cat when dtypes are mixed.
        device_policy: ``"error"`` or ``"align"``.
        kernels: route to torchfix's kernels on every device type (``True``), never
            (``False``), or only where a hardware run is recorded (``None``: the
            default, or ``TORCHFIX_KERNELS``).

    >>> import torchfix
    >>> torchfix.enable("warn").mode
    'warn'
    >>> torchfix.disable()
    """
    kernels = env_kernels() if kernels is None else kernels
    # Settings validates and normalises guards (a single name, a tuple, a set); no tuple() here,
    # which would split "dtype" into letters and turn None into a bare TypeError.
    settings = Settings(mode=mode, guards=guards, dtype=dtype, device_policy=device_policy, kernels=kernels)
    with _lock:
        was_on = _context.get_global() is not OFF
        if settings.mode == "off":
            _context.set_global(OFF)
            if was_on:
                _release()
            return settings
        if not was_on:
            _hold()  # first: a failed install leaves the global switch off
        _context.set_global(settings)
    log.debug("torchfix enabled: %s", settings.describe())
    return settings


def disable() -> None:
    """Switch the global guards off; with no scoped block alive, every patch is removed.

    Forgiving: calling it when nothing is on does nothing.

    >>> import torchfix
    >>> torchfix.disable()
    """
    with _lock:
        if _context.get_global() is OFF:
            return
        _context.set_global(OFF)
        _release()
    log.debug("torchfix disabled")


def is_enabled() -> bool:
    """Whether guards are active in this context (globally or in a scoped block)."""
    return current().active


@contextlib.contextmanager
def enabled(
    mode: str | None = None,
    *,
    guards: Iterable[str] | None = None,
    dtype: torch.dtype | str | None = None,
    device_policy: str | None = None,
    kernels: bool | None = None,
) -> Iterator[Settings]:
    """Guards on for this thread / async context only; nestable.

    Arguments left as ``None`` are inherited from the settings in force
    outside the block (when those are active), else the defaults. The outer
    settings come back on exit, also on an exception. Works whether or not
    the global switch is on.

    >>> import torch, torchfix
    >>> with torchfix.enabled(mode="strict") as s:
    ...     s.mode
    'strict'
    """
    outer = current()
    base = outer if outer.active else Settings(kernels=env_kernels())
    settings = Settings(
        mode=base.mode if mode is None else mode,
        guards=base.guards if guards is None else guards,
        dtype=base.dtype if dtype is None else dtype,
        device_policy=base.device_policy if device_policy is None else device_policy,
        kernels=base.kernels if kernels is None else kernels,
    )
    state = _context.push_scoped(settings)
    try:
        _hold()
    except BaseException:
        _context.pop_scoped(state)
        raise
    try:
        yield settings
    finally:
        _context.pop_scoped(state)
        _release()


@dataclass(frozen=True)
class Status:
    """What torchfix is doing now (see :func:`status`)."""

    enabled: bool
    settings: Settings
    global_settings: Settings
    scoped_blocks: int
    patched: tuple[str, ...]
    known_issues: tuple[ki.RowState, ...] = field(default=())

    def __str__(self) -> str:
        lines = [
            f"torchfix: {'on' if self.enabled else 'off'} here ({self.settings.describe()})",
            f"  global: {self.global_settings.describe()}; scoped blocks alive: {self.scoped_blocks}",
            f"  patched ({len(self.patched)}): {', '.join(self.patched) if self.patched else 'nothing'}",
            f"  known-issue rows (torch {ki.TORCH_VERSION}, macOS {ki.OS_VERSION or '-'}; upper ends exclusive), "
            f"{sum(r.in_force for r in self.known_issues)} of {len(self.known_issues)} in force here:",
            *(f"    {r}" for r in self.known_issues),
        ]
        return "\n".join(lines)


def status() -> Status:
    """What is patched, in which mode, and which known-issue rows are in force.

    >>> import torchfix
    >>> print(torchfix.status())  # doctest: +ELLIPSIS
    torchfix: ...
    """
    with _lock:
        glob = _context.get_global()
        scoped = _holders - (0 if glob is OFF else 1)
        s = current()
        rows = tuple(ki.states())
        return Status(s.active, s, glob, scoped, tuple(patches.installed()), rows)
