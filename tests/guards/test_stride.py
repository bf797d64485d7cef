"""Known-issue rows and the stride guard, exercised on CPU with the device type injected."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchfix
from torchfix.guards import known_issues as ki
from torchfix.guards import stride as stride_guard


def test_version_parsing():
    assert ki.parse_version("2.13.0+cpu") == (2, 13, 0)
    assert ki.parse_version("2.1.0.dev20230306") == (2, 1, 0)
    assert ki.parse_version("2.10.0a0+git123") == (2, 10, 0)
    assert ki.parse_version(None) == ()


def test_every_builtin_row_is_well_formed():
    for e in ki.entries():
        assert e.issue.startswith("pytorch/pytorch#") and e.description and e.workaround in ki.WORKAROUNDS
        assert e.torch_min is None or e.torch_max is None or ki.parse_version(e.torch_min) < ki.parse_version(e.torch_max)


@pytest.mark.parametrize(
    "family,tensors,version,os_version,issue",
    [
        ("matmul", {"input": torch.ones(2, 3, 4).permute(0, 2, 1), "other": torch.ones(2, 3, 5)}, "1.12.1", "12.4", "#78511"),
        ("layer_norm", {"input": torch.ones(4, 6).t(), "weight": torch.ones(4)}, "1.12.0", None, "#80800"),
        ("layer_norm", {"input": torch.ones(2, 4, dtype=torch.float16), "weight": torch.ones(4)}, "2.0.0", None, "#96113"),
        ("linear", {"input": torch.ones(2, 4), "weight": torch.ones(4, 3).t()}, "2.8.0", "15.6", "#162730"),
        ("linear", {"input": torch.ones(1, 4).expand(5, 4), "weight": torch.ones(3, 4)}, "2.9.0", "15.6", "#167154"),
        ("sdpa", {"query": torch.ones(1, 3, 2, 8).permute(0, 2, 1, 3), "key": torch.ones(1, 2, 3, 8)}, "2.13.0", None, "#181133"),
        ("layer_norm", {"input": torch.ones(2, 4, dtype=torch.bfloat16), "weight": torch.ones(4)}, "2.13.0", None, "#190054"),
        ("conv", {"input": torch.ones(1, 3, 4, 4), "weight": torch.ones(2, 3, 3, 3, 3)[:, :, 1]}, "2.13.0", None, "#192212"),
    ],
)
def test_each_row_matches_its_case_and_only_there(family, tensors, version, os_version, issue):
    rows = ki.matching(family, tensors, device_type="mps", torch_version=version, os_version=os_version)
    assert issue in [e.issue.split("/")[-1].replace("pytorch", "") for e, _ in rows]
    assert ki.matching(family, tensors, device_type="cpu", torch_version=version) == []
    assert ki.matching(family, tensors, device_type="cuda", torch_version=version) == []
    fixed = {k: v.contiguous().float() for k, v in tensors.items()}
    still = [e.issue for e, _ in ki.matching(family, fixed, device_type="mps", torch_version=version, os_version=os_version)]
    assert not any(s.endswith(issue) for s in still)


def test_version_gates():
    t = {"input": torch.ones(2, 3, 4).permute(0, 2, 1), "other": torch.ones(2, 3, 5)}
    assert ki.matching("matmul", t, device_type="mps", torch_version="1.12.1")
    assert not any(e.issue.endswith("#78511") for e, _ in ki.matching("matmul", t, device_type="mps", torch_version="2.13.0"))


def test_large_bmm_row_counts_output_elements_without_allocating():
    a = torch.empty_strided((65552, 256, 64), (1, 1, 1))  # zero-stride views: no memory
    b = torch.empty_strided((65552, 64, 256), (1, 1, 64))
    rows = ki.matching("bmm", {"input": a, "mat2": b}, device_type="mps", torch_version="2.13.0", os_version="15.1")
    assert any(e.issue.endswith("#197636") for e, _ in rows)
    small = {"input": a[:8], "mat2": b[:8]}
    assert not ki.matching("bmm", small, device_type="mps", torch_version="2.13.0", os_version="15.1")
    assert not ki.matching("bmm", {"input": a, "mat2": b}, device_type="mps", torch_version="2.13.0", os_version="14.6")


def test_stride_decision_names_operands():
    f = stride_guard.decide("mm", {"input": torch.ones(4, 4), "mat2": torch.ones(4, 4).t()}, device_type="mps", torch_version="1.12.1")
    assert [(a.operand, a.action) for a in f.actions] == [("mat2", "contiguous")]
    assert "#78511" in f.problem


@pytest.fixture
def cpu_row():
    # A user row for the CPU, so the whole path runs here end to end.
    row = torchfix.add_known_issue(
        torchfix.KnownIssue("cpu", ("matmul", "mm"), ki.any_noncontiguous, "test#1", "contiguous", description="test row")
    )
    yield row
    torchfix.remove_known_issue(row)
    assert "cpu" not in ki.ACTIVE_DEVICE_TYPES


def test_user_row_applies_contiguous_copy_and_is_recorded(cpu_row):
    a, b = torch.randn(1, 1, 64, 64), torch.randn(1, 1, 32, 64).transpose(-1, -2)
    expected = a @ b.contiguous()
    with torchfix.enabled():
        out = a @ b
        assert torch.equal(out, expected)
        (ev,) = torchfix.report().events
        assert (ev.guard, ev.action, ev.op) == ("stride", "contiguous", "Tensor.__matmul__")
        assert "test#1" in ev.detail
        # contiguous operands match no row
        torchfix.report().clear()
        torch.matmul(a, b.contiguous())
        assert torchfix.report().events == []


def test_strict_raises_layout_error(cpu_row):
    with torchfix.enabled(mode="strict"), pytest.raises(torchfix.LayoutError) as info:
        torch.mm(torch.randn(4, 4), torch.randn(4, 4).t())
    assert "test#1" in str(info.value) and "stride=(1, 4)" in str(info.value)


def test_upcast_and_cpu_workarounds_restore_dtype_and_device():
    row = torchfix.add_known_issue(torchfix.KnownIssue("cpu", ("layer_norm",), ki.fp16_input, "test#2", "upcast"))
    try:
        x = torch.randn(2, 8, dtype=torch.float16)
        with torchfix.enabled():
            out = F.layer_norm(x, (8,))
        assert out.dtype == torch.float16 and torch.equal(out, F.layer_norm(x.float(), (8,)).half())
    finally:
        torchfix.remove_known_issue(row)
    row = torchfix.add_known_issue(torchfix.KnownIssue("cpu", ("mm",), ki.any_noncontiguous, "test#3", "cpu"))
    try:
        with torchfix.enabled():
            out = torch.mm(torch.ones(2, 2), torch.ones(2, 2).t())
        assert out.device.type == "cpu" and torch.equal(out, torch.full((2, 2), 2.0))
    finally:
        torchfix.remove_known_issue(row)


def test_bad_rows_are_rejected():
    with pytest.raises(ValueError, match="workaround"):
        torchfix.KnownIssue("mps", ("mm",), ki.any_noncontiguous, "x#1", "pray")
    with pytest.raises(TypeError, match="KnownIssue"):
        torchfix.add_known_issue("mps")
