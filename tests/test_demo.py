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
    assert faultless.status == "NO FAULT" and "FIXED" not in demo._table([faultless])
    assert demo.Outcome("2 resolution", "crashed", "runs", True, reproduced=True).status == "FIXED"
    assert demo.Outcome("5 devices", "-", "crashed", False).status == "NOT FIXED"


def test_median():
    assert demo._median([3.0, 1.0, 2.0]) == 2.0 and demo._median([1.0, 2.0, 3.0, 10.0]) == 2.5
