"""Generations and guidance streams, shared by the UNet and the transformer DeepCache.

A *generation* is one pipeline call; within it each ``encoder_hidden_states`` object a
call passes is a *stream* (a prompt, or a guidance branch run as its own call), with its
own step count and cache. Pure Python bookkeeping: no tensor is read but for its shape,
dtype and device.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar

import torch

__all__ = ["MAX_STREAMS", "enter"]

# Streams kept per generation before it is treated as a new one.
MAX_STREAMS = 4


class _HasPrompt(Protocol):
    prompt: Any
    step: int


S = TypeVar("S", bound=_HasPrompt)


def enter(state: Any, latents: torch.Tensor, prompt: Any, new_stream: type[S]) -> S:
    """The stream of this call, after starting a new generation where needed: the pipeline asked for
    one (``state.pending_new_call``), the latents changed shape, dtype or device, or a new stream would
    exceed :data:`MAX_STREAMS`. ``state`` has ``streams``, ``signature``, ``pending_new_call``,
    ``generations``, ``current`` and ``reset()``."""
    signature = (tuple(latents.shape), latents.dtype, latents.device)
    if state.pending_new_call or signature != state.signature or (id(prompt) not in state.streams and len(state.streams) >= MAX_STREAMS):
        state.reset()
        state.pending_new_call = False
        state.signature = signature
        state.generations += 1
    stream = state.streams.get(id(prompt))
    if stream is None or stream.prompt is not prompt:  # the id of a prompt that is gone may be reused
        stream = state.streams[id(prompt)] = new_stream(prompt)
    state.current = stream
    return stream
