"""Known-issue rows and the stride guard, exercised on CPU with the device type injected."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import torchfix
from torchfix import devices
from torchfix.guards import known_issues as ki
from torchfix.guards import stride as stride_guard


def test_versions_order_pre_releases_below_their_release():
    v = ki.parse_version
    assert v("2.14.0a0+git1234abc") < v("2.14") <= v("2.14.0") < v("2.14.0+cpu")
    assert v("2.1.0.dev20230306") < v("2.1") and v("1.13.0a0+git5") < v("1.13")
    assert v("2.13.0+cpu") >= v("2.13") and v("2.10.0") > v("2.9.1")  # not string order
    assert v(None) is None and v("") is None


def test_a_nightly_or_source_build_of_the_fixing_release_keeps_the_guard():
    t = {"input": torch.ones(2, 3, 4).permute(0, 2, 1), "other": torch.ones(2, 3, 5)}
    for build in ("1.13.0a0+git6f3c4bc", "1.13.0.dev20220901", "1.12.1"):
        assert any(e.issue.endswith("#78511") for e, _ in ki.matching("matmul", t, device_type="mps", torch_version=build)), build
    assert not any(e.issue.endswith("#78511") for e, _ in ki.matching("matmul", t, device_type="mps", torch_version="1.13.0"))


def test_a_version_that_is_not_one_is_named_in_the_error():
    with pytest.raises(ValueError, match=r"torch_version='banana' is not a version"):
        ki.matching("mm", {}, device_type="mps", torch_version="banana")
    with pytest.raises(ValueError, match=r"torch_max='2\.x'"):
        torchfix.add_known_issue(torchfix.KnownIssue("mps", ("mm",), ki.any_noncontiguous, "x#1", "contiguous", torch_max="2.x"))
    with pytest.raises(ValueError, match="must be below"):
        torchfix.add_known_issue(
            torchfix.KnownIssue("mps", ("mm",), ki.any_noncontiguous, "x#1", "contiguous", torch_min="2.5", torch_max="2.5")
        )
    assert all(not e.issue.startswith("x#") for e in ki.entries())


def test_every_builtin_row_is_well_formed():
    for e in ki.entries():
        assert e.issue.startswith("pytorch/pytorch#") and e.description and e.basis and e.workaround in ki.WORKAROUNDS
        assert e.validate() is e


def _cl_slice():
    return torch.ones(1, 4, 3, 3).contiguous(memory_format=torch.channels_last)[:, :2]


# One triggering call per row, and an OS version inside its macOS range.
CASES = {
    "#78511": ("matmul", lambda: {"input": torch.ones(2, 3, 4).permute(0, 2, 1), "other": torch.ones(2, 3, 5)}),
    "#80800": ("layer_norm", lambda: {"input": torch.ones(4, 6).t(), "weight": torch.ones(4)}),
    "#96113": ("layer_norm", lambda: {"input": torch.ones(2, 4, dtype=torch.float16), "weight": torch.ones(4, dtype=torch.float16)}),
    "#162730": ("linear", lambda: {"input": torch.ones(2, 4), "weight": torch.ones(3, 4), "bias": torch.ones(3, 2)[:, 0]}),
    "#167154": ("linear", lambda: {"input": torch.ones(1, 4).expand(5, 4), "weight": torch.ones(3, 4)}),
    "#163597": (
        "sdpa",
        lambda: {"query": torch.ones(1, 4, 2, 64).transpose(1, 2), "key": torch.ones(1, 2, 9, 64), "value": torch.ones(1, 2, 9, 64)},
    ),
    "#181133": (
        "sdpa",
        lambda: {"query": torch.ones(3, 5, 2, 64).permute(0, 2, 1, 3), "key": torch.ones(3, 2, 5, 64), "value": torch.ones(3, 2, 5, 64)},
    ),
    "#190054": ("layer_norm", lambda: {"input": torch.ones(2, 4, dtype=torch.bfloat16), "weight": torch.ones(4)}),
    "#192212": ("conv", lambda: {"input": torch.ones(1, 3, 4, 4), "weight": torch.ones(2, 3, 3, 3, 3)[:, :, 1]}),
    "#180201": ("mm", lambda: {"input": torch.ones(1, 4).expand(32, 4), "mat2": torch.ones(4, 4)}),
    "#131750": ("layer_norm", lambda: {"input": torch.ones(3, 4)[1:3], "weight": torch.ones(4)}),
    "#133520": ("batch_norm", lambda: {"input": torch.ones(4, 3, 2, 2)[1:]}),
    "#180984": ("conv", lambda: {"input": _cl_slice(), "weight": torch.ones(1, 2, 1, 1)}),
    "#141471": (
        "conv",
        lambda: {"input": torch.ones(1, 2, 3, 3, 3).contiguous(memory_format=torch.channels_last_3d), "weight": torch.ones(1, 2, 1, 1, 1)},
    ),
    "#85675": ("cat", lambda: {"tensors[0]": torch.ones(2, 2), "tensors[1]": torch.ones(2, 2).t()}),
    "#104832": ("mm", lambda: {"input": torch.ones(4, 4), "mat2": torch.ones(4, 4), "out": torch.zeros(4, 8)[:, 2:6]}),
    "#189960": (
        "cat",
        lambda: {
            "tensors[0]": torch.empty_strided((2**30, 2), (0, 0), dtype=torch.int8),
            "tensors[1]": torch.empty_strided((1, 2), (0, 0), dtype=torch.int8),
        },
    ),
    "#197636": (
        "bmm",
        lambda: {"input": torch.empty_strided((65552, 256, 64), (1, 1, 1)), "mat2": torch.empty_strided((65552, 64, 256), (1, 1, 64))},
    ),
    "#112577": (
        "sdpa",
        lambda: {
            "query": torch.ones(1, 4, 2, 8).transpose(1, 2),
            "key": torch.ones(1, 2, 4, 8),
            "value": torch.ones(1, 2, 4, 8),
            "attn_mask": torch.ones(1, 1, 4, 4),
        },
    ),
    "#191937": (
        "sdpa",
        lambda: {
            "query": torch.ones(1, 4, 2, 8),
            "key": torch.ones(1, 1, 33, 8).expand(1, 4, 33, 8),
            "value": torch.ones(1, 1, 33, 8).expand(1, 4, 33, 8),
            "attn_mask": torch.ones(1, 1, 2, 33, dtype=torch.bool),
        },
    ),
}


def _row(number: str) -> ki.KnownIssue:
    (row,) = [e for e in ki.entries() if e.issue == f"pytorch/pytorch{number}"]
    return row


def _inside(low: str | None, high: str | None) -> str:
    """A version inside [low, high)."""
    return low if low is not None else (f"{high}.0a0" if high is not None else "99.0")


def test_every_builtin_row_has_a_case():
    assert sorted(CASES) == sorted(e.issue.removeprefix("pytorch/pytorch") for e in ki.entries())


def _fixed(tensors):
    """The same call with every operand copied into fresh contiguous memory (what the workaround does)."""
    out = {}
    for name, t in tensors.items():
        if all(s == 0 for s in t.stride()) and t.numel() > 2**20:  # the zero-memory stand-ins of the big rows stay as they are
            out[name] = t
            continue
        out[name] = t.clone(memory_format=torch.contiguous_format) if t.dim() else t
    return out


@pytest.mark.parametrize("number", sorted(CASES))
def test_each_row_matches_its_case_and_only_there(number):
    row, (family, make) = _row(number), CASES[number]
    tensors = make()
    assert family in row.ops
    version = _inside(row.torch_min, row.torch_max)
    os_version = _inside(row.os_min, row.os_max) if row.device_type == "mps" else None
    names = row.predicate(tensors)
    assert names and set(names) <= set(tensors)
    found = [e for e, _ in ki.matching(family, tensors, device_type=row.device_type, torch_version=version, os_version=os_version)]
    assert row in found
    for other in {"cpu", "cuda", "mps"} - {row.device_type}:
        assert row not in [e for e, _ in ki.matching(family, tensors, device_type=other, torch_version=version, os_version=os_version)]
    if number not in ("#96113", "#190054", "#189960", "#197636"):  # dtype or size rows: a copy does not change them
        assert not row.predicate(_fixed(tensors)), f"{number}: the contiguous copy still matches"


@pytest.mark.parametrize("number", sorted(CASES))
def test_each_row_range_at_its_boundaries(number):
    row = _row(number)
    os_version = _inside(row.os_min, row.os_max) if row.device_type == "mps" else None

    def on(torch_version, os=os_version):
        return row.explain(row.device_type, torch_version, os)[0]

    if row.torch_min is not None:
        assert on(row.torch_min) and on(f"{row.torch_min}.0+cpu")
        assert not on(f"{row.torch_min}.0a0+git1"), "a pre-release of the first affected release is before it"
    if row.torch_max is not None:
        assert not on(row.torch_max) and not on(f"{row.torch_max}.0+cu130")
        assert on(f"{row.torch_max}.0a0+git1") and on(f"{row.torch_max}.0.dev20260901"), "nightlies of the fix keep the guard"
    inside = _inside(row.torch_min, row.torch_max)
    if row.os_min is not None:
        assert on(inside, row.os_min) and on(inside, f"{row.os_min}.1")
        assert not on(inside, f"{int(row.os_min.split('.')[0]) - 1}.7")
    if row.os_max is not None:
        assert not on(inside, row.os_max) and not on(inside, f"{row.os_max}.1") and on(inside, f"{row.os_max}.0a0")
    if row.device_type == "mps":
        ok, why = row.explain("mps", inside, None)
        assert not ok and "needs macOS" in why


def test_status_and_doctor_say_why_each_row_is_or_is_not_in_force_on_linux():
    states = {s.issue: s for s in ki.states()}
    assert len(states) == len(ki.entries())
    assert not states["pytorch/pytorch#197636"].in_force and "needs macOS (macOS ≥ 15)" in states["pytorch/pytorch#197636"].reason
    assert "is not in torch < 1.13" in states["pytorch/pytorch#78511"].reason
    # On Linux only a CUDA row can be in force: one whose torch range holds this torch, where a CUDA device is usable
    # (tests/test_devices.py shows both sides on any machine).
    cuda = devices.backend_usable("cuda")
    here = {e.issue for e in ki.entries() if e.device_type == "cuda" and cuda and e.explain("cuda", ki.TORCH_VERSION, None)[0]}
    assert {issue for issue, s in states.items() if s.in_force} == here
    text = str(torchfix.status())
    assert "upper ends exclusive" in text and "15.0 ≤ macOS < 26.4" in text and text.count("IN FORCE") == len(here)


def test_the_guide_shows_the_table_as_the_rows_have_it():
    guide = (Path(__file__).parents[2] / "docs" / "guide.md").read_text()
    assert ki.table_markdown() in guide


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
    assert not any("cpu" in ki.holder(family)[0] for family in ("matmul", "mm"))


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


def test_rows_in_force_are_held_per_op_family():
    row = torchfix.add_known_issue(torchfix.KnownIssue("cpu", ("mm",), ki.any_noncontiguous, "test#4", "contiguous"))
    try:
        assert "cpu" in ki.holder("mm")[0] and "cpu" not in ki.holder("conv")[0] and "cpu" not in ki.holder("matmul")[0]
    finally:
        torchfix.remove_known_issue(row)
    assert "cpu" not in ki.holder("mm")[0]


def test_a_strided_out_row_computes_into_fresh_memory_and_copies_into_out():
    row = torchfix.add_known_issue(torchfix.KnownIssue("cpu", ("mm",), ki.strided_out, "test#5", "contiguous"))
    try:
        a, b = torch.randn(4, 4), torch.randn(4, 4)
        buf = torch.zeros(4, 8)
        with torchfix.enabled():
            got = torch.mm(a, b, out=buf[:, 2:6])
            (ev,) = torchfix.report().events
        assert torch.equal(buf[:, 2:6], a @ b) and torch.equal(got, a @ b) and got.data_ptr() == buf[:, 2:6].data_ptr()
        assert buf[:, :2].abs().sum() == 0 and buf[:, 6:].abs().sum() == 0
        assert (ev.guard, ev.action) == ("stride", "contiguous") and "test#5" in ev.detail and "out" in ev.detail
    finally:
        torchfix.remove_known_issue(row)


def test_a_storage_offset_row_copies_a_slice_that_counts_as_contiguous():
    row = torchfix.add_known_issue(torchfix.KnownIssue("cpu", ("layer_norm",), ki.input_storage_offset, "test#6", "contiguous"))
    try:
        x = torch.randn(3, 4)
        with torchfix.enabled():
            out = F.layer_norm(x[1:3], (4,))
            (ev,) = torchfix.report().events
        assert torch.equal(out, F.layer_norm(x[1:3].clone(), (4,))) and "test#6" in ev.detail
    finally:
        torchfix.remove_known_issue(row)


def test_the_cpu_workaround_moves_every_operand_not_only_floats():
    a = torch.empty_strided((2**30, 2), (0, 0), dtype=torch.int8)
    f = stride_guard.decide("cat", {"tensors[0]": a, "tensors[1]": a[:1]}, device_type="mps", torch_version="2.13.0", os_version="15.1")
    assert {("tensors[0]", "cpu"), ("tensors[1]", "cpu")} <= {(x.operand, x.action) for x in f.actions}
    assert "#189960" in f.problem
