"""torchfix: makes diffusion scripts that break on dtype, device, memory-layout
and resolution problems just work, and says what it fixed.

``import torchfix`` switches the guards on for the process in the mode named by
``TORCHFIX_MODE`` (default ``fix``; ``off`` patches nothing). Importing a submodule (``import
torchfix.testing``, ``from torchfix.comfyui import ...``) does not: call ``torchfix.enable()`` where you want them.

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


def _importing_a_submodule() -> bool:
    """Whether this import of the package is the first step of importing one of its submodules (``import
    torchfix.testing``, ``from torchfix.comfyui import ...``): Python runs this file first either way, and only
    ``import torchfix`` itself switches the guards on. Read off the import machinery's frames (CPython names
    the module being loaded in ``_find_and_load``); where they cannot be read, the import enables as before."""
    import sys

    getframe = getattr(sys, "_getframe", None)
    frame = getframe(1) if getframe is not None else None
    while frame is not None:
        if frame.f_code.co_name == "_find_and_load" and str(frame.f_locals.get("name", "")).startswith(__name__ + "."):
            return True
        frame = frame.f_back
    return False


try:
    _mode = env_mode()
except ValueError:
    if not _under_cli():  # a script gets the error at import; the command says it without a traceback
        raise
    _mode = "off"
if _mode != "off" and not _importing_a_submodule():
    enable(_mode)
