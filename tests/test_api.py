"""The three ways in, nesting, threads, status, and the import contract."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

import torchfix
from torchfix.patches import ALL as PATCHES

from .conftest import ORIGINALS, leaked


def _mixed_linear():
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    w = torch.randn(5, 4, dtype=torch.float16)
    return x, w


def test_enable_disable_restores_every_attribute():
    torchfix.enable()
    assert all(getattr(p.owner, p.name) is not ORIGINALS[p.label] for p in PATCHES)
    torchfix.disable()
    for p in PATCHES:
        assert getattr(p.owner, p.name) is ORIGINALS[p.label], p.label
    # inherited methods come back through inheritance, not as a copy in Tensor.__dict__
    assert "mm" not in vars(torch.Tensor)
    assert "__rmatmul__" in vars(torch.Tensor)


def test_double_enable_never_stacks_wrappers():
    torchfix.enable()
    first = F.linear
    torchfix.enable("warn")
    assert F.linear is first
    assert torchfix.status().settings.mode == "warn"
    assert F.linear.__wrapped__ is ORIGINALS["torch.nn.functional.linear"]
    torchfix.disable()
    torchfix.disable()  # forgiving
    assert not leaked()


def test_enable_off_is_disable():
    torchfix.enable()
    torchfix.enable("off")
    assert not leaked()
    assert not torchfix.is_enabled()


def test_signature_and_name_kept():
    import inspect

    torchfix.enable()
    assert F.layer_norm.__name__ == "layer_norm"
    assert inspect.signature(F.layer_norm) == inspect.signature(ORIGINALS["torch.nn.functional.layer_norm"])
    assert F.linear.__doc__ == ORIGINALS["torch.nn.functional.linear"].__doc__
    assert torch.matmul.__wrapped__ is ORIGINALS["torch.matmul"]


def test_disabled_passthrough_raises_like_torch():
    x, w = _mixed_linear()
    with pytest.raises(RuntimeError, match="same dtype"):
        F.linear(x, w)
    torchfix.enable()
    with torchfix.enabled(mode="off"):
        with pytest.raises(RuntimeError, match="same dtype"):
            F.linear(x, w)
    assert F.linear(x, w).dtype == torch.bfloat16


def test_scoped_block_works_without_global_and_restores_on_exception():
    x, w = _mixed_linear()
    with pytest.raises(ZeroDivisionError):
        with torchfix.enabled():
            assert F.linear(x, w).dtype == torch.bfloat16
            1 / 0  # noqa: B018
    assert not leaked()
    assert not torchfix.is_enabled()


def test_nesting_inherits_and_restores():
    torchfix.enable("fix", dtype=torch.float32)
    with torchfix.enabled(mode="strict") as inner:
        assert inner.dtype == torch.float32  # inherited
        assert torchfix.current().mode == "strict"
        with torchfix.enabled(mode="off"):
            assert not torchfix.is_enabled()
        assert torchfix.current().mode == "strict"
    assert torchfix.current().mode == "fix"


def test_scoped_is_per_thread():
    seen = {}
    inside = threading.Event()
    release = threading.Event()

    def worker():
        with torchfix.enabled(mode="strict"):
            seen["worker"] = torchfix.current().mode
            inside.set()
            release.wait(5)

    t = threading.Thread(target=worker)
    t.start()
    inside.wait(5)
    seen["main"] = torchfix.current().mode
    assert torchfix.status().scoped_blocks == 1
    release.set()
    t.join()
    assert seen == {"worker": "strict", "main": "off"}
    assert not leaked()


def test_global_switch_reaches_all_threads():
    torchfix.enable()
    out = {}

    def worker():
        x, w = _mixed_linear()
        out["dtype"] = F.linear(x, w).dtype

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert out["dtype"] == torch.bfloat16


def test_many_threads_enable_disable_leave_no_residue():
    errors = []
    barrier = threading.Barrier(8)

    def worker(i):
        try:
            barrier.wait(5)
            for j in range(40):
                if (i + j) % 3 == 0:
                    torchfix.enable()
                    torchfix.disable()
                else:
                    with torchfix.enabled(mode="fix"):
                        x, w = _mixed_linear()
                        assert F.linear(x, w).dtype == torch.bfloat16
        except Exception as exc:  # collected and re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    torchfix.disable()
    assert not leaked()
    assert torchfix.status().scoped_blocks == 0


def test_status_lists_patches_and_mode():
    assert torchfix.status().patched == ()
    torchfix.enable("warn", guards=("dtype",))
    st = torchfix.status()
    assert "torch.matmul" in st.patched and "torch.nn.functional.linear" in st.patched
    assert st.settings.guards == frozenset({"dtype"})
    assert "mode=warn" in str(st)


def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match="mode='fast'"):
        torchfix.enable("fast")
    with pytest.raises(ValueError, match="unknown guard"):
        torchfix.enable(guards=("dtype", "shape"))
    with pytest.raises(ValueError, match="device_policy"):
        torchfix.enable(device_policy="move")
    with pytest.raises(ValueError, match="not a floating dtype"):
        torchfix.enable(dtype=torch.int32)
    with pytest.raises(TypeError, match=r"guards=None is not valid.*\('dtype', 'device'\)"):
        torchfix.enable(guards=None)
    with pytest.raises(ValueError, match=r"guards=\(\) switches every guard off.*mode='off'"):
        torchfix.enable(guards=())
    with pytest.raises(ValueError, match=r"guards=\(\) switches every guard off"), torchfix.enabled(guards=()):
        pass
    assert not leaked()


def test_a_single_guard_name_is_one_guard():
    """enable(guards="dtype") once split the string into letters: unknown guard(s) ['d', 'e', ...]."""
    assert torchfix.enable(guards="dtype").guards == frozenset({"dtype"})
    with torchfix.enabled(guards="device") as s:
        assert s.guards == frozenset({"device"})
    assert torchfix.enable(guards={"dtype", "stride"}).guards == frozenset({"dtype", "stride"})


def _run(code: str, mode: str | None) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ)
    env.pop("TORCHFIX_MODE", None)
    if mode is not None:
        env["TORCHFIX_MODE"] = mode
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_import_enables_by_default_and_stays_lean():
    code = (
        "import sys, torch, torchfix\n"
        "heavy = [m for m in ('diffusers', 'transformers', 'torch._dynamo', 'triton', 'torch_mlir', 'wrapt') if m in sys.modules]\n"
        "assert not heavy, f'heavy import: {heavy}'\n"
        "assert not torch.cuda.is_initialized()\n"
        "st = torchfix.status(); assert st.enabled and st.settings.mode == 'fix', st\n"
        "x = torch.randn(2, 4, dtype=torch.bfloat16); w = torch.randn(3, 4, dtype=torch.float16)\n"
        "print(torch.nn.functional.linear(x, w).dtype)\n"
    )
    r = _run(code, None)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "torch.bfloat16"


def test_import_with_mode_off_patches_nothing():
    code = (
        "import sys, torch, torch.nn.functional as F\n"
        "orig = F.linear, torch.matmul, torch.Tensor.__matmul__, torch.cat\n"
        "before = set(sys.modules)\n"
        "import torchfix\n"
        "assert (F.linear, torch.matmul, torch.Tensor.__matmul__, torch.cat) == orig\n"
        "new = {m.partition('.')[0] for m in set(sys.modules) - before} - {'torchfix'}\n"
        "new = {m for m in new if m not in sys.stdlib_module_names and not m.startswith('_sysconfigdata')}\n"
        "assert not new, f'imported beyond torchfix and the standard library: {new}'\n"
        "assert torchfix.status().patched == () and not torchfix.is_enabled()\n"
        "from torchfix import wrap  # wrapt comes with the first use\n"
        "assert 'wrapt' in sys.modules and callable(wrap)\n"
    )
    r = _run(code, "off")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize(
    "statement",
    [
        "import torchfix.testing",
        "from torchfix.comfyui import NODE_CLASS_MAPPINGS",
        "from torchfix.deepcache import apply",
        "import importlib; importlib.import_module('torchfix.families')",
    ],
)
def test_importing_a_submodule_does_not_switch_the_guards_on(statement):
    """Only ``import torchfix`` enables (a test helper, the ComfyUI node pack or the cache alone change nothing)."""
    code = (
        "import torch, torch.nn.functional as F\n"
        "orig = F.linear, torch.matmul, torch.cat\n"
        f"{statement}\n"
        "import torchfix\n"
        "assert (F.linear, torch.matmul, torch.cat) == orig and not torchfix.is_enabled()\n"
        "x = torch.randn(2, 4, dtype=torch.bfloat16); w = torch.randn(3, 4, dtype=torch.float16)\n"
        "try:\n    F.linear(x, w)\nexcept RuntimeError:\n    print('torch refused')\n"
        "torchfix.enable()\n"
        "print(F.linear(x, w).dtype)\n"
    )
    r = _run(code, None)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["torch", "refused", "torch.bfloat16"]


def test_import_with_bad_mode_says_how_to_fix():
    r = _run("import torchfix", "loud")
    assert r.returncode != 0
    assert "TORCHFIX_MODE='loud'" in r.stderr and "strict" in r.stderr
