"""For valid inputs (one dtype, one device, no known-issue layout) every guarded
callable is bit-identical to plain torch, in every mode, and records nothing."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torchfix

from ..strategies import FLOATS, _batch, dims, matmul_args, tensor

MODES = ("off", "fix", "warn", "strict")


def _cases():
    """(name, strategy producing a zero-argument callable) per guarded callable."""

    @st.composite
    def two(draw, fn):
        dtype = draw(st.sampled_from(FLOATS))
        a, b = draw(matmul_args(dtype))
        return lambda: fn(a, b)

    @st.composite
    def mm(draw, fn, batched=False, add=False):
        dtype = draw(st.sampled_from(FLOATS))
        n, k, m = draw(dims), draw(dims), draw(dims)
        pre = (draw(dims),) if batched else ()
        a, b = draw(tensor((*pre, n, k), dtype)), draw(tensor((*pre, k, m), dtype))
        if not add:
            return lambda: fn(a, b)
        c = draw(tensor(draw(st.sampled_from([(*pre, n, m), (m,)])), dtype))
        kw = draw(st.sampled_from([{}, {"beta": 0.5, "alpha": 2.0}]))
        return lambda: fn(c, a, b, **kw)

    @st.composite
    def linear(draw):
        dtype = draw(st.sampled_from(FLOATS))
        k, m = draw(dims), draw(dims)
        x = draw(tensor((*_batch(draw, draw(st.integers(0, 2))), k), dtype))
        w = draw(tensor((m, k), dtype))
        b = draw(st.none() | tensor((m,), dtype))
        return lambda: F.linear(x, w, b)

    @st.composite
    def conv(draw, nd, alias=False):
        dtype = draw(st.sampled_from((torch.float32, torch.float64, torch.bfloat16)))
        groups = draw(st.sampled_from([1, 2]))
        cin, cout = 2 * draw(st.integers(1, 2)), 2 * draw(st.integers(1, 2))
        size = tuple(draw(st.integers(3, 6)) for _ in range(nd))
        x = draw(tensor((draw(st.integers(1, 2)), cin, *size), dtype))
        w = draw(tensor((cout, cin // groups) + (draw(st.integers(1, 3)),) * nd, dtype))
        b = draw(st.none() | tensor((cout,), dtype))
        kw = {"stride": draw(st.sampled_from([1, 2])), "padding": draw(st.sampled_from([0, 1])), "groups": groups}
        name = f"conv{nd}d"
        return lambda: getattr(torch if alias else F, name)(x, w, b, **kw)

    @st.composite
    def sdpa(draw):
        dtype = draw(st.sampled_from((torch.float32, torch.float64, torch.bfloat16)))
        b, h, lq, s, e = draw(dims), draw(st.integers(1, 3)), draw(dims), draw(dims), 2 * draw(dims)
        q, k, v = draw(tensor((b, h, lq, e), dtype)), draw(tensor((b, h, s, e), dtype)), draw(tensor((b, h, s, e), dtype))
        mask_kind = draw(st.sampled_from(["none", "bool", "float", "causal"]))
        if mask_kind == "bool":
            mask = torch.ones(lq, s, dtype=torch.bool).tril()
            mask[:, 0] = True
            return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        if mask_kind == "float":
            mask = draw(tensor((lq, s), dtype))
            return lambda: F.scaled_dot_product_attention(q, k, v, mask)
        if mask_kind == "causal":
            return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
        return lambda: F.scaled_dot_product_attention(q, k, v)

    @st.composite
    def layer_norm(draw, fn=None):
        dtype = draw(st.sampled_from(FLOATS))
        d = draw(dims)
        x = draw(tensor((*_batch(draw, draw(st.integers(1, 2))), d), dtype))
        # low-precision input with float32 parameters is valid torch: it must pass untouched
        pdtype = draw(st.sampled_from([dtype, torch.float32])) if dtype in (torch.float16, torch.bfloat16) else dtype
        w = draw(st.none() | tensor((d,), pdtype))
        b = draw(st.none() | tensor((d,), pdtype))
        return lambda: (fn or F.layer_norm)(x, (d,), w, b, eps=1e-5)

    @st.composite
    def group_norm(draw, fn=None):
        dtype = draw(st.sampled_from((torch.float32, torch.float64, torch.bfloat16)))
        g = draw(st.integers(1, 3))
        c = g * draw(st.integers(1, 2))
        x = draw(tensor((draw(st.integers(1, 2)), c, draw(st.integers(2, 4)), draw(dims)), dtype))
        w = draw(st.none() | tensor((c,), dtype))
        b = draw(st.none() | tensor((c,), dtype))
        return lambda: (fn or F.group_norm)(x, g, w, b)

    @st.composite
    def cat(draw, fn, kwname="dim"):
        dtype = draw(st.sampled_from((*FLOATS, torch.int64)))
        shape = tuple(draw(st.lists(dims, min_size=1, max_size=3)))
        dim = draw(st.integers(-len(shape), len(shape) - 1))
        parts = []
        for _ in range(draw(st.integers(1, 4))):
            s = list(shape)
            s[dim] = draw(dims)
            parts.append(draw(tensor(tuple(s), dtype)))
        seq = tuple(parts) if draw(st.booleans()) else parts
        return lambda: fn(seq, **{kwname: dim})

    @st.composite
    def embedding(draw):
        dtype = draw(st.sampled_from(FLOATS))
        n, d = draw(st.integers(2, 9)), draw(dims)
        w = draw(tensor((n, d), dtype))
        shape = _batch(draw, draw(st.integers(1, 3)))
        ids = torch.randint(0, n, shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
        ids = ids.to(draw(st.sampled_from((torch.int64, torch.int32))))
        pad = draw(st.none() | st.integers(0, n - 1))
        return lambda: F.embedding(ids, w, pad) if pad is not None else F.embedding(ids, w)

    @st.composite
    def lookup(draw, fn, gather=False):
        """index_select / gather: data of any layout, an integer index into ``dim``."""
        dtype = draw(st.sampled_from((*FLOATS, torch.int64)))
        shape = tuple(draw(st.lists(dims, min_size=1, max_size=3)))
        x = draw(tensor(shape, dtype))
        dim = draw(st.integers(-len(shape), len(shape) - 1))
        gen = torch.Generator().manual_seed(draw(st.integers(0, 99)))
        if gather:
            index = torch.randint(0, shape[dim], tuple(draw(st.integers(1, s)) for s in shape), generator=gen)
        else:
            index = torch.randint(0, shape[dim], (draw(dims),), generator=gen).to(draw(st.sampled_from((torch.int64, torch.int32))))
        return lambda: fn(x, dim, index)

    return {
        "F.embedding": embedding(),
        "torch.index_select": lookup(torch.index_select),
        "Tensor.index_select": lookup(lambda x, d, i: x.index_select(d, i)),
        "torch.gather": lookup(torch.gather, gather=True),
        "Tensor.gather": lookup(lambda x, d, i: x.gather(d, i), gather=True),
        "torch.matmul": two(torch.matmul),
        "Tensor.matmul": two(lambda a, b: a.matmul(b)),
        "Tensor.__matmul__": two(lambda a, b: a @ b),
        "Tensor.__rmatmul__": two(lambda a, b: b.__rmatmul__(a)),
        "torch.mm": mm(torch.mm),
        "Tensor.mm": mm(lambda a, b: a.mm(b)),
        "torch.bmm": mm(torch.bmm, batched=True),
        "Tensor.bmm": mm(lambda a, b: a.bmm(b), batched=True),
        "torch.addmm": mm(torch.addmm, add=True),
        "Tensor.addmm": mm(lambda c, a, b, **kw: c.addmm(a, b, **kw), add=True),
        "torch.baddbmm": mm(torch.baddbmm, batched=True, add=True),
        "Tensor.baddbmm": mm(lambda c, a, b, **kw: c.baddbmm(a, b, **kw), batched=True, add=True),
        "F.linear": linear(),
        "F.conv1d": conv(1),
        "F.conv2d": conv(2),
        "F.conv3d": conv(3),
        "F.scaled_dot_product_attention": sdpa(),
        "F.layer_norm": layer_norm(),
        "F.group_norm": group_norm(),
        "torch.cat": cat(torch.cat),
        "torch.concat": cat(torch.concat),
        "torch.concatenate": cat(torch.concatenate, "axis"),
        # torch's other spellings of the same builtins, looked up per call (patched or not)
        "torch.linalg.matmul": two(lambda a, b: torch.linalg.matmul(a, b)),
        "torch.conv1d": conv(1, alias=True),
        "torch.conv2d": conv(2, alias=True),
        "torch.conv3d": conv(3, alias=True),
        "torch.layer_norm": layer_norm(lambda *a, **k: torch.layer_norm(*a, **k)),
        "torch.group_norm": group_norm(lambda *a, **k: torch.group_norm(*a, **k)),
    }


CASES = _cases()


def test_every_guarded_callable_has_a_case():
    from torchfix.guards.ops import SPECS

    assert set(CASES) == set(SPECS)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_bit_identical_to_plain_torch(name, mode):
    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(CASES[name])
    def check(call):
        plain = call()
        torchfix.report().clear()
        with torchfix.enabled(mode=mode), warnings.catch_warnings():
            warnings.simplefilter("error", torchfix.TorchfixWarning)
            guarded = call()
        assert guarded.dtype == plain.dtype and guarded.shape == plain.shape and guarded.device == plain.device
        same_nans = (guarded.isnan() == plain.isnan()).all()
        assert torch.equal(guarded, plain) or (same_nans and torch.equal(guarded.nan_to_num(), plain.nan_to_num()))
        assert torchfix.report().events == []

    check()


LOW = (torch.float32, torch.bfloat16, torch.float16)
pairs = st.tuples(st.sampled_from(LOW), st.sampled_from(LOW)).filter(lambda p: p[0] != p[1])


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(pairs, st.data())
def test_mixed_dtypes_follow_the_policy(dts, data):
    da, db = dts
    k, m = data.draw(dims), data.draw(dims)
    x = data.draw(tensor((data.draw(dims), k), da))
    w = data.draw(tensor((m, k), db))
    b = data.draw(st.none() | tensor((m,), db))
    other = data.draw(tensor((k, m), db))
    with torchfix.enabled():
        got_linear = F.linear(x, w, b)
        got_mm = x @ other
        got_cat = torch.cat([x, w])
    assert torch.equal(got_linear, F.linear(x, w.to(da), None if b is None else b.to(da)))
    target = torch.promote_types(da, db)
    assert torch.equal(got_mm, x.to(target) @ other.to(target))
    assert torch.equal(got_cat, torch.cat([x, w]))  # torch's own promotion, now recorded
    ops = [e.op for e in torchfix.report().events]
    assert ops == ["F.linear", "Tensor.__matmul__", "torch.cat"]
    torchfix.report().clear()
