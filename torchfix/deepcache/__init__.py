"""Resolution-tolerant DeepCache that is never stale, for every denoiser family torchfix knows: diffusers
UNets (SD1.x/2.x/SDXL, AnimateDiff, Stable Video Diffusion) and the diffusion transformers of
:mod:`torchfix.families` (SD3, Flux.1/2, Qwen-Image, Wan, HunyuanVideo, LTX, ...).

>>> import torchfix
>>> cfg = torchfix.DeepCacheConfig(interval=3, branch=0)
>>> # torchfix.deepcache.apply(pipe, cfg); pipe(...); torchfix.deepcache.remove(pipe)
"""

from ..errors import UnsupportedModelError, UnsupportedUNetError
from .api import (
    DeepCacheState,
    TransformerCacheState,
    apply,
    auto,
    auto_applied,
    check,
    denoisers,
    new_call,
    remove,
    state_of,
    states_of,
    stats,
)
from .blocks import BlockState, TransformerLayout, analyse_transformer
from .config import DeepCacheConfig
from .engine import CacheState
from .layout import Layout, analyse
from .schedule import full_steps, is_full_step
from .unet import UNetState

__all__ = [
    "BlockState",
    "CacheState",
    "DeepCacheConfig",
    "DeepCacheState",
    "Layout",
    "TransformerCacheState",
    "TransformerLayout",
    "UNetState",
    "UnsupportedModelError",
    "UnsupportedUNetError",
    "analyse",
    "analyse_transformer",
    "apply",
    "auto",
    "auto_applied",
    "check",
    "denoisers",
    "full_steps",
    "is_full_step",
    "new_call",
    "remove",
    "state_of",
    "states_of",
    "stats",
]
