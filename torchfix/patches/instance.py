"""Reversible changes to *one object* (a UNet's ``forward``, a scheduler's
``set_timesteps``, a module hook), never to its class.

Patching a class to change one instance would change every pipeline in the
process; these helpers set instance attributes and remember exactly what was
there, so that removal leaves the object as it was (an attribute that was
inherited from the class is deleted again, not left as a copy).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .._frames import hide
from ..errors import TorchfixError
from .core import leave_theirs

__all__ = [
    "AttrHandle",
    "ForwardHandle",
    "HookHandle",
    "TensorHandle",
    "add_hook",
    "forward_source",
    "place",
    "place_all",
    "set_attr",
    "shadowed",
    "swap_tensor",
    "wrap_forward",
]

_MISSING = object()


@dataclass
class AttrHandle:
    """What :func:`set_attr` replaced; ``restore()`` puts it back (once)."""

    obj: Any
    name: str
    value: Any
    previous: Any = _MISSING
    active: bool = True

    def restore(self) -> None:
        if not self.active:
            return
        self.active = False
        if vars(self.obj).get(self.name, _MISSING) is not self.value:
            leave_theirs(f"{type(self.obj).__name__}.{self.name}")
            return
        if self.previous is _MISSING:
            delattr(self.obj, self.name)
        else:
            setattr(self.obj, self.name, self.previous)


def set_attr(obj: Any, name: str, value: Any) -> AttrHandle:
    """Set ``obj.name = value`` on the instance, remembering what its ``__dict__`` held.

    >>> import types
    >>> ns = types.SimpleNamespace()
    >>> h = set_attr(ns, "x", 1); h.restore(); hasattr(ns, "x")
    False
    """
    previous = vars(obj).get(name, _MISSING)
    setattr(obj, name, value)
    return AttrHandle(obj, name, value, previous)


@contextlib.contextmanager
def shadowed(module: torch.nn.Module, values: Mapping[str, Any]) -> Iterator[None]:
    """Within the block, reading ``module.<name>`` gives ``values[name]`` instead of the child module registered under
    that name; afterwards (also when the block raises) the child is what the name reads again.

    The value goes into the instance's ``__dict__``, which Python reads before ``nn.Module.__getattr__`` looks in
    ``_modules``: the child stays registered (``state_dict``, ``.to()``, ``named_modules`` and hooks see it), and a
    plain list can stand in for a ``ModuleList``, which ``nn.Module.__setattr__`` would refuse.

    >>> m = torch.nn.Module(); m.blocks = torch.nn.ModuleList([torch.nn.Identity()])
    >>> with shadowed(m, {"blocks": [abs]}):
    ...     m.blocks[0](-1)
    1
    >>> type(m.blocks).__name__, "blocks" in vars(m)
    ('ModuleList', False)
    """
    taken = [name for name in values if name in vars(module)]
    if taken:
        raise TorchfixError(
            f"torchfix: {type(module).__name__}.{taken[0]} is already an instance attribute (someone shadows the child "
            "module there); torchfix leaves it alone."
        )
    put = []
    try:
        for name, value in values.items():
            vars(module)[name] = value
            put.append((name, value))
        yield
    finally:
        for name, value in put:
            if vars(module).get(name, _MISSING) is value:
                del vars(module)[name]
            else:
                leave_theirs(f"{type(module).__name__}.{name}")


@dataclass
class HookHandle:
    """A forward (pre-)hook added by :func:`add_hook`; ``restore()`` removes it."""

    handle: Any = field(repr=False)

    def restore(self) -> None:
        self.handle.remove()


def add_hook(
    module: torch.nn.Module, fn: Callable[..., Any], *, pre: bool = False, with_kwargs: bool = False, always_call: bool = False
) -> HookHandle:
    """Register a forward hook (or pre-hook) on one module; remove it with ``restore()``. ``always_call``: a forward
    hook that runs even where the call raised (to end what its pre-hook began)."""
    if pre:
        return HookHandle(module.register_forward_pre_hook(fn, with_kwargs=with_kwargs))
    return HookHandle(module.register_forward_hook(fn, with_kwargs=with_kwargs, always_call=always_call))


Forward = Callable[..., Any]


def _hook_registry() -> Any:
    """diffusers' ``HookRegistry`` where the installed diffusers has one (0.32+), else ``None``."""
    import sys

    if "diffusers" not in sys.modules:  # never import diffusers for a model that does not come from it
        return None
    try:
        from diffusers.hooks import HookRegistry, ModelHook
    except ImportError:
        return None
    return HookRegistry, ModelHook


def _registry_wrapper(module: torch.nn.Module, fn: Any) -> bool:
    """Whether ``fn`` is one of diffusers' ``HookRegistry`` forwards on ``module`` (a ``functools.partial`` of a hook's
    forward with the module bound first)."""
    return isinstance(fn, functools.partial) and fn.args[:1] == (module,)


def forward_source(module: torch.nn.Module) -> Callable[..., Any]:
    """The forward whose signature a call of ``module`` binds to. ``module.forward`` itself, unless it is (or wraps,
    through ``__wrapped__`` links: accelerate's hooks) a forward of diffusers' ``HookRegistry``: diffusers before 0.40
    points those at its own ``new_forward(module, *args, **kwargs)``, whose signature is not the model's (0.40+
    points them at the forward beneath). Then the forward beneath the registry's hooks (they pass every argument
    on), or the class's own forward bound to the module where the registry's bookkeeping names none.

    >>> import inspect
    >>> lin = torch.nn.Linear(2, 2)
    >>> list(inspect.signature(forward_source(lin)).parameters)
    ['input']
    """
    forward = module.forward
    registry = getattr(module, "_diffusers_hook", None)
    refs = getattr(registry, "_fn_refs", None)
    if not refs:
        return forward
    fn: Any = forward
    for _ in range(64):
        if _registry_wrapper(module, getattr(fn, "__func__", fn)) or _registry_wrapper(module, fn):
            first = refs[0]
            beneath = first.original_forward if first.original_forward is not None else first.forward
            if beneath is None or _registry_wrapper(module, beneath):  # a hook removed from beneath left a stale link
                return type(module).forward.__get__(module, type(module))
            return beneath
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            break
    return forward


def _context_listener(on_context: Callable[[Any], None]) -> Any:
    """An object diffusers' ``cache_context`` hands each call's context to (``None`` after the call): it finds every
    ``StateManager`` on a stateful hook (0.41+: ``_set_cache_context``, a ``CacheContext``; before: the registry's
    ``_set_context``, the context's name). ``None`` where this diffusers has none."""
    try:
        from diffusers.hooks.hooks import BaseState, StateManager
    except ImportError:
        return None

    class _Listener(StateManager):
        def __init__(self) -> None:
            super().__init__(BaseState)

        def set_context(self, context: Any) -> None:
            super().set_context(context)
            on_context(context)

    return _Listener()


@dataclass
class ForwardHandle:
    """A ``forward`` replaced by :func:`wrap_forward`; ``restore()`` takes it out of the chain.

    Another library may re-install the ``forward`` it saved before ours went in: accelerate's
    ``remove_hook_from_module`` (which diffusers' ``maybe_free_model_hooks`` runs after every
    offloaded pipeline call) sets ``module.forward = module._old_forward``. :meth:`in_path` says
    whether a call of the module still reaches ours, and :meth:`ensure` puts it back on top.
    """

    module: torch.nn.Module
    name: str
    make: Callable[[Forward, Forward], Forward] = field(repr=False)
    reset: Callable[[], None] | None = field(default=None, repr=False)
    on_context: Callable[[Any], None] | None = field(default=None, repr=False)
    attr: AttrHandle | None = None  # the plain path (no diffusers HookRegistry)
    created_registry: bool = False
    had_forward: bool = False
    installed: Any = field(default=None, repr=False)  # what module.forward was right after ours went in
    reinstalls: int = 0
    active: bool = True

    def in_path(self) -> bool:
        """Whether calling the module runs our forward: it is ``module.forward``, or what that wraps."""
        f = vars(self.module).get("forward")
        for _ in range(64):  # update_wrapper's __wrapped__ links: diffusers' registry, accelerate's hooks
            if f is None:
                return False
            if f is self.installed:
                return True
            f = getattr(f, "__wrapped__", None)
        return False

    def ensure(self) -> bool:
        """Put ours back on top of whatever ``forward`` the module has now, if a call no longer reaches it.
        Returns whether it had to."""
        if not self.active or self.in_path():
            return False
        registry = getattr(self.module, "_diffusers_hook", None)
        if self.attr is None and registry is not None and self.name in registry.hooks:
            # Drop our stale entry without touching module.forward (diffusers' remove_hook would
            # put back the forward we wrapped, which is the one that was replaced), then register anew.
            _drop_entry(registry, self.name)
            _register(self.module, self.name, self.make, self.reset, self.on_context)
        else:
            self.attr = set_attr(self.module, "forward", self.make(self.module.forward, forward_source(self.module)))
        self.installed = vars(self.module).get("forward")
        self.reinstalls += 1
        return True

    def restore(self) -> None:
        if not self.active:
            return
        self.active = False
        if self.attr is not None:
            self.attr.restore()
            return
        registry = getattr(self.module, "_diffusers_hook", None)
        if registry is None:
            return
        reached = self.in_path()
        if not reached and self.name in registry.hooks:
            _drop_entry(registry, self.name)  # someone re-installed a forward over ours: leave theirs
        else:
            registry.remove_hook(self.name, recurse=False)
        if registry.hooks or not reached:
            return
        if self.created_registry:  # nobody else hooked it: leave the module as it was
            vars(self.module).pop("_diffusers_hook", None)
        forward = vars(self.module).get("forward")
        if not self.had_forward and getattr(forward, "__self__", None) is self.module and getattr(forward, "__func__", None) is getattr(
            type(self.module), "forward", None
        ):  # the registry put back the class's own forward as an instance attribute: take it off again
            vars(self.module).pop("forward", None)


def _drop_entry(registry: Any, name: str) -> None:
    """Take hook ``name`` out of a diffusers ``HookRegistry``'s bookkeeping, leaving ``module.forward`` as it is."""
    index = registry._hook_order.index(name)
    del registry.hooks[name]
    registry._hook_order.pop(index)
    registry._fn_refs.pop(index)


def _register(
    module: torch.nn.Module,
    name: str,
    make: Callable[[Forward, Forward], Forward],
    reset: Callable[[], None] | None,
    on_context: Callable[[Any], None] | None = None,
) -> None:
    registry_cls, model_hook = _hook_registry()
    source = forward_source(module)

    class _TorchfixHook(model_hook):  # type: ignore[misc, valid-type]
        _is_stateful = reset is not None or on_context is not None
        _torchfix = True  # torchfix's own (libraries.foreign_cache_hooks leaves it out)

        def __init__(self) -> None:
            super().__init__()
            self.forward = make(lambda *a, **k: self.fn_ref.original_forward(*a, **k), source)
            if on_context is not None:
                self.contexts = _context_listener(on_context)

        def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            try:
                return self.forward(*args, **kwargs)
            except Exception as exc:  # the model's own error: its traceback without torchfix's frames
                hide(exc)
                raise

        def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
            if reset is not None:
                reset()
            return module

    registry_cls.check_if_exists_or_initialize(module).register_hook(_TorchfixHook(), name)


def wrap_forward(
    module: torch.nn.Module,
    name: str,
    make: Callable[[Forward, Forward], Forward],
    reset: Callable[[], None] | None = None,
    on_context: Callable[[Any], None] | None = None,
) -> ForwardHandle:
    """Replace ``module.forward`` by ``make(call_original, signature_source)``.

    ``call_original`` calls whatever ``forward`` lies underneath at call time, and
    ``signature_source`` is the forward to read the signature from. Where diffusers has its
    ``HookRegistry``, the replacement is registered there as the named ``ModelHook`` ``name``
    (``reset`` as its ``reset_state``), so diffusers' layerwise casting, group offloading and
    caches see it and compose with it, in any order; otherwise it is an instance attribute.
    Either way ``restore()`` takes exactly it out. ``on_context`` gets the ``cache_context`` diffusers'
    pipelines set around each call of the module (and ``None`` after it), where diffusers has them.
    """
    if _hook_registry() is None:
        source = module.forward
        handle = ForwardHandle(module, name, make, reset, on_context, attr=set_attr(module, "forward", make(source, source)))
    else:
        created = not hasattr(module, "_diffusers_hook")
        had_forward = "forward" in vars(module)
        _register(module, name, make, reset, on_context)
        handle = ForwardHandle(module, name, make, reset, on_context, created_registry=created, had_forward=had_forward)
    handle.installed = vars(module).get("forward")
    return handle


def place_all(handles: list[Any], outer: torch.nn.Module, theirs: Callable[[str], bool]) -> tuple[bool, bool]:
    """:func:`place` each forward handle among ``handles``: the one on ``outer`` outside the hooks ``theirs`` names,
    every other inside them. Returns whether any moved: ``outer``'s, another's.

    >>> place_all([], torch.nn.Identity(), lambda name: False)
    (False, False)
    """
    moved_outer = moved_inner = False
    for h in handles:
        if isinstance(h, ForwardHandle):
            outside = h.module is outer
            if place(h, theirs, outside=outside):
                moved_outer |= outside
                moved_inner |= not outside
    return moved_outer, moved_inner


def place(handle: ForwardHandle, theirs: Callable[[str], bool], *, outside: bool) -> bool:
    """Put ``handle``'s hook ``outside`` (or inside) every hook of its module's diffusers ``HookRegistry`` that
    ``theirs`` names (diffusers' context-parallel hooks, ``cp_input---...``), where it is not already. Returns whether
    it moved anything.

    The registry can only be unstacked from the top without breaking a hook that calls what lies beneath it
    (its ``remove_hook`` rewires the hook above a removed one by overwriting its ``forward``): the hooks from the
    lowest one out of place up are removed top down and registered again, ours among them, in the order wanted;
    the others keep their order and their own hook objects.

    Raises:
        TorchfixError: a hook of neither kind lies among those that would move (another library's), so moving them
            could change what it does.
    """
    module, name = handle.module, handle.name
    registry = getattr(module, "_diffusers_hook", None)
    if registry is None or handle.attr is not None or not handle.active or name not in registry.hooks:
        return False
    order = list(registry._hook_order)  # innermost first
    mine = order.index(name)
    wrong = [i for i, n in enumerate(order) if theirs(n) and (i > mine if outside else i < mine)]
    if not wrong:
        return False
    low = min(mine, *wrong)
    moving = order[low:]
    strangers = [n for n in moving if n != name and not theirs(n)]
    if strangers:
        raise TorchfixError(
            f"torchfix: cannot move its hook {name!r} on {type(module).__name__} past diffusers' {order[wrong[0]]!r}: "
            f"other hooks lie between ({', '.join(strangers)}); apply torchfix before them."
        )
    hooks = {n: registry.hooks[n] for n in moving}
    for n in reversed(moving):  # top down: each is the outermost when it goes
        registry.remove_hook(n, recurse=False)
    others = [n for n in moving if n != name]
    for n in ([*others, name] if outside else [name, *others]):
        registry.register_hook(hooks[n], n)
        if n == name:
            handle.installed = vars(module).get("forward")
    return True


@dataclass
class TensorHandle:
    """A parameter's data or a buffer replaced by :func:`swap_tensor`; ``restore()`` puts
    the original back (the very tensor, so it is bit-identical)."""

    module: torch.nn.Module
    name: str
    original: torch.Tensor = field(repr=False)
    replaced: torch.Tensor = field(repr=False)
    active: bool = True

    @property
    def nbytes(self) -> int:
        """Bytes the kept original holds."""
        return self.original.numel() * self.original.element_size()

    def restore(self) -> None:
        if not self.active:
            return
        self.active = False
        param = self.module._parameters.get(self.name)
        if param is not None and _same_tensor(param, self.replaced):  # .data is a fresh alias on every read
            param.data = self.original
        elif param is None and self.module._buffers.get(self.name) is self.replaced:
            self.module._buffers[self.name] = self.original
        else:
            leave_theirs(f"{type(self.module).__name__}.{self.name}", f" (torchfix's original, {self.nbytes:,} B, is released)")


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.device == b.device and a.shape == b.shape


def swap_tensor(module: torch.nn.Module, name: str, convert: Callable[[torch.Tensor], torch.Tensor]) -> TensorHandle:
    """Replace parameter (its ``.data``: the Parameter object stays, so hooks and optimizers
    keep it) or buffer ``name`` of ``module`` by ``convert(tensor)``, keeping the original.

    >>> lin = torch.nn.Linear(2, 2)
    >>> h = swap_tensor(lin, "weight", lambda t: t.half())
    >>> lin.weight.dtype
    torch.float16
    >>> h.restore(); lin.weight.dtype
    torch.float32
    """
    param = module._parameters.get(name)
    if param is not None:
        original = param.data
        param.data = convert(original)
        return TensorHandle(module, name, original, param.data)
    original = module._buffers[name]
    module._buffers[name] = replaced = convert(original)
    return TensorHandle(module, name, original, replaced)
