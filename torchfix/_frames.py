"""Where an op was called from: the user's ``file:line`` and the module path.

Both are computed only when torchfix acts (an event or an error), never on the
fast path, by walking the Python stack.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import weakref
from types import FrameType, TracebackType
from typing import Any

import torch

from .config import env_traceback_filtering
from .errors import InvalidArgumentTypeError, TorchfixError

__all__ = [
    "call_site",
    "drop_frames",
    "hide",
    "hiding_frames",
    "in_library",
    "module_chain",
    "module_path",
    "name_root",
    "outside_graphs",
    "owner",
    "traceback_filtering",
    "uncompiled",
]

# Libraries whose own internal promotions are theirs, not the user's to fix (diffusers' SDXL UNet concatenates
# bf16 text embeddings with fp32 time embeddings and casts the result back on the next line).
LIBRARIES = ("diffusers", "transformers", "peft", "accelerate")

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TORCHFIX_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_SKIP = (_TORCH_DIR, _TORCHFIX_DIR)
# Layer wrappers and hook plumbing between the caller and the op: a call site there names the wrapper,
# not who called the layer (ComfyUI's cast-weight layers, peft's LoRA layers, accelerate's and diffusers'
# forward hooks). The layer itself stays in the module path.
LAYER_WRAPPERS = tuple(
    os.sep + p.replace("/", os.sep)
    for p in (
        "comfy/ops.py",
        "peft/tuners/lora/layer.py",
        "peft/tuners/lora/bnb.py",
        "peft/tuners/tuners_utils.py",
        "accelerate/hooks.py",
        "diffusers/hooks/hooks.py",
    )
)
_SITE_DIRS = tuple(
    sorted({p + os.sep for p in (sysconfig.get_paths().get("purelib"), sysconfig.get_paths().get("platlib")) if p}, key=len, reverse=True)
)
_CALL_IMPL = torch.nn.Module._call_impl.__code__

# root module -> name the pipeline gave it ("text_encoder"); filled by torchfix.wrap
_ROOT_NAMES: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
# root module -> the pipeline that named it (a weak reference), for the pipeline's dtype (torchfix._model)
_ROOT_PIPES: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref] = weakref.WeakKeyDictionary()
# root module -> {id(submodule): dotted name}, rebuilt when a lookup misses
_NAME_CACHE: weakref.WeakKeyDictionary[torch.nn.Module, dict[int, str]] = weakref.WeakKeyDictionary()


def _user_frame(frame: FrameType | None) -> FrameType | None:
    """The innermost frame outside torch, torchfix and :data:`LAYER_WRAPPERS` (the first outside torch
    and torchfix where nothing else is left)."""
    fallback = None
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_SKIP):
            if not filename.endswith(LAYER_WRAPPERS):
                return frame
            fallback = fallback or frame
        frame = frame.f_back
    return fallback


def _short(filename: str) -> str:
    """A file as events and errors name it: ``diffusers/models/…`` for a file of an installed package, the relative
    path for the user's own. A library of :data:`LIBRARIES` is named by where it was imported from (its package's
    ``__path__``), wherever that is: ``pip install --target DIR`` on ``PYTHONPATH`` (a GPU machine whose wheels
    were carried in) or a source checkout is as much the library's as site-packages, and its sites read alike."""
    for site_dir in _SITE_DIRS:
        if filename.startswith(site_dir):
            return filename[len(site_dir) :]
    for name in LIBRARIES:
        for root in getattr(sys.modules.get(name), "__path__", None) or ():
            root = os.path.join(os.path.abspath(root), "")
            if filename.startswith(root):
                return f"{name}/{filename[len(root) :].replace(os.sep, '/')}"
    try:
        rel = os.path.relpath(filename)
    except ValueError:
        return filename
    return filename if rel.startswith("..") else rel


def call_site(depth: int = 1) -> str:
    """``file:line`` of the innermost frame that is neither torch's nor torchfix's."""
    frame = _user_frame(sys._getframe(depth))
    if frame is None:
        return "<unknown>"
    return f"{_short(frame.f_code.co_filename)}:{frame.f_lineno}"


def in_library(site: str) -> bool:
    """Whether a call site (as :func:`call_site` gives it) lies in one of :data:`LIBRARIES`' own code.

    >>> in_library("diffusers/models/unets/unet_2d_condition.py:920"), in_library("my_script.py:3")
    (True, False)
    """
    return site.replace(os.sep, "/").split("/", 1)[0] in LIBRARIES


def module_chain(depth: int = 1) -> list[torch.nn.Module]:
    """Modules being run, innermost first: read from ``Module._call_impl`` frames and from the
    frames of a module's own methods (``vae.decode`` runs the VAE, though not its ``forward``)."""
    chain: list[torch.nn.Module] = []
    frame: FrameType | None = sys._getframe(depth)
    while frame is not None:
        code = frame.f_code
        if code is _CALL_IMPL or (code.co_argcount and code.co_varnames[0] == "self" and not code.co_filename.startswith(_TORCH_DIR)):
            module = frame.f_locals.get("self")
            if isinstance(module, torch.nn.Module) and not any(module is m for m in chain):
                chain.append(module)
        frame = frame.f_back
    return chain


def name_root(module: torch.nn.Module, name: str | None, pipeline: object = None) -> None:
    """Give a top-level module a display name, and the pipeline it is a component of (``None`` forgets both)."""
    if name is None:
        _ROOT_NAMES.pop(module, None)
        _ROOT_PIPES.pop(module, None)
    else:
        _ROOT_NAMES[module] = name
        if pipeline is not None:
            try:
                _ROOT_PIPES[module] = weakref.ref(pipeline)
            except TypeError:  # not weakly referable: no pipeline dtype for it
                pass


def _resolves(root: torch.nn.Module, name: str, leaf: torch.nn.Module) -> bool:
    try:
        return root.get_submodule(name) is leaf
    except AttributeError:
        return False


def _names(root: torch.nn.Module, leaf: torch.nn.Module) -> str | None:
    cache = _NAME_CACHE.get(root)
    name = None if cache is None else cache.get(id(leaf))
    if name is None or not _resolves(root, name, leaf):
        cache = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
        _NAME_CACHE[root] = cache
        name = cache.get(id(leaf))
    return name


def _component(chain: list[torch.nn.Module], frame: FrameType | None) -> tuple[torch.nn.Module, str, object] | None:
    """The running module that a calling pipeline holds as a component, the component's name and the pipeline:
    the nearest frame whose ``self`` has a ``components`` dict (a diffusers pipeline's ``__call__``)."""
    running = {id(m): m for m in chain}
    for _ in range(256):
        if frame is None:
            return None
        owner = frame.f_locals.get("self") if frame.f_code is not _CALL_IMPL else None
        components = getattr(owner, "components", None) if owner is not None and not isinstance(owner, torch.nn.Module) else None
        if isinstance(components, dict):
            for name, component in components.items():
                if id(component) in running:
                    return running[id(component)], name, owner
        frame = frame.f_back
    return None


def _root(chain: list[torch.nn.Module], frame: FrameType | None) -> tuple[torch.nn.Module, str, object]:
    """The model the running modules belong to, its display name and the pipeline it is a component of (or ``None``).

    The outermost module that the pipeline named wins; else a named module that
    contains the running ones (a submodule called directly); else a running module
    that a calling pipeline holds as a component (plain `import torchfix`, no wrap);
    else the outermost running.
    """
    root = next((m for m in reversed(chain) if m in _ROOT_NAMES), None)
    if root is None:
        root = next((r for r in list(_ROOT_NAMES.keys()) if _names(r, chain[-1]) is not None), None)
    if root is None:
        found = _component(chain, frame)
        if found is not None:
            return found
        return chain[-1], "", None
    pipe = _ROOT_PIPES.get(root)
    return root, _ROOT_NAMES.get(root, ""), None if pipe is None else pipe()


def outside_graphs(fn: Any) -> Any:
    """``torch.compiler.disable(fn)``, made when dynamo first traces a call to ``fn``: decorating at import time would
    import torch._dynamo (and Triton) with torchfix, ~1.3-1.8 s. In eager ``fn`` runs directly; while dynamo traces,
    the call to ``torch.compiler.disable`` itself is a graph break that runs eagerly once, and every trace after that
    calls the disabled function."""
    disabled: list[Any] = []

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return wrapper


def under_dynamo(depth: int = 1000) -> bool:
    """Whether this Python call was reached through torch.compile's frame evaluation (an ``OptimizedModule`` or a
    compiled function calling it, or a graph break running eagerly inside compiled code): some of the calls around
    it then run as compiled graphs, whose Python never runs. Reads up to ``depth`` frames.

    >>> under_dynamo()
    False
    """
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_filename.endswith(_EVAL_FRAME):
            return True
        frame = frame.f_back
    return False


_EVAL_FRAME = os.path.join("torch", "_dynamo", "eval_frame.py")


def uncompiled(module: torch.nn.Module) -> torch.nn.Module:
    """The module a ``torch.compile``'d ``OptimizedModule`` runs (that module is the model), else ``module``.

    >>> import torch
    >>> lin = torch.nn.Linear(2, 2)
    >>> uncompiled(lin) is lin
    True
    """
    inner = module._modules.get("_orig_mod") if type(module).__name__ == "OptimizedModule" else None
    return inner if isinstance(inner, torch.nn.Module) else module


def owner(chain: list[torch.nn.Module]) -> tuple[torch.nn.Module, str, object] | None:
    """The model a call made inside the running modules ``chain`` (innermost first) belongs to, with
    its name (a pipeline component's, else its class's) and the pipeline it is a component of (``None``
    outside one); ``None`` when no module is running.

    >>> import torch
    >>> owner([]) is None
    True
    """
    if not chain:
        return None
    root, name, pipe = _root([uncompiled(m) for m in chain], sys._getframe(1))
    return root, name or type(root).__name__, pipe


def module_path(chain: list[torch.nn.Module]) -> str | None:
    """Dotted path of the innermost module, e.g. ``text_encoder.text_projection``."""
    if not chain:
        return None
    leaf = chain[0]
    root, prefix, _ = _root(chain, sys._getframe(1))
    if leaf is root:
        return prefix or type(leaf).__name__
    name = _names(root, leaf)
    if name is None:
        name = type(leaf).__name__
    return f"{prefix}.{name}" if prefix else name


# --- tracebacks ---------------------------------------------------------------------------------------------

_FILTERING = [env_traceback_filtering()]


def traceback_filtering(on: bool | None = None) -> bool:
    """Whether torchfix leaves its own frames out of the tracebacks of errors that are not its own (an error
    torch, a library or the user's code raised through a torchfix wrapper); with ``on`` given, set it first.
    On by default; ``TORCHFIX_TRACEBACK_FILTERING=off`` starts with it off. torchfix's own errors
    (:class:`torchfix.TorchfixError`) keep every frame.

    >>> import torchfix
    >>> before = torchfix.traceback_filtering()   # the setting now
    >>> torchfix.traceback_filtering(False)       # every frame, as when debugging torchfix itself
    False
    >>> torchfix.traceback_filtering(before) == before
    True
    """
    if on is not None:
        if not isinstance(on, bool):
            raise InvalidArgumentTypeError(f"torchfix.traceback_filtering(on=...) takes True, False or None, not {type(on).__name__}.")
        _FILTERING[0] = on
    return _FILTERING[0]


def hide(exc: BaseException, also: tuple[str, ...] = ()) -> None:
    """Drop torchfix's frames from ``exc``'s traceback, for a bare ``raise`` right after (which, unlike
    ``raise exc``, adds no frame): the user's traceback then ends where plain torch's would. Called only on
    the way out of a wrapper with an error that is not torchfix's; JAX filters its frames the same way.
    ``also``: more file-name prefixes whose frames go too (``torchfix run``'s runpy)."""
    if _FILTERING[0] and not isinstance(exc, TorchfixError):
        drop_frames(exc, (_TORCHFIX_DIR, *also))


def hiding_frames(fn: Any) -> Any:
    """``fn`` (a model forward the cache installs) as a traceback boundary: an error that is not torchfix's, raised in
    the model's own code below it, leaves with torchfix's frames dropped (:func:`hide`), so it reads
    as it would without the cache. ``fn``'s attributes (the cache's marker) and ``__wrapped__`` carry over."""

    @functools.wraps(fn)
    def forward(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            hide(exc)
            raise

    return forward


def drop_frames(exc: BaseException, prefixes: tuple[str, ...]) -> None:
    """Rebuild ``exc``'s traceback without the frames of files whose names start with one of ``prefixes``."""
    tb = exc.__traceback__
    kept: list[TracebackType] = []
    dropped = False
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.startswith(prefixes):
            dropped = True
        else:
            kept.append(tb)
        tb = tb.tb_next
    if not dropped:
        return
    rebuilt = None
    for entry in reversed(kept):
        rebuilt = TracebackType(rebuilt, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    exc.__traceback__ = rebuilt
