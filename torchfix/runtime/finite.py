"""The NaN-VAE rescue: a reduced-precision VAE pass that turns finite input into NaN/inf is re-run in float32 and
returned in the VAE's dtype (AUTOMATIC1111's "automatically revert VAE to 32-bit floats"; diffusers' answer is
``force_upcast``). One home for both ways in: ``torchfix.wrap``'s hook on ``vae.decoder``/``vae.encoder`` and
``import torchfix``'s patch of every diffusers autoencoder's ``decode`` (:mod:`torchfix.patches.libraries`).

The check costs one ``isfinite`` pass over a reduced-precision output; a finite one is returned as it is
(bit-identical). Input that is already non-finite is not the VAE's precision at fault and is left alone.

>>> import torch
>>> needs_rescue(torch.tensor([1.0, float("nan")], dtype=torch.float16), [torch.ones(2)])
True
>>> needs_rescue(torch.ones(2, dtype=torch.float16), []), needs_rescue(torch.tensor([float("nan")]), [])
(False, False)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from .. import _frames, _warn
from .._report import FixEvent, report
from .._text import dtype_name
from ..errors import NonFiniteError

__all__ = ["LOW", "needs_rescue", "rescued", "up", "upcast"]

log = logging.getLogger("torchfix")

LOW = (torch.float16, torch.bfloat16)


def needs_rescue(output: Any, inputs: Iterable[Any]) -> bool:
    """A reduced-precision tensor ``output`` with NaN/inf, made from finite floating ``inputs``."""
    if not isinstance(output, torch.Tensor) or output.dtype not in LOW or bool(torch.isfinite(output).all()):
        return False
    return all(bool(torch.isfinite(t).all()) for t in inputs if isinstance(t, torch.Tensor) and t.is_floating_point())


def up(value: Any) -> Any:
    """A floating tensor as float32; anything else as it is."""
    return value.float() if isinstance(value, torch.Tensor) and value.is_floating_point() else value


@contextlib.contextmanager
def upcast(module: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """``module`` runs with float32 copies of its floating parameters and buffers inside the block; the module
    itself is never changed (its own tensors are back on exit, however the block ends)."""
    state = {n: up(t) for n, t in (*module.named_parameters(), *module.named_buffers())}
    with torch.nn.utils.stateless._reparametrize_module(module, state):
        yield state


def rescued(
    path: str,
    low: torch.dtype,
    mode: str,
    op: str,
    module: torch.nn.Module,
    call: Callable[..., Any],
    args: tuple,
    kwargs: dict[str, Any],
    pick: Callable[[Any], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Re-run a non-finite ``low``-precision pass of ``path``: ``call(*args, **kwargs)`` again with ``module`` on float32
    copies of its weights and the floating arguments in float32 (``pick``: the tensor in what it returns); record it
    and return the result cast back to ``low`` where that stays finite (else the float32 result). ``strict``:
    :class:`torchfix.NonFiniteError` instead, before anything re-runs."""
    site = _frames.call_site(2)
    name = dtype_name(low)
    problem = f"{path} in {name} produced NaN/inf from finite input (its activations exceed {name}'s range)"
    fix = f"run the VAE in float32 (pipe.vae.to(torch.float32), or a VAE fixed for {name} such as madebyollin/sdxl-vae-fp16-fix)"
    if mode == "strict":
        raise NonFiniteError(f"torchfix: {problem}. To fix: {fix}.")
    with upcast(module) as state:
        result = call(*map(up, args), **{k: up(v) for k, v in kwargs.items()})
    result = result if pick is None else pick(result)
    back = result.to(low)
    result = back if bool(torch.isfinite(back).all()) else result
    detail = (
        f"{problem} → re-ran in float32, returned {dtype_name(result.dtype)} "
        "(rule: a non-finite reduced-precision decode is re-run in float32, as AUTOMATIC1111's VAE revert does)"
    )
    nbytes = result.numel() * result.element_size() + sum(t.numel() * 4 for t in state.values() if t.dtype == torch.float32)
    report().add(FixEvent(op, "dtype", "upcast", site, path, detail, change=f"{name}→float32", nbytes=nbytes))
    log.info("%s: %s: %s", op, path, detail)
    if mode == "warn":
        _warn.once(("non-finite", path), f"{op}: {detail}. To fix it for good: {fix}.", site=site)
    return result
