"""The pytest plugin (pytest11 entry point), through pytester in a subprocess."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

TEST_FILE = """
import torch

def test_mixed():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4).to(torch.bfloat16))
    assert model(torch.randn(2, 8)).dtype == torch.float32

def test_clean():
    assert (torch.ones(2, 2) @ torch.ones(2, 2)).sum() == 8
"""


@pytest.fixture
def suite(pytester, monkeypatch):
    monkeypatch.delenv("TORCHFIX_MODE", raising=False)
    pytester.makepyfile(test_user=TEST_FILE)
    return pytester


def test_without_the_option_the_plugin_does_nothing(suite):
    result = suite.runpytest_subprocess("-q")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*RuntimeError*same dtype*"])
    assert "torchfix (" not in result.stdout.str()


def test_fix_mode_passes_and_summarises(suite):
    result = suite.runpytest_subprocess("-q", "--torchfix=fix")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*torchfix (fix)*", "*F.linear*dtype*cast*test_user.py:5*"])


def test_strict_mode_fails_the_test_naming_the_site(suite):
    result = suite.runpytest_subprocess("-q", "--torchfix=strict")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*DtypeMismatchError*", "*test_user.py:5*"])
    out = result.stdout.str()
    assert "runtime/call.py" not in out and "torch_ops.py" not in out  # torchfix's own frames are hidden


def test_warn_mode_warns(suite):
    result = suite.runpytest_subprocess("-q", "--torchfix=warn")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*TorchfixWarning*"])


TESTING_IMPORT = """
import pytest
import torch
{statement}


def test_torch_rejects_a_mixed_dtype_linear():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="dtype"):
        model(torch.randn(2, 8))
"""


def test_importing_torchfix_testing_leaves_torch_as_it_is(pytester, monkeypatch):
    """A test helper's import has no side effect (#40): torch still rejects what it rejects."""
    monkeypatch.delenv("TORCHFIX_MODE", raising=False)
    pytester.makepyfile(test_plain=TESTING_IMPORT.format(statement="import torchfix.testing"))
    pytester.runpytest_subprocess("-q").assert_outcomes(passed=1)


def test_off_keeps_the_guards_off_even_where_a_test_imports_torchfix(pytester, monkeypatch):
    monkeypatch.delenv("TORCHFIX_MODE", raising=False)
    pytester.makepyfile(test_plain=TESTING_IMPORT.format(statement="import torchfix  # switches the guards on"))
    guarded = pytester.runpytest_subprocess("-q")
    guarded.assert_outcomes(failed=1)  # the import's purpose: the call was fixed, nothing raised
    guarded.stdout.fnmatch_lines(["*DID NOT RAISE*"])
    off = pytester.runpytest_subprocess("-q", "--torchfix=off")
    off.assert_outcomes(passed=1)
    assert "torchfix (" not in off.stdout.str()
