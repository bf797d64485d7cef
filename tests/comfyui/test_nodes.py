"""The node pack in ComfyUI itself: loaded by ComfyUI's own custom-node loader, sampled with ComfyUI's own sampler
(comfy.sample.sample, as KSampler runs it) on tiny SD1.5-like, SDXL-like, Flux-like and Wan (video) models."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
import torch

import torchfix
from torchfix.comfyui import TorchfixCache, TorchfixGuards, TorchfixReport, report_text
from torchfix.testing import comfyui

PACK = comfyui.REPO / "comfyui-torchfix"
MODELS = ["sd15", "sdxl", "flux", "wan"]


@pytest.fixture(params=MODELS)
def tiny(request) -> comfyui.TinyComfy:
    return comfyui.tiny(request.param)


def stray_layer(model: torch.nn.Module) -> tuple[str, torch.nn.Linear]:
    """The first attention projection: left in bf16 in an fp32 model, as a half-converted checkpoint leaves it."""
    return next((n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "attn" in n)


def test_the_pack_loads_through_comfyuis_loader_and_changes_nothing_process_wide():
    nodes, _ = comfyui.load()
    matmul, linear = torch.matmul, torch.nn.functional.linear
    before = set(nodes.NODE_CLASS_MAPPINGS)
    loaded = nodes.load_custom_node(str(PACK), module_parent="custom_nodes")
    if asyncio.iscoroutine(loaded):
        loaded = asyncio.run(loaded)
    assert loaded is True
    assert {"TorchfixGuards", "TorchfixCache", "TorchfixReport"} <= set(nodes.NODE_CLASS_MAPPINGS) - before or "TorchfixCache" in before
    assert nodes.NODE_CLASS_MAPPINGS["TorchfixCache"] is TorchfixCache
    assert nodes.NODE_DISPLAY_NAME_MAPPINGS["TorchfixCache"] == "torchfix cache"
    assert not torchfix.is_enabled()
    assert torch.matmul is matmul and torch.nn.functional.linear is linear
    assert any(m.endswith("comfyui-torchfix") for m in sys.modules)  # ComfyUI's loader imported the folder


def test_loading_the_pack_in_a_fresh_comfyui_process_leaves_torch_and_torchfix_as_they_were():
    """As the server loads it: a fresh process, TORCHFIX_MODE unset, nothing of torchfix imported before ComfyUI's
    loader runs the pack (which looks torchfix up without importing it, then imports torchfix.comfyui: a submodule's
    import, which never enables)."""
    nodes, why = comfyui.load()
    if nodes is None:
        pytest.skip(why)
    folder = os.path.dirname(os.path.abspath(nodes.__file__))  # ComfyUI's root
    stub = comfyui._stand_in(comfyui._cache() / "stand-in")
    code = (
        "import asyncio, sys, torch\n"
        f"sys.path[:0] = {[p for p in (str(stub) if stub else None, folder) if p]!r}\n"
        "import comfy.cli_args\n"
        "comfy.cli_args.args.cpu = True\n"
        "import nodes\n"
        "assert not any(m == 'torchfix' or m.startswith('torchfix.') for m in sys.modules)\n"
        "originals = torch.matmul, torch.nn.functional.linear, torch.Tensor.__matmul__, torch.cat\n"
        f"loaded = nodes.load_custom_node({str(PACK)!r}, module_parent='custom_nodes')\n"
        "loaded = asyncio.run(loaded) if asyncio.iscoroutine(loaded) else loaded\n"
        "import torchfix\n"
        "assert loaded is True and 'TorchfixCache' in nodes.NODE_CLASS_MAPPINGS\n"
        "assert (torch.matmul, torch.nn.functional.linear, torch.Tensor.__matmul__, torch.cat) == originals\n"
        "assert not torchfix.is_enabled() and torchfix.status().patched == ()\n"
        "x = torch.randn(2, 4); w = torch.randn(3, 4, dtype=torch.float16)\n"
        "try:\n    torch.nn.functional.linear(x, w)\nexcept RuntimeError:\n    print('torch refused')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCHFIX_MODE"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=folder)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-2:] == ["torch", "refused"]


@pytest.mark.parametrize("mode", ["fix", "strict"])
def test_guards_leave_a_sound_model_bit_identical(tiny, mode):
    plain = comfyui.sample(tiny)
    (guarded,) = TorchfixGuards().patch(tiny.patcher, mode)
    assert torch.equal(comfyui.sample(tiny, guarded), plain)
    assert "nothing to fix" in report_text(guarded)
    assert torch.equal(comfyui.sample(tiny), plain)  # the MODEL it was given is untouched
    assert not torchfix.is_enabled()


def test_guards_fix_a_stray_bf16_layer_and_name_it(tiny):
    name, layer = stray_layer(tiny.diffusion_model)
    layer.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="dtype"):
        comfyui.sample(tiny)
    (guarded,) = TorchfixGuards().patch(tiny.patcher, "fix")
    fixed = comfyui.sample(tiny, guarded)
    text = TorchfixReport().report(guarded, {"samples": fixed})["result"][0]
    assert "F.linear" in text and "bfloat16" in text, text
    layer.to(torch.float32)  # the maintainers' fix: the layer in the model's dtype (its weights were bf16-rounded)
    assert torch.equal(fixed, comfyui.sample(tiny))
    layer.to(torch.bfloat16)
    (strict,) = TorchfixGuards().patch(tiny.patcher, "strict")
    with pytest.raises(torchfix.DtypeMismatchError, match=name.rsplit(".", 1)[-1]):
        comfyui.sample(tiny, strict)


def test_the_report_says_when_torchfix_is_on_process_wide(fix_mode):
    """Not the nodes' doing (an ``import torchfix`` somewhere in ComfyUI's process): every workflow then runs guarded,
    and the report node says so first (tests/comfyui/test_server.py checks through the server that it is not)."""
    tiny = comfyui.tiny("sd15")
    (guarded,) = TorchfixGuards().patch(tiny.patcher, "fix")
    assert report_text(guarded).startswith("torchfix is on process-wide (mode=fix ")
    assert report_text(tiny.patcher).splitlines()[1:] == ["no torchfix node on this model"]
    torchfix.disable()
    assert report_text(guarded) == "guards: nothing to fix (0 denoiser call(s) guarded, mode fix)"
    assert "process-wide" not in TorchfixReport().report(guarded, {})["result"][0]


def test_the_cache_node_refuses_a_model_it_does_not_know():
    tiny = comfyui.tiny("sd15")
    tiny.patcher.model.diffusion_model = torch.nn.Linear(2, 2)
    with pytest.raises(torchfix.UnsupportedModelError, match="Linear"):
        TorchfixCache().patch(tiny.patcher, 3, 0.0, 0)


def test_the_pack_names_the_linter_when_another_torchfix_answers(tmp_path):
    """Meta's TorchFix linter installs the same import name: the pack says so and how to fix it, rather than fail
    later on a missing module."""
    (tmp_path / "torchfix").mkdir()
    (tmp_path / "torchfix" / "__init__.py").write_text('"""TorchFix: a linter (stand-in)."""\n')
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('comfyui_torchfix', {str(PACK / '__init__.py')!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "try:\n    spec.loader.exec_module(module)\nexcept ImportError as exc:\n    print(exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    # -S: no site-packages, so not this project's own editable install either: the stand-in is the torchfix found
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert "TorchFix linter" in out.stdout and "pip uninstall torchfix" in out.stdout, out.stdout + out.stderr
