"""Revising a transformer's cached steps, when a call ends: where one run of cached blocks ends the chain and
feeds the output layers (Flux-like), and the scheduler is a deterministic flow-matching Euler one, each full step
adds to its output what the cached steps since the last one would have added had their blocks' output been the one
interpolated between the full steps around them (``DeepCacheConfig.revise``). The latents then land where the
revised steps would have put them.

>>> import torch
>>> revised((torch.zeros(1),), torch.ones(1))[0]
tensor([1.])
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ._graphs import outside_graphs
from .forecast import as_dtype, interpolate, is_one

if TYPE_CHECKING:
    from .blocks import BlockState
    from .chain import Chain
    from .generation import Stream

__all__ = ["after_call", "revised", "sample_of"]


@outside_graphs
def after_call(state: BlockState, output: Any, kept: bool) -> Any:
    """The call's output, once the call has ended (its step is over: ``state.step`` goes back to idle). Where the
    cached steps are revised: a cached step is noted, and a full step whose residuals were ``kept`` adds to its
    output what the cached steps since the last one would have added, revised (eager: Python lists and numbers).

    >>> import torch
    >>> from torchfix.deepcache.blocks import BlockStep
    >>> from torchfix.deepcache.generation import Generation
    >>> class S: step, generation, idle = BlockStep("full"), Generation(None), BlockStep  # a full step, not revising
    >>> after_call(S(), (torch.zeros(1),), False)[0]
    tensor([0.])
    """
    step, stream = state.step, state.generation.current
    state.step = state.idle()
    if not step.revising or stream is None or step.chain is None or step.chain.revise is not None:
        return output
    sample = sample_of(output)
    if step.mode == "cached":
        if step.entered is not None and step.conditioning is not None and sample is not None:
            stream.since_full.append((stream.step - 1, step.entered, step.conditioning, sample.detach(), step.used))
        return output
    change = None
    if step.mode == "full" and kept and stream.since_full and sample is not None:
        change = _revision(state, step.chain, stream, sample)
    stream.since_full.clear()
    return output if change is None else revised(output, change)


def sample_of(output: Any) -> torch.Tensor | None:
    """The model's output tensor: the first of a tuple, or ``.sample``."""
    sample = output[0] if isinstance(output, tuple) and output else getattr(output, "sample", output)
    return sample if isinstance(sample, torch.Tensor) else None


def _revision(state: BlockState, chain: Chain, stream: Stream, sample: torch.Tensor) -> torch.Tensor | None:
    """What full step ``stream.step − 1`` adds to its output for the cached steps since the last full one:
    per cached step, the output layers rerun on the cached blocks' output interpolated between the full
    steps around it, minus the output the step returned, times its step size; all over this step's size.
    The latents then land where the revised steps would have put them (a flow-matching Euler step is
    ``latents + (σ[i+1] − σ[i])·output``). ``None`` where the scheduler's step index is unknown."""
    model = state.model() if state.model is not None else None
    scheduler = state.scheduler() if state.scheduler is not None else None
    index = getattr(scheduler, "step_index", None)
    sigmas = state.generation.sigmas
    if model is None or not isinstance(index, int) or sigmas is None or index + 1 >= len(sigmas):
        return None
    step = stream.step - 1
    size = sigmas[index + 1] - sigmas[index]
    if size == 0 or index - (step - stream.since_full[0][0]) < 0:
        return None
    run = chain.runs[0]
    k, image = len(run.streams), run.image
    change = torch.zeros_like(sample, dtype=torch.promote_types(sample.dtype, torch.float32))  # half precision sums in float32
    points = [(i, (value[image], value[k + image] if len(value) > k else None)) for i, value in stream.run_history(0)]
    if len(points) == 3 and points[0][0] == 0 and state.generation.warms_up:
        # the quadratic through step 0 overshoots between the next two (on the trained Flux-like model 2-5× the
        # error of the line through them; from the third full step on, the quadratic is the more exact)
        points = points[1:]
    norm, proj = (getattr(model, name) for name in state.family.tail)
    for at, entered, conditioning, used_output, s in stream.since_full:
        residual, predicted = interpolate(points, at)
        if residual is None:
            return None
        revised = entered + residual
        if predicted is not None and not is_one(s):
            revised = revised + (1.0 - as_dtype(s, entered)) * (predicted - entered)
        output = proj(norm(revised, conditioning))
        if output.shape != used_output.shape:
            return None
        i = index - (step - at)
        change += (output - used_output) * (sigmas[i + 1] - sigmas[i])
    state.revised_steps += len(stream.since_full)
    return (change / size).to(sample.dtype)


def revised(output: Any, change: torch.Tensor) -> Any:
    """``output`` with ``change`` added to its sample (a tuple's first item, or ``.sample``)."""
    if isinstance(output, tuple):
        return (output[0] + change, *output[1:])
    output.sample = output.sample + change
    return output
