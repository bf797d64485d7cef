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
