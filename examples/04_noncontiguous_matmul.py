"""Seed incident 1 (strides): `[1,1,4096,4096] @ [1,1,4096,512]` with a transposed rhs view.

CPU and CUDA handle the strides; MPS has a record of wrong results for such
layouts. torchfix keeps those bugs as data (device type, op, predicate, torch
and macOS versions, pytorch issue, workaround) and applies a workaround only
where a row matches. Here we show which rows would match this call on MPS, and
the guard acting end to end through a row added for the CPU.
"""

import torch

import torchfix
from torchfix.guards import known_issues as ki

a = torch.randn(1, 1, 4096, 4096)
b = torch.randn(1, 1, 512, 4096).transpose(-1, -2)  # non-contiguous view, strides (.., 1, 4096)
print(f"rhs {tuple(b.shape)} strides {b.stride()} contiguous={b.is_contiguous()}")

for version in ("1.12.1", torch.__version__):
    rows = ki.matching("matmul", {"input": a, "other": b}, device_type="mps", torch_version=version, os_version="15.5")
    print(f"on MPS with torch {version}: {[e.issue for e, _ in rows] or 'no known issue'}")

row = torchfix.add_known_issue(
    torchfix.KnownIssue("cpu", ("matmul",), ki.any_noncontiguous, "demo#1", "contiguous", description="demo row for the CPU")
)
try:
    with torchfix.enabled():
        out = a @ b
    print(f"with a CPU row: {torchfix.report().events[-1].detail}")
finally:
    torchfix.remove_known_issue(row)
ref = a.double() @ b.double()
print(f"result matches a float64 reference: rel err {((out.double() - ref).norm() / ref.norm()).item():.2e}")
assert torch.allclose(out.double(), ref, rtol=1e-4, atol=1e-3)
