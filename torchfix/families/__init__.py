"""The model families torchfix knows, as data: block signatures for the cache, conditioning widths for the
wrapper's preflight, and the defaults measured per family (:mod:`torchfix.families.spec`); for a denoiser the
registry does not know, an entry read off its code (:mod:`torchfix.families.from_code`).

>>> import torchfix.families as families
>>> families.get("wan").describe()
'blocks(hidden_states=image) -> image'
"""

from .from_code import infer, is_inferred, resolve
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
    refusal,
    refuse,
    register,
    supported,
    unregister,
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
    "infer",
    "is_inferred",
    "main_denoiser",
    "names",
    "refusal",
    "refuse",
    "register",
    "resolve",
    "supported",
    "unregister",
]
