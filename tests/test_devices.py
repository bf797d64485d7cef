from __future__ import annotations

import pytest
import torch

from torchfix import devices


def test_cpu_spellings_are_one_device():
    assert devices.same("cpu", "cpu:0")
    assert devices.same(torch.device("cpu"), torch.device("cpu", 0))
    assert devices.same(torch.zeros(1), "cpu:0")
    assert devices.canonical("cpu:0") == torch.device("cpu")


def test_cuda_without_index_means_current_device(monkeypatch):
    # Without a usable CUDA, "cuda" means index 0 (and CUDA is never initialised to ask).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("asked CUDA for its device"))
    assert devices.canonical("cuda") == torch.device("cuda", 0)
    assert devices.same("cuda", "cuda:0") and not devices.same("cuda", "cuda:1")
    # With CUDA, "cuda" is whatever set_device made current.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert devices.canonical("cuda") == torch.device("cuda", 1)
    assert devices.same("cuda", "cuda:1") and not devices.same("cuda", "cuda:0")
    assert not devices.same("cuda:0", "cuda:1")
    assert devices.canonical(1) == torch.device("cuda", 1)


def test_meta_and_cpu_differ():
    assert not devices.same("cpu", "meta")
    assert devices.canonical(torch.empty(2, device="meta")) == torch.device("meta")


def test_modules():
    assert devices.canonical(torch.nn.Linear(2, 2)) == torch.device("cpu")
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match="spans several devices"):
        devices.canonical(m)
    with pytest.raises(ValueError, match="no parameters"):
        devices.canonical(torch.nn.ReLU())


def test_bad_inputs():
    with pytest.raises(ValueError, match="not a device string"):
        devices.canonical("gpu")
    with pytest.raises(TypeError):
        devices.canonical(3.5)


@pytest.mark.parametrize("cuda", [False, True], ids=["no-cuda", "cuda"])
def test_rows_in_force_status_and_doctor_follow_a_usable_cuda(monkeypatch, capsys, cuda):
    """On Linux the CUDA rows whose torch range holds this torch are in force exactly where a CUDA device is usable;
    ``status()`` and ``torchfix doctor`` say so either way (a GPU machine is told apart here by what torch reports)."""
    import argparse

    import torchfix
    from torchfix import cli
    from torchfix.guards import known_issues as ki

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1 if cuda else 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "NVIDIA H200")
    row = torchfix.add_known_issue(torchfix.KnownIssue("cuda", ("mm",), ki.any_noncontiguous, "test#cuda", "contiguous"))
    try:
        ranged = {e.issue for e in ki.entries() if e.device_type == "cuda" and e.explain("cuda", ki.TORCH_VERSION, None)[0]}
        states = {s.issue: s for s in ki.states()}
        assert "test#cuda" in ranged and {issue for issue, s in states.items() if s.in_force} == (ranged if cuda else set())
        for issue in ranged:
            assert states[issue].reason.endswith("no usable cuda device in this process") != cuda
        assert str(torchfix.status()).count("IN FORCE") == (len(ranged) if cuda else 0)
        assert cli.cmd_doctor(argparse.Namespace()) == 0
    finally:
        monkeypatch.undo()  # first: removing the row refreshes the rows in force with what torch really reports
        torchfix.remove_known_issue(row)
    out = capsys.readouterr().out
    assert out.count("IN FORCE HERE") == (len(ranged) if cuda else 0)
    assert ("cuda          yes: cuda:0 NVIDIA H200" in out) == cuda and ("cuda          no" in out) != cuda
