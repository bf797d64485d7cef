"""The guarded torch callables and their wrappers.

Patch once, gate per call. One wrapper per argument shape (matmul-like, addmm-like,
linear, conv, attention, norm, cat) takes ``*args, **kwargs`` and hands them to the
original untouched: what came by position goes on by position, what came by keyword
goes on by keyword, what was left out stays out (a tensor subclass's
``__torch_function__`` sees the same ``args`` and ``kwargs`` as without torchfix).
Each wrapper first asks, in three closure reads, whether dynamo or torch.export is
tracing and whether a known-issue row is in force for the op's family; while tracing, or
if the call needs a closer look, it takes the general path. Where a row is in force (the
CUDA sdpa row of pytorch/pytorch#191937 on torch < 2.15, the MPS rows), the call pays what
that row's predicate costs (a few attribute reads on its operands, by the call's device
type: ``screen``), and only a call the predicate matches takes the general path.

Eager calls take the *optimistic* path, which reads no settings at all:

1. An operand on the meta device goes to the general path first: for some
   positions torch computes a meta result, or a CPU result with no data behind
   it, instead of raising, and the device guard must see it first. Only those
   positions are read (``is_meta``, ~0.03 µs each; :func:`_meta_operands`);
   tests/patches/test_torch_ops.py puts a meta tensor in every position of
   every op and checks that the device guard names it.
2. Otherwise the original runs with the caller's own arguments. What torch
   accepts comes back exactly as torch computes it: that is the rule
   (docs/guide.md), and it costs no dtype or device reads at all, whichever
   settings are in force (active ones would run it the same way; inactive
   ones run it straight).
3. Only if torch raises does torchfix look: with torchfix off in this
   context, or inputs of one dtype and one device, the error is not
   torchfix's to fix, and torch's own exception propagates untouched;
   anything else goes to :func:`torchfix.runtime.guarded_call`, which casts,
   moves, routes or raises a clear error.

Every other call takes the *general* path (:func:`_general`), which reads the
settings in force: while dynamo or torch.export trace (the checks then run
first and cost nothing in the compiled graph: fake tensors accept dtype mixes
that real kernels reject, so "run it and see" would not see), where a known-issue
row in force matches the call (such rows match calls that torch runs without an
error), and for a call whose operands the fast reads cannot place
(a tensor passed by keyword where a position is read, a non-tensor, too few
arguments; the general path binds by name). ``cat`` always reads its dtypes first: a
promotion torch accepts is still reported, or cast where ``dtype=`` asks for
it. (A ``dtype=`` policy changes no other mix that torch accepts, so it needs
no check first.)
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from .. import _context, _frames, runtime
from .._frames import hide
from ..guards import known_issues as ki
from ..guards.ops import SPECS, OpSpec
from ..runtime import widths
from .core import Patch

__all__ = ["PATCHES", "TARGETS"]

# pytest leaves out of a failure's traceback every frame whose globals hold this (as it does its own
# helpers): a strict-mode failure shows the user's call and torchfix's error, not torchfix's internals.
__tracebackhide__ = True

Wrapper = Callable[..., Any]
Picker = Callable[[tuple, dict], tuple]
# Anything that is not a tensor where one is expected, a missing argument, or
# too few of them: the slow path binds the call properly and lets torch report.
_ODD = (AttributeError, TypeError, ValueError, IndexError, KeyError)
_NO_ROWS: dict[str, Any] = {}
_SCREEN_ODD = (StopIteration, *_ODD)
# A device type's flag on a tensor: a C getter (~0.09 µs), where ``t.device.type`` builds a device (~0.5 µs).
_ON_DEVICE = {"cpu": "is_cpu", "cuda": "is_cuda", "mps": "is_mps", "xpu": "is_xpu", "meta": "is_meta"}
# Re-running a call after these would only repeat them.
_OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def _meta_operands(spec: OpSpec) -> tuple[str, ...]:
    """The operands torch computes with, instead of raising, when that one alone is on the meta
    device (a meta result, or a CPU result with no data behind it); the others raise in torch
    and reach the device guard through step 3. Measured on torch 2.13 CPU and pinned by
    tests/patches/test_torch_ops.py."""
    if spec.kind == "matmul":
        # addmm raises for a meta input or mat1 and computes with a meta mat2; baddbmm computes with any
        return spec.params[2:] if spec.family == "mm" and len(spec.params) == 3 else spec.params
    return {"linear": ("input", "weight"), "conv": spec.params, "attention": ("attn_mask",), "index": spec.tensors}.get(spec.kind, ())


def _uniform(tensors: tuple, rows: Mapping[str, Any], dtypes: bool = True) -> bool:
    """One dtype (bool masks aside; not asked with ``dtypes=False``: an index beside its data) and one
    device among ``tensors`` (``None`` skipped), and no known-issue row in force for that device type."""
    dt = dev = None
    for t in tensors:
        if t is None:
            continue
        if dev is None:
            dt, dev = t.dtype, t.device
            if rows and dev.type in rows:
                return False
        elif t.device != dev or (dtypes and t.dtype is not dt and t.dtype is not torch.bool):
            return False
    return True


def _picker(spec: OpSpec) -> Picker:
    """Where a call's tensors sit (position or keyword), read per call; for ``cat``, its sequence."""
    if spec.sequence:

        def seq(args: tuple, kwargs: dict) -> tuple:
            tensors = args[0] if args else kwargs["tensors"]
            if not isinstance(tensors, (list, tuple)):  # never consume an iterator torch would reject
                raise TypeError(type(tensors).__name__)
            return tuple(tensors)

        return seq
    where = tuple(zip(spec.tensor_positions, spec.tensors))

    def pick(args: tuple, kwargs: dict) -> tuple:
        n = len(args)
        return tuple(args[i] if i < n else kwargs.get(name) for i, name in where)

    return pick


class _CompilingFlag:
    """Stands in for ``torch.compiler`` on a torch without ``_is_compiling_flag``."""

    @property
    def _is_compiling_flag(self) -> bool:
        return torch.compiler.is_compiling()


# ``_DYNAMO() or _COMPILER._is_compiling_flag`` is torch.compiler.is_compiling() without its
# torch.jit.is_scripting() call (scripted code never reaches a Python wrapper): True while dynamo
# traces (folded to a constant, so dynamo never reads the flag or guards on it) and while
# torch.export traces non-strict.
_DYNAMO = torch.compiler.is_dynamo_compiling
_COMPILER = torch.compiler if hasattr(torch.compiler, "_is_compiling_flag") else _CompilingFlag()


def _outer_twin(spec: OpSpec) -> Any:
    """The code of the ``torch.nn.functional`` function that calls ``spec``'s builtin itself
    (``F.layer_norm`` calls ``torch.layer_norm``), or ``None``. Inside its guarded twin, the inner
    guard leaves torch's error to the outer one, so the event names what the user called."""
    twin = {"torch.layer_norm": "layer_norm", "torch.group_norm": "group_norm"}.get(spec.name)
    if twin is None:
        return None
    fn = getattr(F, twin)
    return getattr(fn, "__wrapped__", fn).__code__


def _general(
    spec: OpSpec, orig: Wrapper
) -> tuple[Callable[[tuple, dict], Any], Callable[[BaseException, tuple, dict], Any], Callable[[tuple, dict], bool]]:
    """The general path for one op, the fast path's "torch raised: whose error is it?", and its
    "does a known-issue row in force match this call?"."""
    slow, rows, pick = runtime.guarded_call, ki.holder(spec.family), _picker(spec)
    dynamo, compiler = _DYNAMO, _COMPILER
    meta = tuple((spec.params.index(name), name) for name in _meta_operands(spec))
    sequence, names = spec.sequence, spec.tensors
    twin = _outer_twin(spec)
    dtypes = spec.kind != "index"  # an integer index beside float data is no dtype mix

    def uniform(args: tuple, kwargs: dict) -> bool:
        try:
            return _uniform(pick(args, kwargs), rows[0], dtypes)
        except _ODD:
            return False

    def agree(args: tuple, kwargs: dict) -> bool:
        """One dtype and one device: torch's own error, not torchfix's (rows in force aside: they were screened)."""
        try:
            return _uniform(pick(args, kwargs), _NO_ROWS, dtypes)
        except _ODD:
            return False

    def screen(args: tuple, kwargs: dict) -> bool:
        """Whether a known-issue row in force for the call's device type matches it (or its operands cannot be
        placed): only then does the call take the general path. Costs the rows' predicates and a few reads
        (the first operand's ``is_cuda``-style flag, not its ``device``, which builds an object), nothing more."""
        try:
            tensors = pick(args, kwargs)
            first = tensors[0]
            if first is None:  # an optional first operand left out (addmm's input by keyword)
                first = next(t for t in tensors if t is not None)
            for device_type, found in rows[0].items():
                flag = _ON_DEVICE.get(device_type)
                if getattr(first, flag) if flag is not None else first.device.type == device_type:
                    predicates = found
                    break
            else:
                return False
        except _SCREEN_ODD:
            return True
        # the predicates read the operands given, by name, as on the checked path
        if sequence:
            named = {f"tensors[{i}]": t for i, t in enumerate(tensors)}
        else:
            named = {}
            for name, t in zip(names, tensors):
                if t is not None:
                    named[name] = t
        out = kwargs.get("out") if kwargs else None
        if out is not None:
            named["out"] = out
        for predicate in predicates:
            if predicate(named):
                return True
        return False

    def checked(settings: Any, args: tuple, kwargs: dict) -> Any:
        """Ask first: one dtype and one device, and no row in force, call straight through."""
        if settings.active and not uniform(args, kwargs):
            return slow(spec, orig, settings, args, kwargs)
        return orig(*args, **kwargs)

    def general(args: tuple, kwargs: dict) -> Any:
        if dynamo() or compiler._is_compiling_flag:
            return checked(_context.current(), args, kwargs)
        settings = _context.current()
        if not settings.active or rows[0]:
            return checked(settings, args, kwargs)
        # Read first, act after: nothing is called from inside a try that catches _ODD.
        mixed = on_meta = False
        try:
            if sequence:
                tensors = args[0] if args else kwargs["tensors"]
                dt = tensors[0].dtype
                mixed = any(t.dtype is not dt for t in tensors)
            for i, name in meta:
                t = args[i] if i < len(args) else kwargs.get(name)
                if t is not None and t.is_meta:
                    on_meta = True
        except _ODD:
            on_meta = True  # not tensors where tensors belong: the checked path binds by name
        if mixed:
            return slow(spec, orig, settings, args, kwargs)
        if on_meta:
            return checked(settings, args, kwargs)
        try:
            return orig(*args, **kwargs)
        except Exception as exc:
            if isinstance(exc, _OUT_OF_MEMORY) or agree(args, kwargs):
                raise
        return slow(spec, orig, settings, args, kwargs)

    def failed(exc: BaseException, args: tuple, kwargs: dict) -> Any:
        """After torch raised on the fast path: the settings to fix the call with, or ``None``
        where the error is not torchfix's (torchfix off here, inputs that agree, out of memory)."""
        if isinstance(exc, _OUT_OF_MEMORY):
            return None
        if twin is not None and sys._getframe(2).f_code is twin:
            return None  # called by F.layer_norm / F.group_norm, whose own guard fixes the call
        settings = _context.current()
        if not settings.active or agree(args, kwargs):
            return None
        return settings

    return general, failed, screen


def _prologue(spec: OpSpec, orig: Wrapper) -> tuple[Any, ...]:
    """What every fast wrapper holds in its closure (closure cells are the cheapest reads)."""
    general, failed, screen = _general(spec, orig)
    return _DYNAMO, _COMPILER, ki.holder(spec.family), general, failed, screen, runtime.guarded_call


# The fast wrappers, one per argument shape. Each reads the meta-capable operands where the
# calls that matter put them (by position; a keyword-only bias or mask is read from kwargs)
# and sends anything else (a tensor passed by keyword where a position is read, too few
# arguments, a non-tensor) to the general path, which binds by name. Nothing is called from
# inside a ``try`` that catches _ODD: an error of the caller's own would be caught there and
# the call run twice.


def _matmul(spec: OpSpec, orig: Wrapper) -> Wrapper:
    """matmul / mm / bmm and their Tensor methods: two tensors (``out=`` passes through)."""
    dynamo, compiler, rows, general, failed, screen, slow = _prologue(spec, orig)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if dynamo() or compiler._is_compiling_flag:
            return general(args, kwargs)
        try:
            look = args[0].is_meta or args[1].is_meta
        except _ODD:
            look = True
        if look or (rows[0] and screen(args, kwargs)):
            try:
                return general(args, kwargs)
            except Exception as exc:
                hide(exc)
                raise
        try:
            return orig(*args, **kwargs)
        except Exception as exc:
            settings = failed(exc, args, kwargs)
            if settings is None:
                hide(exc)
                raise
        try:
            return slow(spec, orig, settings, args, kwargs)
        except Exception as exc:
            hide(exc)
            raise

    return wrapper


def _addmm(spec: OpSpec, orig: Wrapper) -> Wrapper:
    """addmm / baddbmm and their Tensor methods: three tensors (``beta=``, ``alpha=``, ``out=`` pass through)."""
    dynamo, compiler, rows, general, failed, screen, slow = _prologue(spec, orig)
    batched = spec.family == "bmm"  # addmm raises for a meta input or mat1; baddbmm computes

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if dynamo() or compiler._is_compiling_flag:
            return general(args, kwargs)
        try:
            look = args[2].is_meta or (batched and (args[0].is_meta or args[1].is_meta))
        except _ODD:
            look = True
        if look or (rows[0] and screen(args, kwargs)):
            try:
                return general(args, kwargs)
            except Exception as exc:
                hide(exc)
                raise
        try:
            return orig(*args, **kwargs)
        except Exception as exc:
            settings = failed(exc, args, kwargs)
            if settings is None:
                hide(exc)
                raise
        try:
            return slow(spec, orig, settings, args, kwargs)
        except Exception as exc:
            hide(exc)
            raise

    return wrapper


def _linear(spec: OpSpec, orig: Wrapper) -> Wrapper:
    """linear(input, weight, bias=None), and the index ops: embedding(input, weight, ...), index_select and
    gather(input, dim, index). Either of the first two tensors on the meta device computes (a meta result, or a CPU
    result with no data behind it; torch checks an index's device only in an accelerator's kernels); a meta bias
    raises."""
    dynamo, compiler, rows, general, failed, screen, slow = _prologue(spec, orig)
    first, second = spec.tensor_positions[:2]

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if dynamo() or compiler._is_compiling_flag:
            return general(args, kwargs)
        try:
            look = args[first].is_meta or args[second].is_meta
        except _ODD:
            look = True
        if look or (rows[0] and screen(args, kwargs)):
            try:
                return general(args, kwargs)
            except Exception as exc:
                hide(exc)
                raise
        try:
            return orig(*args, **kwargs)
        except Exception as exc:
            settings = failed(exc, args, kwargs)
            if settings is None:
                hide(exc)
                raise
        try:
            return slow(spec, orig, settings, args, kwargs)
        except Exception as exc:
            hide(exc)
            raise

    return wrapper


def _conv(spec: OpSpec, orig: Wrapper) -> Wrapper:
    """conv1d/2d/3d(input, weight, bias=None, stride, padding, dilation, groups): all three compute."""
    dynamo, compiler, rows, general, failed, screen, slow = _prologue(spec, orig)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if dynamo() or compiler._is_compiling_flag:
            return general(args, kwargs)
        try:
            bias = args[2] if len(args) > 2 else kwargs.get("bias") if kwargs else None
            look = args[0].is_meta or args[1].is_meta or (bias is not None and bias.is_meta)
        except _ODD:
            look = True
        if look or (rows[0] and screen(args, kwargs)):
            try:
                return general(args, kwargs)
            except Exception as exc:
                hide(exc)
                raise
        try:
            return orig(*args, **kwargs)
        except Exception as exc:
            settings = failed(exc, args, kwargs)
            if settings is None:
                hide(exc)
                raise
        try:
            return slow(spec, orig, settings, args, kwargs)
        except Exception as exc:
            hide(exc)
            raise

    return wrapper


def _attention(spec: OpSpec, orig: Wrapper) -> Wrapper:
    """scaled_dot_product_attention(q, k, v, attn_mask=None, ...): q, k, v on meta raise; a meta mask computes."""
    dynamo, compiler, rows, general, failed, screen, slow = _prologue(spec, orig)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if dynamo() or compiler._is_compiling_flag:
            return general(args, kwargs)
        try:
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask") if kwargs else None
            look = mask is not None and mask.is_meta
        except _ODD:
            look = True
        if look or (rows[0] and screen(args, kwargs)):
            try:
                return general(args, kwargs)
            except Exception as exc:
                hide(exc)
                raise
        try:
            return orig(*args, **kwargs)
        except Exception as exc:
            settings = failed(exc, args, kwargs)
            if settings is None:
                hide(exc)
                raise
        try:
            return slow(spec, orig, settings, args, kwargs)
        except Exception as exc:
            hide(exc)
            raise

    return wrapper


def _norm(spec: OpSpec, orig: Wrapper) -> Wrapper:
    """layer_norm / group_norm: a meta input, weight or bias raises in torch: nothing to read first."""
    dynamo, compiler, rows, general, failed, screen, slow = _prologue(spec, orig)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if dynamo() or compiler._is_compiling_flag:
            return general(args, kwargs)
        if rows[0] and screen(args, kwargs):
            try:
                return general(args, kwargs)
            except Exception as exc:
                hide(exc)
                raise
        try:
            return orig(*args, **kwargs)
        except Exception as exc:
            settings = failed(exc, args, kwargs)
            if settings is None:
                hide(exc)
                raise
        try:
            return slow(spec, orig, settings, args, kwargs)
        except Exception as exc:
            hide(exc)
            raise

    return wrapper


def _cat(spec: OpSpec, orig: Wrapper) -> Wrapper:
    """cat / concat / concatenate(tensors, dim=0, *, out=None): every dtype is read, since a
    promotion torch accepts is still reported; devices are left to torch, which raises."""
    dynamo, compiler, rows, general, failed, screen, slow = _prologue(spec, orig)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if dynamo() or compiler._is_compiling_flag:
            return general(args, kwargs)
        try:
            seq = args[0] if args else kwargs["tensors"]
            dt = seq[0].dtype
            look = False
            for t in seq:
                if t.dtype is not dt:
                    look = True
                    break
        except _ODD:
            look = True
        if look or (rows[0] and screen(args, kwargs)):
            try:
                return general(args, kwargs)
            except Exception as exc:
                hide(exc)
                raise
        try:
            return orig(*args, **kwargs)
        except Exception as exc:
            settings = failed(exc, args, kwargs)
            if settings is None:
                explained = _explain_cat(exc, args, kwargs)
                if explained is not None:
                    raise explained from exc  # torch's own error stays its cause
                hide(exc)
                raise
        try:
            return slow(spec, orig, settings, args, kwargs)
        except Exception as exc:
            hide(exc)
            raise

    return wrapper


def _explain_cat(exc: BaseException, args: tuple, kwargs: dict) -> BaseException | None:
    """torch's cat error, named (embeddings of two models' widths), where torchfix is on; else ``None``."""
    if isinstance(exc, _OUT_OF_MEMORY) or not _context.current().active:
        return None
    seq = args[0] if args else kwargs.get("tensors")
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not isinstance(seq, (list, tuple)) or not isinstance(dim, int):
        return None
    return widths.explain_cat(exc, seq, dim, _frames.call_site(2))


_TEMPLATES: dict[str, Callable[[OpSpec, Wrapper], Wrapper]] = {
    "cat": _cat,
    "attention": _attention,
    "norm": _norm,
    "linear": _linear,
    "conv": _conv,
    "index": _linear,
}


def _template(spec: OpSpec) -> Callable[[OpSpec, Wrapper], Wrapper]:
    if spec.kind in _TEMPLATES:
        return _TEMPLATES[spec.kind]
    return _matmul if len(spec.tensors) == 2 else _addmm


def _maker(spec: OpSpec) -> Callable[[Wrapper], Wrapper]:
    template = _template(spec)

    def make(orig: Wrapper) -> Wrapper:
        wrapper = template(spec, orig)
        # Keep name, docs and signature (torch.export and inspect follow __wrapped__).
        try:
            functools.update_wrapper(wrapper, orig)
        except AttributeError:  # some builtins lack attributes; keep what exists
            wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
        wrapper.__torchfix_spec__ = spec  # type: ignore[attr-defined]
        # TorchScript compiles a Python function it meets (F.layer_norm, F.group_norm) from its source, which
        # inspect finds through __wrapped__, but with the wrapper's globals, where F's helpers are undefined: it
        # asks __prepare_scriptable__ for what to compile, and scripted code calls torch's function as it would
        # without torchfix (builtins such as F.linear go through compilers.sync's table instead).
        wrapper.__prepare_scriptable__ = lambda: orig  # type: ignore[attr-defined]
        return wrapper

    return make


# (owner, attribute, spec name)
TARGETS: tuple[tuple[Any, str, str], ...] = (
    (torch, "matmul", "torch.matmul"),
    (torch, "mm", "torch.mm"),
    (torch, "bmm", "torch.bmm"),
    (torch, "addmm", "torch.addmm"),
    (torch, "baddbmm", "torch.baddbmm"),
    (torch.Tensor, "matmul", "Tensor.matmul"),
    (torch.Tensor, "__matmul__", "Tensor.__matmul__"),
    (torch.Tensor, "__rmatmul__", "Tensor.__rmatmul__"),
    (torch.Tensor, "mm", "Tensor.mm"),
    (torch.Tensor, "bmm", "Tensor.bmm"),
    (torch.Tensor, "addmm", "Tensor.addmm"),
    (torch.Tensor, "baddbmm", "Tensor.baddbmm"),
    (F, "linear", "F.linear"),
    (F, "conv1d", "F.conv1d"),
    (F, "conv2d", "F.conv2d"),
    (F, "conv3d", "F.conv3d"),
    (F, "scaled_dot_product_attention", "F.scaled_dot_product_attention"),
    (F, "layer_norm", "F.layer_norm"),
    (F, "group_norm", "F.group_norm"),
    (torch, "cat", "torch.cat"),
    (torch, "concat", "torch.concat"),
    (torch.linalg, "matmul", "torch.linalg.matmul"),
    (torch, "conv1d", "torch.conv1d"),
    (torch, "conv2d", "torch.conv2d"),
    (torch, "conv3d", "torch.conv3d"),
    (torch, "layer_norm", "torch.layer_norm"),
    (torch, "group_norm", "torch.group_norm"),
    (torch, "concatenate", "torch.concatenate"),
    (F, "embedding", "F.embedding"),
    (torch, "index_select", "torch.index_select"),
    (torch.Tensor, "index_select", "Tensor.index_select"),
    (torch, "gather", "torch.gather"),
    (torch.Tensor, "gather", "Tensor.gather"),
)

PATCHES: tuple[Patch, ...] = tuple(
    Patch(owner, attr, name if not name.startswith("F.") else f"torch.nn.functional.{attr}", _maker(SPECS[name]))
    for owner, attr, name in TARGETS
)
