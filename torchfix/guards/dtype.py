"""The dtype guard: what to do when floating dtypes meet in one op.

Pure: it sees dtypes, never tensors, and patches nothing. Whether torch accepts
the mix is asked of torch itself (:mod:`torchfix.guards.accepts`) and passed in.

The rule (see :mod:`torchfix.guards`): a mix torch accepts is left alone, in
every mode. The one exception the caller asks for is ``dtype=``, which also
decides a silent ``cat`` promotion; without it such a promotion is only
reported (an *advisory* finding). Where torch raises, **the model's own dtype
wins** (what diffusers and transformers maintainers do: cast the stray input to
``model.dtype``, cast the stray layer to the model's dtype, upcast the latents
for a VAE kept in fp32). ``model_dtype`` is the dominant floating dtype, by
parameter bytes, of the model the call belongs to (:func:`dominant`); a stray
input is cast to it at the first op that rejects it, so every later layer runs
natively. In order:

- a module kept in its precision on purpose (``keep=True``: ``keep_dtype``,
  ``_keep_in_fp32_modules``) wins in ``linear``/``conv``/``norm``: its input is
  cast to the weight's dtype;
- ``matmul``/``cat``: the configured ``dtype``, else an active autocast dtype;
- the model's dtype, when a model is running the call (``linear``, ``conv``,
  ``norm``, ``matmul``, ``attention``);
- with no model running (a bare call): ``linear``/``conv``/``norm`` cast weight
  and bias to the input's dtype; the matmul family promotes
  (``torch.promote_types``), except that parameters follow the activations;
  attention follows the query; a ``cat`` rejected under autocast goes to
  autocast's dtype.

>>> import torch
>>> from torchfix.guards.plan import Operand
>>> cpu = torch.device("cpu")
>>> f = decide("linear", [Operand("input", torch.bfloat16, cpu), Operand("weight", torch.float16, cpu)], accepted=False)
>>> [(a.operand, a.to) for a in f.actions]
[('weight', torch.bfloat16)]
>>> decide("norm", [Operand("input", torch.bfloat16, cpu), Operand("weight", torch.float32, cpu)], accepted=True) is None
True
>>> f = decide("linear", [Operand("input", torch.float32, cpu), Operand("weight", torch.float16, cpu)], accepted=False,
...            model_dtype=torch.float16)
>>> [(a.operand, a.to) for a in f.actions]  # a stray fp32 input into an fp16 model
[('input', torch.float16)]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import reduce

import torch

from .._text import dtype_name as _name
from .plan import Action, Finding, Operand

__all__ = [
    "FOLLOWS_INPUT_FLAGS",
    "UPCAST_FLAGS",
    "cast_once",
    "component_dtype",
    "decide",
    "dominant",
    "handover",
    "kept_in_fp32",
    "whole_call",
]


def kept_in_fp32(model: object, path: str) -> bool:
    """Whether the submodule at dotted ``path`` of ``model`` is listed in the model's
    ``_keep_in_fp32_modules`` (the diffusers/transformers rule: a listed name is one
    component of the path).

    >>> class M: _keep_in_fp32_modules = ["proj"]
    >>> kept_in_fp32(M(), "encoder.proj"), kept_in_fp32(M(), "encoder.projection")
    (True, False)
    """
    names = getattr(model, "_keep_in_fp32_modules", None) or ()
    parts = path.split(".")
    return any(n in parts for n in names)


# Config flags with which a component's maintainers say it runs in a higher precision than the pipeline on purpose
# (diffusers' VAEs: ``force_upcast``, which the SDXL pipelines honour by decoding in fp32).
UPCAST_FLAGS = ("force_upcast",)

# Module attributes with which a library says a layer computes in its *input's* dtype, casting its stored weights to it
# on every call (ComfyUI's cast ops: ``comfy.ops.manual_cast``, and layers its model patcher loads partially). A model
# built of such layers has no dtype of its own to win: where torch rejects a mix inside it (a plain torch layer among
# them, such as wav2vec2's weight-normed positional conv, Comfy-Org/ComfyUI#12808), the input's dtype wins, as those
# layers and the maintainers' fix (ComfyUI 0.16.4, #12811: the layer keeps its model-defined dtype) have it.
FOLLOWS_INPUT_FLAGS = ("comfy_cast_weights",)


def component_dtype(
    own: torch.dtype | None, pipeline: torch.dtype | None, *, denoiser: bool = False, kept_high: bool = False
) -> torch.dtype | None:
    """The dtype a pipeline component runs in where torch rejects a mix inside it.

    The rule, in one sentence: **a side component runs in the pipeline's dtype (its denoiser's), unless it is kept in
    a higher precision on purpose** (``kept_high``: a config flag of :data:`UPCAST_FLAGS`, or ``torchfix.keep_dtype``
    on the component). That is how the maintainers load them: ``ControlNetModel.from_pretrained(...,
    torch_dtype=pipe.dtype)``, the text encoders with the pipeline's ``torch_dtype``, a VAE with ``force_upcast``
    left in fp32. The denoiser, and a model outside any pipeline (``pipeline`` is ``None``), run in their own dtype.

    >>> f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32
    >>> component_dtype(f32, f16), component_dtype(f16, bf16)    # a ControlNet, CLIP bodies: the pipeline's dtype
    (torch.float16, torch.bfloat16)
    >>> component_dtype(f32, f16, kept_high=True)                # a VAE with force_upcast stays fp32
    torch.float32
    >>> component_dtype(f16, f32, kept_high=True), component_dtype(bf16, f16, denoiser=True)
    (torch.float32, torch.bfloat16)
    """
    if own is None or pipeline is None or denoiser or own == pipeline:
        return own
    if kept_high and own.itemsize > pipeline.itemsize:
        return own
    return pipeline


def whole_call(
    own: torch.dtype | None, runs: torch.dtype | None, given: torch.dtype | None, *, autocast: bool = False
) -> torch.dtype | None:
    """The dtype a side component's whole call runs in, weights and floating inputs alike, or ``None`` to leave the
    call to the guards op by op (and whatever torch accepts in it as torch computes it).

    ``own`` is the component's dtype, ``runs`` the dtype it runs in inside its pipeline (:func:`component_dtype`) and
    ``given`` the dtype of the tensor its first layer reads (a ControlNet's latents, a VAE's latents or image). Where
    the component runs in another dtype than its own and is handed that tensor in another dtype than its weights,
    plain torch rejects the call at that first layer, so the call is torchfix's to fix, and it runs as the maintainers'
    fix runs it: the component in the pipeline's dtype (``ControlNetModel.from_pretrained(..., torch_dtype=pipe.dtype)``,
    huggingface/diffusers#4860; a VAE without ``force_upcast`` loaded in the pipeline's dtype, #7572). Op by op, a
    ControlNet would add its fp32 control image to its fp16 latents (torch promotes, silently) and hand fp32
    residuals on; a VAE decoder would run its up blocks in their own fp32 (diffusers casts to them). A component kept
    higher on purpose has ``runs == own`` and is left alone; so is a call under autocast (torch accepts it).

    >>> f16, f32 = torch.float16, torch.float32
    >>> whole_call(f32, f16, f16), whole_call(f16, f32, f32)    # an fp32 ControlNet in fp16; an fp16 one beside fp32
    (torch.float16, torch.float32)
    >>> whole_call(f32, f32, f16) is None, whole_call(f32, f16, f32) is None, whole_call(f32, f16, f16, autocast=True) is None
    (True, True, True)
    """
    if own is None or runs is None or given is None or autocast:
        return None
    if runs == own or given == own or not given.is_floating_point:
        return None
    return runs


def dominant(sizes: Mapping[torch.dtype, int]) -> torch.dtype | None:
    """A model's own dtype: the floating dtype holding the most parameter bytes (``sizes``: bytes
    per dtype). One-byte storage dtypes (fp8) are never a compute dtype and are not counted (a
    model stored in fp8 by diffusers' layerwise casting counts its compute dtype instead, see
    :func:`torchfix._model.model_dtype`); a tie goes to the wider dtype. ``None`` for no parameters.

    >>> dominant({torch.bfloat16: 1000, torch.float16: 10})
    torch.bfloat16
    >>> dominant({torch.float8_e4m3fn: 4000, torch.bfloat16: 10}) is torch.bfloat16
    True
    """
    counted = [(n, dt.itemsize, dt) for dt, n in sizes.items() if dt.is_floating_point and dt.itemsize > 1 and n > 0]
    return max(counted, key=lambda c: (c[0], c[1]))[2] if counted else None


def cast_once(current: torch.dtype, wanted: set[torch.dtype]) -> torch.dtype | None:
    """``torchfix.wrap``'s one-time cast of a parameter or buffer that the guards cast on every call:
    the dtype to cast it to once, or ``None`` to leave it (and keep casting per call).

    The guards only ever cast the stray minority of a model to the model's dtype, so
    a one-time cast never touches a component's majority. It is made only where every
    call wanted the same dtype, and never upwards: a one-time cast must never increase
    memory, and a tensor kept in a higher precision stays in it.

    >>> cast_once(torch.float16, {torch.bfloat16}), cast_once(torch.float16, {torch.float32})
    (torch.bfloat16, None)
    """
    if len(wanted) != 1:
        return None  # used at two dtypes: one cast cannot serve both
    (target,) = wanted
    if target == current or target.itemsize > current.itemsize:
        return None
    return target


def handover(receiver: torch.dtype | None, given: torch.dtype) -> torch.dtype | None:
    """The dtype to cast a tensor that one pipeline component hands to another (ControlNet
    residuals to the UNet or transformer) to, or ``None`` to leave it as torch computes it.

    The receiver adds such tensors to its own activations; where torch's promotion keeps the
    receiver's dtype (an fp16 residual into an fp32 UNet) the call runs and is left alone.
    Where it would not (fp16 into bf16 promotes to fp32, which the receiver's next layer
    rejects), the hand-over is cast to the receiver's dtype.

    >>> handover(torch.bfloat16, torch.float16), handover(torch.float32, torch.float16)
    (torch.bfloat16, None)
    """
    if receiver is None or not given.is_floating_point or given == receiver:
        return None
    return receiver if torch.promote_types(receiver, given) != receiver else None


def _describe(floats: Sequence[Operand]) -> str:
    by_dtype: dict[torch.dtype, list[str]] = {}
    for o in floats:
        by_dtype.setdefault(o.dtype, []).append(o.name)
    return "; ".join(f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} {_name(dt)}" for dt, names in by_dtype.items())


def _cast_all(floats: Sequence[Operand], target: torch.dtype, action: str = "cast") -> tuple[Action, ...]:
    return tuple(Action("dtype", action, o.name, target) for o in floats if o.dtype != target)


def decide(
    kind: str,
    operands: Sequence[Operand],
    *,
    accepted: bool,
    policy_dtype: torch.dtype | None = None,
    autocast_dtype: torch.dtype | None = None,
    keep: bool = False,
    model_dtype: torch.dtype | None = None,
    model: str = "",
) -> Finding | None:
    """The dtype finding for one call, or ``None`` when there is nothing to fix or report.

    Args:
        kind: the op's kind (see :mod:`torchfix.guards.ops`).
        operands: the call's tensor arguments.
        accepted: plain torch runs this mix of dtypes (:func:`torchfix.guards.accepts.accepts`).
        policy_dtype: the ``dtype=`` given to enable/enabled/wrap.
        autocast_dtype: the active autocast dtype for the operands' device type.
        keep: the op belongs to a module kept in its precision on purpose.
        model_dtype: the dominant dtype of the model running the call (``None``: a bare call).
        model: that model's name, for the messages.
    """
    floats = [o for o in operands if o.dtype.is_floating_point]
    if len({o.dtype for o in floats}) <= 1:
        return None
    mix = f"mixed floating dtypes: {_describe(floats)}"
    if accepted:
        if kind != "cat":
            return None
        if policy_dtype is not None:  # the caller chose the dtype of mixed cats
            fix = f"cast the tensors to one dtype before the call (torchfix casts to the configured dtype {_name(policy_dtype)})"
            return Finding("dtype", mix, fix, _cast_all(floats, policy_dtype), torch_raises=False)
        target = reduce(torch.promote_types, (o.dtype for o in floats))
        narrowest = min(o.dtype.itemsize for o in floats)
        if target.itemsize <= narrowest:
            return None
        note = f"torch promotes the result to {_name(target)}, {target.itemsize // narrowest}× the bytes of the narrowest input"
        fix = "cast the tensors to one dtype before the call, or pass dtype= to torchfix to choose the result's dtype"
        return Finding("dtype", mix, fix, (), torch_raises=False, note=note, advisory=True)
    inp = next((o for o in floats if o.role == "input"), None)
    weight = next((o for o in floats if o.role == "weight"), None)
    if kind in _PARAM_KINDS and keep and weight is not None and inp is not None:
        target = weight.dtype
        fix = f"this module is kept in {_name(target)} on purpose; its input is cast to {_name(target)}"
        actions = _cast_all(floats, target, _verb(floats, target))
        return Finding("dtype", mix, fix, actions, True, "rule: a module kept in its precision wins")
    if kind in ("matmul", "cat") and (policy_dtype is not None or autocast_dtype is not None):
        if policy_dtype is not None:
            target, why = policy_dtype, f"the requested dtype {_name(policy_dtype)} (dtype= or out=)"
        else:
            target, why = autocast_dtype, f"the active autocast dtype {_name(autocast_dtype)}"
        fix = f"cast the operands to one dtype before the call, or pass dtype= to torchfix (now: {why})"
        return Finding("dtype", mix, fix, _cast_all(floats, target), True, f"rule: {why}")
    if model_dtype is not None and kind != "cat":
        return _model_wins(floats, mix, model_dtype, model or "the model")
    if kind in ("matmul", "cat"):
        params = [o for o in floats if o.param]
        acts = {o.dtype for o in floats if not o.param}
        if kind == "matmul" and params and len(acts) == 1:
            target = next(iter(acts))
            names = ", ".join(o.name for o in params if o.dtype != target)
            fix = f"cast the module that owns {names} once with module.to(torch.{_name(target)}) (or use torchfix.wrap(pipe))"
            note = f"rule: the activations' dtype wins over the parameters' (no model running); per-call cast of {names}"
            return Finding("dtype", mix, fix, _cast_all(floats, target), True, note)
        target = reduce(torch.promote_types, (o.dtype for o in floats))
        fix = f"cast the operands to one dtype before the call, or pass dtype= to torchfix (now: torch.promote_types → {_name(target)})"
        return Finding("dtype", mix, fix, _cast_all(floats, target, "promote"), True, "rule: no model running, torch.promote_types")
    if kind == "attention":
        query = next((o for o in floats if o.role == "query"), floats[0])
        actions = _cast_all(floats, query.dtype)
        return Finding("dtype", mix, f"make key/value/mask {_name(query.dtype)} like the query", actions, True, "rule: the query wins")
    # linear, conv, norm with no model running: parameters against activations
    if inp is None:
        return Finding("dtype", mix, "give weight and bias one dtype", (), True)
    target = inp.dtype
    actions = _cast_all(floats, target)
    params = ", ".join(a.operand for a in actions)
    fix = f"cast the module once with module.to(torch.{_name(target)}) (or use torchfix.wrap(pipe), which does it after the first call)"
    note = f"rule: no model running, the input's dtype wins; per-call cast of {params}: a copy every call until the module is cast once"
    if model:  # a model whose layers compute in their input's dtype (FOLLOWS_INPUT_FLAGS)
        fix = f"give this layer the dtype {model} computes in, torch.{_name(target)} (its other layers cast their weights to their input)"
        note = f"rule: {model}: the input's dtype wins, as in its other layers; per-call cast of {params}"
    return Finding("dtype", mix, fix, actions, True, note)


_PARAM_KINDS = ("linear", "conv", "norm")


def _is_param(o: Operand) -> bool:
    return o.param or o.role in ("weight", "bias")


def _verb(floats: Sequence[Operand], target: torch.dtype) -> str:
    """``upcast`` where an activation is cast to a wider dtype (an fp32 VAE's fp16 latents), else ``cast``."""
    return "upcast" if any(not _is_param(o) and o.dtype != target and o.dtype.itemsize < target.itemsize for o in floats) else "cast"


def _model_wins(floats: Sequence[Operand], mix: str, target: torch.dtype, model: str) -> Finding:
    """The model's own dtype wins: stray inputs and stray parameters alike are cast to it."""
    actions = _cast_all(floats, target, _verb(floats, target))
    stray = [a.operand for a in actions]
    inputs = [o.name for o in floats if o.name in stray and not _is_param(o)]
    dt = _name(target)
    if inputs and len(inputs) == len(stray):
        fix = f"{model} runs in {dt}: cast {', '.join(inputs)} to torch.{dt} before calling it"
        note = f"rule: the model's own dtype ({dt}, {model}) wins; the stray input is cast once, every later layer runs in {dt}"
    else:
        fix = (
            f"cast the module that owns {', '.join(stray)} once with module.to(torch.{dt}) "
            "(or use torchfix.wrap(pipe), which does it after the first call)"
        )
        note = f"rule: the model's own dtype ({dt}, {model}) wins; per-call cast of {', '.join(stray)} until the module is cast once"
    return Finding("dtype", mix, fix, actions, True, note)
