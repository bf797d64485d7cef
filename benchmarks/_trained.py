"""Denoisers trained here, offline, for the cache benchmarks: where their checkpoints live and how a
benchmark gets a pipeline with one.

    .venv/bin/python benchmarks/train_denoisers.py      # builds them (make denoisers); a few CPU-minutes each

Random weights misrank caches (their features change the same amount at every step; a trained
denoiser's change is U-shaped over the steps). These are the tiny pipelines of ``torchfix.testing``
with their denoiser trained on scikit-learn's digits (8×8, lifted to 128×128 images and encoded by
the pipeline's own VAE), conditioned on "a handwritten digit k" through the pipeline's own frozen
text encoders. Checkpoints are kept outside git, under ``$TORCHFIX_CACHE`` (default
``~/.cache/torchfix``)/denoisers/<kind>.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torchfix.testing import tiny_flux_pipeline, tiny_sd3_pipeline, tiny_sd15_pipeline, tiny_wan22_pipeline

SIZE = (128, 128)
KINDS = ("sd15", "sd3", "flux", "wan")
# The architectures the benchmarks use (torchfix.testing's builders with these arguments).
BUILDERS = {
    "sd15": lambda: tiny_sd15_pipeline(),
    "sd3": lambda: tiny_sd3_pipeline(layers=8),
    "flux": lambda: tiny_flux_pipeline(layers=4, single_layers=8),
    "wan": lambda: tiny_wan22_pipeline(boundary_ratio=None, layers=8, heads=4, head_dim=16),
}
LABELS = {
    "sd15": "SD1.5-like UNet",
    "sd3": "SD3-like (8 joint blocks, CFG)",
    "flux": "Flux-like (4 double + 8 single blocks)",
    "wan": "Wan-like video (8 blocks, CFG; 9 frames of a moving digit)",
}
# What a video kind is called with: its size (pixels) and frames; the image kinds use SIZE.
VIDEO = {"wan": {"size": (64, 64), "num_frames": 9, "max_sequence_length": 16}}


def call(kind: str) -> dict[str, Any]:
    """Keyword arguments of ``torchfix.testing.latents`` for ``kind``: its size, and a video's frames."""
    video = dict(VIDEO.get(kind, {}))
    return {"size": video.pop("size", SIZE), **video}


def prompt(digit: int) -> str:
    return f"a handwritten digit {digit}"


def cache_dir() -> Path:
    return Path(os.environ.get("TORCHFIX_CACHE", Path.home() / ".cache" / "torchfix")) / "denoisers"


def denoiser_name(pipe: Any) -> str:
    return "unet" if getattr(pipe, "unet", None) is not None else "transformer"


def meta(kind: str) -> dict[str, Any] | None:
    path = cache_dir() / kind / "training.json"
    return json.loads(path.read_text()) if path.exists() else None


def trained_pipeline(kind: str) -> Any:
    """The tiny pipeline of ``kind`` with its trained denoiser; a clear error naming the command that
    builds it where the checkpoint is missing."""
    path = cache_dir() / kind
    if meta(kind) is None:
        raise FileNotFoundError(f"no trained {kind} denoiser under {path}: run `make denoisers` (benchmarks/train_denoisers.py)")
    pipe = BUILDERS[kind]()
    name = denoiser_name(pipe)
    model = getattr(pipe, name)
    trained = type(model).from_pretrained(path)
    setattr(pipe, name, trained.eval())
    pipe.register_modules(**{name: trained})
    return pipe
