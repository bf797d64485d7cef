"""ComfyUI for tests and benchmarks, offline: its source loaded from a tarball or a folder, and tiny models of its
own classes built the way ComfyUI builds them (``comfy.supported_models.<Family>(unet_config).get_model``, wrapped
in a ``ModelPatcher``), with seeded random weights; and ComfyUI's own server for workflows posted to its API
(:class:`Server`, on 127.0.0.1 only) with a tiny SD1.5 checkpoint it loads (:func:`write_checkpoint`). Nothing is
downloaded.

ComfyUI is not on the package index in a usable form; its source (``ComfyUI-<version>.tar.gz``) is looked for in
``$TORCHFIX_COMFYUI`` (a tarball or an extracted ``ComfyUI/`` folder), then in ``../shared/vendor/`` beside this
repository. :func:`load` returns ``None`` and a reason where there is none (a user's machine without it).

>>> from torchfix.testing import comfyui
>>> comfy = comfyui.load()  # doctest: +SKIP
>>> patcher = comfyui.tiny("flux")  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import TorchfixError

__all__ = [
    "MODELS",
    "REFUSED",
    "BlockCounter",
    "Server",
    "TinyComfy",
    "blocks_of",
    "find_source",
    "load",
    "sample",
    "server_missing",
    "tiny",
    "write_checkpoint",
]

REPO = Path(__file__).resolve().parents[2]


def find_source() -> Path | None:
    """A ComfyUI tarball or folder: ``$TORCHFIX_COMFYUI``, else the newest ``ComfyUI-*.tar.gz`` in ../shared/vendor."""
    given = os.environ.get("TORCHFIX_COMFYUI")
    if given:
        return Path(given) if Path(given).exists() else None
    vendor = REPO.parent / "shared" / "vendor"
    found = sorted(vendor.glob("ComfyUI-*.tar.gz")) if vendor.is_dir() else []
    return found[-1] if found else None


def _cache() -> Path:
    return Path(os.environ.get("TORCHFIX_CACHE", Path.home() / ".cache" / "torchfix")) / "comfyui"


def _extracted(source: Path) -> Path:
    """The ``ComfyUI/`` folder: ``source`` itself, or the tarball extracted once into the cache."""
    if source.is_dir():
        return source if (source / "comfy").is_dir() else source / "ComfyUI"
    target = _cache() / source.name.removesuffix(".tar.gz")
    done = target / ".extracted"
    if not done.exists():
        target.mkdir(parents=True, exist_ok=True)
        with tarfile.open(source) as tar:
            tar.extractall(target, filter="data")
        done.touch()
    return target / "ComfyUI"


def _stand_in(root: Path) -> Path | None:
    """An import-only ``torchvision`` for ComfyUI's model files that import it at module level (Cosmos, Cascade,
    ACE): the package index has no torchvision for a CPU torch 2.13 (docs/comfyui.md). Only where none is installed."""
    if importlib.util.find_spec("torchvision") is not None:
        return None
    stub = root / "torchvision"
    stub.mkdir(parents=True, exist_ok=True)
    (stub / "__init__.py").write_text(
        '"""Import-only stand-in for torchvision (torchfix tests of ComfyUI)."""\nfrom . import transforms  # noqa: F401\n'
    )
    (stub / "transforms.py").write_text('"""Import-only stand-in."""\n')
    return root


def _settle_torchvision_checks() -> None:
    """transformers and diffusers each decide once whether torchvision is installed (and remember it): let them
    decide before the stand-in exists, so that they never take it for torchvision."""
    import importlib

    for package in ("transformers", "diffusers"):
        if importlib.util.find_spec(package) is not None:
            importlib.import_module(f"{package}.utils").is_torchvision_available()


@functools.cache
def load() -> tuple[Any, str]:
    """``(nodes module, "")`` with ComfyUI importable on the CPU, or ``(None, why not)``."""
    source = find_source()
    if source is None:
        return None, "no ComfyUI source: set TORCHFIX_COMFYUI or put ComfyUI-<version>.tar.gz in ../shared/vendor"
    folder = _extracted(source)
    stub = _stand_in(_cache() / "stand-in")
    if stub is not None:
        _settle_torchvision_checks()
    sys.path.insert(0, str(folder))
    if stub is not None:
        sys.path.insert(0, str(stub))
    import comfy.cli_args

    comfy.cli_args.args.cpu = True  # before comfy.model_management is imported
    try:
        import comfy.model_base  # every model file, the ones that import torchvision too
        import nodes
    except ImportError as exc:
        return None, f"ComfyUI {folder} does not import here: {exc} (docs/comfyui.md lists the packages it needs)"
    finally:
        if stub is not None:  # the stand-in served ComfyUI's imports only: diffusers must not think torchvision is here
            sys.path.remove(str(stub))
            for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
                del sys.modules[name]
    return nodes, ""


@dataclass
class TinyComfy:
    """A tiny ComfyUI model and how to sample it: latent channels, frames, the conditioning width."""

    name: str
    patcher: Any
    channels: int
    frames: int = 0  # video latents: (B, C, frames, H, W)
    context: int = 32
    pooled: int = 0  # Flux-like, SDXL-like: a pooled text vector
    adm: int = 0  # the width of the vector ``y`` the denoiser takes (SDXL: pooled + size embeddings; Flux: pooled)
    sizes: tuple[tuple[int, int], ...] = ((13, 21), (15, 21))  # latent sizes tests sample at (odd ones round down and up)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def diffusion_model(self) -> torch.nn.Module:
        return self.patcher.model.diffusion_model

    def latent(self, height: int, width: int, batch: int = 1) -> torch.Tensor:
        shape = (batch, self.channels, self.frames, height, width) if self.frames else (batch, self.channels, height, width)
        return torch.zeros(shape)

    def call(
        self, x: torch.Tensor, sigma: float, *, seed: int = 0, passes: list[int] | None = None, control: Any = None, **options: Any
    ) -> torch.Tensor:
        """One denoiser call the way ComfyUI's sampler makes it (``BaseModel.apply_model``), for a batch of ``x``:
        random conditioning drawn from ``seed``, ``passes`` as ``transformer_options["cond_or_uncond"]``."""
        g = torch.Generator().manual_seed(seed)
        batch = x.shape[0]
        extra: dict[str, Any] = {}
        if self.adm and self.name not in ("chroma", "chroma-radiance"):  # Chroma takes no pooled vector
            extra["y"] = torch.randn(batch, self.adm, generator=g)
        if self.name in ("flux", "chroma", "chroma-radiance", "hunyuanvideo"):
            extra["guidance"] = torch.full((batch,), 3.5)
        if self.name in ("ltx", "mochi"):
            extra["attention_mask"] = torch.ones(batch, 7, dtype=torch.long)
        if self.name == "mochi":
            extra["num_tokens"] = 7
        if self.name in ("lumina2", "omnigen2"):
            extra["num_tokens"] = 7  # what ComfyUI's Lumina2.extra_conds derives from the text's attention mask
        context = torch.randn(batch, 7, self.context, generator=g)
        if self.name == "wan-vace":  # what ComfyUI's WAN21_Vace.extra_conds builds: control frames and mask
            extra["vace_context"] = torch.randn(batch, 1, 96, *x.shape[2:], generator=g)
            extra["vace_strength"] = [1.0]
        if self.name == "wan-camera":  # a camera embedding at 8× the latent size (ComfyUI's WanCameraEmbedding)
            frames, height, width = x.shape[2:]
            extra["camera_conditions"] = torch.randn(batch, 24, frames, 8 * height, 8 * width, generator=g) * 0.1
        if self.name == "hidream":
            extra["encoder_hidden_states_llama3"] = torch.randn(batch, HIDREAM_LLAMA, 7, self.context, generator=g)
        opts = {"cond_or_uncond": list(passes if passes is not None else [0] * batch), **options}
        with torch.inference_mode():  # as ComfyUI's executor runs every node
            return self.patcher.model.apply_model(
                x, torch.full((batch,), sigma), c_crossattn=context, control=control, transformer_options=opts, **extra
            )

    def conditioning(self, seed: int, tokens: int = 7) -> list:
        g = torch.Generator().manual_seed(seed)
        extra = {"pooled_output": torch.randn(1, self.pooled, generator=g)} if self.pooled else {}
        if self.name == "hidream":  # its Llama conditioning: hidden states of HIDREAM_LLAMA layers
            extra["conditioning_llama3"] = torch.randn(1, HIDREAM_LLAMA, tokens, self.context, generator=g)
        return [[torch.randn(1, tokens, self.context, generator=g), {**extra, **self.extra}]]


def _unet(**changes: Any) -> dict[str, Any]:
    config = {
        "image_size": 32,
        "in_channels": 4,
        "out_channels": 4,
        "model_channels": 32,
        "num_res_blocks": 1,
        "channel_mult": [1, 2],
        "transformer_depth": [1, 1],
        "transformer_depth_output": [1, 1, 1, 1],
        "transformer_depth_middle": 1,
        "use_spatial_transformer": True,
        "context_dim": 32,
        "num_heads": 2,
        "num_head_channels": -1,
        "legacy": False,
        "use_linear_in_transformer": False,
        "adm_in_channels": None,
        "use_temporal_attention": False,
        "use_temporal_resblock": False,
        "use_checkpoint": False,
    }
    return config | changes


# What ComfyUI's model detection sets for every Cosmos Predict2 checkpoint (comfy/model_detection.py)
COSMOS2 = {
    "max_img_h": 240, "max_img_w": 240, "max_frames": 128, "patch_spatial": 2, "patch_temporal": 1, "concat_padding_mask": True,
    "pos_emb_cls": "rope3d", "pos_emb_learnable": True, "pos_emb_interpolation": "crop", "min_fps": 1, "max_fps": 30,
    "use_adaln_lora": True,
    "extra_per_block_abs_pos_emb": False, "rope_h_extrapolation_ratio": 4.0, "rope_w_extrapolation_ratio": 4.0,
    "rope_t_extrapolation_ratio": 1.0, "extra_h_extrapolation_ratio": 1.0, "extra_w_extrapolation_ratio": 1.0,
    "extra_t_extrapolation_ratio": 1.0, "rope_enable_fps_modulation": False,
}  # fmt: skip

# name -> (supported_models class, unet_config, channels, frames, pooled width, extra conditioning)
MODELS: dict[str, tuple[str, dict[str, Any], int, int, int]] = {
    "sd15": ("SD15", _unet(), 4, 0, 0),
    "sdxl": ("SDXL", _unet(channel_mult=[1, 2, 2], transformer_depth=[0, 1, 1], transformer_depth_output=[0, 0, 1, 1, 1, 1],
                           use_linear_in_transformer=True, adm_in_channels=32 + 6 * 256, num_classes="sequential"), 4, 0, 32),
    "flux": ("Flux", {"image_model": "flux", "in_channels": 16, "out_channels": 16, "vec_in_dim": 32, "context_in_dim": 32,
                      "hidden_size": 64, "mlp_ratio": 2.0, "num_heads": 2, "depth": 2, "depth_single_blocks": 3,
                      "axes_dim": [8, 12, 12], "theta": 10000, "patch_size": 2, "qkv_bias": True, "guidance_embed": True}, 16, 0, 32),
    "wan": ("WAN21_T2V", {"image_model": "wan2.1", "model_type": "t2v", "patch_size": (1, 2, 2), "text_len": 16, "in_dim": 16,
                          "dim": 64, "ffn_dim": 128, "freq_dim": 32, "text_dim": 32, "out_dim": 16, "num_heads": 2,
                          "num_layers": 4}, 16, 3, 0),
    "chroma": ("Chroma", {"image_model": "chroma", "in_channels": 64, "out_channels": 64, "context_in_dim": 32, "hidden_size": 64,
                          "mlp_ratio": 2.0, "num_heads": 2, "depth": 2, "depth_single_blocks": 3, "axes_dim": [8, 12, 12],
                          "theta": 10000, "patch_size": 2, "qkv_bias": True, "in_dim": 64, "out_dim": 64, "hidden_dim": 64,
                          "n_layers": 2}, 16, 0, 32),
    "chroma-radiance": ("ChromaRadiance", {"image_model": "chroma_radiance", "in_channels": 3, "out_channels": 3, "context_in_dim": 32,
                                           "hidden_size": 64, "mlp_ratio": 2.0, "num_heads": 2, "depth": 2, "depth_single_blocks": 3,
                                           "axes_dim": [8, 12, 12], "theta": 10000, "patch_size": 16, "qkv_bias": True, "in_dim": 64,
                                           "out_dim": 64, "hidden_dim": 64, "n_layers": 2, "nerf_hidden_size": 16, "nerf_mlp_ratio": 2,
                                           "nerf_depth": 2, "nerf_max_freqs": 4, "nerf_tile_size": 32, "nerf_final_head_type": "conv",
                                           "nerf_embedder_dtype": torch.float32}, 3, 0, 32),
    "qwenimage": ("QwenImage", {"image_model": "qwen_image", "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 3,
                                "attention_head_dim": 32, "num_attention_heads": 2, "joint_attention_dim": 32,
                                "axes_dims_rope": (8, 12, 12)}, 16, 1, 0),
    "hunyuanvideo": ("HunyuanVideo", {"image_model": "hunyuan_video", "in_channels": 16, "out_channels": 16, "vec_in_dim": 32,
                                      "context_in_dim": 32, "hidden_size": 64, "mlp_ratio": 2.0, "num_heads": 2, "depth": 2,
                                      "depth_single_blocks": 2, "axes_dim": [8, 12, 12], "theta": 256, "patch_size": [1, 2, 2],
                                      "qkv_bias": True, "guidance_embed": True, "byt5": False, "meanflow": False}, 16, 3, 32),
    "ltx": ("LTXV", {"image_model": "ltxv", "in_channels": 128, "cross_attention_dim": 96, "attention_head_dim": 48,
                     "num_attention_heads": 2, "caption_channels": 32, "num_layers": 3}, 128, 2, 0),
    # Lumina 2 (NextDiT) and Cosmos Predict2 (MiniTrainDIT): no registry entry, read off their code (families.infer)
    "lumina2": ("Lumina2", {"image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 64, "cap_feat_dim": 32, "n_layers": 3,
                            "n_refiner_layers": 1, "n_heads": 2, "n_kv_heads": 2, "multiple_of": 16, "qk_norm": True,
                            "axes_dims": [8, 12, 12], "axes_lens": [300, 512, 512]}, 16, 0, 0),
    "cosmos2": ("CosmosT2IPredict2", {"image_model": "cosmos_predict2", "in_channels": 16, "out_channels": 16, "model_channels": 64,
                                      "num_blocks": 3, "num_heads": 2, "crossattn_emb_channels": 32, "adaln_lora_dim": 16,
                                      **COSMOS2}, 16, 1, 0),
    "auraflow": ("AuraFlow", {"in_channels": 4, "out_channels": 4, "patch_size": 2, "dim": 64, "n_layers": 4, "n_double_layers": 2,
                              "n_heads": 2, "global_conddim": 64, "cond_seq_dim": 32, "max_seq": 256}, 4, 0, 0),
    "omnigen2": ("Omnigen2", {"image_model": "omnigen2", "axes_dim_rope": [8, 12, 12], "axes_lens": [1024, 1664, 1664],
                              "ffn_dim_multiplier": None, "hidden_size": 64, "in_channels": 16, "multiple_of": 16, "norm_eps": 1e-05,
                              "num_attention_heads": 2, "num_kv_heads": 2, "num_layers": 3, "num_refiner_layers": 1,
                              "out_channels": None, "patch_size": 2, "text_feat_dim": 32, "timestep_scale": 1000.0}, 16, 0, 0),
    "pixart": ("PixArtSigma", {"image_model": "pixart_sigma", "micro_condition": False, "num_heads": 2, "patch_size": 2,
                               "hidden_size": 64, "in_channels": 4, "depth": 3, "caption_channels": 32, "model_max_length": 16,
                               "input_size": 32, "pe_interpolation": 0.5}, 4, 0, 0),
    # Mochi: ComfyUI asserts hidden_size_x × mlp_ratio_x == 1536 × 8 (the real model's MLP width), whatever the size
    "mochi": ("GenmoMochi", {"image_model": "mochi_preview", "depth": 3, "patch_size": 2, "num_heads": 2, "hidden_size_x": 64,
                             "hidden_size_y": 32, "mlp_ratio_x": 192.0, "mlp_ratio_y": 2.0, "learn_sigma": False, "in_channels": 12,
                             "qk_norm": True, "qkv_bias": False, "out_bias": True, "attn_drop": 0.0, "patch_embed_bias": True,
                             "posenc_preserve_area": True, "timestep_mlp_bias": True, "attend_to_padding": False,
                             "timestep_scale": 1000.0, "use_t5": True, "t5_feat_dim": 32, "t5_token_length": 16,
                             "rope_theta": 10000.0}, 12, 2, 0),
    "wan-camera": ("WAN22_Camera", {"image_model": "wan2.1", "model_type": "camera_2.2", "patch_size": (1, 2, 2), "text_len": 16,
                                    "in_dim": 16, "dim": 64, "ffn_dim": 128, "freq_dim": 32, "text_dim": 32, "out_dim": 16,
                                    "num_heads": 2, "num_layers": 4, "in_dim_control_adapter": 24}, 16, 3, 0),
    "hidream": ("HiDream", {"image_model": "hidream", "patch_size": 2, "in_channels": 16, "out_channels": 16, "attention_head_dim": 32,
                            "num_attention_heads": 2, "num_layers": 2, "num_single_layers": 2, "num_routed_experts": 2,
                            "num_activated_experts": 1, "axes_dims_rope": [16, 8, 8], "caption_channels": [32, 32], "text_emb_dim": 32,
                            "max_resolution": [128, 128], "llama_layers": [0, 1, 1, 1]}, 16, 0, 32),
}
# ComfyUI classes the cache refuses by name (tests/comfyui/test_cache.py checks the refusal through the node)
REFUSED: dict[str, tuple[str, dict[str, Any], int, int, int]] = {
    "wan-vace": ("WAN21_Vace", {"image_model": "wan2.1", "model_type": "vace", "patch_size": (1, 2, 2), "text_len": 16, "in_dim": 16,
                                "dim": 64, "ffn_dim": 128, "freq_dim": 32, "text_dim": 32, "out_dim": 16, "num_heads": 2,
                                "num_layers": 4, "vace_layers": 2, "vace_in_dim": 96}, 16, 3, 0),
}
HIDREAM_LLAMA = 2  # Llama layers in the tiny HiDream's conditioning (its llama_layers pick among them)


def tiny(name: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> TinyComfy:
    """A tiny ComfyUI model of kind ``name`` (:data:`MODELS`) in a ``ModelPatcher``, seeded random weights.

    ComfyUI's layers skip weight initialisation (``comfy.ops.disable_weight_init``): every weight is drawn here.
    """
    nodes, why = load()
    if nodes is None:
        raise TorchfixError(f"torchfix.testing.comfyui: {why}")
    import comfy.model_patcher
    import comfy.supported_models

    cls, config, channels, frames, pooled = MODELS[name] if name in MODELS else REFUSED[name]
    model_config = getattr(comfy.supported_models, cls)(dict(config))
    model_config.set_inference_dtype(dtype, None)
    model = model_config.get_model({})
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            elif pname.endswith("weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)
    cpu = torch.device("cpu")
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)
    adm = config.get("adm_in_channels") or config.get("vec_in_dim") or config.get("text_emb_dim") or 0
    # ComfyUI's HunyuanVideo, Cosmos Predict2, Mochi, Wan VACE and camera (their control inputs) need even sizes
    even = ("hunyuanvideo", "cosmos2", "wan-vace", "wan-camera", "mochi")
    sizes = ((12, 20), (14, 22)) if name in even else ((13, 21), (15, 21))
    if name == "pixart":  # its position embedding's base size is the latent's mean side rounded to 64: at least 32
        sizes = ((32, 40), (34, 42))
    if name == "chroma-radiance":  # pixels, 16×16 to a token: 3×5, then 4×5 tokens (56 padded to 64)
        sizes = ((48, 80), (56, 80))
    # LTX's text mask (integer); Lumina 2, OmniGen2 and Mochi take their token count from the mask (ComfyUI's extra_conds)
    extra = {"attention_mask": torch.ones(1, 7, dtype=torch.long)} if name in ("ltx", "lumina2", "omnigen2", "mochi") else {}
    return TinyComfy(name, patcher, channels, frames, pooled=pooled, adm=adm, sizes=sizes, extra=extra)


def sample(
    model: TinyComfy,
    patcher: Any = None,
    *,
    height: int | None = None,
    width: int | None = None,
    steps: int = 6,
    cfg: float = 4.0,
    seed: int = 1,
    prompts: tuple[int, int] = (1, 2),
    sampler: str = "euler",
    scheduler: str = "normal",
) -> torch.Tensor:
    """ComfyUI's own sampling (``comfy.sample.sample``, as KSampler runs it) of ``patcher`` (default: the model's)
    at a latent of ``height`` × ``width`` (× frames; default: the model's first size)."""
    import comfy.sample

    latent = model.latent(height or model.sizes[0][0], width or model.sizes[0][1])
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(seed))
    positive, negative = (model.conditioning(p) for p in prompts)
    with torch.inference_mode():  # as ComfyUI's executor runs every node
        return comfy.sample.sample(
            patcher or model.patcher, noise, steps, cfg, sampler, scheduler, positive, negative, latent, seed=seed, disable_pbar=True
        )


def blocks_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose calls count as the denoiser's work: a UNet's block layers (input, middle, output), a
    transformer's blocks in its family's lists."""
    from torchfix import families

    family = families.find(model)
    if family is None and not hasattr(model, "input_blocks"):
        family = families.resolve(model)  # a class read off its code
    if family is not None and family.kind == "transformer":
        return [block for spec in family.blocks for block in getattr(model, spec.attr)]
    groups = [*model.input_blocks, model.middle_block, *model.output_blocks]
    return [layer for group in groups if group is not None for layer in group]


def _first_weighted(module: torch.nn.Module) -> torch.nn.Module:
    """The first module inside ``module`` that holds weights of its own: it runs only where the block computes
    (a cached block's forward is still called, and hands its input on)."""
    return next((m for m in module.modules() if m is not module and any(True for _ in m.parameters(recurse=False))), module)


class BlockCounter:
    """Counts the blocks of ``model`` (:func:`blocks_of`) that computed while in use: calls of the first weighted
    module inside each (forward hooks, removed on exit)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.modules = [_first_weighted(block) for block in blocks_of(model)]
        self.calls = 0
        self._handles: list[Any] = []

    def __enter__(self) -> BlockCounter:
        def count(*_: Any) -> None:
            self.calls += 1

        self._handles = [m.register_forward_hook(count) for m in self.modules]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()


# An SD1.5 checkpoint as ComfyUI's CheckpointLoaderSimple detects it (comfy/model_detection.py reads the UNet's config
# from the keys and shapes; comfy.supported_models.SD15 then matches on model_channels 320, context_dim 768, a conv
# proj_in, no adm): the UNet is shallow (one block per level, two levels at 320 channels: 44M parameters), the text
# encoder is ComfyUI's CLIP-L at its fixed size (sd1_clip_config.json: 123M parameters; no SD1.5 checkpoint can hold a
# smaller one), and the VAE is ComfyUI's TAESD, which it detects from the checkpoint's keys as well (2.4M parameters
# instead of the 84M of the KL autoencoder: the VAE only turns the latents into pictures here).
SD15_CHECKPOINT_UNET = _unet(model_channels=320, context_dim=768, channel_mult=[1, 1], num_heads=8)


def write_checkpoint(path: str | os.PathLike[str], seed: int = 0) -> Path:
    """Write a tiny SD1.5 checkpoint (safetensors, fp16, seeded random weights; UNet, CLIP-L and TAESD) that ComfyUI's
    ``CheckpointLoaderSimple`` loads from ``models/checkpoints``, through ComfyUI's own ``state_dict_for_saving`` (as
    its CheckpointSave node writes one). About 340 MB, 2 s.

    >>> write_checkpoint(tmp / "models" / "checkpoints" / "tiny-sd15.safetensors")  # doctest: +SKIP
    """
    nodes, why = load()
    if nodes is None:
        raise TorchfixError(f"torchfix.testing.comfyui: {why}")
    import comfy.sd1_clip
    import comfy.supported_models
    import comfy.taesd.taesd
    import comfy.utils

    model_config = comfy.supported_models.SD15(dict(SD15_CHECKPOINT_UNET))
    model_config.set_inference_dtype(torch.float32, None)
    model = model_config.get_model({})
    clip = comfy.sd1_clip.SD1ClipModel(device="cpu", dtype=torch.float16)
    vae = comfy.taesd.taesd.TAESD(latent_channels=4)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # weights of std 1/sqrt(fan-in): features keep their scale through 320-channel layers
        for module in (model, clip, vae):
            for pname, p in module.named_parameters():
                if p.ndim >= 2:
                    p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
                elif pname.endswith("weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.01)
        vae.vae_scale.fill_(0.18215)  # SD1's latent scale, as ComfyUI's VAELoader sets it for SD1's TAESD
    state = model.state_dict_for_saving(clip.state_dict(), vae.state_dict())
    state = {k: v.half() if v.is_floating_point() else v for k, v in state.items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    comfy.utils.save_torch_file(state, str(path))
    return path


# What ComfyUI's server imports at start beside what load() needs (the `comfyui` extra of setup.cfg has them all).
SERVER_MODULES = ("aiohttp", "yarl", "PIL", "av", "pydantic", "safetensors")


def server_missing() -> str:
    """Why ComfyUI's server cannot start here ("" where it can): no source, or a package it imports missing."""
    nodes, why = load()
    if nodes is None:
        return why
    missing = [name for name in SERVER_MODULES if importlib.util.find_spec(name) is None]
    return f"ComfyUI's server needs {', '.join(missing)} (pip install -e '.[comfyui]')" if missing else ""


_LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1 directly, whatever *_proxy says


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """ComfyUI's own server (``main.py --cpu``) in a subprocess with this Python, on 127.0.0.1 only, every folder it
    writes to (models, custom_nodes, input, output, temp, user, its database in memory) under ``base``; this
    repository's node pack linked into ``base/custom_nodes``. No web frontend: ``--front-end-root`` points at an empty
    folder (the API needs none). A context manager: stopped on exit, whatever happened.

    >>> with Server(tmp) as server:  # doctest: +SKIP
    ...     entry = server.run(workflow)
    """

    def __init__(self, base: str | os.PathLike[str], startup_s: float = 180.0) -> None:
        self.base = Path(base)
        self.startup_s = startup_s
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.output = self.base / "output"
        self.log_path = self.base / "server.log"
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Server:
        nodes, why = load()
        if nodes is None:
            raise TorchfixError(f"torchfix.testing.comfyui: {why}")
        folder = Path(nodes.__file__).resolve().parent
        (self.base / "custom_nodes").mkdir(parents=True, exist_ok=True)
        (self.base / "web").mkdir(exist_ok=True)
        pack = self.base / "custom_nodes" / "comfyui-torchfix"
        if not pack.exists():
            try:
                pack.symlink_to(REPO / "comfyui-torchfix", target_is_directory=True)
            except OSError:  # no symlinks here (Windows without the privilege): a copy does the same
                shutil.copytree(REPO / "comfyui-torchfix", pack)
        stub = _stand_in(_cache() / "stand-in")
        # This repository's torchfix first (not another install of it), then the torchvision stand-in (load()).
        path = [str(REPO), *([str(stub)] if stub else []), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        env.pop("TORCHFIX_MODE", None)  # as a user's ComfyUI runs: nothing asks torchfix for anything
        self._log = open(self.log_path, "wb")  # closed in __exit__
        try:
            for attempt in range(3):  # the free port may be taken between our look and the server's bind
                command = [
                    sys.executable, str(folder / "main.py"), "--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
                    "--disable-auto-launch", "--base-directory", str(self.base), "--front-end-root", str(self.base / "web"),
                    "--database-url", "sqlite:///:memory:", "--disable-api-nodes", "--preview-method", "none",
                ]  # fmt: skip
                self.process = subprocess.Popen(command, cwd=self.base, env=env, stdout=self._log, stderr=subprocess.STDOUT)
                if self._wait_ready(last=attempt == 2):
                    return self
                self.port = _free_port()
                self.url = f"http://127.0.0.1:{self.port}"
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self  # not reached: the last attempt raises

    def __exit__(self, *exc: Any) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=20)
        self._log.close()

    @property
    def log(self) -> str:
        """What the server printed so far (stdout and stderr)."""
        return self.log_path.read_text(errors="replace")

    def _request(self, path: str, data: dict[str, Any] | None = None, timeout: float = 10.0) -> Any:
        body = None if data is None else json.dumps(data).encode()
        request = urllib.request.Request(self.url + path, data=body, headers={"Content-Type": "application/json"})
        with _LOOPBACK.open(request, timeout=timeout) as response:
            answer = response.read()
        return json.loads(answer) if answer else None

    def _wait_ready(self, last: bool) -> bool:
        """True once the server answers; False where it could not bind its port (and ``last`` is false)."""
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                if not last and "address already in use" in self.log[-4000:]:
                    return False
                raise TorchfixError(f"ComfyUI's server exited ({self.process.returncode}) before it served:\n{self.log[-4000:]}")
            try:
                self._request("/system_stats", timeout=2)
                return True
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.25)
        raise TorchfixError(f"ComfyUI's server did not answer within {self.startup_s:.0f} s:\n{self.log[-4000:]}")

    def run(self, workflow: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
        """Post an API-format ``workflow`` to ``/prompt``, wait for it in ``/history`` (at most ``timeout_s``), and
        return its history entry (``outputs``, ``status``); a workflow that failed raises with ComfyUI's messages."""
        try:
            answer = self._request("/prompt", {"prompt": workflow, "client_id": uuid.uuid4().hex})
        except urllib.error.HTTPError as exc:  # 400: ComfyUI's validation (a node type it lacks, a bad input)
            raise TorchfixError(f"ComfyUI refused the workflow: {exc.read().decode(errors='replace')[:4000]}") from exc
        prompt_id = answer["prompt_id"]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            entry = self._request(f"/history/{prompt_id}").get(prompt_id)
            if entry and entry.get("status", {}).get("completed") is not None:
                if entry["status"].get("status_str") != "success":
                    raise TorchfixError(f"ComfyUI ran the workflow with an error: {entry['status'].get('messages')}\n{self.log[-4000:]}")
                return entry
            if self.process.poll() is not None:
                raise TorchfixError(f"ComfyUI's server exited ({self.process.returncode}):\n{self.log[-4000:]}")
            time.sleep(0.2)
        raise TorchfixError(f"ComfyUI did not finish the workflow within {timeout_s:.0f} s:\n{self.log[-4000:]}")

    def free(self) -> None:
        """Drop what the server keeps between workflows (``/free``: its node outputs and loaded models), as the
        "free model and node cache" button does: the next workflow loads the checkpoint and runs every node afresh.
        The worker drops them when it next waits for work; a workflow of one empty latent is waited for first, so
        that whatever comes next runs after the drop."""
        self._request("/free", {"unload_models": True, "free_memory": True})
        self.run(
            {
                "1": {"class_type": "EmptyLatentImage", "inputs": {"width": 16, "height": 16, "batch_size": 1}},
                "2": {"class_type": "SaveLatent", "inputs": {"samples": ["1", 0], "filename_prefix": f"latents/free-{uuid.uuid4().hex}"}},
            }
        )

    def files(self, entry: dict[str, Any], node: str, kind: str = "images") -> list[Path]:
        """The files a node of a finished workflow wrote (SaveImage: ``images``; SaveLatent: ``latents``)."""
        return [self.output / f["subfolder"] / f["filename"] for f in entry["outputs"][node][kind]]
