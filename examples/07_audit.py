"""The static audit: find the stray fp16 layer, the meta weight and the MPS layout hazard before running.

`torchfix.audit` exports the model with the guards on (so the graph is whole even though the dtypes clash),
imports it into torch-mlir and reads the typed IR; each finding names the module path, the op and the hazard.
Same thing from the shell: `torchfix audit package.module:factory --backend mps`.
"""

import torch

import torchfix


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)
        self.out = torch.nn.Linear(16, 16).half()  # the stray layer
        with torch.device("meta"):
            self.gate = torch.nn.Linear(16, 16)  # never loaded

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)).softmax(-1) @ v  # permuted operands feed the matmuls
        h = att.transpose(1, 2).reshape(2, 8, 16)
        return self.out(h) + self.gate(h)


model = torch.nn.Sequential()
model.add_module("block", Block())
report = torchfix.audit(model, torch.randn(2, 8, 16), backend="mps", torch_version="1.12.1")
print(report.summary())
assert {f.hazard for f in report.findings} >= {"mixed-dtype", "meta-device", "known-issue"}
