"""The model families torchfix knows, as data: block signatures for the cache, conditioning widths for the
wrapper's preflight, and the defaults measured per family (:mod:`torchfix.families.spec`).

>>> import torchfix.families as families
>>> families.get("wan").describe()
'blocks(hidden_states=image) -> image'
"""

from .spec import (
    DENOISERS,
    FULL_ONLY,
    Blocks,
    Family,
    Width,
    config_int,
    config_value,
    find,
    get,
    main_denoiser,
    names,
    register,
    supported,
)

__all__ = [
    "DENOISERS",
    "FULL_ONLY",
    "Blocks",
    "Family",
    "Width",
    "config_int",
    "config_value",
    "find",
    "get",
    "main_denoiser",
    "names",
    "register",
    "supported",
]
