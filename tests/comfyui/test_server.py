"""A workflow the way a ComfyUI user runs one: ComfyUI 0.3.64's own server (``main.py --cpu`` on 127.0.0.1, in a
subprocess with this Python), the node pack in its ``custom_nodes/``, a checkpoint in ``models/checkpoints`` that
``CheckpointLoaderSimple`` detects from its keys and shapes, API-format workflows posted to ``/prompt`` and waited
for in ``/history``, the images and latents read back from its output folder.

CheckpointLoaderSimple -> torchfix cache -> KSampler -> VAEDecode -> SaveImage (plus SaveLatent, and torchfix report
for the cache's counts), at two latent sizes one after another, against the same workflow without the cache node.
One test (the server is started once: pytest-xdist would spread several tests of a module over its workers, each
starting a server), its checks one section each; the server is stopped on the way out, whatever happened.
About 20 s on an otherwise idle 2-core machine (ComfyUI's import 4 s, shared with the other tests here; the
checkpoint 2 s; the server's start 5 s; nine workflows 0.5-1.6 s each), 40 s at a load of 6.
"""

from __future__ import annotations

import re

import numpy
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from torchfix.testing import comfyui

CHECKPOINT = "tiny-sd15.safetensors"
SIZES = ((64, 80), (72, 88))  # pixels (height, width): latents 8x10, then 9x11 (odd: rounds down and up the UNet)
STEPS = 6
SEED = 7
RUNS = (("TorchfixCache", "cached"), (None, "plain"), ("TorchfixGuards", "guarded"))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def workflow(height: int, width: int, node: str | None = None, prefix: str = "plain") -> dict:
    """The API-format workflow: a checkpoint, two prompts, an empty latent, ``node`` (TorchfixCache, TorchfixGuards or
    none) between the loader's MODEL and KSampler, the image and the latent saved, the torchfix report where a node
    is used."""
    graph = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": CHECKPOINT}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a lighthouse on a cliff at dusk", "clip": ["1", 1]}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry, low quality", "clip": ["1", 1]}},
        "4": {"class_type": "EmptyLatentImage", "inputs": {"width": width, "height": height, "batch_size": 1}},
        "6": {
            "class_type": "KSampler",
            "inputs": {
                "model": ["5", 0] if node else ["1", 0],
                **{"seed": SEED, "steps": STEPS, "cfg": 4.0, "sampler_name": "euler", "scheduler": "normal", "denoise": 1.0},
                **{"positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0]},
            },
        },
        "7": {"class_type": "VAEDecode", "inputs": {"samples": ["6", 0], "vae": ["1", 2]}},
        "8": {"class_type": "SaveImage", "inputs": {"images": ["7", 0], "filename_prefix": f"{prefix}-{height}x{width}"}},
        "9": {"class_type": "SaveLatent", "inputs": {"samples": ["6", 0], "filename_prefix": f"latents/{prefix}-{height}x{width}"}},
    }
    if node == "TorchfixCache":
        graph["5"] = {"class_type": node, "inputs": {"model": ["1", 0], "interval": 3, "threshold": 0.0, "branch": 0}}
    elif node == "TorchfixGuards":
        graph["5"] = {"class_type": node, "inputs": {"model": ["1", 0], "mode": "fix"}}
    if node:
        graph["10"] = {"class_type": "TorchfixReport", "inputs": {"model": ["5", 0], "samples": ["6", 0]}}
    return graph


def run_all(server: comfyui.Server) -> dict:
    """``(image path, latent, report text)`` of each workflow, run in this order: cached at both sizes one after
    another, plain, guarded, plain at another seed (the control); then, after the server dropped everything it kept
    (``/free``), the cache node afresh at the second size."""
    order = [(node, prefix, size) for node, prefix in RUNS for size in SIZES] + [(None, "other-seed", SIZES[0])]
    done = {}
    for node, prefix, (height, width) in [*order, ("free", None, (0, 0)), ("TorchfixCache", "fresh", SIZES[1])]:
        if node == "free":
            server.free()
            continue
        graph = workflow(height, width, node, prefix)
        if prefix == "other-seed":
            graph["6"]["inputs"]["seed"] = SEED + 1
        entry = server.run(graph, timeout_s=120)
        (image,) = server.files(entry, "8")
        (latent,) = server.files(entry, "9", "latents")
        report = entry["outputs"]["10"]["text"][0] if node else ""
        done[prefix, height, width] = (image, load_file(str(latent))["latent_tensor"], report)
    return done


def counts(report: str) -> tuple[int, int]:
    found = re.search(r"cache \(comfy-unet\): (\d+) full, (\d+) cached denoiser call", report)
    assert found, report
    return int(found[1]), int(found[2])


def pixels(path) -> torch.Tensor:
    with Image.open(path) as picture:
        return torch.from_numpy(numpy.array(picture.convert("RGB"))).float()


def test_a_workflow_through_comfyuis_own_server(tmp_path):
    why = comfyui.server_missing()
    if why:
        pytest.skip(why)
    checkpoint = comfyui.write_checkpoint(tmp_path / "models" / "checkpoints" / CHECKPOINT)
    try:
        with comfyui.Server(tmp_path) as server:
            runs = run_all(server)
            log = server.log
    finally:
        checkpoint.unlink()  # 340 MB: pytest keeps the temporary folders of its last three runs

    # The pack was loaded by the server's own custom-node loader (an import failure is logged with IMPORT FAILED).
    assert re.search(r"\d seconds: \S*custom_nodes.comfyui-torchfix", log), log[-3000:]

    # Every run completed (Server.run raises otherwise) with a picture and a latent of its size.
    for _, prefix in RUNS:
        for height, width in SIZES:
            image, latent, _ = runs[prefix, height, width]
            with Image.open(image) as picture:
                assert picture.size == (width, height), (prefix, picture.size)
            assert latent.shape == (1, 4, height // 8, width // 8) and torch.isfinite(latent).all(), prefix

    # The cache ran at both sizes: its report through /history and its log line in the server's output, full and cached
    # calls adding up to the steps (ComfyUI batches cond and uncond into one call). It stayed close to the plain run.
    # Measured here: rel-L2 of the final latents 0.084 and 0.088 (cached vs plain), 1.24 between plain runs of two
    # seeds; the bound 0.25 is the one tests/comfyui/test_cache.py holds every class to, a fifth of the seed distance:
    # a cache that fed stale features (another size's, another step's) lands near the latter. The pictures (8-bit,
    # through a random TAESD): mean |difference| 5.4 levels cached vs plain, 24 between seeds; bound: half the latter.
    (h, w), _ = SIZES
    control = (pixels(runs["other-seed", h, w][0]) - pixels(runs["plain", h, w][0])).abs().mean()
    for height, width in SIZES:
        image, cached, report = runs["cached", height, width]
        plain_image, plain, _ = runs["plain", height, width]
        full, skipped = counts(report)
        assert full >= 1 and skipped >= 1 and full + skipped == STEPS, report
        assert f"torchfix cache (comfy-unet): {full} full and {skipped} cached denoiser call(s)" in log
        assert not torch.equal(cached, plain) and rel(cached, plain) < 0.25, (height, width, rel(cached, plain))
        assert (pixels(image) - pixels(plain_image)).abs().mean() < control / 2

    # The second size after the first, through one cache node, is bit for bit the cache node's first run at that size
    # in a server that dropped its nodes' outputs and models (a fresh cache on a freshly loaded checkpoint).
    _, (height, width) = SIZES
    _, after, report_after = runs["cached", height, width]
    _, fresh, report_fresh = runs["fresh", height, width]
    assert torch.equal(after, fresh) and counts(report_after) == counts(report_fresh)

    # The guards node on a sound model changes no bit; the pack's load and the nodes left torchfix off for the process
    # (the report node says so where something switched it on process-wide: tests/comfyui/test_nodes.py).
    for height, width in SIZES:
        _, guarded, report = runs["guarded", height, width]
        assert torch.equal(guarded, runs["plain", height, width][1])
        assert f"nothing to fix ({STEPS} denoiser call(s) guarded, mode fix)" in report, report
        assert "process-wide" not in report and "process-wide" not in runs["cached", height, width][2]
    assert f"torchfix guards (fix) over {STEPS} denoiser call(s): nothing to fix" in log
