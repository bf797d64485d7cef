"""Seed incident 1 (strides): `[1,1,4096,4096] @ [1,1,4096,512]` with a transposed rhs view.

CPU and CUDA handle the strides; MPS has a record of wrong results for such layouts (rows in torchfix's
known-issues table). The quick fix copies the rhs; torch.ops.torchfix.matmul reads the strides instead,
and the guards route to it where they would otherwise copy or cast (on CUDA/MPS, or where a row asks).
"""

import torch
from torch.profiler import ProfilerActivity, profile

import torchfix
from torchfix.guards import known_issues as ki

a = torch.randn(1, 1, 4096, 4096)
b = torch.randn(1, 1, 512, 4096).transpose(-1, -2)  # non-contiguous view, strides (.., 1, 4096)
print(f"rhs {tuple(b.shape)} strides {b.stride()} contiguous={b.is_contiguous()}")

for version in ("1.12.1", torch.__version__):
    rows = ki.matching("matmul", {"input": a, "other": b}, device_type="mps", torch_version=version, os_version="15.5")
    print(f"on MPS with torch {version}: {[e.issue for e, _ in rows] or 'no known issue'}")

with profile(activities=[ProfilerActivity.CPU]) as prof:
    out = torch.ops.torchfix.matmul(a, b)
copies = [e.name for e in prof.events() if e.name in ("aten::clone", "aten::copy_", "aten::contiguous")]
ref = a.double() @ b.double()
err = ((out.double() - ref).norm() / ref.norm()).item()
print(f"torch.ops.torchfix.matmul: copies {copies or 'none'}, rel err vs float64 {err:.2e}")
assert not copies and err < 1e-5

# The guards route to the kernel where a row asks for it: here a row for the CPU, as a user would add one.
row = torchfix.add_known_issue(
    torchfix.KnownIssue("cpu", ("matmul",), ki.any_noncontiguous, "demo#1", "kernel", description="demo row for the CPU")
)
try:
    with torchfix.enabled():
        routed = a @ b
    print(f"with a CPU row: {torchfix.report().events[-1].action}: {torchfix.report().events[-1].detail}")
finally:
    torchfix.remove_known_issue(row)
assert torch.equal(routed, out)
