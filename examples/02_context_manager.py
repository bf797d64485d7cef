"""`with torchfix.enabled(...)`: scoped to this thread; strict mode finds stray layers for CI."""

import torch

import torchfix

model = torch.nn.Sequential()
model.add_module("encoder", torch.nn.Linear(8, 8))
model.add_module("head", torch.nn.Linear(8, 4).to(torch.bfloat16))  # the stray layer
x = torch.randn(2, 8)

outer = torchfix.current().mode  # "fix" after `import torchfix`, unless TORCHFIX_MODE says otherwise
with torchfix.enabled(mode="strict"):
    try:
        model(x)
    except torchfix.DtypeMismatchError as exc:
        print(f"strict mode names the layer and the fix:\n{exc}\n")

with torchfix.enabled(mode="fix"):
    y = model(x)
print(f"fix mode: output {y.dtype}; {len(torchfix.report())} fix(es) recorded")
assert y.dtype == torch.float32 and torchfix.current().mode == outer  # the block restored the outer settings
