"""torchfix's ComfyUI node pack: drop or link this folder into ``ComfyUI/custom_nodes/`` (docs/comfyui.md).

The nodes live in the ``torchfix`` package (``torchfix.comfyui``); install it into ComfyUI's Python
(``pip install -e /path/to/torchfix``). Where it is not installed, the repository this folder belongs to is used.
Loading the pack changes nothing process-wide: it looks torchfix up without importing it, and importing
``torchfix.comfyui`` does not switch torchfix's guards on (only ``import torchfix`` itself does).
"""

import importlib.util
import os
import sys


def _torchfix_here() -> None:
    spec = importlib.util.find_spec("torchfix")  # a top-level name: looked up, not imported
    if spec is not None:
        places = spec.submodule_search_locations or []
        if not any(os.path.isfile(os.path.join(place, "comfyui.py")) for place in places):  # without importing it
            raise ImportError(
                f"comfyui-torchfix: the 'torchfix' package in this Python ({spec.origin}) is not torchfix-diffusion (Meta's "
                "TorchFix linter uses the same name). Fix: pip uninstall torchfix, then pip install -e <this repository>."
            )
        return
    repository = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    if not os.path.isfile(os.path.join(repository, "torchfix", "comfyui.py")):
        raise ImportError("comfyui-torchfix: torchfix is not installed in ComfyUI's Python. Fix: pip install -e <the torchfix repository>.")
    sys.path.append(repository)


_torchfix_here()

from torchfix.comfyui import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: E402

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
