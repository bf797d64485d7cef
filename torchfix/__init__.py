"""torchfix: makes diffusion scripts that break on dtype, device, memory-layout
and resolution problems just work, and says what it fixed.

``import torchfix`` switches the guards on for the process in the mode named by
``TORCHFIX_MODE`` (default ``fix``; ``off`` patches nothing). Importing a submodule (``import
torchfix.testing``, ``from torchfix.comfyui import ...``) does not: call ``torchfix.enable()`` where you want them.
(Python imports the package first either way; the import system then holds the submodule's import lock, which is
what tells the two apart. ``importlib.util.find_spec("torchfix.<submodule>")`` imports the package as ``import
torchfix`` does, so it enables; ``find_spec("torchfix")`` looks the package up without importing it.)

>>> import torchfix
>>> torchfix.disable()
>>> torchfix.is_enabled()
False
"""

from . import devices, kernels
from ._frames import traceback_filtering
from ._kept import keep_dtype
from ._report import FixEvent, Report, report
from ._state import Status, current, disable, enable, enabled, is_enabled, status
from .audit import AuditFinding, AuditReport, audit
from .config import Settings, env_mode
from .errors import (
    DeviceMismatchError,
    DtypeMismatchError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    InvalidCallError,
    LayoutError,
    ModelMismatchError,
    NonFiniteError,
    TorchfixError,
    TorchfixWarning,
    UnknownNameError,
    UnsupportedModelError,
)
from .guards.known_issues import KnownIssue
from .guards.known_issues import add as add_known_issue
from .guards.known_issues import remove as remove_known_issue

__version__ = "0.1.0"

__all__ = [
    "AuditFinding",
    "AuditReport",
    "DeepCacheConfig",
    "DeviceMismatchError",
    "DtypeMismatchError",
    "FixEvent",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "InvalidCallError",
    "KnownIssue",
    "LayoutError",
    "ModelMismatchError",
    "NonFiniteError",
    "PipelineProxy",
    "Report",
    "Settings",
    "Status",
    "TorchfixError",
    "TorchfixWarning",
    "UnknownNameError",
    "UnsupportedModelError",
    "__version__",
    "add_known_issue",
    "audit",
    "current",
    "deepcache",
    "devices",
    "disable",
    "enable",
    "enabled",
    "is_enabled",
    "keep_dtype",
    "kernels",
    "remove_known_issue",
    "report",
    "status",
    "traceback_filtering",
    "wrap",
]

# Imported at first use, so that `import torchfix` brings only the guards: torchfix.wrap needs wrapt, and a script
# that never caches needs none of the cache (its submodule import is the same: `import torchfix.deepcache`).
_LAZY = {"PipelineProxy": "pipeline", "wrap": "pipeline", "DeepCacheConfig": "deepcache", "deepcache": None}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f".{_LAZY[name] or name}", __name__)
        value = module if _LAZY[name] is None else getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'torchfix' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def _under_cli() -> bool:
    """The torchfix command (console script or ``python -m torchfix``) is importing the package."""
    import itertools
    import os
    import sys

    argv = getattr(sys, "orig_argv", sys.argv)
    return os.path.basename(sys.argv[0]) in ("torchfix", "torchfix.exe") or any(
        a == "-m" and b == "torchfix" for a, b in itertools.pairwise(argv)
    )


def _importing(name: str) -> bool:
    """Whether Python is importing module ``name`` (``name`` ending in ``.``: any module under it) right now: the import
    system holds a module's lock from the moment its import starts, through the import of its parent packages, until
    it is loaded. Read from importlib's lock table (``_module_locks``), not from frames; where that table cannot be
    read, ``False``."""
    from importlib import _bootstrap

    locks = getattr(_bootstrap, "_module_locks", None)
    if not isinstance(locks, dict):
        return False
    held = [key for key, ref in list(locks.items()) if isinstance(key, str) and callable(ref) and ref() is not None]
    return any(key.startswith(name) if name.endswith(".") else key == name for key in held)


try:
    _mode = env_mode()
except ValueError:
    if not _under_cli():  # a script gets the error at import; the command says it without a traceback
        raise
    _mode = "off"
if _mode != "off" and not _importing(__name__ + "."):  # `import torchfix.testing` imports this package first
    enable(_mode)
