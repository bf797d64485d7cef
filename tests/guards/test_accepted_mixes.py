"""Do no harm: for every mix of dtypes, layouts, autocast states and calling
conventions that plain torch *accepts*, torchfix returns the bit-identical
tensor (dtype included) in fix, warn and strict.

Hypothesis draws operand dtypes independently (so most draws are mixed), with
autocast on or off, positional or keyword arguments and ``out=``; a draw that
plain torch rejects is not a case here (the guards' fixes are tested
elsewhere). Each op must reach ``ACCEPTED_PER_OP`` accepted draws, so the
suite checks at least 22 × 140 = 3,080 accepted calls, most of them mixed.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torchfix
from torchfix.guards.ops import SPECS

from ..strategies import dims, tensor

f16, bf16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
DTYPES = (f16, bf16, f32, f64)
EXAMPLES_PER_OP = 240
ACCEPTED_PER_OP = 140


@st.composite
def autocast(draw):
    return draw(st.sampled_from([None, bf16, f16]))


LOW = (f16, bf16, f32)  # the dtypes CPU autocast casts between


@st.composite
def mix(draw, ac, base):
    """A second dtype: under autocast usually another low/fp32 dtype (autocast makes the mix valid), else ``base``."""
    if ac is not None and base in LOW and draw(st.integers(0, 3)) > 0:
        return draw(st.sampled_from([d for d in LOW if d != base]))
    return base if draw(st.integers(0, 5)) > 0 else draw(st.sampled_from(DTYPES))


def _mm_case(fn, kind, method=False):
    @st.composite
    def case(draw):
        ac = draw(autocast())
        # Outside autocast the matmul family accepts only one dtype; under it, any low/fp32 mix.
        base = draw(st.sampled_from(DTYPES))
        da = base
        db = draw(mix(ac, base))
        n, k, m = draw(dims), draw(dims), draw(dims)
        pre = (draw(dims),) if kind in ("bmm", "baddbmm") else ()
        a, b = draw(tensor((*pre, n, k), da)), draw(tensor((*pre, k, m), db))
        kw = {}
        extra = ()
        if kind in ("addmm", "baddbmm"):
            c = draw(tensor(draw(st.sampled_from([(*pre, n, m), (m,)])), draw(mix(ac, base))))
            extra = (c,)
            if draw(st.booleans()):
                kw = {"beta": draw(st.sampled_from([0, 0.5, 1])), "alpha": draw(st.sampled_from([0.5, 1, 2]))}
        # autocast rejects out=: draw it only without autocast
        out_dtype = draw(st.sampled_from([None, None, base, f32])) if not method and ac is None else None
        keywords = draw(st.booleans())

        def make():
            k2 = dict(kw)
            if out_dtype is not None:
                k2["out"] = torch.empty(0, dtype=out_dtype)
            if method:
                self_, rest = (extra[0], (a, b)) if extra else (a, (b,))
                return fn, (self_, *rest), k2
            args = (*extra, a, b)
            if keywords and kind in ("matmul", "mm", "bmm"):
                names = {"matmul": ("input", "other"), "mm": ("input", "mat2"), "bmm": ("input", "mat2")}[kind]
                return fn, (), {**dict(zip(names, args)), **k2}
            return fn, args, k2

        return ac, make

    return case()


@st.composite
def _linear(draw):
    ac = draw(autocast())
    base = draw(st.sampled_from(DTYPES))
    x = draw(tensor((*draw(st.lists(st.integers(1, 3), max_size=2)), draw(dims)), base))
    k, m = x.shape[-1], draw(dims)
    w = draw(tensor((m, k), draw(mix(ac, base))))
    b = draw(st.none() | tensor((m,), draw(st.sampled_from([w.dtype, w.dtype, draw(mix(ac, base))]))))
    form = draw(st.sampled_from(["positional", "bias=", "all keywords"]))

    def make():
        if form == "positional":
            return F.linear, (x, w, b), {}
        if form == "bias=":
            return F.linear, (x, w), {"bias": b}
        return F.linear, (), {"input": x, "weight": w, "bias": b}

    return ac, make


def _conv(nd, owner=F):
    def fn(*args, **kwargs):
        return getattr(owner, f"conv{nd}d")(*args, **kwargs)  # looked up per call: patched or not

    @st.composite
    def case(draw):
        ac = draw(autocast())
        base = draw(st.sampled_from((f32, f64, bf16)))
        cin, cout = 2, 2 * draw(st.integers(1, 2))
        size = tuple(draw(st.integers(3, 5)) for _ in range(nd))
        x = draw(tensor((1, cin, *size), base))
        w = draw(tensor((cout, cin) + (draw(st.integers(1, 3)),) * nd, draw(mix(ac, base))))
        b = draw(st.none() | tensor((cout,), w.dtype))
        kw = {"stride": draw(st.sampled_from([1, 2])), "padding": draw(st.sampled_from([0, 1]))}
        keywords = draw(st.booleans())
        return ac, (lambda: (fn, (x, w), {"bias": b, **kw}) if keywords else (fn, (x, w, b), kw))

    return case()


@st.composite
def _sdpa(draw):
    ac = draw(autocast())
    base = draw(st.sampled_from((f32, f64, bf16, f16)))
    b, h, lq, s, e = 1, draw(st.integers(1, 2)), draw(dims), draw(dims), 2 * draw(dims)
    q = draw(tensor((b, h, lq, e), base))
    k = draw(tensor((b, h, s, e), draw(mix(ac, base))))
    v = draw(tensor((b, h, s, e), k.dtype if draw(st.booleans()) else base))
    mask_kind = draw(st.sampled_from(["none", "bool", "float32", "float32", "query", "other"]))
    mask = None
    if mask_kind == "bool":
        mask = torch.ones(lq, s, dtype=torch.bool).tril()
        mask[:, 0] = True
    elif mask_kind != "none":
        mdt = {"float32": f32, "query": base}.get(mask_kind) or draw(st.sampled_from(DTYPES))
        mask = draw(tensor((lq, s), mdt))
    form = draw(st.sampled_from(["positional", "diffusers"]))
    scale = draw(st.none() | st.just(0.3))
    fn = F.scaled_dot_product_attention

    def make():
        if form == "positional":
            return fn, (q, k, v, mask), {"scale": scale}
        return fn, (q, k, v), {"attn_mask": mask, "dropout_p": 0.0, "is_causal": False, "scale": scale}

    return ac, make


@st.composite
def _norm(draw, group, owner=F):
    ac = draw(autocast())
    base = draw(st.sampled_from((f16, bf16, bf16, f32, f64)))
    # fp32 parameters with a low-precision input are valid torch; other mixes mostly are not
    pdt = draw(st.sampled_from([f32, f32, f32, base, draw(st.sampled_from(DTYPES))]))
    c = 2 * draw(st.integers(1, 2))
    x = draw(tensor((draw(st.integers(1, 2)), c, draw(dims)) if group else (draw(st.integers(1, 3)), c), base))
    w = draw(tensor((c,), pdt)) if draw(st.integers(0, 3)) else None
    bias = draw(st.none() | tensor((c,), pdt if draw(st.integers(0, 6)) > 0 else draw(st.sampled_from(DTYPES))))
    keywords = draw(st.booleans())
    if group:
        g = draw(st.sampled_from([1, 2]))
        return ac, (
            lambda: (owner.group_norm, (x, g), {"weight": w, "bias": bias, "eps": 1e-5})
            if keywords
            else (owner.group_norm, (x, g, w, bias), {})
        )
    return ac, (
        lambda: (owner.layer_norm, (x, (c,)), {"weight": w, "bias": bias, "eps": 1e-5})
        if keywords
        else (owner.layer_norm, (x, (c,), w, bias), {})
    )


def _cat(fn, dim_name="dim"):
    @st.composite
    def case(draw):
        ac = draw(autocast())
        shape = tuple(draw(st.lists(dims, min_size=1, max_size=3)))
        dim = draw(st.integers(-len(shape), len(shape) - 1))
        base = draw(st.sampled_from((*DTYPES, torch.int64)))
        parts = []
        for _ in range(draw(st.integers(1, 4))):
            s = list(shape)
            s[dim] = draw(dims)
            parts.append(draw(tensor(tuple(s), base if draw(st.booleans()) else draw(st.sampled_from((*DTYPES, torch.int64))))))
        seq = tuple(parts) if draw(st.booleans()) else parts
        out_dtype = draw(st.sampled_from([None, None, f32, f64]))
        keywords = draw(st.booleans())

        def make():
            kw = {dim_name: dim}
            if out_dtype is not None:
                kw["out"] = torch.empty(0, dtype=out_dtype)
            return (fn, (), {"tensors": seq, **kw}) if keywords else (fn, (seq,), kw)

        return ac, make

    return case()


CASES = {
    "torch.matmul": _mm_case(torch.matmul, "matmul"),
    "Tensor.matmul": _mm_case(torch.Tensor.matmul, "matmul", method=True),
    "Tensor.__matmul__": _mm_case(lambda a, b: a @ b, "matmul", method=True),
    "Tensor.__rmatmul__": _mm_case(lambda a, b: b.__rmatmul__(a), "matmul", method=True),
    "torch.mm": _mm_case(torch.mm, "mm"),
    "Tensor.mm": _mm_case(torch.Tensor.mm, "mm", method=True),
    "torch.bmm": _mm_case(torch.bmm, "bmm"),
    "Tensor.bmm": _mm_case(torch.Tensor.bmm, "bmm", method=True),
    "torch.addmm": _mm_case(torch.addmm, "addmm"),
    "Tensor.addmm": _mm_case(torch.Tensor.addmm, "addmm", method=True),
    "torch.baddbmm": _mm_case(torch.baddbmm, "baddbmm"),
    "Tensor.baddbmm": _mm_case(torch.Tensor.baddbmm, "baddbmm", method=True),
    "F.linear": _linear(),
    "F.conv1d": _conv(1),
    "F.conv2d": _conv(2),
    "F.conv3d": _conv(3),
    "F.scaled_dot_product_attention": _sdpa(),
    "F.layer_norm": _norm(False),
    "F.group_norm": _norm(True),
    "torch.cat": _cat(torch.cat),
    "torch.concat": _cat(torch.concat),
    "torch.concatenate": _cat(torch.concatenate, "axis"),
    "torch.linalg.matmul": _mm_case(lambda *a, **kw: torch.linalg.matmul(*a, **kw), "matmul"),
    "torch.conv1d": _conv(1, torch),
    "torch.conv2d": _conv(2, torch),
    "torch.conv3d": _conv(3, torch),
    "torch.layer_norm": _norm(False, torch),
    "torch.group_norm": _norm(True, torch),
}


# An index op (embedding, index_select, gather) meets one floating dtype at most: there is no dtype mix to accept.
# test_differential.py shows them bit-identical on valid inputs, integer index dtypes included.
NO_DTYPE_MIX = frozenset(name for name, spec in SPECS.items() if spec.kind == "index")


def test_every_guarded_callable_has_a_case():
    assert NO_DTYPE_MIX and set(CASES) == set(SPECS) - NO_DTYPE_MIX


def _run(ac, make):
    """Call the op with fresh arguments (a fresh ``out=``) under ``ac``; its result, or the exception."""
    fn, args, kwargs = make()
    ctx = torch.autocast("cpu", dtype=ac) if ac is not None else contextlib.nullcontext()
    with ctx:
        try:
            return fn(*args, **kwargs)
        except (RuntimeError, TypeError, ValueError) as exc:
            return exc


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
        return False
    return torch.equal(a, b) or bool((a.isnan() == b.isnan()).all() and torch.equal(a.nan_to_num(), b.nan_to_num()))


@pytest.mark.parametrize("name", sorted(CASES))
def test_accepted_mixes_are_bit_identical_in_every_mode(name):
    counts: Counter[str] = Counter()

    # derandomize: the coverage counts below must not flake in CI
    @settings(max_examples=EXAMPLES_PER_OP, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True)
    @given(CASES[name])
    def check(case):
        ac, make = case
        plain = _run(ac, make)
        if isinstance(plain, Exception):
            counts["rejected"] += 1
            return
        counts["accepted"] += 1
        _, args, kwargs = make()
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        tensors += [t for v in (*args, *kwargs.values()) if isinstance(v, (list, tuple)) for t in v if isinstance(t, torch.Tensor)]
        counts["mixed"] += len({t.dtype for t in tensors if t.is_floating_point()}) > 1
        for mode in ("fix", "warn", "strict"):
            with torchfix.enabled(mode=mode), warnings.catch_warnings():
                warnings.simplefilter("ignore", torchfix.TorchfixWarning)  # a noted promotion may warn; it changes nothing
                got = _run(ac, make)
            assert not isinstance(got, Exception), f"{name} in {mode}: torch accepted this call, torchfix raised {got!r}"
            assert _same(got, plain), f"{name} in {mode}: {got.dtype} {tuple(got.shape)} vs torch's {plain.dtype} {tuple(plain.shape)}"
        assert all(e.action == "noted" for e in torchfix.report().events), torchfix.report().events
        torchfix.report().clear()

    check()
    assert counts["accepted"] >= ACCEPTED_PER_OP, counts
    assert counts["mixed"] >= counts["accepted"] // 4, counts  # the draws are not just the single-dtype fast path
