"""The model a guarded call belongs to, and that model's own dtype.

Asked only after torch rejected a mix of dtypes (never on the fast path). The
model is the pipeline component running the call under ``torchfix.wrap``, else a
component of a calling diffusers pipeline, else the outermost module running
(:func:`torchfix._frames.owner`). Its dtype is the dominant floating dtype of its
parameters by bytes (:func:`torchfix.guards.dtype.dominant`), counting a layer
that diffusers' layerwise casting stores in fp8 by its compute dtype, and leaving
out modules kept in their precision on purpose (``_keep_in_fp32_modules``,
``keep_dtype``).

The answer is cached per model (weakly) and checked on every use against the dtypes
of 64 of the model's parameters spread evenly by bytes (``PROBES``): about 6 µs,
against 0.9 ms for a fresh walk of an SD1.5 UNet's 686 tensors, and 75 µs to read
all their dtypes. ``model.to(dtype)``, or a cast of any submodule that holds at
least 1/64 of the model's parameter bytes, is seen at once (parameters of a
submodule are contiguous in the walk, so such a run of bytes holds a probe); a
smaller cast cannot change the dominant dtype unless its lead is smaller than
that. A parameter *replaced* by another object while the old one lives on is
not seen: whoever replaces one calls :func:`forget`. A dead probe recounts.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import _frames, _kept
from .families import DENOISERS, config_value, main_denoiser
from .guards import dtype as dtype_guard

__all__ = ["PROBES", "follows_input", "forget", "kept_high", "layer_dtype", "model_dtype", "owner_dtype", "pipeline_dtype"]

PROBES = 64

_DTYPE = operator.attrgetter("dtype")
_LAYERWISE = "layerwise_casting"  # diffusers.hooks.layerwise_casting's hook name

# model -> (weakrefs to its parameters, their dtypes when counted, the answer)
_CACHE: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _compute_dtype(module: torch.nn.Module) -> torch.dtype | None:
    """The compute dtype of a layer under diffusers' ``enable_layerwise_casting`` (stored in fp8, run in bf16)."""
    registry = module.__dict__.get("_diffusers_hook")
    get = getattr(registry, "get_hook", None)
    hook = get(_LAYERWISE) if callable(get) else None
    dtype = getattr(hook, "compute_dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def layer_dtype(layer: torch.nn.Module) -> torch.dtype | None:
    """The dtype a layer computes in: its compute dtype under diffusers' layerwise casting, else its weight's.

    >>> layer_dtype(torch.nn.Linear(2, 2).half())
    torch.float16
    """
    weight = getattr(layer, "weight", None)
    return _compute_dtype(layer) or (weight.dtype if isinstance(weight, torch.Tensor) else None)


def _count(model: torch.nn.Module) -> tuple[tuple[weakref.ref, ...], tuple[torch.dtype, ...], torch.dtype | None]:
    params, sizes = [], {}
    kept = _kept.kept_parameters(model)
    for sub in model.modules():
        compute = _compute_dtype(sub)
        for p in sub._parameters.values():
            if p is None:
                continue
            nbytes = p.numel() * p.element_size()
            params.append((p, nbytes))
            if id(p) not in kept:
                counted = compute or p.dtype
                sizes[counted] = sizes.get(counted, 0) + nbytes
    probes: list[torch.Tensor] = []
    total = sum(n for _, n in params)
    if total:
        # The parameter holding byte (i + 1/2) · total / PROBES of the walk, for each i.
        marks = iter([(i + 0.5) * total / PROBES for i in range(PROBES)])
        mark, seen = next(marks), 0
        for p, nbytes in params:
            seen += nbytes
            while mark is not None and mark < seen:
                if not probes or probes[-1] is not p:
                    probes.append(p)
                mark = next(marks, None)
    return tuple(weakref.ref(p) for p in probes), tuple(p.dtype for p in probes), dtype_guard.dominant(sizes)


def model_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The model's own dtype: the floating dtype holding most of its parameter bytes.

    >>> import torch
    >>> m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(2, 2).half())
    >>> model_dtype(m)
    torch.float32
    >>> model_dtype(m.half())
    torch.float16
    """
    entry = _CACHE.get(model)
    if entry is not None:
        refs, dtypes, answer = entry
        try:
            if tuple(map(_DTYPE, map(operator.call, refs))) == dtypes:
                return answer
        except AttributeError:  # a probe died
            pass
    entry = _count(model)
    _CACHE[model] = entry
    return entry[2]


def forget(model: torch.nn.Module) -> None:
    """Drop what is cached about ``model`` (its parameters were replaced)."""
    _CACHE.pop(model, None)


def kept_high(model: torch.nn.Module) -> bool:
    """The component is kept in its precision on purpose: a config flag says so, or ``torchfix.keep_dtype``."""
    return any(config_value(model, f) is True for f in dtype_guard.UPCAST_FLAGS) or _kept.is_kept_module(model)


# model -> whether its layers compute in their input's dtype (read once per model: ComfyUI sets the flag when it builds
# the model's layers)
_FOLLOWS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def follows_input(model: torch.nn.Module) -> bool:
    """Whether ``model``'s layers compute in their input's dtype, casting their weights to it on every call (a flag of
    :data:`torchfix.guards.dtype.FOLLOWS_INPUT_FLAGS` on one of its modules: ComfyUI's cast ops).

    >>> follows_input(torch.nn.Linear(2, 2))
    False
    """
    found = _FOLLOWS.get(model)
    if found is None:
        found = any(getattr(m, f, False) is True for m in model.modules() for f in dtype_guard.FOLLOWS_INPUT_FLAGS)
        _FOLLOWS[model] = found
    return found


def pipeline_dtype(pipe: object) -> torch.dtype | None:
    """A pipeline's dtype: its (first) denoiser's own dtype; ``None`` without one."""
    found = main_denoiser(pipe)
    return None if found is None else model_dtype(_frames.uncompiled(found[1]))


def owner_dtype(chain: Sequence[torch.nn.Module]) -> tuple[torch.dtype | None, str]:
    """The dtype and name of the model that the running modules ``chain`` (innermost first) belong to;
    ``(None, "")`` when no module is running (a bare call). A component of a pipeline answers with the dtype it
    runs in there (:func:`torchfix.guards.dtype.component_dtype`: the pipeline's, unless kept higher on purpose),
    and a name that says so. A model whose layers compute in their input's dtype (:func:`follows_input`) answers
    ``None`` with its name: the input's dtype wins in it."""
    found = _frames.owner(list(chain))
    if found is None:
        return None, ""
    model, name, pipe = found
    if follows_input(model):  # no dtype of its own: the input's wins (the name says why)
        return None, f"{name} (its layers compute in their input's dtype)"
    own = model_dtype(model)
    if own is None:
        return None, ""  # no floating parameters: a bare call
    if pipe is None or name in DENOISERS:
        return own, name
    main = pipeline_dtype(pipe)
    target = dtype_guard.component_dtype(own, main, kept_high=kept_high(model))
    if target == own or target is None:
        return own, name
    return target, f"{name} (pipeline dtype)"
