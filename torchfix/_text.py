"""Plain-text tables for reports and error messages.

>>> align([("a", "bb"), ("ccc", "d")], rule=True)
['a    bb', '---  --', 'ccc  d']
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["align", "dtype_name"]


def dtype_name(dtype: object) -> str:
    """``torch.bfloat16`` → ``bfloat16``.

    >>> import torch
    >>> dtype_name(torch.bfloat16)
    'bfloat16'
    """
    return str(dtype).removeprefix("torch.")


def align(rows: Sequence[Sequence[str]], *, rule: bool = False) -> list[str]:
    """Rows as lines with every column padded to its widest cell (trailing spaces dropped);
    ``rule`` puts a line of dashes under the first row (the header)."""
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    if rule:
        lines.insert(1, "  ".join("-" * w for w in widths))
    return lines
