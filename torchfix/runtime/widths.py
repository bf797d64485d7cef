"""Embeddings of another model's width meeting in one ``torch.cat``: torch says "Expected size 1280 but got size
768" and names nothing; torchfix names the tensors, their widths, the models such widths come from, and the fix.

Asked only after torch raised on a cat whose tensors agree in dtype and device (never on the fast path).

>>> import torch
>>> a, b = torch.zeros(1, 77, 768), torch.zeros(1, 77, 1280)
>>> torchs = RuntimeError("Sizes of tensors must match except in dimension 0. Expected size 768 but got size 1280")
>>> explain_cat(torchs, [a, b], 0, "my_script.py:3") is not None
True
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import ModelMismatchError
from ..families.entries import LIKELY

__all__ = ["explain_cat"]


def _models(width: int) -> str:
    known = [f"{LIKELY[(kind, width)]} ({kind} embeddings)" for kind in ("text", "pooled") if (kind, width) in LIKELY]
    return " or ".join(known)


def explain_cat(exc: BaseException, tensors: Sequence[object], dim: int, site: str) -> ModelMismatchError | None:
    """A :class:`torchfix.ModelMismatchError` for a ``cat`` that torch rejected because embeddings of different
    widths met (the last dimension, not the one joined, differs, and each width is one a known model's text
    or pooled embeddings have), or ``None`` where that is not what happened (torch's own error stands)."""
    if not isinstance(exc, RuntimeError) or "Expected size" not in str(exc):
        return None
    shapes = [tuple(t.shape) for t in tensors if isinstance(t, torch.Tensor) and t.dim() >= 2]
    if len(shapes) < 2 or len({len(s) for s in shapes}) != 1:
        return None
    rank = len(shapes[0])
    if dim % rank == rank - 1:
        return None  # joined along the width: not two widths meeting
    widths = sorted({s[-1] for s in shapes})
    if len(widths) < 2 or not all(_models(w) for w in widths):
        return None
    listed = ", ".join(f"tensor {i} {s} (width {s[-1]})" for i, s in enumerate(shapes))
    whence = "; ".join(f"{w}: {_models(w)}" for w in widths)
    return ModelMismatchError(
        f"torchfix: torch.cat at {site} joins embeddings of different widths: {listed}. Embeddings of these widths come "
        f"from different models ({whence}): a textual-inversion embedding or prompt_embeds made with another model's text "
        "encoder. To fix: encode the prompt again with this pipeline's text encoders (pipe.encode_prompt), or load the "
        "embedding made for this pipeline's base model."
    )
