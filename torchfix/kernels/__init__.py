"""torchfix's custom operators, registered through ``torch.library``.

``torch.ops.torchfix.matmul(a, b, out_dtype=None)`` exists once ``torchfix`` is
imported. Triton and Metal are imported only when a CUDA / MPS tensor first
reaches the operator.

>>> import torch, torchfix
>>> a = torch.randn(1, 1, 64, 64)
>>> b = torch.randn(1, 1, 32, 64).transpose(-1, -2)
>>> torch.ops.torchfix.matmul(a, b).shape
torch.Size([1, 1, 64, 32])
>>> [k.device_type for k in torchfix.kernels.backends()]
['cpu', 'cuda', 'mps']
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from .. import devices
from .hardware import HARDWARE_RUNS, HardwareRun, verified
from .ops import DECOMPOSITIONS, aten_reference, matmul

__all__ = [
    "DECOMPOSITIONS",
    "HARDWARE_RUNS",
    "Backend",
    "HardwareRun",
    "aten_reference",
    "available_for",
    "backends",
    "matmul",
    "verified",
]


@dataclass(frozen=True)
class Backend:
    """One impl of ``torchfix::matmul`` as this process sees it.

    Attributes:
        device_type: ``cpu``, ``cuda`` or ``mps``.
        impl: what runs there.
        registered: the dispatcher has a kernel for the device's key.
        usable: it would run here now (the device exists and its compiler is importable).
        note: why not, or what was (not) verified.
    """

    device_type: str
    impl: str
    registered: bool
    usable: bool
    note: str


def _registered(key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("torchfix::matmul", key)


def backends() -> list[Backend]:
    """The operator's impls, whether each is registered, and whether it can run here.

    Asks without initialising CUDA or compiling anything.
    """
    triton_found = importlib.util.find_spec("triton") is not None
    cuda = devices.backend_usable("cuda")
    mps = devices.backend_usable("mps")
    if not triton_found:
        cuda_note = "Triton is not installed: CUDA tensors use the ATen path (pip install 'torchfix-diffusion[triton]')"
    elif not cuda:
        cuda_note = "Triton is installed; no CUDA device here (the kernel is tested on CPU with TRITON_INTERPRET=1)"
    else:
        cuda_note = "Triton kernel, strides and dtypes read in registers"
    mps_note = (
        "Metal kernel via torch.mps.compile_shader; UNRUN on Apple hardware by torchfix's developers"
        if mps
        else "MPS is not available here; the Metal kernel is registered but UNRUN (no Apple hardware tested)"
    )
    return [
        Backend("cpu", "BLAS reference (transposed/permuted views passed as strides)", _registered("CPU"), True, "always available"),
        Backend("cuda", "Triton", _registered("CUDA"), triton_found and cuda, cuda_note),
        Backend("mps", "Metal", _registered("MPS"), mps, mps_note),
    ]


def available_for(device_type: str) -> bool:
    """Whether routing may send a ``device_type`` call to the operator's own kernel (not the ATen fallback).

    >>> available_for("cpu")
    True
    """
    if device_type == "cpu":
        return True
    if device_type == "cuda":
        return importlib.util.find_spec("triton") is not None
    if device_type == "mps":
        return devices.backend_usable("mps")
    return False
