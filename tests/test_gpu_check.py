"""benchmarks/gpu.py, the GPU check, as far as it runs without a GPU: its ``--small`` dry run writes the JSON and the
table as a lent machine would, ``--render`` rewrites only the GPU section of the docs, and the tests part counts
outcomes test by test (no timings are asserted)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import torchfix

GPU_PY = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.py"


@pytest.fixture
def gpu_check(monkeypatch: pytest.MonkeyPatch) -> Any:
    """benchmarks/gpu.py as a module; the ``sys.path`` entry it adds for ``_common`` goes again after the test (its
    folder holds ``kernels.py``, which would shadow the HF ``kernels`` package)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    had_common = "_common" in sys.modules
    threads = torch.get_num_threads()
    spec = importlib.util.spec_from_file_location("torchfix_gpu_check", GPU_PY)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    torch.set_num_threads(threads)  # --small takes one thread
    if not had_common:
        sys.modules.pop("_common", None)


def test_the_small_dry_run_of_a_part_writes_the_json_and_the_table(gpu_check, tmp_path):
    pytest.importorskip("diffusers")
    out = tmp_path / "out"
    assert gpu_check.main(["--small", "--only", "overhead", "--budget", "overhead=3", "--out", str(out)]) == 0
    data = json.loads((out / "gpu.json").read_text())
    assert data["schema"] == gpu_check.SCHEMA and data["small"] is True and data["finished"]
    env = data["env"]
    assert env["device"] == "cpu" and env["torch"] == torch.__version__ and "commit" in env["torchfix"]
    assert set(data["parts"]) == {"overhead"}
    part = data["parts"]["overhead"]
    assert part["status"] == "done" and part["budget_s"] <= 3 and len(part["rows"]) == 2
    for row in part["rows"]:
        assert {"case", "plain_ms", "enabled_ms", "enable_ms", "aten_ops", "bit_identical"} <= set(row)
        assert row["aten_ops"] > 0 and row["bit_identical"] is True  # do no harm: guarded steps are plain's
    table = (out / "gpu.md").read_text()
    assert table.startswith("## GPU (`benchmarks/gpu.py`)") and "--small dry run" in table
    assert "| UNet step | plain ms |" in table and table.count("| 64² batch") == 2
    assert not torchfix.is_enabled()  # enable() was measured and switched off again


def test_render_rewrites_only_the_gpu_section(gpu_check, tmp_path, monkeypatch):
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n<!-- other:start -->\nkept\n<!-- other:end -->\n")
    monkeypatch.setitem(gpu_check.write_section.__globals__, "DOCS", docs)
    data = {"schema": gpu_check.SCHEMA, "small": False, "started": "then", "env": {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130"}}
    rows = [{"suite": "quick", "passed": 3, "failed": 1, "error": 0, "skipped": 0, "xfailed": 0, "seconds": 9.0, "timed_out": False,
             "failing": ["tests/test_x.py::test_y - AssertionError"]}]  # fmt: skip
    data["parts"] = {"tests": {"status": "done", "seconds": 9.5, "budget_s": 210, "rows": rows}}
    for started in ("first", "second"):
        path = tmp_path / f"{started}.json"
        path.write_text(json.dumps({**data, "started": started}))
        assert gpu_check.main(["--render", str(path)]) == 0
    text = docs.read_text()
    assert text.count("<!-- gpu:start -->") == 1 and "run second" in text and "run first" not in text
    assert text.startswith("# Benchmarks\n\n<!-- other:start -->\nkept\n<!-- other:end -->")
    assert "NVIDIA H200" in text and "`tests/test_x.py::test_y - AssertionError`" in text and "| quick | 3 | 1 |" in text


def test_the_tests_summary_counts_each_outcome_and_names_the_failing(gpu_check):
    def phase(test: str, when: str, outcome: str, xfail: bool = False, message: str = "") -> dict[str, Any]:
        return {"id": test, "when": when, "outcome": outcome, "xfail": xfail, "message": message}

    lines = [
        *(phase("t::ok", w, "passed") for w in ("setup", "call", "teardown")),
        phase("t::bad", "setup", "passed"),
        phase("t::bad", "call", "failed", message="AssertionError: 1 != 2"),
        phase("t::bad", "teardown", "passed"),
        phase("t::broken", "setup", "failed", message="fixture 'gpu' not found"),
        phase("t::skip", "setup", "skipped"),
        phase("t::xf", "setup", "passed"),
        phase("t::xf", "call", "skipped", xfail=True),
        phase("t::cut", "setup", "passed"),  # the run was killed during its call
        phase("tests/broken.py", "collect", "failed", message="ImportError: no diffusers"),
    ]
    s = gpu_check.summarise(lines)
    assert (s["passed"], s["failed"], s["error"], s["skipped"], s["xfailed"]) == (1, 1, 2, 1, 1)
    assert s["failing"] == [
        "t::bad - AssertionError: 1 != 2",
        "t::broken - fixture 'gpu' not found",
        "tests/broken.py - ImportError: no diffusers",
    ]
    assert s["unfinished"] == ["t::cut"]


SAMPLE = """
import time, pytest

def test_passes():
    pass

def test_fails():
    assert 1 == 2

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass

def test_zz_hangs():
    time.sleep(120)
"""


def test_the_tests_part_logs_each_test_as_it_ends_and_keeps_them_at_a_timeout_subprocess(gpu_check, tmp_path):
    sample = tmp_path / "test_sample.py"
    sample.write_text(SAMPLE)
    work = tmp_path / "work"
    work.mkdir()
    got = gpu_check.run_pytest(["-n", "1", str(sample)], timeout=25, workdir=work, log_name="sample")
    assert got["timed_out"] and (got["passed"], got["failed"], got["skipped"]) == (1, 1, 1)  # what ran before the kill
    (failing,) = got["failing"]
    assert "test_fails - " in failing and "assert 1 == 2" in failing
    assert [t.rsplit("::", 1)[-1] for t in got["unfinished"]] == ["test_zz_hangs"]
