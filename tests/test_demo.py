"""torchfix demo's honesty: speed figures it can back, and no FIXED where nothing failed."""

from __future__ import annotations

from torchfix import demo


def test_a_wall_figure_above_what_the_interval_allows_is_flagged():
    assert demo.speed_verdict(2.65, 2.76, 3.0) == ""
    assert "load changed" in demo.speed_verdict(24.14, 2.2, 2.5)  # a newcomer's run printed 24.14x at interval 3
    assert "below 1x" in demo.speed_verdict(0.63, 2.2, 2.5)  # and 0.63x on a loaded machine
    assert demo.speed_verdict(0.95, 0.98, 2.5) == ""  # no cache win counted, none claimed


def test_an_incident_the_plain_run_did_not_reproduce_is_never_counted_fixed():
    faultless = demo.Outcome("2 resolution", "DeepCache 0.1.1 ran", "runs", True, reproduced=False)
    assert faultless.status == "NO FAULT HERE" and "FIXED" not in demo._table([faultless])
    assert demo.Outcome("2 resolution", "not installed", "runs", True).status == "NO FAULT HERE"  # not run plainly
    assert demo.Outcome("2 resolution", "crashed", "runs", True, reproduced=True).status == "FIXED"
    assert demo.Outcome("5 devices", "-", "crashed", False).status == "NOT FIXED"


def test_a_clear_refusal_is_counted_as_one_not_as_fixed():
    refused = demo.Outcome("3 switching", "raised mid-run", "refused first", True, reproduced=True, refused=True)
    assert refused.status == "REFUSED CLEARLY"
    line = demo.headline([refused, demo.Outcome("1 strides", "correct here", "no copy", True, reproduced=False)])
    assert line == "2 incidents: 0 fixed, 1 refused clearly, 1 no fault here (1 strides), 0 not fixed"


def test_strides_on_this_cpu_is_no_fault_here():
    """torch >= 1.13 on CPU computes the transposed-rhs matmul right: the incident is shown, never counted fixed."""
    outcome = demo.strides(quick=True)
    assert outcome.fixed and outcome.reproduced is False and outcome.status == "NO FAULT HERE"
    assert outcome.plain.startswith("correct on this CPU") and "torch < 1.13" in outcome.plain


def test_devices_is_a_clear_refusal():
    outcome = demo.devices(show=False)
    assert outcome.status == "REFUSED CLEARLY", outcome
    assert "DeviceMismatchError" in outcome.torchfix


def test_error_text_is_cut_at_a_word_never_mid_word():
    text = "RuntimeError: Sizes of tensors must match except in dimension 1. Expected size 45 but got size 90 for tensor number 1"
    for width in range(20, len(text)):
        clipped = demo._clip(text, width)
        kept = clipped[: -len(" …")]
        assert len(clipped) <= width and clipped.endswith(" …")
        assert text.startswith(kept) and text[len(kept)] in " ,;:"  # the cut falls at the end of a word
    assert demo._clip(text, len(text)) == text


def test_median():
    assert demo._median([3.0, 1.0, 2.0]) == 2.0 and demo._median([1.0, 2.0, 3.0, 10.0]) == 2.5
