"""The device guard: CPU vs meta (silent garbage in plain torch), policies, scalars."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchfix
from torchfix.guards import device as device_guard
from torchfix.guards.plan import Operand

CPU, META = torch.device("cpu"), torch.device("meta")


def test_plain_torch_returns_garbage_for_meta_weights():
    # The reason the default policy is "error": torch does not raise here.
    out = torch.mm(torch.randn(2, 4), torch.empty(4, 3, device="meta"))
    assert out.device.type == "cpu"


def test_meta_weight_raises_before_the_op_runs():
    model = torch.nn.Sequential()
    model.add_module("proj", torch.nn.Linear(4, 3, device="meta"))
    for mode in ("fix", "warn", "strict"):
        with torchfix.enabled(mode=mode, device_policy="align"), pytest.raises(torchfix.DeviceMismatchError) as info:
            model(torch.randn(2, 4))
        msg = str(info.value)
        assert "meta" in msg and "never loaded" in msg and "proj" in msg and "test_device.py:" in msg
        assert "silently" in msg and "weight" in msg and "load" in msg


def test_mm_meta_raises():
    with torchfix.enabled(), pytest.raises(torchfix.DeviceMismatchError, match=r"torch\.mm"):
        torch.mm(torch.randn(2, 4), torch.empty(4, 3, device="meta"))


def test_all_meta_is_fine():
    with torchfix.enabled():
        out = F.linear(torch.empty(2, 4, device="meta"), torch.empty(3, 4, device="meta"))
    assert out.device.type == "meta" and out.shape == (2, 3)


def test_policy_error_and_align_pure():
    ops = [Operand("input", torch.float32, torch.device("cuda", 1)), Operand("weight", torch.float32, torch.device("cuda", 0))]
    f = device_guard.decide(ops, "error")
    assert f.actions == () and "cuda:1" in f.problem and "device_policy='align'" in f.fix
    f = device_guard.decide(ops, "align")
    assert [(a.operand, a.to) for a in f.actions] == [("input", torch.device("cuda", 0))]


def test_align_goes_to_first_tensor_without_weights():
    ops = [Operand("input", torch.float32, torch.device("cuda", 0)), Operand("other", torch.float32, CPU)]
    f = device_guard.decide(ops, "align")
    assert [(a.operand, a.to) for a in f.actions] == [("other", torch.device("cuda", 0))]


def test_cpu_scalars_are_legal_next_to_accelerators():
    ops = [Operand("input", torch.float32, torch.device("cuda", 0)), Operand("other", torch.float32, CPU, scalar=True)]
    assert device_guard.decide(ops, "error") is None
    # ...but not next to meta, and a 0-dim tensor on an accelerator is not special
    ops = [Operand("input", torch.float32, torch.device("cuda", 0), scalar=True), Operand("other", torch.float32, CPU)]
    assert device_guard.decide(ops, "error") is not None


def test_two_handles_to_one_device_are_one_device():
    ops = [Operand("input", torch.float32, torch.device("cpu")), Operand("other", torch.float32, torch.device("cpu", 0))]
    assert device_guard.decide(ops, "error") is None


def test_device_guard_off_lets_torch_decide():
    with torchfix.enabled(guards=("dtype",)):
        out = torch.mm(torch.randn(2, 4), torch.empty(4, 3, device="meta"))
    assert out.device.type == "cpu"
