from __future__ import annotations

import sys

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
    text = rep.summary(verbose=True)
    assert "6 fix(es) at 2 site(s)" in text and "a.py:1" in text and "TORCHFIX_MAX_EVENTS" in text
    lines = text.splitlines()
    assert lines[3].startswith("5") and "proj" in lines[3]
    grouped = rep.summary().splitlines()
    assert grouped[0] == lines[0] and len(grouped) == len(lines) + 1  # per component and cause, then where to find detail
    assert grouped[3].split()[:2] == ["-", "1"] and grouped[4].split()[:2] == ["proj", "5"]
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


JOIN = "import torch\n\n\ndef join(a, b):\n    return torch.cat([a, b])\n"


def _load(path, name: str):
    """``path`` run as module ``name`` (code objects carry ``path``, as an import from there would give them)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_library_imported_from_outside_site_packages_keeps_its_promotions_quiet(tmp_path, monkeypatch):
    """What the GPU machine does (diffusers from a ``pip install --target`` folder on PYTHONPATH): the library is
    the library wherever it was imported from. Its promotion is internal and quiet, its site reads ``peft/…``; the
    same code in a package of another name is the user's, and warned."""
    import types
    import warnings

    site = tmp_path / "site"
    for name in ("peft", "mylib"):
        (site / name).mkdir(parents=True)
        (site / name / "ops.py").write_text(JOIN)
    package = types.ModuleType("peft")
    package.__path__ = [str(site / "peft")]
    monkeypatch.setitem(sys.modules, "peft", package)  # peft "imported" from the folder, not from site-packages
    library, mine = _load(site / "peft" / "ops.py", "peft.ops"), _load(site / "mylib" / "ops.py", "mylib.ops")
    a, b = torch.randn(2, dtype=torch.float16), torch.randn(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", torchfix.TorchfixWarning)
        with torchfix.enabled(mode="warn"):
            out = library.join(a, b)
    assert torch.equal(out, torch.cat([a, b])) and out.dtype == torch.float32  # left as torch computes it
    (event,) = torchfix.report().events
    assert event.internal and event.action == "noted" and event.site == "peft/ops.py:5" and event.module is None
    with torchfix.enabled(mode="warn"), pytest.warns(torchfix.TorchfixWarning, match="noticed torch.cat"):
        mine.join(a, b)
    assert not torchfix.report().events[-1].internal


def test_a_clean_fp16_sdxl_pipeline_with_diffusers_from_a_target_folder_is_quiet_subprocess(tmp_path):
    """The GPU machine's layout end to end, in a fresh interpreter: diffusers imported from a folder on PYTHONPATH
    (here a link to the installed package, as ``pip install --target`` lays it out), the warn-mode run as above."""
    pytest.importorskip("diffusers")
    import os
    import pathlib
    import subprocess

    import diffusers

    site = tmp_path / "site"
    site.mkdir()
    (site / "diffusers").symlink_to(pathlib.Path(diffusers.__file__).parent, target_is_directory=True)
    code = (
        "import warnings, torch, torchfix, diffusers\n"
        f"assert diffusers.__file__.startswith({str(site)!r}), diffusers.__file__\n"
        "from torchfix.testing import latents, tiny_sdxl_pipeline\n"
        "pipe = tiny_sdxl_pipeline().to(torch.float16)\n"
        "warnings.simplefilter('error', torchfix.TorchfixWarning)\n"
        "with torchfix.enabled(mode='warn'):\n"
        "    latents(pipe, steps=2)\n"
        "rep = torchfix.report()\n"
        "assert len(rep) == 0 and all(e.internal and e.site.startswith('diffusers/') for e in rep.events), rep.events\n"
        "print('quiet', len(rep.events))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.update(TORCHFIX_MODE="off", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "quiet 2", done.stderr[-3000:]


def test_a_promotion_in_your_own_code_is_a_note_and_warned():
    import warnings

    a, b = torch.randn(2, dtype=torch.float16), torch.randn(2, dtype=torch.bfloat16)
    with torchfix.enabled(mode="warn"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cat([a, b])
    assert any("noticed torch.cat" in str(w.message) for w in caught if issubclass(w.category, torchfix.TorchfixWarning))
    rep = torchfix.report()
    assert rep.notes == 1 and rep.fixes == 0 and rep.summary().startswith("torchfix: nothing was fixed; 1 note(s)")


def test_a_real_scale_run_reads_as_one_row_per_component_and_cause_with_bytes():
    pytest.importorskip("diffusers")
    from torchfix.testing import latents, tiny_sd15_pipeline

    pipe = tiny_sd15_pipeline()
    pipe.unet.down_blocks.to(torch.float16)  # stray layers: each cast to the UNet's fp32 on every call
    pipe.unet.up_blocks[1].to(torch.bfloat16)
    with torchfix.enabled():
        latents(pipe, steps=2)
    rep = torchfix.report()
    per_site = rep.summary(verbose=True).splitlines()
    text = rep.summary()
    rows = text.splitlines()[3:-1]
    assert len(per_site) > 100 and len(rows) <= 10  # was a row per call site and module
    causes = rep.causes()
    assert all(component == "unet" and guard == "dtype" for component, _, guard, _, _ in causes)
    assert {change for *_, change in causes} == {"float16→float32", "bfloat16→float32"}
    assert sum(n for n, *_ in causes.values()) == rep.fixes == len(rep.events)
    linear = causes[("unet", "F.linear", "dtype", "cast", "float16→float32")]
    weights = [e for e in rep.events if e.op == "F.linear" and e.change == "float16→float32"]
    assert linear[1] == sum(e.nbytes for e in weights) > 0  # bytes: what the casts made (fp32 copies of fp16 weights)
    assert "KiB" in text and "report().summary(verbose=True)" in text


def test_run_verbose_prints_the_per_site_table(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "mix.py"
    script.write_text("import torch, torch.nn.functional as F\nF.linear(torch.randn(2, 4, dtype=torch.bfloat16), torch.randn(3, 4))\n")
    run = [sys.executable, "-m", "torchfix", "run"]
    grouped = subprocess.run([*run, str(script)], capture_output=True, text=True, check=True).stderr
    verbose = subprocess.run([*run, "--verbose", str(script)], capture_output=True, text=True, check=True).stderr
    assert "first site" in grouped and "float32→bfloat16" in grouped and "mix.py:2" in grouped
    assert "first site" not in verbose and "mix.py:2" in verbose


COMFY_OPS = '''
import torch
import torch.nn.functional as F


class Linear(torch.nn.Linear):  # ComfyUI's cast-weight layer, reduced to its call
    def forward(self, input):
        return F.linear(input, self.weight, self.bias)
'''


def test_call_sites_skip_layer_wrappers_and_keep_the_layer_in_the_module_path(tmp_path, monkeypatch):
    (tmp_path / "comfy").mkdir()
    (tmp_path / "comfy" / "__init__.py").write_text("")
    (tmp_path / "comfy" / "ops.py").write_text(COMFY_OPS)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("comfy", "comfy.ops"):  # ComfyUI's own, where tests/comfyui loaded it into this worker
        monkeypatch.delitem(sys.modules, name, raising=False)
    from comfy import ops

    model = torch.nn.Sequential(ops.Linear(4, 3))
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    with torchfix.enabled():
        model(x)  # the site: this line, not comfy/ops.py
    (event,) = torchfix.report().events
    assert event.site.startswith("tests/test_report.py:") and event.module == "0"


def test_a_peft_lora_layer_is_a_module_path_and_its_caller_the_site():
    peft = pytest.importorskip("peft")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.proj(x)

    net = peft.get_peft_model(Net(), peft.LoraConfig(target_modules=["proj"], r=2, init_lora_weights=False))
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    with torchfix.enabled():
        net(x)
    events = torchfix.report().events
    # the site was peft/tuners/lora/layer.py
    assert events and all(e.site.startswith("tests/test_report.py:") for e in events), [e.site for e in events]
    assert [e.module for e in events] == ["base_model.model.proj.base_layer"]  # the LoRA layer stays in the module path


def test_the_report_saves_as_json_with_what_the_summary_prints(tmp_path):
    import json

    r = Report()
    r.add(FixEvent("F.linear", "dtype", "cast", "a.py:1", "unet.x", "weight cast", change="float32→float16", nbytes=64))
    r.add(FixEvent("F.linear", "dtype", "cast", "a.py:2", "unet.y", "weight cast", change="float32→float16", nbytes=64))
    r.add(FixEvent("torch.add", "dtype", "noted", "b.py:9", None, "promoted"))
    r.add(FixEvent("F.linear", "dtype", "noted", "lib.py:1", "text_encoder.z", "", internal=True))
    path = tmp_path / "report.json"
    text = r.to_json(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data == json.loads(text) == r.to_dict()
    assert (data["fixes"], data["notes"], data["internal"], data["events_dropped"]) == (2, 1, 1, 0)
    assert data["causes"][1] == {
        "component": "unet", "op": "F.linear", "guard": "dtype", "action": "cast", "change": "float32→float16",
        "count": 2, "bytes": 128, "sites": 2, "first_site": "a.py:1",
    }  # fmt: skip
    assert [e["site"] for e in data["events"]] == ["a.py:1", "a.py:2", "b.py:9", "lib.py:1"]
    assert data["internal_causes"][0]["component"] == "text_encoder"
    json.dumps(torchfix.report().to_dict())  # the process report too
