"""The torchfix command, through subprocesses: exit codes and output."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def torchfix(*args: str, cwd: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TORCHFIX_MODE"}
    return subprocess.run([sys.executable, "-m", "torchfix", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


MIXED = textwrap.dedent(
    """
    import sys
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4).to(torch.bfloat16))
    out = model(torch.randn(2, 8))
    print("OUT", out.dtype, sys.argv[1:])
    """
)


def test_console_script_is_installed():
    assert (BIN / "torchfix").exists()
    r = subprocess.run([str(BIN / "torchfix"), "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and all(c in r.stdout for c in ("demo", "run", "doctor", "audit"))


def test_run_makes_a_crashing_script_work_and_prints_the_report(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(MIXED)
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert plain.returncode != 0 and "dtype" in plain.stderr
    r = torchfix("run", str(script), "--lr", "1")
    assert r.returncode == 0, r.stderr
    assert "OUT torch.float32 ['--lr', '1']" in r.stdout
    assert "F.linear" in r.stderr and "cast" in r.stderr and "crash.py:5" in r.stderr


def test_run_keeps_the_scripts_exit_code_and_errors(tmp_path):
    (tmp_path / "exit3.py").write_text("import sys\nsys.exit(3)\n")
    assert torchfix("run", str(tmp_path / "exit3.py")).returncode == 3
    (tmp_path / "boom.py").write_text("raise ValueError('from the user script')\n")
    r = torchfix("run", str(tmp_path / "boom.py"))
    assert r.returncode == 1 and "ValueError: from the user script" in r.stderr and "Traceback" in r.stderr
    assert "torchfix: nothing was fixed." in r.stderr


def test_run_strict_fails_naming_the_site(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(MIXED)
    r = torchfix("run", "--mode", "strict", str(script))
    assert r.returncode == 1 and "DtypeMismatchError" in r.stderr and "crash.py:5" in r.stderr


def test_run_module(tmp_path):
    (tmp_path / "mixedmod.py").write_text(MIXED)
    env = {k: v for k, v in os.environ.items() if k != "TORCHFIX_MODE"}
    env["PYTHONPATH"] = str(tmp_path)
    r = subprocess.run(
        [sys.executable, "-m", "torchfix", "run", "-m", "mixedmod", "a", "--b"], capture_output=True, text=True, env=env, timeout=300
    )
    assert r.returncode == 0, r.stderr
    assert "OUT torch.float32 ['a', '--b']" in r.stdout


def test_run_everything_after_the_script_belongs_to_it(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(MIXED)
    r = torchfix("run", "--mode", "warn", str(script), "--n", "2", "-m", "resnet", "--mode", "x")
    assert r.returncode == 0, r.stderr
    assert "OUT torch.float32 ['--n', '2', '-m', 'resnet', '--mode', 'x']" in r.stdout
    bad = torchfix("run", "--frobnicate", str(script))
    assert bad.returncode == 2 and "unknown option '--frobnicate'" in bad.stderr


def test_console_script_runs_a_module_from_the_current_directory(tmp_path):
    (tmp_path / "localmod.py").write_text(MIXED)
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHFIX_MODE", "PYTHONPATH")}
    r = subprocess.run(
        [str(BIN / "torchfix"), "run", "-m", "localmod", "x"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300
    )
    assert r.returncode == 0, r.stderr
    assert "OUT torch.float32 ['x']" in r.stdout


def test_ctrl_c_exits_130(tmp_path):
    (tmp_path / "interrupted.py").write_text("raise KeyboardInterrupt\n")
    r = torchfix("run", str(tmp_path / "interrupted.py"))
    assert r.returncode == 130 and "KeyboardInterrupt" in r.stderr


def test_bad_torchfix_mode_is_a_message_not_a_traceback(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TORCHFIX_MODE"}
    env["TORCHFIX_MODE"] = "garbage"
    for cmd in ([sys.executable, "-m", "torchfix", "doctor"], [str(BIN / "torchfix"), "doctor"]):
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "TORCHFIX_MODE='garbage' is not valid" in r.stdout and "strict" in r.stdout
    (tmp_path / "ok.py").write_text("print('ran')\n")
    r = subprocess.run([str(BIN / "torchfix"), "run", str(tmp_path / "ok.py")], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "TORCHFIX_MODE='garbage' is not valid" in r.stderr
    assert "ran" not in r.stdout


def test_run_without_a_target():
    assert torchfix("run").returncode == 2


def test_doctor():
    r = torchfix("doctor")
    assert r.returncode == 0, r.stderr
    for needle in ("torch ", "diffusers", "transformers", "triton", "torch-mlir", "devices", "kernels", "UNRUN", "pytorch/pytorch#78511"):
        assert needle in r.stdout, needle


FACTORY = textwrap.dedent(
    """
    import torch

    def stray():
        model = torch.nn.Sequential()
        model.add_module("encoder", torch.nn.Linear(8, 8))
        model.add_module("head", torch.nn.Linear(8, 4).half())
        return model, (torch.randn(2, 8),)

    def clean():
        return torch.nn.Linear(8, 4), torch.randn(2, 8)

    def not_a_pair():
        return 3
    """
)


def test_audit_command(tmp_path):
    pytest.importorskip("torch_mlir")
    (tmp_path / "factories.py").write_text(FACTORY)
    r = torchfix("audit", "factories:stray", cwd=tmp_path)
    assert "Warning" not in r.stderr, r.stderr  # torch's pytree LeafSpec FutureWarning is torch's, not the user's
    assert r.returncode == 1, r.stderr
    assert "head" in r.stdout and "aten.linear" in r.stdout and "mixed-dtype" in r.stdout
    r = torchfix("audit", "factories:clean", "--ir", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "no hazards found" in r.stdout and "!torch.vtensor<[2,8],f32>" in r.stdout
    assert torchfix("audit", "factories:not_a_pair", cwd=tmp_path).returncode == 2
    assert torchfix("audit", "factories", cwd=tmp_path).returncode == 2
    assert torchfix("audit", "nosuchmodule:f", cwd=tmp_path).returncode == 2


def test_demo_quick_fixes_every_incident():
    r = torchfix("demo", "--quick")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "5 incidents: 2 fixed, 2 refused clearly, 1 no fault here (1 strides), 0 not fixed" in r.stdout
    assert "FIXED" not in r.stdout.split("[2/")[0]  # strides: correct on this CPU, never counted fixed
    for needle in ("mat1 and mat2 shapes cannot be multiplied", "expected m1 and m2 to have the same dtype", "ModelMismatchError",
                   "DeviceMismatchError", "Sizes of tensors must match", "GFLOP", "median of 3", "allows at most 2.00x"):  # fmt: skip
        assert needle in r.stdout, needle


def test_run_writes_the_report_as_json(tmp_path):
    import json

    script = tmp_path / "crash.py"
    script.write_text(MIXED)
    out = tmp_path / "report.json"
    r = torchfix("run", "--report", str(out), str(script))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text(encoding="utf-8"))
    assert data["fixes"] >= 1 and any(c["op"] == "F.linear" and c["action"] == "cast" for c in data["causes"])
    assert any(e["site"].endswith("crash.py:5") for e in data["events"])
    assert f"report written to {out}" in r.stderr


def test_run_shows_the_scripts_traceback_as_python_does(tmp_path):
    """No runpy, cli or torchfix frame above or below the script's own (#40)."""
    script = tmp_path / "shapes.py"
    script.write_text(
        "import torch\n\ndef user():\n    return torch.nn.functional.linear(torch.randn(2, 3), torch.randn(4, 5))\n\nuser()\n"
    )
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    r = torchfix("run", str(script))
    assert r.returncode == plain.returncode == 1
    trace = r.stderr.split("\ntorchfix:")[0].strip()
    assert trace == plain.stderr.strip()
    assert "runpy" not in r.stderr and "cli.py" not in r.stderr and "torch_ops.py" not in r.stderr


def test_run_deepcache_caches_an_unmodified_scripts_pipeline(tmp_path):
    """--deepcache: the script's pipeline returns what the same pipeline with the cache applied before it returns."""
    import torch

    import torchfix as tf
    from torchfix import testing

    script = tmp_path / "gen.py"
    script.write_text(
        f"import sys, torch\nfrom torchfix import testing\ntorch.set_num_threads({torch.get_num_threads()})\n"
        "pipe = testing.tiny_sd15_pipeline()\ntorch.save(testing.latents(pipe, steps=8), sys.argv[1])\n"
    )
    r = torchfix("run", "--deepcache", str(script), str(tmp_path / "out.pt"))
    assert r.returncode == 0, r.stderr
    assert "torchfix: DeepCache on StableDiffusionPipeline: 5 of 8 denoiser steps cached" in r.stderr
    pipe = testing.tiny_sd15_pipeline()
    tf.deepcache.apply(pipe, tf.DeepCacheConfig(interval=3))
    try:
        expected = testing.latents(pipe, steps=8)
    finally:
        tf.deepcache.remove(pipe)
    assert torch.equal(torch.load(tmp_path / "out.pt"), expected)
    bad = torchfix("run", "--deepcache-interval", "0", str(script))
    assert bad.returncode == 2 and "--deepcache-interval" in bad.stderr


def test_doctor_piped_into_head_exits_quietly():
    """`torchfix doctor | head -2`: the reader leaves early; no BrokenPipeError traceback."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHFIX_MODE"} | {"PYTHONUNBUFFERED": "1"}  # a line a write
    proc = subprocess.Popen([sys.executable, "-m", "torchfix", "doctor"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout.readline().startswith(b"torchfix ")
    proc.stdout.close()  # before doctor has written the rest: its next write meets a closed pipe
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
