from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchfix
from torchfix._report import FixEvent, Report


def test_summary_counts_per_site_and_caps_kept_events():
    rep = Report(max_events=2)
    for i in range(5):
        rep.add(FixEvent("F.linear", "dtype", "cast", "a.py:1", "proj", f"d{i}"))
    rep.add(FixEvent("torch.cat", "dtype", "promote", "b.py:7", None, "x"))
    assert len(rep.events) == 2 and rep.dropped == 4 and len(rep) == 6
    text = rep.summary()
    assert "6 fix(es) at 2 site(s)" in text and "a.py:1" in text and "TORCHFIX_MAX_EVENTS" in text
    lines = text.splitlines()
    assert lines[3].startswith("5") and "proj" in lines[3]
    rep.clear()
    assert rep.summary() == "torchfix: nothing was fixed."


def test_process_report_is_shared_and_sites_are_user_frames():
    x, w = torch.randn(2, 4, dtype=torch.bfloat16), torch.randn(3, 4, dtype=torch.float16)
    with torchfix.enabled():
        for _ in range(3):
            F.linear(x, w.clone())  # this line is the site (fresh tensors: one tensor cast again is one event)
    evs = torchfix.report().events
    assert len(evs) == 3 and len({e.site for e in evs}) == 1
    assert evs[0].site.startswith("tests/test_report.py:") and evs[0].module is None
    assert "3 fix(es) at 1 site(s)" in torchfix.report().summary()


def test_a_clean_fp16_sdxl_pipeline_is_quiet_in_warn_mode_with_warnings_as_errors():
    pytest.importorskip("diffusers")
    import warnings

    from torchfix.testing import latents, tiny_sdxl_pipeline

    pipe = tiny_sdxl_pipeline().to(torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", torchfix.TorchfixWarning)
        with torchfix.enabled(mode="warn"):
            latents(pipe, steps=3)  # diffusers concatenates fp16 text embeddings with fp32 time ids, then casts back
    rep = torchfix.report()
    assert rep.fixes == 0 and rep.notes == 0 and len(rep) == 0
    assert rep.summary().startswith("torchfix: nothing was fixed. (3 library-internal promotion(s) not shown")
    internal = [e for e in rep.events if e.internal]
    assert len(internal) == 3 and internal[0].site.startswith("diffusers/") and internal[0].action == "noted"
    assert "torch.concat" in rep.summary(verbose=True)


def test_a_promotion_in_your_own_code_is_a_note_and_warned():
    import warnings

    a, b = torch.randn(2, dtype=torch.float16), torch.randn(2, dtype=torch.bfloat16)
    with torchfix.enabled(mode="warn"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cat([a, b])
    assert any("noticed torch.cat" in str(w.message) for w in caught if issubclass(w.category, torchfix.TorchfixWarning))
    rep = torchfix.report()
    assert rep.notes == 1 and rep.fixes == 0 and rep.summary().startswith("torchfix: nothing was fixed; 1 note(s)")
