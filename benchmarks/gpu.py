"""The project's GPU check: the quick tests, the kernel tests and a benchmark of at most 6 minutes, in one command,
for a CUDA machine lent for a few minutes (``--small``: the same code on the CPU with tiny models, a dry run).

Here, once per checkout (the GPU machine has torch, triton, transformers, wrapt, pytest, pytest-xdist and
hypothesis, but no diffusers, no DeepCache and no network)::

    bash benchmarks/gpu_wheels.sh        # diffusers 0.42.1, DeepCache 0.1.1, importlib_metadata wheels -> .whl/

On the device, from the repository root (``carry: [".whl"]``, ``timeout_s: 600``; at most 9.5 minutes: the
tests within 3.5, the benchmark within 6, each part within its budget and all of it within ``--deadline``)::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \\
        PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 python3 benchmarks/gpu.py --out "$OUT"

Back here, the GPU section of docs/benchmarks.md from the JSON that came back::

    .venv/bin/python benchmarks/gpu.py --render <files_at>/gpu.json

Parts (``--only part,part``; ``env`` always runs):

- ``tests``: ``pytest -m "not slow" -n <cores> tests`` (tests/kernels apart) and ``pytest tests/kernels``; counts
  and the failing test ids, logged test by test as they end (a timeout keeps what ran);
- ``overhead``: an SD1.5-size fp16 UNet step (random weights, ``no_grad``) at 256², batch 1 (launch-bound) and
  512², batch 2: plain, ``with torchfix.enabled()`` and ``torchfix.enable()``, interleaved rounds, the best of
  each; aten ops per step; whether the guarded outputs are bit-identical;
- ``sd15``, ``sdxl``, ``flux``: pipelines with SD1.5-, SDXL- and Flux.1-size denoisers built from configs (random
  weights, precomputed embeddings, ``output_type="latent"``): plain, torchfix's cache, DeepCache 0.1.1 (UNets) and
  diffusers' FirstBlockCache and TaylorSeer (Flux): wall time, rel-L2 of the final latents vs the plain run,
  layers and attentions that computed, peak memory;
- ``compile``: the SD1.5-size UNet under ``torch.compile`` (inductor), plain and guarded: first call, step
  time, bit-identity;
- ``day0``: two denoisers with no registry entry at their default (full) size, bare, a flow-matching Euler loop:
  Qwen-Image 2.1 (7.1B, its KV cache on, as its pipeline runs it) and Flux 3 (5.5B): plain, torchfix's cache through
  the entry it reads off their code, diffusers' TaylorSeer (its hook state reset before each run, as a pipeline's
  call does).

Writes ``gpu.json`` (device, driver, versions, torchfix's commit, every figure; rewritten after every row) and
``gpu.md`` (the tables) to ``--out`` (default ``$OUT``), and the "gpu" section of docs/benchmarks.md (not with
``--small``; on the device that copy stays there, hence ``--render`` here). Timings stay out of the unit tests
(tests/test_gpu_check.py runs ``--small`` and checks the shape).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("TORCHFIX_MODE", "off")  # the guarded variants opt in; plain is torch as it is
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _common import machine, rel_l2, write_section

import torchfix

REPO = Path(__file__).resolve().parent.parent
SCHEMA = "torchfix-gpu-check/1"
PARTS = ("tests", "overhead", "sd15", "sdxl", "flux", "compile", "day0")
# Seconds per part on an H200, within which each part picks its rows and repeats (the tests: the two pytest runs'
# timeouts). The benchmark parts add up to 6 minutes; --deadline caps the whole run below the device's 10.
BUDGETS = {"tests": 210, "overhead": 45, "sd15": 50, "sdxl": 60, "flux": 85, "compile": 120, "day0": 150}
DEADLINE_S = 570  # the whole command, from start to the last write: under a 600 s device timeout
SECTION = "gpu"


# --- results: one JSON, rewritten as they come -------------------------------------------------------------------


class Results:
    """``gpu.json`` and ``gpu.md`` in ``out``, rewritten (atomically) after every row, so a killed run leaves
    what ran."""

    def __init__(self, out: Path, small: bool, argv: list[str]) -> None:
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.data: dict[str, Any] = {
            "schema": SCHEMA,
            "small": small,
            "argv": argv,
            "started": _dt.datetime.now().isoformat(timespec="seconds"),
            "finished": None,
            "env": {},
            "parts": {},
        }

    def part(self, name: str) -> dict[str, Any]:
        return self.data["parts"].setdefault(name, {"status": "pending", "rows": []})

    def row(self, part: str, **row: Any) -> None:
        self.part(part)["rows"].append(row)
        print(f"[{part}] " + json.dumps(row, default=str), flush=True)
        self.save()

    def save(self) -> None:
        try:
            table = markdown(self.data)
        except Exception:  # the JSON is what matters: a table that fails to render must not end the run
            table = f"gpu.md could not be rendered:\n\n```\n{traceback.format_exc()}```\n"
        for name, text in (("gpu.json", json.dumps(self.data, indent=1, default=str)), ("gpu.md", table)):
            tmp = self.out / f".{name}.tmp"
            tmp.write_text(text + "\n")
            os.replace(tmp, self.out / name)


@dataclass
class Budget:
    """A part's time: its own budget, never past the run's deadline."""

    seconds: float
    deadline: float  # time.perf_counter() value
    start: float = field(default_factory=time.perf_counter)

    @property
    def end(self) -> float:
        return min(self.start + self.seconds, self.deadline)

    def left(self) -> float:
        return self.end - time.perf_counter()

    def fits(self, seconds: float) -> bool:
        return seconds <= self.left()


# --- the device --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rig:
    """Where and at which sizes this run measures."""

    small: bool
    device: str

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def reset_peak(self) -> None:
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self) -> float | None:
        return round(torch.cuda.max_memory_allocated() / 2**30, 2) if self.device == "cuda" else None


def timed(rig: Rig, fn: Callable[[], Any], repeats: int, budget: Budget) -> tuple[float, Any, int]:
    """The best wall time of up to ``repeats`` calls of ``fn`` (at least one; no call that would end past the
    budget), the last call's result, and how many calls ran."""
    best, out, calls = math.inf, None, 0
    while calls < repeats:
        rig.sync()
        start = time.perf_counter()
        out = fn()
        rig.sync()
        took = time.perf_counter() - start
        best, calls = min(best, took), calls + 1
        if not budget.fits(took):
            break
    return best, out, calls


@contextlib.contextmanager
def building(rig: Rig, dtype: torch.dtype) -> Iterator[None]:
    """Modules built inside are made on the device in ``dtype`` directly (a Flux.1-size model in fp32 first would
    need 48 GB)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(rig.device):
            yield
    finally:
        torch.set_default_dtype(old)


class Work:
    """What computed while counting: the layers (each counted at its first weighted submodule, which a cache that
    skips the layer never reaches) and the attentions (at ``to_q``)."""

    def __init__(self, model: torch.nn.Module, layers: list[torch.nn.Module]) -> None:
        self.layers = self.attention = 0
        firsts = [_first_weighted(layer) for layer in layers]
        queries = [m.to_q for m in model.modules() if isinstance(getattr(m, "to_q", None), torch.nn.Linear)]
        self.handles = [m.register_forward_pre_hook(self._layer) for m in firsts]
        self.handles += [m.register_forward_pre_hook(self._attention) for m in queries]

    def _layer(self, *_: Any) -> None:
        self.layers += 1

    def _attention(self, *_: Any) -> None:
        self.attention += 1

    def reset(self) -> None:
        self.layers = self.attention = 0

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _first_weighted(module: torch.nn.Module) -> torch.nn.Module:
    return next((m for m in module.modules() if any(True for _ in m.parameters(recurse=False))), module)


def unet_layers(unet: torch.nn.Module) -> list[torch.nn.Module]:
    """A diffusers UNet's layers in call order: each block's resnets, attentions and resamplers."""
    out: list[torch.nn.Module] = []
    for block in [*unet.down_blocks, unet.mid_block, *unet.up_blocks]:
        for name in ("resnets", "attentions", "downsamplers", "upsamplers"):
            out.extend(getattr(block, name, None) or ())
    return out


def flux_layers(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    return [*transformer.transformer_blocks, *transformer.single_transformer_blocks]


# --- env ---------------------------------------------------------------------------------------------------------


def _version(name: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def commit() -> dict[str, Any]:
    """torchfix's commit: from git, else from ``.whl/COMMIT`` (written by gpu_wheels.sh: the device's copy of the
    working tree has no .git), else ``TORCHFIX_COMMIT``."""
    head = _git("rev-parse", "HEAD")
    if head is not None:
        changed = _git("status", "--porcelain", "--untracked-files=no")
        return {"commit": head, "uncommitted_files": len(changed.splitlines()) if changed else 0, "from": "git"}
    stamp = REPO / ".whl" / "COMMIT"
    if stamp.exists():
        return {**json.loads(stamp.read_text()), "from": ".whl/COMMIT"}
    return {"commit": os.environ.get("TORCHFIX_COMMIT"), "from": "TORCHFIX_COMMIT"}


def environment(rig: Rig) -> dict[str, Any]:
    env: dict[str, Any] = {
        "device": rig.device,
        "machine": machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "torch_threads": torch.get_num_threads(),
        "cpu_cores": os.cpu_count(),
        "platform": f"{platform.system()} {platform.release()}",
        **{name: _version(name) for name in ("triton", "diffusers", "transformers", "DeepCache", "wrapt", "pytest-xdist")},
        "torchfix": commit(),
    }
    if rig.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=torch.cuda.get_device_name(0),
            gpu_count=torch.cuda.device_count(),
            capability=".".join(map(str, torch.cuda.get_device_capability(0))),
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            cuda_driver_api=getattr(torch._C, "_cuda_getDriverVersion", lambda: None)(),  # 13000 for CUDA 13.0
        )
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
            )
            env["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else None
        except (OSError, subprocess.TimeoutExpired):
            env["driver"] = None
    return env


# --- tests -------------------------------------------------------------------------------------------------------

# A pytest plugin, written next to the log when the tests run: one JSON line per test phase as it ends (in the
# xdist controller only), so a run cut short still says what passed and what failed.
TESTLOG_PLUGIN = """
import json, os

def _write(entry):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(os.environ["TORCHFIX_GPU_TESTLOG"], "a") as fh:
        fh.write(json.dumps(entry) + "\\n")

def _message(report):
    lines = report.longreprtext.strip().splitlines() if report.failed else []
    errors = [line[1:].strip() for line in lines if line.startswith("E ")]
    return (errors or lines or [""])[0][:300]

def pytest_runtest_logreport(report):
    _write({"id": report.nodeid, "when": report.when, "outcome": report.outcome, "xfail": hasattr(report, "wasxfail"),
            "message": _message(report)})

def pytest_collectreport(report):
    if report.failed:
        _write({"id": report.nodeid, "when": "collect", "outcome": "failed", "xfail": False, "message": _message(report)})
"""


def summarise(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts per outcome and the failing ids from the per-phase log."""
    outcome: dict[str, str] = {}
    messages: dict[str, str] = {}
    for entry in lines:
        test, when, result = entry["id"], entry["when"], entry["outcome"]
        if result == "failed":
            outcome[test] = "failed" if when == "call" else "error"
            messages.setdefault(test, entry.get("message", ""))
        elif test in outcome and outcome[test] in ("failed", "error"):
            continue
        elif result == "skipped":
            outcome[test] = "xfailed" if entry.get("xfail") else "skipped"
        elif when == "call":
            outcome[test] = "xpassed" if entry.get("xfail") else "passed"
        else:
            outcome.setdefault(test, "running")
    counts = {k: sum(1 for v in outcome.values() if v == k) for k in ("passed", "failed", "error", "skipped", "xfailed", "xpassed")}
    failing = sorted(t for t, v in outcome.items() if v in ("failed", "error"))
    unfinished = sorted(t for t, v in outcome.items() if v == "running")
    return {**counts, "failing": [f"{t} - {messages.get(t, '')}".rstrip(" -") for t in failing], "unfinished": unfinished}


def run_pytest(args: list[str], timeout: float, workdir: Path, log_name: str) -> dict[str, Any]:
    """``python -m pytest ARGS`` in the repository with the per-test log; killed (its process group) at ``timeout``."""
    log = workdir / f"{log_name}.jsonl"
    log.unlink(missing_ok=True)
    (workdir / "torchfix_gpu_testlog.py").write_text(TESTLOG_PLUGIN)
    path = os.pathsep.join(filter(None, [str(workdir), os.environ.get("PYTHONPATH")]))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}  # run from a test
    env.update(TORCHFIX_GPU_TESTLOG=str(log), PYTHONPATH=path)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-p", "torchfix_gpu_testlog", *args]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.strip()] if log.exists() else []
    return {
        "command": "pytest " + " ".join(args),
        "returncode": proc.returncode,
        "timed_out": timed_out,
        "seconds": round(time.perf_counter() - start, 1),
        **summarise(lines),
        "output_tail": (output or "")[-1500:],
    }


def part_tests(rig: Rig, res: Results, budget: Budget) -> None:
    workers = str(os.cpu_count() or 1)
    if rig.small:  # a dry run: one small file each, one xdist worker
        quick = ["-n", "1", "tests/test_devices.py"]
        kernels = ["-n", "1", "tests/kernels/test_cuda.py"]
    else:
        quick = ["-n", workers, "-m", "not slow", "--ignore=tests/kernels", "tests"]
        kernels = ["-n", workers, "tests/kernels"]
    with tempfile.TemporaryDirectory() as tmp:
        # the kernels get what the quick suite leaves, at least 60 s
        res.row("tests", suite="quick", **run_pytest(quick, budget.left() - 60, Path(tmp), "quick"))
        res.row("tests", suite="kernels", **run_pytest(kernels, budget.left(), Path(tmp), "kernels"))


# --- models ------------------------------------------------------------------------------------------------------


def sd15_unet(rig: Rig, dtype: torch.dtype) -> torch.nn.Module:
    """SD1.5's UNet (diffusers' defaults with 768-wide cross-attention, 8 heads), or a tiny one with ``--small``."""
    from diffusers import UNet2DConditionModel

    if rig.small:
        config = dict(
            block_out_channels=(32, 64),
            layers_per_block=1,
            cross_attention_dim=32,
            attention_head_dim=4,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            sample_size=16,
        )
    else:
        config = dict(cross_attention_dim=768, attention_head_dim=8, sample_size=64)
    with building(rig, dtype):
        return UNet2DConditionModel(**config).eval()


def sdxl_unet(rig: Rig, dtype: torch.dtype) -> torch.nn.Module:
    from diffusers import UNet2DConditionModel

    if rig.small:
        config = dict(
            block_out_channels=(32, 64),
            layers_per_block=1,
            cross_attention_dim=64,
            attention_head_dim=(2, 4),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            transformer_layers_per_block=(1, 2),
            addition_time_embed_dim=8,
            projection_class_embeddings_input_dim=80,
            sample_size=16,
        )
    else:
        config = dict(
            block_out_channels=(320, 640, 1280),
            layers_per_block=2,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            transformer_layers_per_block=(1, 2, 10),
            attention_head_dim=(5, 10, 20),
            cross_attention_dim=2048,
            addition_time_embed_dim=256,
            projection_class_embeddings_input_dim=2816,
            sample_size=128,
        )
    with building(rig, dtype):
        return UNet2DConditionModel(addition_embed_type="text_time", use_linear_projection=True, **config).eval()


def flux_transformer(rig: Rig, dtype: torch.dtype) -> torch.nn.Module:
    """Flux.1's transformer (19 double + 38 single blocks, 24 heads × 128), or a tiny one."""
    from diffusers import FluxTransformer2DModel

    if rig.small:
        config = dict(in_channels=16, num_layers=2, num_single_layers=4, attention_head_dim=16, num_attention_heads=2,
                      joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))  # fmt: skip
    else:
        config = dict(in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
                      joint_attention_dim=4096, pooled_projection_dim=768, axes_dims_rope=(16, 56, 56))  # fmt: skip
    with building(rig, dtype):
        return FluxTransformer2DModel(patch_size=1, guidance_embeds=True, **config).eval()


def latent_vae(rig: Rig, dtype: torch.dtype, channels: int) -> torch.nn.Module:
    """A VAE the pipelines only read their scale factor (8) from: ``output_type="latent"`` never decodes."""
    from diffusers import AutoencoderKL

    with building(rig, dtype):
        return AutoencoderKL(
            block_out_channels=(32, 32, 32, 32),
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            layers_per_block=1,
            latent_channels=channels,
        ).eval()


@dataclass
class Bench:
    """A pipeline, how to run it, and its layers."""

    name: str
    pipe: Any
    model: torch.nn.Module
    layers: list[torch.nn.Module]
    size: tuple[int, int]
    steps: int
    call: Callable[[Any, int], torch.Tensor]  # (pipeline, steps) -> final latents


def _sd_call(kwargs: dict[str, Any], size: tuple[int, int]) -> Callable[[Any, int], Any]:
    def call(pipe: Any, steps: int) -> Any:
        generator = torch.Generator().manual_seed(0)
        return pipe(**kwargs, height=size[0], width=size[1], num_inference_steps=steps, output_type="latent", generator=generator).images

    return call


def _embeddings(rig: Rig, dtype: torch.dtype, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(*s, generator=g).to(rig.device, dtype) for s in shapes]


def _named(rig: Rig, family: str, kind: str, dtype: torch.dtype) -> str:
    size = f"tiny {family}-like" if rig.small else f"{family}-size"
    return f"{size} {kind}, {str(dtype).removeprefix('torch.')}, random weights" + (", CFG" if kind == "UNet" else "")


def sd15_bench(rig: Rig) -> Bench:
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    dtype = torch.float32 if rig.small else torch.float16
    unet = sd15_unet(rig, dtype)
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1)  # fmt: skip
    pipe = StableDiffusionPipeline(vae=latent_vae(rig, dtype, 4), text_encoder=None, tokenizer=None, unet=unet, scheduler=scheduler,
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    width = unet.config.cross_attention_dim
    pe, ne = _embeddings(rig, dtype, (1, 77, width), (1, 77, width))
    size = (128, 128) if rig.small else (512, 512)
    call = _sd_call(dict(prompt_embeds=pe, negative_prompt_embeds=ne), size)
    return Bench(_named(rig, "SD1.5", "UNet", dtype), pipe, unet, unet_layers(unet), size, 5 if rig.small else 50, call)


def sdxl_bench(rig: Rig) -> Bench:
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

    dtype = torch.float32 if rig.small else torch.float16
    unet = sdxl_unet(rig, dtype)
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1,
                                       timestep_spacing="leading")  # fmt: skip
    pipe = StableDiffusionXLPipeline(vae=latent_vae(rig, dtype, 4), text_encoder=None, text_encoder_2=None, tokenizer=None,
                                     tokenizer_2=None, unet=unet, scheduler=scheduler)  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    width, pooled = (64, 32) if rig.small else (2048, 1280)
    pe, ne, pp, npp = _embeddings(rig, dtype, (1, 77, width), (1, 77, width), (1, pooled), (1, pooled))
    size = (128, 128) if rig.small else (1024, 1024)
    kwargs = dict(prompt_embeds=pe, negative_prompt_embeds=ne, pooled_prompt_embeds=pp, negative_pooled_prompt_embeds=npp)
    return Bench(_named(rig, "SDXL", "UNet", dtype), pipe, unet, unet_layers(unet), size, 5 if rig.small else 30, _sd_call(kwargs, size))


def flux_bench(rig: Rig) -> Bench:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    dtype = torch.float32 if rig.small else torch.bfloat16
    transformer = flux_transformer(rig, dtype)
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=latent_vae(rig, dtype, 16), text_encoder=None, tokenizer=None,
                        text_encoder_2=None, tokenizer_2=None, transformer=transformer)  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    config = transformer.config
    pe, pooled = _embeddings(rig, dtype, (1, 16 if rig.small else 512, config.joint_attention_dim), (1, config.pooled_projection_dim))
    size = (64, 64) if rig.small else (1024, 1024)

    def call(p: Any, steps: int) -> Any:
        generator = torch.Generator().manual_seed(0)
        return p(prompt_embeds=pe, pooled_prompt_embeds=pooled, height=size[0], width=size[1], num_inference_steps=steps,
                 guidance_scale=3.5, output_type="latent", generator=generator).images  # fmt: skip

    name = _named(rig, "Flux.1", "transformer", dtype)
    return Bench(name, pipe, transformer, flux_layers(transformer), size, 4 if rig.small else 20, call)


# --- day-0 families: denoisers with no registry entry, cached through the entry read off their code --------------


def _euler(model: torch.nn.Module, arguments: dict[str, Any], latent: str, steps: int, extra: Callable[[int], dict[str, Any]]) -> Any:
    """A bare denoiser's flow-matching Euler loop (timesteps 1 -> 0), a new generation for torchfix's cache each run;
    ``extra(i)``: per-step arguments (a KV cache's mode)."""
    torchfix.deepcache.new_call(model)
    reset = getattr(model, "_reset_stateful_cache", None)  # diffusers' CacheMixin (Flux 3 has none)
    if reset is not None and getattr(model, "_diffusers_hook", None) is not None:
        reset()  # its cache hooks keep state across calls: a new run starts afresh, as a pipeline's call does
    x = arguments[latent]
    with torch.no_grad():
        for i in range(steps):
            t = torch.full((x.shape[0],), 1.0 - i / steps, device=x.device, dtype=x.dtype)
            named = getattr(model, "cache_context", None)  # as the pipelines call it (diffusers' cache hooks need one)
            with named("cond") if named is not None else contextlib.nullcontext():
                out = model(**{**arguments, latent: x, "timestep": t, **extra(i)}, return_dict=False)[0]
            x = x - out[:, -x.shape[1] :] / steps
    return x


def _day0_model(rig: Rig, cls: type) -> tuple[torch.nn.Module, torch.dtype]:
    """A day-0 denoiser at its default (full) size in bfloat16, or its tiny builder's config in float32 (``--small``)."""
    from torchfix.testing.families import FAMILIES

    dtype = torch.float32 if rig.small else torch.bfloat16
    with building(rig, dtype):
        model = cls(**FAMILIES["auto:" + cls.__name__].config) if rig.small else cls()
    return model.eval(), dtype


def qwen21_bench(rig: Rig) -> Bench:
    """Qwen-Image 2.1's transformer (32 blocks, 32 heads x 128: 7.1B; its default config), 1024x1024 (4,096 image
    tokens, 256 text tokens), with its pipeline's KV cache (the first step prefills the text, later steps run the
    image tokens alone); or the tiny builder. No registry entry: torchfix reads one off its code."""
    from diffusers import QwenImage21Transformer2DModel
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    model, dtype = _day0_model(rig, QwenImage21Transformer2DModel)
    c = model.config
    h = w = 4 if rig.small else 64
    text = 8 if rig.small else 256
    g = torch.Generator().manual_seed(0)
    img_mask = torch.zeros(1, text + h * w // 4, dtype=torch.bool)
    img_mask[:, text:] = True
    arguments = {
        "hidden_states": torch.randn(1, h * w, c.in_channels, generator=g).to(rig.device, dtype),
        "encoder_hidden_states": torch.randn(1, text, c.context_in_dim, generator=g).to(rig.device, dtype),
        "encoder_hidden_states_mask": torch.ones(1, text, dtype=torch.bool, device=rig.device),
        "img_shapes": [[(1, h, w)]],
        "img_mask": img_mask.to(rig.device),
    }
    steps = 4 if rig.small else 20
    blocks = len(model.transformer_blocks)

    def call(m: Any, n: int) -> Any:
        cache = QwenImage21KVCache(blocks)
        return _euler(m, arguments, "hidden_states", n, lambda i: {"kv_cache": cache, "kv_cache_mode": "extract" if i == 0 else "cached"})

    name = _named(rig, "Qwen-Image 2.1", "transformer (no registry entry)", dtype)
    return Bench(name, model, model, list(model.transformer_blocks), (h * 16, w * 16), steps, call)


def flux3_bench(rig: Rig) -> Bench:
    """Flux 3's transformer (its default config: 5 mode + 28 single blocks, 5.5B), 1024x1024 (4,096 image tokens,
    512 text tokens); or the tiny builder. No registry entry: torchfix reads one off its code."""
    from diffusers import Flux3Transformer2DModel

    from torchfix.testing.tiny import _ids

    model, dtype = _day0_model(rig, Flux3Transformer2DModel)
    c = model.config
    h = w = 4 if rig.small else 64
    text = 12 if rig.small else 512
    g = torch.Generator().manual_seed(0)
    txt_ids = torch.zeros(text, 4, dtype=torch.long)
    txt_ids[:, 3] = torch.arange(text)
    arguments = {
        "hidden_states": torch.randn(1, h * w, c.in_channels, generator=g).to(rig.device, dtype),
        "encoder_hidden_states": torch.randn(1, text, c.joint_attention_dim, generator=g).to(rig.device, dtype),
        "img_ids": _ids(h, w, width=4).to(rig.device),
        "txt_ids": txt_ids.to(rig.device),
    }
    steps = 4 if rig.small else 20
    call = lambda m, n: _euler(m, arguments, "hidden_states", n, lambda i: {})  # noqa: E731
    layers = [*model.single_transformer_blocks]
    return Bench(_named(rig, "Flux 3", "transformer (no registry entry)", dtype), model, model, layers, (h * 16, w * 16), steps, call)


def day0_caches() -> list[Cache]:
    from diffusers import TaylorSeerCacheConfig

    return [
        torchfix_cache("torchfix DeepCache (transformer defaults; entry read off the code)"),
        torchfix_cache("torchfix DeepCache interval=5", interval=5),
        diffusers_cache("diffusers TaylorSeer cache_interval=3", lambda: TaylorSeerCacheConfig(cache_interval=3)),
    ]


def part_day0(rig: Rig, res: Results, budget: Budget) -> None:
    """Both day-0 models, each within half of what is left."""
    for name, build in (("qwen21", qwen21_bench), ("flux3", flux3_bench)):
        share = Budget(budget.left() / (2 if name == "qwen21" else 1), budget.deadline)
        res.part(f"day0 {name}")["budget_s"] = round(share.left(), 1)
        try:
            part_caches(f"day0 {name}", build, day0_caches)(rig, res, share)
            res.part(f"day0 {name}")["status"] = "done"
        except Exception as exc:  # one model's failure is a result; the other still runs
            res.part(f"day0 {name}").update(status="failed", error=f"{type(exc).__name__}: {str(exc)[:500]}")
        finally:
            res.part(f"day0 {name}")["seconds"] = round(time.perf_counter() - share.start, 1)
            res.save()
            gc.collect()
            if rig.device == "cuda":
                torch.cuda.empty_cache()


# --- overhead ----------------------------------------------------------------------------------------------------


def aten_ops(rig: Rig, step: Callable[[], Any]) -> int:
    """aten ops one call of ``step`` makes (the profiler's CPU events named ``aten::``, nested ones included)."""
    from torch import profiler

    with profiler.profile(activities=[profiler.ProfilerActivity.CPU]) as prof:
        step()
    rig.sync()
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


@contextlib.contextmanager
def process_wide() -> Iterator[None]:
    """``torchfix.enable()`` for the block, ``disable()`` after it (installing the patches takes milliseconds: it
    stays out of the timed loop, as it would in a script that enables once)."""
    torchfix.enable()
    try:
        yield
    finally:
        torchfix.disable()


GUARDED: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
    "plain": contextlib.nullcontext,
    "enabled": torchfix.enabled,
    "enable": process_wide,
}


def interleaved(rig: Rig, loop: Callable[[], None], rounds: int, end: float) -> tuple[dict[str, float], int]:
    """The best time of ``loop`` in each of :data:`GUARDED` over up to ``rounds`` rounds (each round runs every
    variant once, in turn); no round that would end past ``end``."""
    best = dict.fromkeys(GUARDED, math.inf)
    done = 0
    while done < rounds:
        start = time.perf_counter()
        for name, guarded in GUARDED.items():
            with guarded():
                rig.sync()
                t0 = time.perf_counter()
                loop()
                rig.sync()
                best[name] = min(best[name], time.perf_counter() - t0)
        done += 1
        if 2 * time.perf_counter() - start > end:
            break
    return best, done


def part_overhead(rig: Rig, res: Results, budget: Budget) -> None:
    dtype = torch.float32 if rig.small else torch.float16
    unet = sd15_unet(rig, dtype)
    width = unet.config.cross_attention_dim
    n = 3 if rig.small else 20
    cases = [("launch-bound", 1, 32), ("", 2, 64)]
    for k, (kind, batch, side) in enumerate(cases):
        side = 8 if rig.small else side
        label = f"{8 * side}² batch {batch}" + (f" ({kind})" if kind else "")
        x, e = _embeddings(rig, dtype, (batch, 4, side, side), (batch, 77, width))
        t = torch.full((batch,), 500, device=rig.device)

        def step(x: torch.Tensor = x, t: torch.Tensor = t, e: torch.Tensor = e) -> torch.Tensor:
            with torch.no_grad():
                return unet(x, t, e).sample

        def loop(step: Callable[[], torch.Tensor] = step) -> None:
            for _ in range(n):
                step()

        outputs = {}
        for name, guarded in GUARDED.items():  # warm-up (kernels chosen, caches filled), outputs kept
            with guarded():
                loop()
                outputs[name] = step()
        # the cases share what is left: the first leaves room for the second
        best, rounds = interleaved(rig, loop, 3 if rig.small else 7, time.perf_counter() + budget.left() / (len(cases) - k))
        ops = aten_ops(rig, step)
        ms = {name: 1000 * s / n for name, s in best.items()}
        res.row(
            "overhead",
            case=label,
            steps_per_round=n,
            rounds=rounds,
            plain_ms=round(ms["plain"], 3),
            enabled_ms=round(ms["enabled"], 3),
            enable_ms=round(ms["enable"], 3),
            enabled_ratio=round(ms["enabled"] / ms["plain"], 4),
            enable_ratio=round(ms["enable"] / ms["plain"], 4),
            aten_ops=ops,
            enable_us_per_op=round(1000 * (ms["enable"] - ms["plain"]) / ops, 3),
            bit_identical=all(torch.equal(out, outputs["plain"]) for out in outputs.values()),  # do no harm
        )


# --- caches ------------------------------------------------------------------------------------------------------


@dataclass
class Cache:
    """One row: how to switch a cache on for the pipeline (returning a handle), and off again (given the handle)."""

    label: str
    on: Callable[[Any], Any]
    off: Callable[[Any, Any], None]


def torchfix_cache(label: str, **config: Any) -> Cache:
    def on(pipe: Any) -> Any:
        return torchfix.deepcache.apply(pipe, torchfix.DeepCacheConfig(**config))

    return Cache(label, on, lambda pipe, _: torchfix.deepcache.remove(pipe))


def deepcache_pypi(interval: int) -> Cache:
    def on(pipe: Any) -> Any:
        from DeepCache import DeepCacheSDHelper

        helper = DeepCacheSDHelper(pipe=pipe)
        helper.set_params(cache_interval=interval, cache_branch_id=0)
        helper.enable()
        return helper

    return Cache(f"DeepCache 0.1.1 interval={interval} branch=0", on, lambda pipe, helper: helper.disable())


def diffusers_cache(label: str, make: Callable[[], Any]) -> Cache:
    """diffusers' hooks through the model's ``enable_cache`` (which, unlike the ``apply_*`` helpers, refreshes the
    hook registry); FluxPipeline sets the cache context they need."""

    def on(pipe: Any) -> Any:
        getattr(pipe, "transformer", pipe).enable_cache(make())  # a pipeline's transformer, or a bare one

    return Cache(label, on, lambda pipe, _: getattr(pipe, "transformer", pipe).disable_cache())


def unet_caches(model: str) -> list[Cache]:
    rows = [
        torchfix_cache("torchfix DeepCache interval=3 (defaults)", interval=3),
        deepcache_pypi(3),
        torchfix_cache("torchfix DeepCache interval=3 forecast=0 (DeepCache 0.1.1's steps)", interval=3, forecast=0),
    ]
    if model == "sd15":
        rows += [torchfix_cache("torchfix DeepCache interval=5 (defaults)", interval=5), deepcache_pypi(5)]
    return rows


def flux_caches() -> list[Cache]:
    from diffusers import FirstBlockCacheConfig, TaylorSeerCacheConfig

    return [
        torchfix_cache("torchfix DeepCache (transformer defaults)"),
        diffusers_cache("diffusers FirstBlockCache threshold=0.2", lambda: FirstBlockCacheConfig(threshold=0.2)),
        diffusers_cache("diffusers TaylorSeer cache_interval=3", lambda: TaylorSeerCacheConfig(cache_interval=3)),
        diffusers_cache("diffusers FirstBlockCache threshold=1.0", lambda: FirstBlockCacheConfig(threshold=1.0)),
        torchfix_cache("torchfix DeepCache interval=5", interval=5),
    ]


def part_caches(name: str, build: Callable[[Rig], Bench], caches: Callable[[], list[Cache]]) -> Callable[[Rig, Results, Budget], None]:
    """The part for one model: plain (best of 2), then each cache while the budget holds (a short warm-up run, then
    the best of 2), each compared with plain's final latents."""

    def run(rig: Rig, res: Results, budget: Budget) -> None:
        t0 = time.perf_counter()
        bench = build(rig)
        built = round(time.perf_counter() - t0, 1)
        res.part(name)["model"] = dict(name=bench.name, size=list(bench.size), steps=bench.steps, build_s=built)
        warm = min(4, bench.steps)  # reaches a cached step at interval 3: set-up costs stay out of the timed runs
        work = Work(bench.model, bench.layers)

        def measure(repeats: int) -> tuple[float, torch.Tensor, dict[str, Any]]:
            bench.call(bench.pipe, warm)
            rig.reset_peak()
            work.reset()
            seconds, out, calls = timed(rig, lambda: bench.call(bench.pipe, bench.steps), repeats, budget)
            done = dict(layers=work.layers // calls, attention=work.attention // calls, peak_gib=rig.peak_gib())
            return seconds, out, done

        try:
            plain_s, plain, full = measure(2)
            res.row(name, cache="plain", seconds=round(plain_s, 3), speedup=1.0, rel_l2=0.0, **full)
            for cache in caches():
                if not budget.fits(1.5 * plain_s):  # the warm-up and one timed run, each at most plain's time
                    res.row(name, cache=cache.label, skipped=f"budget: {budget.left():.0f} s left, a run takes up to {plain_s:.1f} s")
                    continue
                handle = None
                try:
                    handle = cache.on(bench.pipe)
                    seconds, out, done = measure(2)
                    speedup, error = round(plain_s / seconds, 3), rel_l2(out, plain)
                    row = dict(cache=cache.label, seconds=round(seconds, 3), speedup=speedup, rel_l2=error, **done)
                    if done["layers"] >= full["layers"] and done["attention"] >= full["attention"]:
                        row["note"] = "did not engage: computed as much as plain"
                    res.row(name, **row)
                except Exception as exc:  # a cache that cannot run on this model is a result too
                    res.row(name, cache=cache.label, error=f"{type(exc).__name__}: {str(exc)[:300]}")
                finally:
                    with contextlib.suppress(Exception):  # also after a failed switch-on: leave the pipeline plain
                        cache.off(bench.pipe, handle)
        finally:
            work.close()

    return run


# --- compile -----------------------------------------------------------------------------------------------------


def part_compile(rig: Rig, res: Results, budget: Budget) -> None:
    dtype = torch.float32 if rig.small else torch.float16
    unet = sd15_unet(rig, dtype)
    batch, side = (2, 8) if rig.small else (2, 64)
    x, e = _embeddings(rig, dtype, (batch, 4, side, side), (batch, 77, unet.config.cross_attention_dim))
    t = torch.full((batch,), 500, device=rig.device)
    n = 3 if rig.small else 20
    backend = "aot_eager" if rig.small else "inductor"  # --small: the plumbing without C++ code generation on 2 cores
    with torch.no_grad():
        eager = unet(x, t, e).sample
    outputs: dict[str, torch.Tensor] = {}
    first = 0.0
    for label in ("plain", "torchfix.enabled()"):
        # the second compile finds the first's kernels in inductor's cache when the guards leave the graph alone
        if outputs and not budget.fits(0.5 * first):
            res.row("compile", variant=label, skipped=f"budget: {budget.left():.0f} s left, the first compile took {first:.0f} s")
            continue
        torch._dynamo.reset()
        counters = torch._dynamo.utils.counters
        counters.clear()
        compiled = torch.compile(unet, backend=backend)
        block = torchfix.enabled() if label != "plain" else contextlib.nullcontext()
        with block, torch.no_grad():
            rig.sync()
            start = time.perf_counter()
            outputs[label] = compiled(x, t, e).sample
            rig.sync()
            first = time.perf_counter() - start

            def loop(compiled: Callable[..., Any] = compiled) -> None:
                for _ in range(n):
                    compiled(x, t, e)

            loop()
            best, _, _ = timed(rig, loop, 3, budget)
        res.row(
            "compile",
            variant=label,
            backend=backend,
            first_call_s=round(first, 1),
            graphs=counters["stats"]["unique_graphs"],  # more than plain's: the guards broke the graph
            ms_per_step=round(1000 * best / n, 3),
            rel_l2_vs_eager=rel_l2(outputs[label], eager),
            bit_identical_to_plain=bool(torch.equal(outputs[label], outputs["plain"])),
        )
    torch._dynamo.reset()


# --- the run -----------------------------------------------------------------------------------------------------

RUNNERS: dict[str, Callable[[Rig, Results, Budget], None]] = {
    "tests": part_tests,
    "overhead": part_overhead,
    "sd15": part_caches("sd15", sd15_bench, lambda: unet_caches("sd15")),
    "sdxl": part_caches("sdxl", sdxl_bench, lambda: unet_caches("sdxl")),
    "flux": part_caches("flux", flux_bench, flux_caches),
    "day0": part_day0,
    "compile": part_compile,
}


def run_part(name: str, rig: Rig, res: Results, budget: Budget) -> None:
    info = res.part(name)
    info.update(status="running", budget_s=round(budget.left(), 1))
    res.save()
    try:
        if budget.deadline - time.perf_counter() < 5:
            info["status"] = "skipped: no time left before --deadline"
            return
        RUNNERS[name](rig, res, budget)
        info["status"] = "done"
    except Exception as exc:  # a part's crash is a result; the next part runs
        info.update(status="failed", error=f"{type(exc).__name__}: {str(exc)[:500]}", traceback=traceback.format_exc()[-2000:])
    finally:
        info["seconds"] = round(time.perf_counter() - budget.start, 1)
        res.save()
        gc.collect()
        if rig.device == "cuda":
            torch.cuda.empty_cache()


def parse_budgets(text: str | None) -> dict[str, float]:
    budgets = dict(BUDGETS)
    for item in filter(None, (text or "").split(",")):
        part, _, seconds = item.partition("=")
        if part not in budgets or not seconds:
            raise SystemExit(f"--budget {item!r}: give part=seconds for a part of {', '.join(PARTS)}")
        budgets[part] = float(seconds)
    return budgets


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help=f"comma-separated parts: {','.join(PARTS)} (default: all)")
    ap.add_argument("--small", action="store_true", help="tiny models on the CPU (a dry run of every part)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/gpu-check", help="folder for gpu.json and gpu.md (default: $OUT)")
    ap.add_argument("--budget", help="part=seconds,... overriding the per-part budgets " + json.dumps(BUDGETS))
    ap.add_argument("--deadline", type=float, default=DEADLINE_S, help="seconds the whole run may take (default %(default)s)")
    ap.add_argument("--render", metavar="JSON", help="only rewrite the 'gpu' section of docs/benchmarks.md from a gpu.json")
    args = ap.parse_args(argv)
    if args.render:
        write_section(SECTION, markdown(json.loads(Path(args.render).read_text())))
        print(f"wrote the '{SECTION}' section of docs/benchmarks.md from {args.render}")
        return 0
    only = [p.strip() for p in (args.only or ",".join(PARTS)).split(",") if p.strip()]
    unknown = sorted(set(only) - set(PARTS) - {"env"})
    if unknown:
        raise SystemExit(f"--only: unknown part(s) {', '.join(unknown)}; the parts: {', '.join(PARTS)}")
    budgets = parse_budgets(args.budget)
    deadline = time.perf_counter() + args.deadline

    if not args.small and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --small for the CPU dry run")
    rig = Rig(small=args.small, device="cpu" if args.small else "cuda")
    if args.small:
        torch.set_num_threads(1)  # one torch thread on a shared CPU (docs: NOTES, OpenMP barrier spinning)
    res = Results(Path(args.out), args.small, ["benchmarks/gpu.py", *(argv if argv is not None else sys.argv[1:])])
    res.data["env"] = environment(rig)
    res.save()
    print("[env] " + json.dumps(res.data["env"], default=str), flush=True)
    for name in PARTS:
        if name in only:
            run_part(name, rig, res, Budget(budgets[name], deadline))
    res.data["finished"] = _dt.datetime.now().isoformat(timespec="seconds")
    res.save()
    if not args.small:  # a dry run's figures are not the GPU's
        write_section(SECTION, markdown(res.data))
    print(f"wrote {res.out / 'gpu.json'} and {res.out / 'gpu.md'}", flush=True)
    return 0


# --- the tables --------------------------------------------------------------------------------------------------

RUN_HOWTO = """\
Rerun on a lent GPU machine: `bash benchmarks/gpu_wheels.sh` here (the machine has no diffusers, DeepCache or
network), then on the device, with `.whl` carried and a 600 s timeout:
`python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site:$PWD
PYTHONUNBUFFERED=1 python3 benchmarks/gpu.py --out "$OUT"` (at most 9.5 min, `--deadline 570`: the tests within 3.5,
the benchmark within 6; some parts only with `--only tests,overhead,...`); back here
`.venv/bin/python benchmarks/gpu.py --render <folder>/gpu.json` rewrites this section. `--small` is the CPU dry run.
Parts: `tests` (the quick suite and tests/kernels: counts, failing ids), `overhead` (the guards per eager UNet step),
`sd15`, `sdxl`, `flux` (caches: torchfix, DeepCache 0.1.1, diffusers' FirstBlockCache and TaylorSeer: wall time,
rel-L2, layers and attentions computed), `compile` (inductor, plain and guarded); `$OUT/gpu.json` and `$OUT/gpu.md`
are rewritten after every row, so a run cut short keeps what ran."""


def _cell(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|")


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(_cell(c) for c in r) + " |" for r in rows)]


def _machine(env: dict[str, Any]) -> str:
    fix = env.get("torchfix") or {}
    rev = (fix.get("commit") or "unknown")[:10]
    if fix.get("uncommitted_files"):
        rev += f" + {fix['uncommitted_files']} uncommitted file(s)"
    gpu, memory = env.get("gpu") or "no GPU (CPU dry run)", env.get("gpu_memory_gib")
    return (
        f"{gpu}{f' ({memory} GiB)' if memory else ''}, driver {env.get('driver') or '—'}, "
        f"CUDA {env.get('cuda_runtime') or '—'}; {env.get('cpu_cores')} cores, {env.get('platform')}; Python {env.get('python')}, "
        f"torch {env.get('torch')}, triton {env.get('triton') or '—'}, diffusers {env.get('diffusers') or '—'}, "
        f"transformers {env.get('transformers') or '—'}, DeepCache {env.get('DeepCache') or '—'}; torchfix {rev}"
    )


def markdown(data: dict[str, Any]) -> str:
    """The section body: machine, how to rerun, then one table per part that ran."""
    env, parts = data.get("env", {}), data.get("parts", {})
    small = " **--small dry run on the CPU: tiny models, not GPU figures.**" if data.get("small") else ""
    lines = ["## GPU (`benchmarks/gpu.py`)", "", f"Machine: {_machine(env)}; run {data.get('started')}.{small}", "", RUN_HOWTO, ""]
    for name in [*(n for n in PARTS if n in parts), *(n for n in parts if n not in PARTS)]:  # day0's models: parts of their own
        info = parts[name]
        rows = info.get("rows", [])
        status = info.get("status")
        head = f"**{name}** ({status}, {info.get('seconds', '?')} s of a {info.get('budget_s', '?')} s budget)"
        if info.get("model"):
            m = info["model"]
            head += f": {m['name']}, {m['size'][0]}×{m['size'][1]}, {m['steps']} steps (built in {m['build_s']} s)"
        lines += [head, ""]
        if info.get("error"):
            lines += [f"Failed: `{info['error'][:300]}`", ""]
        if name == "tests" and rows:
            table = [[r["suite"], r.get("passed"), r.get("failed"), r.get("error"), r.get("skipped"), r.get("xfailed"),
                      r.get("seconds"), r.get("timed_out")] for r in rows]  # fmt: skip
            lines += _table(["suite", "passed", "failed", "errors", "skipped", "xfailed", "s", "timed out"], table)
            failing = [f"- `{f}`" for r in rows for f in r.get("failing", [])]
            lines += ["", "Failing:" if failing else "Failing: none.", *failing[:60], ""]
        elif name == "overhead" and rows:
            table = [[r["case"], r["plain_ms"], r["enabled_ms"], r["enable_ms"], f"{r['enabled_ratio']:.3f}×", f"{r['enable_ratio']:.3f}×",
                      r["aten_ops"], r["enable_us_per_op"], r["bit_identical"]] for r in rows]  # fmt: skip
            header = ["UNet step", "plain ms", "enabled() ms", "enable() ms", "enabled()/plain", "enable()/plain", "aten ops/step",
                      "enable() µs/op", "bit-identical"]  # fmt: skip
            rounds = f"Best of {rows[0]['rounds']} interleaved rounds of {rows[0]['steps_per_round']} steps each."
            lines += [*_table(header, table), "", rounds, ""]
        elif name == "compile" and rows:
            table = [[r["variant"], r.get("backend"), r.get("first_call_s"), r.get("graphs"), r.get("ms_per_step"),
                      r.get("rel_l2_vs_eager"), r.get("bit_identical_to_plain"), r.get("skipped")] for r in rows]  # fmt: skip
            header = ["variant", "backend", "first call s", "graphs", "ms/step", "rel-L2 vs eager", "= plain compiled", "skipped"]
            lines += [*_table(header, table), ""]
        elif rows:
            table = []
            for r in rows:
                note = r.get("note") or r.get("skipped") or r.get("error") or ""
                table.append([r["cache"], r.get("seconds"), f"{r['speedup']:.2f}×" if "speedup" in r else None, r.get("rel_l2"),
                              r.get("layers"), r.get("attention"), r.get("peak_gib"), note])  # fmt: skip
            header = ["cache", "wall s", "speedup", "rel-L2 vs plain", "layers computed", "attentions computed", "peak GiB", "note"]
            lines += [*_table(header, table), ""]
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
