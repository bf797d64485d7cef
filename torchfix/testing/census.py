"""Every denoiser class of the installed diffusers, and what torchfix's cache does with it: cached through a
registry entry, cached through an entry read off its code, or refused with the reason.

The list in docs/families.md ("Every denoiser class") is :func:`table` of this module; tests/testing/test_census.py
keeps it true, and the conformance suite (tests/deepcache/test_families.py) holds every cached class's tiny builder
to the cache's guarantees.

>>> from torchfix.testing.census import denoiser_classes
>>> "FluxTransformer2DModel" in denoiser_classes()  # doctest: +SKIP
True
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["CONFIG_ONLY", "Status", "denoiser_classes", "status", "statuses", "table"]

# Denoiser classes no tiny builder steps (torchfix.testing.FAMILIES has none): a tiny config is enough for what the
# cache decides at apply (the UNets it refuses; diffusers' nested transformer building blocks).
CONFIG_ONLY: dict[str, dict[str, Any]] = {
    "UNet1DModel": {
        "block_out_channels": (8, 16),
        "in_channels": 2,
        "out_channels": 2,
        "extra_in_channels": 16,
        "down_block_types": ("DownBlock1DNoSkip", "DownBlock1D"),
        "up_block_types": ("UpBlock1D", "UpBlock1DNoSkip"),
        "mid_block_type": "UNetMidBlock1D",
    },
    "UNet2DModel": {
        "block_out_channels": (8, 16),
        "layers_per_block": 1,
        "norm_num_groups": 4,
        "attention_head_dim": 4,
        "down_block_types": ("DownBlock2D", "AttnDownBlock2D"),
        "up_block_types": ("AttnUpBlock2D", "UpBlock2D"),
        "sample_size": 16,
    },
    # diffusers' building blocks that its older pipelines nest inside a UNet (no pipeline runs one as the denoiser)
    "Transformer2DModel": {"num_attention_heads": 2, "attention_head_dim": 4, "in_channels": 4, "num_layers": 2, "norm_num_groups": 2},
    "TransformerTemporalModel": {
        "num_attention_heads": 2,
        "attention_head_dim": 4,
        "in_channels": 4,
        "num_layers": 2,
        "norm_num_groups": 2,
    },
    "UNet3DConditionModel": {
        "block_out_channels": (8, 16),
        "layers_per_block": 1,
        "norm_num_groups": 4,
        "cross_attention_dim": 8,
        "attention_head_dim": 4,
        "down_block_types": ("CrossAttnDownBlock3D", "DownBlock3D"),
        "up_block_types": ("UpBlock3D", "CrossAttnUpBlock3D"),
        "sample_size": 8,
    },
}


def denoiser_classes() -> list[str]:
    """The installed diffusers' exported denoiser classes: its ``nn.Module`` classes named ``*Transformer*`` or
    ``UNet*`` (ControlNets and adapters are side models, not denoisers), sorted."""
    diffusers = importlib.import_module("diffusers")
    found = []
    for name in dir(diffusers):
        if not ("Transformer" in name or name.startswith("UNet")) or "ControlNet" in name:
            continue
        try:
            cls = getattr(diffusers, name)
        except Exception:  # an optional dependency missing: not a class this install can build
            continue
        if isinstance(cls, type) and issubclass(cls, torch.nn.Module):
            found.append(name)
    return sorted(found)


@dataclass(frozen=True)
class Status:
    """What the cache does with one class: ``how`` is ``"registered"``, ``"read off its code"``, ``"refused at
    apply"``, ``"refused at its first call"``, ``"accepted at apply, not run here"`` (no tiny builder steps it) or
    ``"not built here"``; ``detail``: the family, or the reason."""

    model: str
    how: str
    detail: str
    builder: str | None = None  # the tiny builder's key in torchfix.testing.FAMILIES

    @property
    def cached(self) -> bool:
        return self.how in ("registered", "read off its code")


def _reason(exc: Exception) -> str:
    """The part of a refusal that says why (its first sentence after the model's name), for the table."""
    text = str(exc).split(" Registered families:")[0].split(" Supported:")[0]
    return text.replace("torchfix.deepcache: ", "").replace("torchfix.families: ", "").strip()


def status(model_name: str) -> Status:
    """Build the class tiny, apply the cache at interval 3 and run one step where a builder says how (a class no
    builder covers: its default config on the meta device, for what ``apply`` decides)."""
    import torchfix
    from torchfix import families

    from .families import FAMILIES, denoise

    tiny = next((t for t in FAMILIES.values() if t.model == model_name and t.unavailable() is None), None)
    if tiny is not None:
        model = tiny.build()
    elif model_name in CONFIG_ONLY:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = getattr(importlib.import_module("diffusers"), model_name)(**CONFIG_ONLY[model_name]).eval()
    else:  # no builder: its default config on the meta device, enough for what apply decides (nothing runs)
        try:
            with torch.device("meta"):
                model = getattr(importlib.import_module("diffusers"), model_name)()
        except Exception as exc:
            return Status(model_name, "not built here", f"no tiny builder, and its default config does not build ({type(exc).__name__})")
    key = tiny.key if tiny is not None else None
    config = torchfix.DeepCacheConfig(interval=3, num_steps=8)
    try:
        torchfix.deepcache.apply(model, config)
    except torchfix.UnsupportedModelError as exc:
        return Status(model_name, "refused at apply", _reason(exc), key)
    try:
        family = torchfix.deepcache.state_of(model).family
        if tiny is None:
            return Status(model_name, "accepted at apply, not run here", family.name, key)
        try:
            denoise(model, tiny, steps=1)
        except torchfix.UnsupportedModelError as exc:
            return Status(model_name, "refused at its first call", _reason(exc), key)
        how = "read off its code" if families.is_inferred(family) else "registered"
        return Status(model_name, how, family.name if how == "registered" else family.describe(), key)
    finally:
        torchfix.deepcache.remove(model)


def statuses() -> list[Status]:
    """:func:`status` of every :func:`denoiser_classes` class (TORCHFIX_MODE is left as the caller set it)."""
    torch.set_num_threads(min(torch.get_num_threads(), int(os.environ.get("OMP_NUM_THREADS", "64"))))
    with torch.no_grad():
        return [status(name) for name in denoiser_classes()]


def table(found: list[Status] | None = None) -> str:
    """The markdown table of docs/families.md's "Every denoiser class" section."""
    found = statuses() if found is None else found
    lines = ["| denoiser class | the cache | family or reason |", "|---|---|---|"]
    for s in found:
        detail = f"`{s.detail}`" if s.how == "registered" else s.detail.replace("|", "\\|")
        lines.append(f"| `{s.model}` | {s.how} | {detail} |")
    cached = sum(s.cached for s in found)
    by = {how: sum(s.how == how for s in found) for how in dict.fromkeys(s.how for s in found)}
    summary = ", ".join(f"{n} {how}" for how, n in by.items())
    return "\n".join(lines) + f"\n\n{len(found)} classes: {cached} cached ({summary})."


DOCS_SECTION = "census"


def write_docs(path: str | os.PathLike[str] | None = None) -> str:
    """Rewrite docs/families.md's ``census`` section (between ``<!-- census:start -->`` and ``<!-- census:end -->``)
    from :func:`table`; returns the table."""
    from pathlib import Path

    import diffusers

    docs = Path(path) if path is not None else Path(__file__).resolve().parents[2] / "docs" / "families.md"
    text = docs.read_text()
    start, end = f"<!-- {DOCS_SECTION}:start -->", f"<!-- {DOCS_SECTION}:end -->"
    body = table()
    block = f"{start}\nFrom `python -m torchfix.testing.census` on diffusers {diffusers.__version__}:\n\n{body}\n{end}"
    docs.write_text(text[: text.index(start)] + block + text[text.index(end) + len(end) :])
    return body


if __name__ == "__main__":
    os.environ.setdefault("TORCHFIX_MODE", "off")
    torch.set_num_threads(1)
    print(write_docs())  # noqa: T201  (a command's output)
