"""The device guard: tensors of one op on different devices.

Pure: it sees devices, never tensors, and patches nothing.

Policy ``error`` raises before the op runs (torch 2.13 silently returns
garbage for ``torch.mm(cpu, meta)`` and ``F.linear(cpu, meta_weight)``);
``align`` moves inputs to the weight's device, else the first tensor's (for
``embedding``, ``index_select`` and ``gather``: the index moves to the data, as
the maintainers' fixes do). A meta tensor can never be moved: it holds no data.

>>> import torch
>>> from torchfix.guards.plan import Operand
>>> f = decide([Operand("input", torch.float32, torch.device("cpu")),
...             Operand("weight", torch.float32, torch.device("meta"))], "align")
>>> f.actions
()
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..devices import canonical
from .ops import PARAM_ROLES
from .plan import Action, Finding, Operand

__all__ = ["decide"]


def _is_index(operand: Operand) -> bool:
    """An integer tensor: an index (token ids, positions) into data of another dtype."""
    return not (operand.dtype.is_floating_point or operand.dtype.is_complex or operand.dtype == torch.bool)


def decide(operands: Sequence[Operand], policy: str = "error") -> Finding | None:
    """The device finding for one call, or ``None`` when all operands share a device.

    Args:
        operands: the call's tensor arguments.
        policy: ``"error"`` or ``"align"``.
    """
    devices = {o.name: canonical(o.device) for o in operands}
    distinct = set(devices.values())
    if len(distinct) <= 1:
        return None
    # 0-dim CPU tensors act as scalars next to tensors on any device, as in plain torch.
    if any(d.type != "cpu" for d in distinct):
        scalars = {o.name for o in operands if o.scalar}
        counted = {n: d for n, d in devices.items() if not (d.type == "cpu" and n in scalars)}
        if len(set(counted.values())) <= 1:
            return None
        devices = counted
    where = ", ".join(f"{name} on {dev}" for name, dev in devices.items())
    meta = [n for n, d in devices.items() if d.type == "meta"]
    if meta:
        problem = (
            f"{', '.join(meta)} {'is' if len(meta) == 1 else 'are'} on the meta device (no data: the weights were never loaded, "
            f"e.g. a model built under init_empty_weights() or with device='meta'), next to real tensors ({where})"
        )
        fix = (
            "load the weights (load_state_dict(..., assign=True) or from_pretrained), "
            "or materialise with module.to_empty(device=...) and initialise them"
        )
        return Finding("device", problem, fix, (), torch_raises=False)
    anchor = next((n for n in devices if n.split("[", 1)[0] in PARAM_ROLES), next(iter(devices)))
    target = devices[anchor]
    if policy != "align":
        indices = [o.name for o in operands if o.name in devices and _is_index(o) and devices[o.name] != target]
        if indices and any(o.dtype.is_floating_point for o in operands):
            fix = (
                f"move the index to the data's device before the call ({indices[0]}.to({str(target)!r})): the small index "
                "moves, never the data; in a pipeline, token ids belong on the encoder's execution device "
                "(pipe._execution_device), and under CPU offload call the encoder module itself so its hook moves them "
                "(or enable torchfix with device_policy='align' to move the index for you)"
            )
        else:
            fix = (
                "move them to one device with .to(device) "
                "(or enable torchfix with device_policy='align' to move inputs to the weight's device)"
            )
        return Finding("device", f"tensors on different devices: {where}", fix, (), torch_raises=True)
    actions = tuple(Action("device", "move", n, target) for n, d in devices.items() if d != target)
    return Finding("device", f"tensors on different devices: {where}", f"move the inputs to {target} once, before the call", actions, True)
