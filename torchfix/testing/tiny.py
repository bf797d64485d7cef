"""What a tiny builder is (:class:`Tiny`: a denoiser class, a small config, the arguments of one step) and the
helpers its ``inputs`` use: the registered families' builders (:mod:`torchfix.testing.families`) and the day-0
ones (``_day0_image``, ``_day0_video``) are made of these.

>>> from torchfix.testing.tiny import Tiny
>>> Tiny("wan", "WanTransformer3DModel", {}, lambda c: {}).key
'wan'
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["ADDED_IN", "JOYIMAGE", "LTX2", "WAN", "Call", "Size", "Tiny"]

# Wan's tiny config (diffusers' test sizes): the Wan-layout builders' (Wan, SkyReels-V2) and the base of
# Wan-Animate's and Helios's
WAN: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 12,
    "in_channels": 4,
    "out_channels": 4,
    "text_dim": 16,
    "freq_dim": 256,
    "ffn_dim": 32,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 32,
}


# JoyImage-Edit's tiny config (diffusers' tests), shared by JoyImage-Edit and JoyImage-Edit-Plus.
JOYIMAGE: dict[str, Any] = {
    "patch_size": [1, 2, 2],
    "in_channels": 16,
    "hidden_size": 32,
    "num_attention_heads": 2,
    "text_dim": 16,
    "num_layers": 2,
    "rope_dim_list": [4, 6, 6],
    "theta": 256,
}

# LTX-2's tiny config (diffusers' test sizes): the ltx2 builder's, and the SANA-WM refiner's (an LTX-2 layout)
LTX2: dict[str, Any] = {
    "in_channels": 4,
    "out_channels": 4,
    "patch_size": 1,
    "patch_size_t": 1,
    "num_attention_heads": 2,
    "attention_head_dim": 8,
    "cross_attention_dim": 16,
    "audio_in_channels": 4,
    "audio_out_channels": 4,
    "audio_num_attention_heads": 2,
    "audio_attention_head_dim": 4,
    "audio_cross_attention_dim": 8,
    "num_layers": 2,
    "qk_norm": "rms_norm_across_heads",
    "caption_channels": 16,
    "rope_double_precision": False,
}

Size = tuple[int, int]

# The diffusers release that first exported each builder's class that diffusers 0.35 (the oldest torchfix claims)
# lacks, read off each release's exports; on an older diffusers those builders are skipped with this reason.
ADDED_IN = {
    "BriaTransformer2DModel": "0.36.0",
    "ChronoEditTransformer3DModel": "0.36.0",
    "Flux2Transformer2DModel": "0.36.0",
    "HunyuanVideo15Transformer3DModel": "0.36.0",
    "Kandinsky5Transformer3DModel": "0.36.0",
    "OvisImageTransformer2DModel": "0.36.0",
    "SanaVideoTransformer3DModel": "0.36.0",
    "ZImageTransformer2DModel": "0.36.0",
    "LTX2VideoTransformer3DModel": "0.37.0",
    "LongCatImageTransformer2DModel": "0.37.0",
    "NucleusMoEImageTransformer2DModel": "0.38.0",
    "JoyImageEditTransformer3DModel": "0.39.0",
    "MotifVideoTransformer3DModel": "0.39.0",
    "BriaFibo2Transformer2DModel": "0.42.0",
    # the day-0 builders' classes (no registry entry), read off each release's exports the same way
    "HunyuanImageTransformer2DModel": "0.36.0",
    "BriaFiboTransformer2DModel": "0.36.0",
    "PRXTransformer2DModel": "0.36.0",
    "WanAnimateTransformer3DModel": "0.36.0",
    "GlmImageTransformer2DModel": "0.37.0",
    "HeliosTransformer3DModel": "0.37.0",
    "ErnieImageTransformer2DModel": "0.38.0",
    "AceStepTransformer1DModel": "0.38.0",
    "LongCatAudioDiTTransformer": "0.38.0",
    "Krea2Transformer2DModel": "0.39.0",
    "Ideogram4Transformer2DModel": "0.39.0",
    "DreamLiteTransformer2DModel": "0.39.0",
    "WanAnimate2Transformer3DModel": "0.40.0",
    "JoyImageEditPlusTransformer3DModel": "0.40.0",
    "MiniMaxH3Transformer3DModel": "0.40.0",
    "MiniMaxMusic3Transformer1DModel": "0.40.0",
    "QwenImage21Transformer2DModel": "0.41.0",
    "Flux3Transformer2DModel": "0.42.0",
    "Kandinsky6Transformer3DModel": "0.42.0",
    "Kandinsky6SRTransformer3DModel": "0.42.0",
    "SanaWMLTX2RefinerTransformer3DModel": "0.42.0",
    "SanaWMTransformer3DModel": "0.42.0",
    "AnyFlowTransformer3DModel": "0.42.0",
}


@dataclass(frozen=True)
class Call:
    """What one builder's ``inputs`` receives: the batch, the latent size (and frames), a generator for the
    latents and one for the prompt (so two prompts differ, and the same prompt is the same tensor values)."""

    batch: int
    size: Size
    frames: int
    latents: torch.Generator
    prompt: torch.Generator
    config: dict[str, Any] = field(default_factory=dict)

    def randn(self, *shape: int, prompt: bool = False) -> torch.Tensor:
        return torch.randn(*shape, generator=self.prompt if prompt else self.latents)


@dataclass(frozen=True)
class Tiny:
    """A tiny denoiser of one family: how to build it and what one step of it is called with.

    Args:
        family: the registry entry (:func:`torchfix.families.get`) it belongs to.
        model: the diffusers class name.
        config: its constructor's arguments (random weights).
        inputs: ``(Call) -> arguments`` of one step (the latents, the prompt, everything but the timestep).
        latent: the argument the loop updates (also the family's ``latent``).
        timestep: the argument that carries the timestep; ``scale``: 1000 (DDPM-like) or 1 (flow matching).
        timestep_as: ``(timestep, latents) -> timestep`` where the model takes the step's timestep otherwise than
            one value per sample with 1 = noise, as its pipeline passes it: in another layout (AnyFlow's
            ``(batch, frames)``, SANA-WM's ``(batch, 1, frames)``) or the other way round (Z-Image, Lumina 2: 1 = clean).
        sizes: two latent sizes it runs at (the second odd where the family allows), ``frames``: two frame counts.
        prompts: the arguments holding the prompt (a guidance stream: a second prompt replaces them).
        build_with: a function that builds it instead (the UNets come from :mod:`torchfix.testing`).
    """

    family: str
    model: str
    config: dict[str, Any]
    inputs: Callable[[Call], dict[str, Any]]
    latent: str = "hidden_states"
    timestep: str = "timestep"
    scale: float = 1000.0
    sizes: tuple[Size, Size] = ((8, 8), (12, 16))
    frames: tuple[int, int] = (1, 1)
    prompts: tuple[str, ...] = ("encoder_hidden_states",)
    build_with: Callable[[], torch.nn.Module] | None = field(default=None, compare=False)
    name: str | None = None  # where a family has several builders (the UNet: sd15, sdxl)
    per_sample: tuple[str, ...] = ()  # arguments that are lists with one item per sample (Z-Image's, Qwen's img_shapes)
    shared: tuple[str, ...] = ()  # tensors with no batch dimension (position ids)
    batch_dim: tuple[tuple[str, int], ...] = ()  # tensors whose batch dimension is not the first (HiDream's llama states)
    per_frame: tuple[str, ...] = ()  # tensors whose first dimension folds the batch and the frames (AnimateDiff's prompt)
    timestep_as: Callable[[torch.Tensor, Any], torch.Tensor] | None = field(default=None, compare=False)

    @property
    def key(self) -> str:
        return self.name or self.family

    def unavailable(self) -> str | None:
        """Why the installed diffusers cannot build it (its class came in a later release, :data:`ADDED_IN`), or
        ``None``. A class missing from a release that should have it is not a reason: :meth:`build` fails there."""
        if self.build_with is not None:
            return None
        diffusers = importlib.import_module("diffusers")
        added = ADDED_IN.get(self.model)
        if hasattr(diffusers, self.model) or added is None or not _diffusers_below(added):
            return None
        return f"diffusers {diffusers.__version__} has no {self.model} (the {self.family!r} family; added in diffusers {added})"

    def build(self, seed: int = 0) -> torch.nn.Module:
        """The model with random weights (seeded; the caller's RNG is left as it was)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            if self.build_with is not None:
                model = self.build_with()
            else:
                model = getattr(importlib.import_module("diffusers"), self.model)(**self.config)
            return _wake(model).eval()

    def arguments(
        self, batch: int = 1, size: Size | None = None, frames: int | None = None, seed: int = 0, prompt: int = 0
    ) -> dict[str, Any]:
        """The arguments of the first step: latents from ``seed``, prompt tensors from ``prompt``."""
        call = Call(
            batch,
            size or self.sizes[0],
            frames or self.frames[0],
            torch.Generator().manual_seed(seed),
            torch.Generator().manual_seed(10_000 + prompt),
            self.config,
        )
        return self.inputs(call)

    def sample(self, arguments: dict[str, Any], index: int) -> dict[str, Any]:
        """Sample ``index`` of a batch's arguments, as a batch of one (what two batch-1 calls would pass)."""
        dims = dict(self.batch_dim)
        batch = _batch(arguments[self.latent])
        return {
            k: [v[index]]
            if k in self.per_sample
            else v
            if k in self.shared
            else _take_rows(v, index, v.shape[0] // batch)
            if k in self.per_frame
            else _take(v, index, dims.get(k, 0))
            for k, v in arguments.items()
        }


@torch.no_grad()
def _wake(model: torch.nn.Module) -> torch.nn.Module:
    """Give the parameters a family initialises to zero (adaLN-zero gates, zero output projections) small random
    values: with them at zero a block adds nothing, and a cache that skips it could not be wrong."""
    for param in model.parameters():
        if param.numel() and not bool(param.any()):
            param.normal_(0.0, 0.05)
    return model


def _batch(latents: Any) -> int:
    return len(latents) if isinstance(latents, list) else latents.shape[0]


def _take_rows(value: torch.Tensor, index: int, rows: int) -> torch.Tensor:
    """Sample ``index``'s ``rows`` rows of a tensor whose first dimension folds the batch and the frames."""
    return value.narrow(0, index * rows, rows)


def _take(value: Any, index: int, dim: int = 0) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() > dim:
        return value.narrow(dim, index, 1)
    if isinstance(value, dict):
        return {k: _take(v, index) for k, v in value.items()}
    return value


def _ids(h: int, w: int, width: int = 3, frame: bool = False) -> torch.Tensor:
    """Flux-style position ids of an ``h × w`` token grid: ``[0, row, col]`` (``width`` 4: one more zero)."""
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3)
    return torch.cat([ids, torch.zeros(ids.shape[0], width - 3, dtype=ids.dtype)], dim=-1) if width > 3 else ids.float()


def _image(c: Call, channels: int = 4) -> torch.Tensor:
    return c.randn(c.batch, channels, *c.size)


def _video(c: Call, channels: int = 4) -> torch.Tensor:
    return c.randn(c.batch, channels, c.frames, *c.size)


def _text(c: Call, tokens: int, width: int) -> torch.Tensor:
    return c.randn(c.batch, tokens, width, prompt=True)


def _diffusers_below(version: str) -> bool:
    """Whether the installed diffusers is older than ``version``."""
    from packaging.version import Version

    return Version(importlib.import_module("diffusers").__version__) < Version(version)
