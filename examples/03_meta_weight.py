"""Seed incident 5 (devices): a weight left on `meta` next to CPU tensors.

Plain torch 2.13 returns a CPU tensor of garbage for F.linear(cpu, meta_weight),
silently. torchfix raises before the op runs and says which weight and why.
"""

import torch
import torch.nn.functional as F

import torchfix

torchfix.disable()  # show plain torch first, whatever TORCHFIX_MODE says
with torch.device("meta"):
    head = torch.nn.Linear(16, 4, bias=False)  # built under init_empty_weights() and never loaded
x = torch.randn(2, 16)

out = F.linear(x, head.weight)
print(f"plain torch: no error, returned a {out.device} tensor of shape {tuple(out.shape)} (garbage)")

model = torch.nn.Sequential()
model.add_module("head", head)
with torchfix.enabled():
    try:
        model(x)
        raise SystemExit("torchfix should have raised")
    except torchfix.DeviceMismatchError as exc:
        print(f"with torchfix:\n{exc}")
print(f"torchfix.devices.same('cpu', 'cpu:0') = {torchfix.devices.same('cpu', 'cpu:0')} (torch.device equality says False)")
