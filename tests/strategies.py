"""Hypothesis strategies shared by the guard and kernel tests: tensors with random
layouts (contiguous, transposed, stepped, expanded, permuted) and matmul operands
with torch's broadcasting."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
dims = st.integers(1, 5)


@st.composite
def tensor(draw, shape, dtype):
    """A tensor of ``shape`` with a random layout: contiguous, transposed, stepped, expanded or permuted."""
    shape = tuple(shape)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    layouts = ["contiguous", "stepped"]
    if len(shape) >= 2:
        layouts.append("transposed")
    if len(shape) >= 1 and shape[0] > 1:
        layouts.append("expanded")
    if len(shape) >= 3:
        layouts.append("permuted")
    layout = draw(st.sampled_from(layouts))

    def randn(s):
        return torch.randn(s, generator=gen).to(dtype)

    if layout == "transposed":
        return randn((*shape[:-2], shape[-1], shape[-2])).transpose(-1, -2)
    if layout == "stepped":
        return randn((*shape[:-1], shape[-1] * 2))[..., ::2] if shape else randn(shape)
    if layout == "expanded":
        return randn((1, *shape[1:])).expand(shape)
    if layout == "permuted":
        perm = draw(st.permutations(range(len(shape))))
        inv = [perm.index(i) for i in range(len(shape))]
        return randn(tuple(shape[p] for p in perm)).permute(*inv)
    return randn(shape)


def _batch(draw, n):
    return tuple(draw(st.lists(st.integers(1, 3), min_size=n, max_size=n)))


@st.composite
def matmul_args(draw, dtype, other_dtype=None):
    """``(a, b)`` for torch.matmul: batched, broadcast or 1-D; ``b`` in ``other_dtype`` when given."""
    n, k, m = draw(dims), draw(dims), draw(dims)
    ba = _batch(draw, draw(st.integers(0, 2)))
    bb = tuple(1 if draw(st.booleans()) else d for d in ba)  # broadcasting
    a_shape = draw(st.sampled_from([(*ba, n, k), (k,)])) if ba else draw(st.sampled_from([(n, k), (k,)]))
    b_shape = draw(st.sampled_from([(*bb, k, m), (k,)]))
    return draw(tensor(a_shape, dtype)), draw(tensor(b_shape, other_dtype or dtype))
