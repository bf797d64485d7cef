"""Routing from the guards to torch.ops.torchfix.matmul.

There is no GPU in CI: the CUDA/MPS rule is checked as pure policy, and
end to end by letting the policy treat ``cpu`` as a kernel device (the
CPU impl of the operator then runs where the Triton/Metal one would)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import torchfix
from torchfix.guards import known_issues as ki
from torchfix.guards import routing
from torchfix.guards.plan import Action, Finding

CAST = Finding("dtype", "mixed", "fix", (Action("dtype", "promote", "other", torch.float32),), True)
COPY = Finding("stride", "layout", "fix", (Action("stride", "contiguous", "other", "x#1"),))
KERNEL_ROW = Finding("stride", "layout", "fix", (Action("stride", "kernel", "other", "x#1"),))
UPCAST_ROW = Finding("stride", "layout", "fix", (Action("stride", "upcast", "other", "x#1"),))
MOVE = Finding("device", "devices", "fix", (Action("device", "move", "other", torch.device("cuda", 0)),), True)
RAISE = Finding("device", "meta", "fix", (), True)


@pytest.mark.parametrize(
    "kind, device, findings, expected",
    [
        ("matmul", "cuda", [CAST], (True, False)),
        ("linear", "mps", [CAST], (True, False)),
        ("matmul", "mps", [COPY], (True, False)),
        ("matmul", "cuda", [MOVE, CAST], (True, False)),
        ("matmul", "cpu", [CAST], (False, False)),  # CPU keeps the cast ...
        ("matmul", "cpu", [COPY], (False, False)),  # ... and the copy
        ("matmul", "cpu", [KERNEL_ROW], (True, False)),  # unless a row asks for the kernel
        ("matmul", "mps", [UPCAST_ROW, CAST], (False, False)),  # rows that want upcast keep it
        ("conv", "cuda", [CAST], (False, False)),  # only the matmul family and linear
        ("matmul", "cuda", [RAISE], (False, False)),  # nothing to fix: raise as before
        ("matmul", "cuda", [MOVE], (False, False)),  # a move alone is not a cast or copy
    ],
)
def test_policy(kind, device, findings, expected):
    assert tuple(routing.decide(kind, device, findings, enabled=True, available=True)) == expected


def test_policy_off_and_missing():
    assert routing.decide("matmul", "cuda", [CAST], enabled=False, available=True) == (False, False)
    assert routing.decide("matmul", "cuda", [CAST], enabled=True, available=False) == (False, True)


@pytest.fixture
def cpu_as_gpu(monkeypatch):
    """Let the policy route CPU calls as it would CUDA/MPS ones."""
    monkeypatch.setattr(routing, "KERNEL_DEVICES", frozenset({"cpu", "cuda", "mps"}))


def _kernel_events():
    return [e for e in torchfix.report().events if e.action == "kernel"]


CALLS = {
    "matmul": (lambda a, b, c, x, w: torch.matmul(a, b), lambda a, b, c, x, w: torch.matmul(a.float(), b.float())),
    "@": (lambda a, b, c, x, w: a @ b, lambda a, b, c, x, w: a.float() @ b.float()),
    "rmatmul": (lambda a, b, c, x, w: b.__rmatmul__(a), lambda a, b, c, x, w: a.float() @ b.float()),
    "mm": (lambda a, b, c, x, w: torch.mm(a[0], b[0]), lambda a, b, c, x, w: torch.mm(a[0].float(), b[0].float())),
    "bmm": (lambda a, b, c, x, w: a.bmm(b), lambda a, b, c, x, w: a.float().bmm(b.float())),
    "baddbmm": (
        lambda a, b, c, x, w: torch.baddbmm(c, a, b, beta=0.5, alpha=2.0),
        lambda a, b, c, x, w: torch.baddbmm(c.float(), a.float(), b.float(), beta=0.5, alpha=2.0),
    ),
    "addmm beta=0": (
        lambda a, b, c, x, w: torch.addmm(c[0].fill_(float("nan")), a[0], b[0], beta=0),
        lambda a, b, c, x, w: torch.mm(a[0].float(), b[0].float()),
    ),
    "linear": (lambda a, b, c, x, w: F.linear(x, w[0], w[1]), lambda a, b, c, x, w: F.linear(x, w[0].bfloat16(), w[1].bfloat16())),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_mixed_dtypes_go_to_the_kernel(name, cpu_as_gpu):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 4, 6, generator=g).half()
    b = torch.randn(2, 5, 6, generator=g).bfloat16().transpose(-1, -2)  # strided, other dtype
    c = torch.randn(2, 4, 5, generator=g)
    x = torch.randn(3, 6, generator=g).bfloat16()
    w = (torch.randn(5, 6, generator=g).half(), torch.randn(5, generator=g).half())
    call, manual = CALLS[name]
    with torchfix.enabled("fix"):
        out = call(a, b, c.clone(), x, w)
    expected = manual(a, b, c.clone(), x, w)
    assert out.dtype == expected.dtype
    assert torch.allclose(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
    events = _kernel_events()
    assert len(events) == 1 and events[0].guard == "dtype"
    assert "torch.ops.torchfix.matmul reads" in events[0].detail and "in place" in events[0].detail


def test_no_operand_copy_when_routed(cpu_as_gpu):
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn(1, 1, 128, 128)
    b = torch.randn(1, 1, 32, 128).transpose(-1, -2).double()  # mixed: fp32 x fp64 → promote to fp64
    with torchfix.enabled("fix"), profile(activities=[ProfilerActivity.CPU]) as prof:
        a @ b
    names = [e.name for e in prof.events()]
    assert "torchfix::matmul" in names
    # the CPU impl upcasts a (that is the accumulation); the strided fp64 rhs is read in place
    assert names.count("aten::copy_") <= 1 and "aten::contiguous" not in names


def test_known_issue_row_asks_for_the_kernel_on_cpu():
    row = torchfix.KnownIssue("cpu", ("matmul",), ki.any_noncontiguous, "example#2", "kernel", description="test row")
    torchfix.add_known_issue(row)
    try:
        a, b = torch.randn(3, 8, 8), torch.randn(3, 4, 8).transpose(-1, -2)
        with torchfix.enabled("fix"):
            out = torch.matmul(a, b)
    finally:
        torchfix.remove_known_issue(row)
    assert torch.allclose(out, torch.matmul(a, b), atol=1e-6)
    [event] = _kernel_events()
    assert event.guard == "stride" and "example#2" in event.detail


def test_cpu_keeps_casting_without_a_row():
    a, b = torch.randn(3, 4).half(), torch.randn(4, 2).bfloat16()
    with torchfix.enabled("fix"):
        a @ b
    assert not _kernel_events() and torchfix.report().events[0].action == "promote"


def test_disable_kernels_env(cpu_as_gpu, monkeypatch):
    monkeypatch.setenv("TORCHFIX_DISABLE_KERNELS", "1")
    with torchfix.enabled("fix"):
        out = torch.randn(3, 4).half() @ torch.randn(4, 2).bfloat16()
    assert out.dtype == torch.float32
    assert not _kernel_events() and torchfix.report().events[0].action == "promote"


def test_strict_still_raises(cpu_as_gpu):
    with torchfix.enabled("strict"), pytest.raises(torchfix.DtypeMismatchError):
        torch.randn(3, 4).half() @ torch.randn(4, 2).bfloat16()


def test_missing_kernel_warns_once_and_casts(cpu_as_gpu, monkeypatch):
    monkeypatch.setattr(torchfix.kernels, "available_for", lambda device_type: False)
    with warnings.catch_warnings(record=True) as caught, torchfix.enabled("fix"):
        warnings.simplefilter("always")
        for _ in range(3):
            torch.randn(3, 4).half() @ torch.randn(4, 2).bfloat16()
    msgs = [w for w in caught if issubclass(w.category, torchfix.TorchfixWarning)]
    assert len(msgs) == 1 and "cast/copied instead" in str(msgs[0].message)
    assert not _kernel_events()


# --- kernels are opt-in until they have run on the hardware --------------------------------


def test_default_routes_only_where_a_hardware_run_is_recorded(monkeypatch):
    from torchfix.kernels import hardware
    from torchfix.runtime import kernel

    assert all(r.device_type in ("cuda", "mps") and r.result for r in hardware.HARDWARE_RUNS)  # rows say what ran
    monkeypatch.setattr(hardware, "HARDWARE_RUNS", ())
    assert not kernel._allowed(None, "cuda") and not kernel._allowed(None, "mps")
    assert kernel._allowed(None, "cpu")  # the ATen reference runs in every test session
    assert kernel._allowed(True, "cuda") and not kernel._allowed(False, "cpu")
    run = hardware.HardwareRun("2026-11-22", "2.13.0", "cuda", "NVIDIA H100", "pytest tests/kernels", "41 passed", True)
    monkeypatch.setattr(hardware, "HARDWARE_RUNS", (run,))
    assert kernel._allowed(None, "cuda") and not kernel._allowed(None, "mps")
    failed = hardware.HardwareRun("2026-11-22", "2.13.0", "mps", "Apple M2", "pytest tests/kernels", "3 failed", False)
    assert not hardware.verified("mps", (failed,))


def test_kernels_setting_and_environment(monkeypatch):
    monkeypatch.delenv("TORCHFIX_DISABLE_KERNELS", raising=False)
    monkeypatch.setenv("TORCHFIX_KERNELS", "1")
    with torchfix.enabled() as s:
        assert s.kernels is True
    with torchfix.enabled(kernels=False) as s:
        assert s.kernels is False
    monkeypatch.setenv("TORCHFIX_KERNELS", "auto")
    assert torchfix.enable().kernels is None
    torchfix.disable()
    monkeypatch.setenv("TORCHFIX_KERNELS", "maybe")
    with pytest.raises(ValueError, match="TORCHFIX_KERNELS"):
        torchfix.enable()
    with pytest.raises(TypeError, match="kernels"):
        torchfix.config.Settings(kernels="yes")


def test_a_failing_kernel_falls_back_once_per_device_type(cpu_as_gpu, monkeypatch):
    from torchfix.runtime import kernel

    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("triton: out of shared memory")

    monkeypatch.setattr(kernel, "express", broken)
    monkeypatch.setattr(kernel, "failed", {})
    a, b = torch.randn(3, 4).half(), torch.randn(4, 2).bfloat16()
    with warnings.catch_warnings(record=True) as caught, torchfix.enabled("fix", kernels=True):
        warnings.simplefilter("always")
        outs = [a.clone() @ b.clone() for _ in range(3)]  # fresh tensors: one tensor cast again is one event
    assert all(torch.equal(o, a.float() @ b.float()) for o in outs)
    msgs = [str(w.message) for w in caught if issubclass(w.category, torchfix.TorchfixWarning)]
    assert len(msgs) == 1 and "out of shared memory" in msgs[0] and "cast/copy path" in msgs[0]
    assert len(calls) == 1 and "cpu" in kernel.failed  # off for this device type after the first failure
    assert [e.action for e in torchfix.report().events] == ["promote"] * 3


def test_a_user_error_is_not_blamed_on_the_kernel(cpu_as_gpu, monkeypatch):
    from torchfix.runtime import kernel

    def broken(*args, **kwargs):
        raise RuntimeError("kernel: bad shapes")

    monkeypatch.setattr(kernel, "express", broken)
    monkeypatch.setattr(kernel, "failed", {})
    a, b = torch.randn(3, 4).half(), torch.randn(5, 2).bfloat16()
    with torchfix.enabled("fix", kernels=True), pytest.raises(RuntimeError, match="cannot be multiplied"):
        a @ b  # torch's own error, from the cast path
    assert kernel.failed == {}
