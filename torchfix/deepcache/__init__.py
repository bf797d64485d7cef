"""Resolution-tolerant DeepCache for diffusers UNets and diffusion transformers (SD3, Flux) that is never stale.

>>> import torchfix
>>> cfg = torchfix.DeepCacheConfig(interval=3, branch=0)
>>> # torchfix.deepcache.apply(pipe, cfg); pipe(...); torchfix.deepcache.remove(pipe)
"""

from .config import DeepCacheConfig, full_steps, is_full_step
from .layout import Layout, UnsupportedUNetError, analyse
from .runtime import DeepCacheState, apply, check, new_call, remove, state_of, stats
from .transformer import TransformerCacheState, TransformerLayout, analyse_transformer

__all__ = [
    "DeepCacheConfig",
    "DeepCacheState",
    "Layout",
    "TransformerCacheState",
    "TransformerLayout",
    "UnsupportedUNetError",
    "analyse",
    "analyse_transformer",
    "apply",
    "check",
    "full_steps",
    "is_full_step",
    "new_call",
    "remove",
    "state_of",
    "stats",
]
