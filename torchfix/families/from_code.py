"""A registry entry for a denoiser the registry does not know, read off its code: the day-0 families.

A diffusion transformer's ``forward`` runs its blocks in loops over ``ModuleList`` attributes, and each loop says
in one assignment what the registry entries say by hand::

    for block in self.transformer_blocks:
        encoder_hidden_states, hidden_states = block(hidden_states=hidden_states, encoder_hidden_states=..., temb=temb)

The names assigned that the call also passes in are the *streams* (here the text and the image tokens), in the
order the block returns them; everything else the block takes is conditioning. :func:`infer` reads those loops
from the model class's source (``ast``, nothing run) and builds the same :class:`~torchfix.families.Family` a hand-
written entry would be. It is a proposal, never trusted as is: the cache's first call checks it exactly as it
checks every registered entry (each block called once in a fixed order, each stream handed straight on, by object
identity; :mod:`torchfix.deepcache.blocks`), and refuses a model whose blocks behave otherwise.

What inference cannot read, it refuses, naming what it found (:class:`torchfix.UnsupportedModelError`, raised by
:func:`resolve` at ``apply``/``wrap``): a forward without block loops; a loop whose block call it cannot map onto
the block's parameters (``*args``, ``**kwargs`` dicts); a stream used outside the loop's block call (kept in a
list for later: a skip connection); a chain with no image stream. A block list whose streams are not the image's
(text refiners, control branches) is left to run on every step, as the hand-written entries leave them.

Registered entries keep what inference cannot see (a family's measured defaults, the preflight's conditioning
widths, revisable output layers); an inferred entry has the transformer defaults and is named ``auto:<class>``.

>>> from torchfix.families.from_code import role
>>> role("encoder_hidden_states"), role("hidden_states"), role("audio_hidden_states")
('text', 'image', 'audio')
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import types
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UnsupportedModelError
from .spec import Blocks, Family

__all__ = ["PREFIX", "Reading", "infer", "is_comfy", "is_inferred", "read_loops", "resolve", "role"]

PREFIX = "auto:"
COMFY = "comfy.ldm."  # ComfyUI's model classes: their module path
_COMFY_METHODS = 12  # methods of a ComfyUI class read, at most (forward, _forward, forward_orig, their helpers)

# What a stream is, from the model's variable name (else the block's parameter name): the image tokens unless the
# name says text, audio or a control branch. Several families' image streams: hidden_states, x, img, visual_embed,
# joint_hidden_states (text and image joined), content_states, combined_hidden_states.
_TEXT = ("encoder", "txt", "text", "context", "prompt", "caption", "input_ids")
_AUDIO = ("audio",)
_CONTROL = ("control", "conditioning", "hint")
# Lists that run before the streams meet (Lumina 2's and Z-Image's noise and context refiners): always run, as
# the hand-written entries leave them.
_REFINER = ("refiner",)
# Reads of a stream that do not use its values (a loop may look at a stream's dtype or shape).
_METADATA = ("shape", "dtype", "device", "ndim", "size", "dim", "is_contiguous")


def role(name: str) -> str:
    """The stream a variable or parameter name carries: ``"text"``, ``"audio"``, ``"control"`` or ``"image"``."""
    lowered = name.lower()
    for label, marks in (("control", _CONTROL), ("audio", _AUDIO), ("text", _TEXT)):
        if any(m in lowered for m in marks):
            return label
    return "image"


@dataclass(frozen=True)
class Loop:
    """One block loop as the source reads: the list, the streams (model variable → block parameter) in the order
    the block returns them, and why it cannot be cached (``None``: it can)."""

    attr: str
    returns: tuple[str, ...]  # model variables, in return order
    params: dict[str, str]  # model variable -> block parameter
    problem: str | None = None

    def blocks(self) -> Blocks | None:
        """The registry's :class:`Blocks` for this loop, or ``None`` where it carries no single image stream."""
        roles = [role(v) if role(v) != "image" else role(self.params[v]) for v in self.returns]
        if roles.count("image") != 1 or "control" in roles or len(set(roles)) != len(roles):
            return None
        inputs = {r: self.params[v] for r, v in zip(roles, self.returns)}
        return Blocks(self.attr, inputs, tuple(roles))


@dataclass(frozen=True)
class Reading:
    """What :func:`read_loops` found in a model class's forward: the loops in source order, and why nothing could
    be read (``None`` where it could)."""

    loops: tuple[Loop, ...]
    problem: str | None = None


def _tree(function: Any) -> ast.FunctionDef | None:
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(function)))
    except (OSError, TypeError):
        return None
    node = ast.parse(source).body[0]
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _forward_tree(cls: type) -> ast.FunctionDef | None:
    return _tree(getattr(cls, "forward", None))


def is_comfy(cls: type) -> bool:
    """Whether ``cls`` is one of ComfyUI's own model classes (``comfy.ldm``) or derives from one: read the ComfyUI way
    (latents ``x``, guidance passes in ``transformer_options``, blocks one or two methods below ``forward``)."""
    return any(base.__module__.startswith(COMFY) for base in cls.__mro__)


def _comfy_trees(cls: type) -> list[ast.FunctionDef]:
    """The forward of a ComfyUI class and the methods of its own it reaches (``self._forward`` through ComfyUI's
    ``WrapperExecutor``, then ``self.forward_orig``, helpers), breadth first: ComfyUI's forwards run their blocks
    one or two methods down."""
    first = _forward_tree(cls)
    if first is None:
        return []
    trees, seen, queue = [], {"forward"}, [first]
    while queue and len(trees) < _COMFY_METHODS:
        tree = queue.pop(0)
        trees.append(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr not in seen:
                seen.add(node.attr)
                method = inspect.getattr_static(cls, node.attr, None)
                if isinstance(method, types.FunctionType) and (found := _tree(method)) is not None:
                    queue.append(found)
    return trees


def _iterated(loop: ast.For) -> tuple[str, str] | None:
    """``(list attribute, loop variable)`` of ``for block in self.attr`` / ``for i, block in enumerate(self.attr)``."""
    target, it = loop.target, loop.iter
    if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "enumerate" and it.args:
        it = it.args[0]
        target = target.elts[-1] if isinstance(target, ast.Tuple) and len(target.elts) == 2 else None
    if isinstance(it, ast.Attribute) and isinstance(it.value, ast.Name) and it.value.id == "self" and isinstance(target, ast.Name):
        return it.attr, target.id
    return None


def _outside_functions(loop: ast.For) -> list[ast.AST]:
    """The nodes of ``loop`` outside the functions it defines (ComfyUI's ``block_wrap``, handed to a
    ``patches_replace`` entry as its ``original_block``: the block call it makes is the patch's, not the loop's)."""
    found, stack = [], [loop]
    while stack:
        node = stack.pop()
        found.append(node)
        stack += [c for c in ast.iter_child_nodes(node) if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    return found


def _block_calls(loop: ast.For, var: str, comfy: bool = False) -> list[tuple[ast.Assign, ast.Call]]:
    """The assignments ``... = var(...)`` in the loop, with the call (also as a branch of ``a if c else var(...)``;
    the gradient-checkpointing call of the same block in a training branch is not one). ``comfy``: the calls in
    functions the loop defines are left out (:func:`_outside_functions`)."""
    found = []
    for node in _outside_functions(loop) if comfy else ast.walk(loop):
        if not isinstance(node, ast.Assign):
            continue
        value = node.value
        options = [value.body, value.orelse] if isinstance(value, ast.IfExp) else [value]
        for option in options:
            if isinstance(option, ast.Call) and isinstance(option.func, ast.Name) and option.func.id == var:
                found.append((node, option))
    return found


def _names(target: ast.expr) -> list[str] | None:
    elts = target.elts if isinstance(target, ast.Tuple) else [target]
    return [e.id for e in elts] if all(isinstance(e, ast.Name) for e in elts) else None


def _tuple_named(loop: ast.For, call: ast.Call, name: str) -> list[ast.expr] | None:
    """The items of ``name = (a, b, ...)``, the loop's last assignment of ``name`` before ``call`` (Kandinsky 6 builds
    its blocks' arguments so), or ``None``."""
    found = None
    for node in ast.walk(loop):
        if (
            isinstance(node, ast.Assign)
            and node.lineno < call.lineno
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id == name
        ):
            found = node.value.elts if isinstance(node.value, (ast.Tuple, ast.List)) else None
    return found


def _read_call(attr: str, loop: ast.For, assign: ast.Assign, call: ast.Call, params: list[str], variadic: bool) -> Loop:
    """The streams of one block call: the assigned names the call also passes, mapped to block parameters. A
    ``*args`` tuple the loop builds is read item by item; a ``**kwargs`` dict (or a ``*args`` that cannot be read)
    after every stream is passed by name or position is conditioning (a stream cannot be passed twice)."""
    targets = _names(assign.targets[0]) if len(assign.targets) == 1 else None
    if targets is None:
        return Loop(attr, (), {}, f"its block call assigns {ast.unparse(assign.targets[0])}, not names")
    positional: list[ast.expr] = []
    for arg in call.args:
        if isinstance(arg, ast.Starred):
            items = _tuple_named(loop, call, arg.value.id) if isinstance(arg.value, ast.Name) else None
            if items is None:
                break  # positions from here on are unknown
            positional += items
        else:
            positional.append(arg)
    if len(positional) > len(params) and not variadic:
        return Loop(attr, tuple(targets), {}, f"its block call passes {len(positional)} positional arguments to {len(params)} parameters")
    given: dict[str, str] = {}
    for param, arg in [*zip(params, positional), *((k.arg, k.value) for k in call.keywords if k.arg is not None)]:
        if isinstance(arg, ast.Name):
            given.setdefault(arg.id, param)
    missing = [t for t in targets if t not in given]
    if missing and (len(positional) < sum(not isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords)
                    or any(isinstance(a, ast.Starred) for a in call.args)):  # fmt: skip
        return Loop(attr, tuple(targets), given, "its block call passes *args or **kwargs that may hold " + ", ".join(missing))
    if missing:
        return Loop(attr, tuple(targets), given, f"its block returns {', '.join(missing)}, which it does not take (not a stream)")
    return Loop(attr, tuple(targets), {t: given[t] for t in targets})


def _escapes(function: ast.AST, loop: ast.For, call: ast.Assign, streams: tuple[str, ...], comfy: bool = False) -> str | None:
    """A stream the loop uses outside its block call other than to update a stream (``skips.append(hidden_states)``:
    a cached block's output kept for later), or ``None``. A temporary computed from a stream in the loop
    (``adapter_out = self.adapter(..., hidden_states)``) may only update a stream in the same loop, and is read
    nowhere after it: what a cached step changes is then recomputed from this step's stand-in."""
    derived: set[str] = set()

    def uses(node: ast.AST) -> set[str]:
        watched = set(streams) | derived
        metadata = {id(p.value) for p in ast.walk(node) if isinstance(p, ast.Attribute) and p.attr in _METADATA}
        return {
            sub.id
            for sub in ast.walk(node)
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load) and sub.id in watched and id(sub) not in metadata
        }

    def escape(stmt: ast.stmt, used: set[str]) -> str:
        return f"{', '.join(sorted(used))} is used outside the block call ({ast.unparse(stmt)[:80]})"

    def in_place(stmt: ast.stmt, guarded: bool) -> str | None:
        """ComfyUI: a stream changed in place between blocks (``x += hint``, ``x[:, :n] = ...``) keeps its identity, so
        the first call sees one run through it, and a cached step would add what it adds twice (once in the run's
        residual, once again); only where it happens for ControlNet calls alone (``if control is not None``), which
        run in full."""
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AugAssign) else []
        hit = [t for t in targets if (isinstance(t, ast.Subscript) or isinstance(stmt, ast.AugAssign)) and _subscripted(t) in streams]
        if not hit or guarded:
            return None
        return f"{_subscripted(hit[0])} is changed in place between blocks ({ast.unparse(stmt)[:80]}): a cached step would add that twice"

    def visit(statements: list[ast.stmt], guarded: bool = False) -> str | None:
        for stmt in statements:
            if stmt is call:
                continue
            if isinstance(stmt, (ast.If, ast.While)):
                inner = guarded or (comfy and any(isinstance(n, ast.Name) and n.id == "control" for n in ast.walk(stmt.test)))
                if (why := visit(stmt.body, inner)) or (why := visit(stmt.orelse, guarded)):
                    return why
                continue
            if isinstance(stmt, (ast.For, ast.With)):
                if (why := visit(stmt.body, guarded)) is not None:
                    return why
                continue
            if comfy:
                if (why := in_place(stmt, guarded)) is not None:
                    return why
                if isinstance(stmt, ast.AugAssign) and _subscripted(stmt.target) in streams:
                    continue  # ComfyUI's ControlNet adds to a stream in place between blocks (``img[:, :n] += add``)
            if isinstance(stmt, ast.Assign):
                names = [n for t in stmt.targets for n in (_names(t) or ())]
                bases = {t.value.id for t in stmt.targets if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)}
                used = uses(stmt.value)
                if not used:
                    continue
                if any(n in streams for n in names) or bases & set(streams):
                    continue  # a stream updated between blocks: the first call splits the chain there
                if names and len(names) == len(stmt.targets) and not bases:
                    derived.update(names)  # a temporary; checked where it goes
                    continue
                return escape(stmt, used)
            if isinstance(stmt, (ast.Expr, ast.AugAssign, ast.Return, ast.AnnAssign)):
                used = uses(stmt)
                if isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id in streams:
                    used -= {stmt.target.id}
                if used:
                    return escape(stmt, used)
        return None

    if (why := visit(loop.body)) is not None:
        return why
    end = loop.end_lineno or loop.lineno
    stores = [(n.id, n.lineno) for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
    after = sorted(
        {
            n.id
            for n in ast.walk(function)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in derived and n.lineno > end
            and not any(name == n.id and end < line <= n.lineno for name, line in stores)  # bound anew before it is read
        }
    )  # fmt: skip
    return f"{', '.join(after)}, computed from a stream in the loop, is read after it" if after else None


def _subscripted(target: ast.expr) -> str | None:
    """``x`` of a target ``x[...]`` (``x[a][b]`` too), else ``None``."""
    while isinstance(target, ast.Subscript):
        target = target.value
    return target.id if isinstance(target, ast.Name) else None


@functools.lru_cache(maxsize=256)
def _read_class(cls: type, block_params: tuple[tuple[str, tuple[str, ...], bool], ...]) -> Reading:
    comfy = is_comfy(cls)
    trees = _comfy_trees(cls) if comfy else [tree] if (tree := _forward_tree(cls)) is not None else []
    if not trees:
        return Reading((), f"the source of {cls.__name__}.forward cannot be read")
    signatures = {attr: (params, variadic) for attr, params, variadic in block_params}
    readings: dict[str, list[Loop]] = {}  # per list, in source order: one per block call (both branches of an if)
    for tree in trees:
        for node in ast.walk(tree):
            if not isinstance(node, ast.For) or (found := _iterated(node)) is None or found[0] not in signatures:
                continue
            attr, var = found
            params, variadic = signatures[attr]
            readings.setdefault(attr, [])
            for assign, call in _block_calls(node, var, comfy):
                loop = _read_call(attr, node, assign, call, list(params), variadic)
                if loop.problem is None and (why := _escapes(tree, node, assign, loop.returns, comfy)) is not None:
                    loop = Loop(attr, loop.returns, loop.params, why)
                readings[attr].append(loop)
    loops = []
    for attr, found in readings.items():
        if not found:
            loops.append(Loop(attr, (), {}, "no assignment of the form `... = block(...)` calls its blocks"))
        elif len({(r.returns, tuple(sorted(r.params.items())), r.problem) for r in found}) > 1:
            loops.append(Loop(attr, (), {}, "its blocks are called in several ways that disagree on the streams"))
        else:
            loops.append(found[0])
    return Reading(tuple(loops))


def _signature(module: torch.nn.Module) -> inspect.Signature:
    """The class's own ``forward`` signature without ``self`` (what its code says, whatever wraps the instance)."""
    sig = inspect.signature(inspect.unwrap(type(module).forward))
    return sig.replace(parameters=list(sig.parameters.values())[1:])


def _block_lists(model: torch.nn.Module) -> tuple[tuple[str, tuple[str, ...], bool], ...]:
    """``(attribute, block parameters, takes *args)`` for each ``ModuleList`` attribute whose modules are all of one
    class (the repeated blocks; the first call checks that each is called once)."""
    found = []
    for attr, child in model.named_children():
        if not isinstance(child, torch.nn.ModuleList) or len(child) < 1 or len({type(b) for b in child}) != 1:
            continue
        try:
            sig = _signature(child[0])
        except (TypeError, ValueError):
            continue
        params = tuple(p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        variadic = any(p.kind == p.VAR_POSITIONAL for p in sig.parameters.values())
        found.append((attr, params, variadic))
    return tuple(found)


def read_loops(model: torch.nn.Module) -> Reading:
    """The block loops of ``model``'s forward (see the module docstring)."""
    return _read_class(type(model), _block_lists(model))


def is_inferred(family: Family) -> bool:
    """Whether ``family`` was read off a model's code rather than registered."""
    return family.name.startswith(PREFIX)


def _parameters(model: torch.nn.Module) -> list[str]:
    sig = _signature(model)
    return [p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def infer(model: torch.nn.Module) -> Family:
    """A :class:`Family` for ``model`` read off its forward's block loops, or :class:`UnsupportedModelError` saying
    what could not be read. The entry is a proposal the cache's first call verifies.

    >>> try:
    ...     infer(torch.nn.Linear(2, 2))
    ... except UnsupportedModelError as exc:
    ...     print(str(exc)[:93])
    torchfix.families: Linear is not a model family torchfix knows, and its forward runs no block
    """
    name = type(model).__name__
    unknown = f"torchfix.families: {name} is not a model family torchfix knows, and its forward"
    hint = " To describe it by hand: docs/families.md (torchfix.families.register)."
    if not _block_lists(model):
        raise UnsupportedModelError(f"{unknown} runs no block lists it can read (no ModuleList attribute of repeated blocks).{hint}")
    reading = read_loops(model)
    if reading.problem is not None:
        raise UnsupportedModelError(f"{unknown}: {reading.problem}.{hint}")
    if not reading.loops:
        raise UnsupportedModelError(f"{unknown} calls its block lists outside `for block in self.<list>` loops.{hint}")
    cached, skipped = [], []
    for loop in reading.loops:
        if any(m in loop.attr for m in _REFINER):
            skipped.append(f"{loop.attr} (a refiner: runs every step)")
            continue
        if loop.problem is not None:
            if any(role(v) == "image" for v in loop.returns) or not loop.returns:
                raise UnsupportedModelError(f"{unknown}'s loop over {loop.attr}: {loop.problem}.{hint}")
            skipped.append(f"{loop.attr} ({loop.problem})")
            continue
        blocks = loop.blocks()
        if blocks is None:
            skipped.append(f"{loop.attr} (streams {', '.join(loop.returns)}: not the image's; runs every step)")
            continue
        if any(b.attr == blocks.attr for b in cached):
            raise UnsupportedModelError(f"{unknown} loops over {loop.attr} more than once.{hint}")
        cached.append(blocks)
    if not cached:
        raise UnsupportedModelError(f"{unknown}'s block loops carry no image stream: {'; '.join(skipped)}.{hint}")
    params = _parameters(model)
    latent = params[0] if params else "hidden_states"
    prompt = next((p for p in params if p == "encoder_hidden_states"), None) or next((p for p in params if role(p) == "text"), None)
    last = getattr(model, cached[-1].attr)[-1]
    keep_last = 1 if getattr(last, "context_pre_only", False) else 0
    lists = {b.attr for b in cached}
    # The text side's modules (a text projection, a text refiner, text-only block lists): a cached step reuses what they
    # returned where they get the very same inputs (torchfix.deepcache.prompt_only checks that on every call).
    prompt_only = tuple(
        attr
        for attr, _ in model.named_children()
        if attr not in lists and role(attr) == "text" and not any(t in attr for t in ("time", "temb", "timestep"))
    )
    if is_comfy(type(model)):
        from .entries import comfy_passes, comfy_patched

        cls = type(model)
        takes = inspect.signature(inspect.unwrap(cls.forward)).parameters
        if "transformer_options" not in takes and not any(p.kind == p.VAR_KEYWORD for p in takes.values()):
            raise UnsupportedModelError(
                f"{unknown} takes no transformer_options, where ComfyUI says which guidance passes (cond, uncond) a call "
                f"runs: their caches could not be kept apart.{hint}"
            )
        return Family(
            PREFIX + name,
            f"{name} in ComfyUI (read off its code)",
            (f"{cls.__module__}.{cls.__qualname__}",),
            blocks=tuple(cached),
            latent=latent,
            prompt=None,  # ComfyUI builds its conditioning anew each step: its passes say which is which
            keep_last=keep_last,
            prompt_only=prompt_only,
            host="comfyui",
            context=comfy_passes,
            patched=comfy_patched,
            full_only=("control",),
        )
    return Family(
        PREFIX + name,
        f"{name} (read off its code)",
        (name,),
        blocks=tuple(cached),
        latent=latent,
        prompt=prompt,
        keep_last=keep_last,
        pipelines=(),
        prompt_only=prompt_only,
    )


def resolve(model: Any) -> Family:
    """The registry's entry for ``model``, else one read off its code (:func:`infer`); a clear
    :class:`UnsupportedModelError` where the registry refuses its class (:func:`torchfix.families.refuse`) or
    neither can say which blocks to cache."""
    from . import find, refusal, supported

    family = find(model)
    if family is not None:
        return family
    refused = refusal(model)
    if refused is not None:
        cls = model if isinstance(model, type) else type(model)
        raise UnsupportedModelError(
            f"torchfix.families: {cls.__module__}.{cls.__qualname__} ({refused[0]}) is not cached: {refused[1]}. Run it "
            "without the cache, or describe it by hand (torchfix.families.register, docs/families.md)."
        )
    try:
        return infer(model)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{exc} Registered families: {supported()}.") from None
