"""Canonical device identity: two handles to one physical device compare equal.

torch says ``torch.device("cpu") != torch.device("cpu", 0)`` and
``torch.device("cuda") != torch.device("cuda:0")``, though each pair names one
device. :func:`canonical` resolves a handle to the device it means;
:func:`same` compares two handles by what they mean.

>>> from torchfix import devices
>>> devices.same("cpu", "cpu:0")
True
>>> devices.canonical("cpu:0")
device(type='cpu')
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .errors import InvalidArgumentError, InvalidArgumentTypeError, TorchfixError

__all__ = ["DeviceLike", "backend_usable", "canonical", "same", "unusable_reason"]

DeviceLike = Any  # str | int | torch.device | torch.Tensor | torch.nn.Module


def _current_index(device_type: str) -> int:
    """The index a bare ``device_type`` handle means: the *current* device, which
    ``set_device`` may have changed; 0 where the backend is absent or has no notion of one."""
    current = getattr(getattr(torch, device_type, None), "current_device", None)
    if not callable(current) or not backend_usable(device_type):
        return 0
    try:
        return int(current())
    except RuntimeError as exc:  # a usable backend that cannot say which device is current: no guessing
        raise TorchfixError(
            f"torchfix: cannot resolve {device_type!r} to one device: torch.{device_type}.current_device() raised "
            f"{type(exc).__name__}: {exc}. Name the device with its index ({device_type}:0)."
        ) from exc


def backend_usable(device_type: str) -> bool:
    """Whether this process can run ops on ``device_type`` (asks without creating a CUDA context).

    >>> backend_usable("cpu")
    True
    """
    if device_type in ("cpu", "meta"):
        return True
    backend = getattr(torch.backends, device_type, None) if device_type == "mps" else getattr(torch, device_type, None)
    is_available = getattr(backend, "is_available", None)
    if not callable(is_available):
        return False
    try:
        return bool(is_available())
    except RuntimeError as exc:  # safe: a backend that cannot answer cannot run an op either
        logging.getLogger("torchfix").debug("torchfix: %s.is_available() raised %s; treated as absent", device_type, exc)
        return False


def unusable_reason(device: DeviceLike) -> str | None:
    """Why ``device`` cannot be used in this process, or ``None`` when it can.

    >>> unusable_reason("cpu") is None
    True
    """
    dev = canonical(device)
    if dev.type == "meta":
        return "meta holds no data"
    if not backend_usable(dev.type):
        if dev.type == "cuda":
            return f"no CUDA device is usable (torch {torch.__version__} built {'with' if torch.version.cuda else 'without'} CUDA)"
        return f"no {dev.type} device is usable in this process"
    count = getattr(getattr(torch, dev.type, None), "device_count", None)
    if dev.index is not None and callable(count) and dev.index >= count():
        return f"{dev.type} has {count()} device(s) here (index 0..{count() - 1})"
    return None


def _module_device(module: torch.nn.Module) -> torch.device:
    seen: dict[torch.device, str] = {}
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        seen.setdefault(canonical(tensor.device), name)
    if not seen:
        raise InvalidArgumentError(f"torchfix.devices: {type(module).__name__} has no parameters or buffers, so it has no device.")
    if len(seen) > 1:
        where = ", ".join(f"{dev} (e.g. {name})" for dev, name in seen.items())
        raise InvalidArgumentError(
            f"torchfix.devices: {type(module).__name__} spans several devices: {where}. "
            "Move it with module.to(device) first, or ask about one tensor."
        )
    return next(iter(seen))


def canonical(device: DeviceLike) -> torch.device:
    """The device a handle means, in one spelling.

    ``cpu``/``cpu:0`` become ``cpu``; an index-less accelerator (``cuda``,
    ``mps``, ``xpu``) gets the current index; an int means that CUDA index.

    Args:
        device: a string, int, ``torch.device``, tensor, or ``nn.Module``
            (all of whose parameters and buffers must share one device).

    >>> canonical(torch.zeros(1))
    device(type='cpu')
    """
    if isinstance(device, torch.Tensor):
        device = device.device
    elif isinstance(device, torch.nn.Module):
        return _module_device(device)
    elif isinstance(device, bool):
        raise InvalidArgumentTypeError("torchfix.devices: a bool is not a device.")
    elif isinstance(device, int):
        device = torch.device("cuda", device)
    elif isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError as exc:
            raise InvalidArgumentError(f"torchfix.devices: {device!r} is not a device string (e.g. 'cpu', 'cuda:0', 'mps').") from exc
    if not isinstance(device, torch.device):
        raise InvalidArgumentTypeError(
            f"torchfix.devices: cannot read a device from {type(device).__name__}; pass a string, torch.device, tensor or module."
        )
    if device.type in ("cpu", "meta"):
        return torch.device(device.type)
    if device.index is None:
        return torch.device(device.type, _current_index(device.type))
    return device


def same(a: DeviceLike, b: DeviceLike) -> bool:
    """Whether two handles name the same physical device.

    >>> same("cpu", torch.device("cpu", 0))
    True
    >>> same("cpu", "meta")
    False
    """
    return canonical(a) == canonical(b)
