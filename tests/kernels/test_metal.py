"""The Metal kernel cannot run here (no Apple hardware; compile_shader raises on
Linux). Tested: its source instantiates every dtype triple, the MPS impl is
registered, and :func:`launch_meta`'s index arithmetic -- replayed by a Python
emulation of the shader over the operands' storage -- computes the matmul."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchfix.kernels import _shapes, metal

from ..strategies import matmul_args
from .test_matmul_op import reference, rel_err


def test_source_instantiates_every_dtype_triple():
    names = [metal.kernel_name(*t) for t in itertools.product((torch.float32, torch.float16, torch.bfloat16), repeat=3)]
    assert len(set(names)) == 27
    assert all(f'host_name("{n}")' in metal.SOURCE for n in names)
    assert metal.SOURCE.count("#if __METAL_VERSION__ >= 310") == 27 - 8  # bfloat needs Metal 3.1


def test_unavailable_here_with_a_reason():
    if torch.backends.mps.is_available():
        pytest.skip("MPS machine: the kernel is exercised for real there")
    assert "MPS is not available" in metal.unavailable_reason()
    with pytest.raises(RuntimeError, match="MPS is not available"):
        metal.matmul(torch.ones(2, 2), torch.ones(2, 2))


def emulate(meta: list[int], batch: int, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
    """The shader's arithmetic, element by element, on flat storage views of the operands."""
    M, N, K, D1, D2 = meta[:5]
    sa, sb, sc = meta[5:10], meta[10:15], meta[15:20]
    fa = a.as_strided((a.untyped_storage().nbytes() // a.element_size(),), (1,), 0)
    fb = b.as_strided((b.untyped_storage().nbytes() // b.element_size(),), (1,), 0)
    fc = c.as_strided((c.untyped_storage().nbytes() // c.element_size(),), (1,), 0)
    for z in range(batch):
        i2, i1, i0 = z % D2, (z // D2) % D1, z // (D2 * D1)
        for row in range(M):
            for col in range(N):
                oa = a.storage_offset() + i0 * sa[0] + i1 * sa[1] + i2 * sa[2] + row * sa[3]
                ob = b.storage_offset() + i0 * sb[0] + i1 * sb[1] + i2 * sb[2] + col * sb[4]
                acc = sum(float(fa[oa + k * sa[4]]) * float(fb[ob + k * sb[3]]) for k in range(K))
                fc[c.storage_offset() + i0 * sc[0] + i1 * sc[1] + i2 * sc[2] + row * sc[3] + col * sc[4]] = acc


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_launch_meta_addresses_every_layout(data):
    a, b = data.draw(matmul_args(torch.float32))
    p = _shapes.plan(a, b)
    out = torch.empty(p.out_shape, dtype=torch.float32)
    sizes, _ = _shapes.collapse_batch(p.batch, p.a.stride()[:-2], p.b.stride()[:-2], out.stride()[:-2])
    if len(sizes) > 3:
        with pytest.raises(RuntimeError, match="at most 3"):
            metal.launch_meta(p, out)
        return
    meta, batch = metal.launch_meta(p, out)
    emulate(meta, batch, p.a, p.b, out)
    assert rel_err(out.reshape(p.result_shape()), reference(a, b)) < 1e-6
