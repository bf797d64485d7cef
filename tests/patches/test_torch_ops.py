"""The wrappers' paths: every calling convention reaches the same decision.

Eager calls run first and ask only when torch raises (or an operand is on the
meta device); the checked path asks first (tracing, ``dtype=`` policy, known-issue
rows). These tests pin that the two agree, that keyword calls are fixed like
positional ones, that torch's own errors come back untouched and run once, and
that an out-of-memory error is never retried.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchfix
from torchfix.guards.ops import SPECS
from torchfix.patches import torch_ops

bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32


def _r(*shape, dtype=f32, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape) * 7 + shape[-1])).to(device=device, dtype=dtype)


x, w, b = _r(3, 4, dtype=bf16), _r(5, 4, dtype=bf16), _r(5, dtype=bf16)
img, kern, kb = _r(1, 2, 5, 5, dtype=bf16), _r(2, 2, 3, 3, dtype=bf16), _r(2, dtype=bf16)
q, k, v = _r(1, 2, 4, 8, dtype=bf16), _r(1, 2, 6, 8, dtype=bf16), _r(1, 2, 6, 8, dtype=bf16)
a, m2 = _r(3, 4, dtype=bf16), _r(4, 5, dtype=bf16)
ba, bb, bc = _r(2, 3, 4, dtype=bf16), _r(2, 4, 5, dtype=bf16), _r(2, 3, 5, dtype=bf16)
c = _r(3, 5, dtype=bf16)
gx, gw = _r(2, 4, 3, 3, dtype=bf16), _r(4, dtype=bf16)


def half(t):
    return t.to(f16)


def _autocast(fn, *args, **kwargs):
    with torch.autocast("cpu", dtype=bf16):  # fp16 + bf16 in a cat raises only under autocast
        return fn(*args, **kwargs)


# (op, convention, call with one fp16 operand torch rejects, the same call written positionally,
#  the result's dtype: activations win over parameters; the matmul family promotes two
#  activations, unless out= names the dtype)
REJECTED = [
    ("F.linear", "bias=", lambda: F.linear(x, w, bias=half(b)), lambda: F.linear(x, w, half(b)), bf16),
    ("F.linear", "input=, weight=", lambda: F.linear(input=x, weight=half(w)), lambda: F.linear(x, half(w)), bf16),
    ("F.linear", "positional", lambda: F.linear(x, half(w), b), lambda: F.linear(x, half(w), b), bf16),
    (
        "F.conv2d",
        "bias=, padding=",
        lambda: F.conv2d(img, half(kern), bias=kb, padding=1),
        lambda: F.conv2d(img, half(kern), kb, 1, 1),
        bf16,
    ),
    ("torch.matmul", "out=", lambda: torch.matmul(a, half(m2), out=torch.empty(3, 5, dtype=bf16)), None, bf16),
    ("torch.mm", "mat2=", lambda: torch.mm(a, mat2=half(m2)), lambda: torch.mm(a, half(m2)), f32),
    ("torch.addmm", "beta=, alpha=", lambda: torch.addmm(c, a, half(m2), beta=0.5, alpha=2.0), None, f32),
    ("torch.baddbmm", "beta=0, alpha=", lambda: torch.baddbmm(bc, ba, half(bb), beta=0, alpha=0.5), None, f32),
    ("Tensor.bmm", "method", lambda: ba.bmm(half(bb)), lambda: torch.bmm(ba, half(bb)), f32),
    (
        "F.scaled_dot_product_attention",
        "attn_mask=, dropout_p=, is_causal=, scale=",
        lambda: F.scaled_dot_product_attention(q, half(k), v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=0.3),
        lambda: F.scaled_dot_product_attention(q, half(k), v, None, 0.0, False, scale=0.3),
        bf16,
    ),
    (
        "F.group_norm",
        "weight=, bias=, eps=",
        lambda: F.group_norm(gx, 2, weight=half(gw), bias=half(gw), eps=1e-5),
        lambda: F.group_norm(gx, 2, half(gw), half(gw), 1e-5),
        bf16,
    ),
    (
        "F.layer_norm",
        "weight=, bias=",
        lambda: F.layer_norm(x, (4,), weight=half(_r(4)), bias=half(_r(4))),
        lambda: F.layer_norm(x, (4,), half(_r(4)), half(_r(4))),
        bf16,
    ),
    # torch's other spellings of the same builtins: fixed like their twins (they raised under torchfix before)
    ("torch.conv1d", "positional", lambda: torch.conv1d(img[:, :, 0], half(kern[..., 0]), kb), None, bf16),
    (
        "torch.conv2d",
        "bias=, padding=",
        lambda: torch.conv2d(img, half(kern), bias=kb, padding=1),
        lambda: F.conv2d(img, half(kern), kb, 1, 1),
        bf16,
    ),
    ("torch.conv3d", "positional", lambda: torch.conv3d(img[..., None], half(kern[..., None]), kb), None, bf16),
    ("torch.linalg.matmul", "positional", lambda: torch.linalg.matmul(a, half(m2)), lambda: torch.matmul(a, half(m2)), f32),
    (
        "torch.layer_norm",
        "positional",
        lambda: torch.layer_norm(x, (4,), half(_r(4)), half(_r(4))),
        lambda: F.layer_norm(x, (4,), half(_r(4)), half(_r(4))),
        bf16,
    ),
    (
        "torch.group_norm",
        "weight=, bias=",
        lambda: torch.group_norm(gx, 2, weight=half(gw), bias=half(gw)),
        lambda: F.group_norm(gx, 2, half(gw), half(gw)),
        bf16,
    ),
    (
        "torch.cat",
        "tensors=, dim=, under bf16 autocast",
        lambda: _autocast(torch.cat, tensors=[x, half(x)], dim=1),
        lambda: _autocast(torch.cat, [x, half(x)], 1),
        bf16,
    ),
]


@pytest.mark.parametrize(("op", "convention", "call", "positional", "dtype"), REJECTED, ids=[f"{r[0]}[{r[1]}]" for r in REJECTED])
def test_every_convention_is_fixed_like_the_positional_call(op, convention, call, positional, dtype):
    with pytest.raises(RuntimeError):
        call()  # plain torch rejects each of these mixes
    with torchfix.enabled("fix"):
        got = call()
        events = list(torchfix.report().events)
        torchfix.report().clear()
        if positional is not None:
            want = positional()
            assert len(torchfix.report().events) == len(events)
    assert events and all(e.guard == "dtype" for e in events), events
    assert {e.op for e in events} <= {op, "torch.ops.torchfix.matmul"} or events[0].op == op
    assert got.dtype == dtype
    if positional is not None:
        assert torch.equal(got, want)
    with torchfix.enabled("strict"), pytest.raises(torchfix.DtypeMismatchError, match=op.rsplit(".", 1)[-1]):
        call()


# Every op with a meta tensor in each position in turn, next to real tensors. torch computes
# garbage (a CPU result with no data) for some positions, a meta result for others, and raises
# for the rest; the wrappers read is_meta only where torch does not raise. Whichever way, the
# device guard must name the meta operand: a new torch that stops raising somewhere fails here.
# Lambdas: the attribute is looked up at call time (the patched one inside enabled()).
META_OPS = {
    "torch.matmul": ([(4, 4), (4, 4)], lambda a, b: torch.matmul(a, b)),
    "a @ b": ([(2, 4, 4), (4, 4)], lambda a, b: a @ b),
    "torch.mm": ([(4, 4), (4, 4)], lambda a, b: torch.mm(a, b)),
    "Tensor.mm": ([(4, 4), (4, 4)], lambda a, b: a.mm(b)),
    "torch.bmm": ([(2, 4, 4), (2, 4, 4)], lambda a, b: torch.bmm(a, b)),
    "torch.addmm": ([(4,), (4, 4), (4, 4)], lambda c, a, b: torch.addmm(c, a, b)),
    "Tensor.addmm": ([(4, 4), (4, 4), (4, 4)], lambda c, a, b: c.addmm(a, b, beta=0.5)),
    "torch.baddbmm": ([(2, 4, 4), (2, 4, 4), (2, 4, 4)], lambda c, a, b: torch.baddbmm(c, a, b)),
    "F.linear": ([(4, 4), (4, 4), (4,)], lambda *t: F.linear(*t)),
    "F.linear(bias=)": ([(2, 4, 4), (4, 4), (4,)], lambda x, w, b: F.linear(x, w, bias=b)),
    "F.linear(x, w)": ([(4, 4), (4, 4)], lambda *t: F.linear(*t)),
    "F.conv1d": ([(1, 2, 5), (2, 2, 1), (2,)], lambda *t: F.conv1d(*t)),
    "F.conv2d(bias=)": ([(1, 2, 5, 5), (2, 2, 3, 3), (2,)], lambda x, w, b: F.conv2d(x, w, bias=b, padding=1)),
    "F.conv3d": ([(1, 2, 3, 3, 3), (2, 2, 1, 1, 1), (2,)], lambda *t: F.conv3d(*t)),
    "sdpa": ([(1, 1, 4, 8), (1, 1, 4, 8), (1, 1, 4, 8), (4, 4)], lambda *t: F.scaled_dot_product_attention(*t)),
    "sdpa(attn_mask=)": (
        [(1, 1, 4, 8), (1, 1, 4, 8), (1, 1, 4, 8), (4, 4)],
        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
    ),
    "F.layer_norm": ([(2, 4), (4,), (4,)], lambda x, w, b: F.layer_norm(x, (4,), w, b)),
    "F.group_norm(weight=, bias=)": ([(1, 4, 2, 2), (4,), (4,)], lambda x, w, b: F.group_norm(x, 2, weight=w, bias=b)),
    "torch.cat": ([(2,), (2,)], lambda a, b: torch.cat([a, b])),
    "torch.conv2d": ([(1, 2, 5, 5), (2, 2, 3, 3), (2,)], lambda *t: torch.conv2d(*t)),
    "torch.linalg.matmul": ([(4, 4), (4, 4)], lambda a, b: torch.linalg.matmul(a, b)),
    "torch.layer_norm": ([(2, 4), (4,), (4,)], lambda x, w, b: torch.layer_norm(x, (4,), w, b)),
}
META = [(f"{op} #{i}", shapes, fn, i) for op, (shapes, fn) in META_OPS.items() for i in range(len(shapes))]


@pytest.mark.parametrize(("name", "shapes", "fn", "position"), META, ids=[m[0] for m in META])
def test_a_meta_operand_in_any_position_is_named(name, shapes, fn, position):
    real = [_r(*shape) for shape in shapes]
    fn(*real)  # valid on one device
    mixed = [t.to("meta") if i == position else t for i, t in enumerate(real)]
    with torchfix.enabled("fix"), pytest.raises(torchfix.DeviceMismatchError, match="meta"):
        fn(*mixed)
    fn(*[t.to("meta") for t in real])  # all on meta: shape inference, left alone
    with torchfix.enabled("fix"):
        assert fn(*[t.to("meta") for t in real]).is_meta


class _Count(torch.overrides.TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch._C._nn.linear or getattr(func, "__name__", "") == "linear":
            self.calls += 1
        return func(*args, **(kwargs or {}))


def test_torch_own_error_on_uniform_inputs_runs_once_and_propagates_untouched():
    wrong = _r(5, 7, dtype=bf16)  # shapes do not fit: torch's error, not torchfix's
    with pytest.raises(RuntimeError) as plain:
        F.linear(x, wrong)
    with torchfix.enabled("fix"), _Count() as counted, pytest.raises(RuntimeError) as guarded:
        F.linear(x, wrong, bias=None)
    assert counted.calls == 1
    assert type(guarded.value) is type(plain.value) and str(guarded.value) == str(plain.value)
    assert guarded.value.__context__ is None and guarded.value.__cause__ is None
    assert torchfix.report().events == []


def test_out_of_memory_is_never_retried():
    calls = []

    def fake_linear(*args, **kwargs):
        calls.append(args)
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    wrapper = torch_ops._maker(SPECS["F.linear"])(fake_linear)
    with torchfix.enabled("fix"), pytest.raises(torch.OutOfMemoryError):
        wrapper(x, half(w))  # a mix the slow path would fix: still one call
    assert len(calls) == 1


def test_dtype_policy_changes_only_the_cat_promotion_it_asks_about():
    mask = _r(4, 6)  # float32 mask with bf16 q/k/v: accepted by torch, left alone even under dtype=
    plain = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    for kw in ({}, {"dtype": bf16}):
        with torchfix.enabled("fix", **kw):
            assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), plain)
    assert torchfix.report().events == []
    with torchfix.enabled("fix", dtype=bf16):
        asked = torch.cat(tensors=[x, x.float()], dim=0)  # torch promotes to fp32; dtype= asks for bf16
    assert asked.dtype == bf16 and torch.equal(asked, torch.cat([x, x]))
    assert [(e.op, e.action) for e in torchfix.report().events] == [("torch.cat", "cast")]


def test_non_strict_export_sees_the_mix_that_fake_tensors_accept():
    """Fake tensors accept F.linear(bf16, fp16): under torch.export the wrappers ask first."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4).to(bf16), torch.nn.Linear(4, 2).to(f16))
    with torchfix.enabled("fix"), torch.no_grad():
        ep = torch.export.export(model, (x,), strict=False)
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert any("_to_copy" in t for t in targets), targets
    assert torch.equal(ep.module()(x), F.linear(model[0](x), model[1].weight.to(bf16), model[1].bias.to(bf16)))


@pytest.mark.parametrize("op", ["F.conv2d", "torch.matmul", "torch.cat"])
def test_an_error_of_the_callers_own_runs_the_call_once_on_every_path(op):
    """Meta operands (the general path) and a mixed cat (the checked path) used to be decided
    inside a try that caught TypeError: an error from the call itself ran it a second time."""
    calls = []

    def fake(*args, **kwargs):
        calls.append(args)
        raise TypeError("the caller's own mistake")

    wrapper = torch_ops._maker(SPECS[op])(fake)
    meta = [_r(2, 2).to("meta"), _r(2, 2).to("meta")]
    for args in ([meta], [[x, x.float()]]) if op == "torch.cat" else (meta,):
        calls.clear()
        with torchfix.enabled("fix"), pytest.raises(TypeError, match="own mistake"):
            wrapper(*args)
        assert len(calls) == 1, op


# --- a known-issue row in force costs what its predicate costs -------------------------------------------------------
# On CUDA, pytorch/pytorch#191937's row is in force for sdpa on every torch < 2.15; the same predicate registered for
# the CPU puts this machine on that path.


@pytest.fixture
def sdpa_row_on_cpu():
    from torchfix.guards import known_issues as ki

    row = torchfix.add_known_issue(torchfix.KnownIssue("cpu", ("sdpa",), ki.broadcast_kv_len_1_mod_32, "test#191937", "contiguous"))
    try:
        yield row
    finally:
        torchfix.remove_known_issue(row)


def test_a_row_in_force_sends_only_the_calls_its_predicate_matches_to_the_checked_path(monkeypatch, sdpa_row_on_cpu):
    orig = F.scaled_dot_product_attention
    assert not hasattr(orig, "__torchfix_spec__")
    checked = []
    real = torch_ops.runtime.guarded_call

    def spy(spec, *rest):
        checked.append(spec.name)
        return real(spec, *rest)

    monkeypatch.setattr(torch_ops.runtime, "guarded_call", spy)
    sdpa = torch_ops._maker(SPECS["F.scaled_dot_product_attention"])(orig)
    key33, value33 = _r(1, 1, 33, 8).expand(1, 2, 33, 8), (_r(1, 1, 33, 8) + 1).expand(1, 2, 33, 8)
    mask = _r(4, 33)
    untouched = [  # the row's predicate does not match: torch runs them as they are
        ((q, k, v), {}),
        ((q, k, v), {"attn_mask": _r(4, 6)}),
        ((q.float(), key33, value33), {}),  # broadcast, length 33, but no mask
        ((q.float(), key33.contiguous(), value33.contiguous()), {"attn_mask": mask}),  # a mask, length 33, no broadcast
        ((), {"query": q, "key": k, "value": v, "attn_mask": _r(4, 6)}),
    ]
    with torchfix.enabled("fix"):
        for args, kwargs in untouched:
            assert torch.equal(sdpa(*args, **kwargs), orig(*args, **kwargs))
        assert checked == [] and torchfix.report().events == []
        fixed = sdpa(q.float(), key33, value33, mask)  # the row's case: broadcast k/v, key length 1 mod 32, a mask
    assert checked == ["F.scaled_dot_product_attention"]
    assert torch.equal(fixed, orig(q.float(), key33.contiguous(), value33.contiguous(), mask))
    assert [(e.guard, e.action) for e in torchfix.report().events] == [("stride", "contiguous")]  # one event for the call
    with torchfix.enabled("off"):  # torchfix off here: the row changes nothing
        torchfix.report().clear()
        assert torch.equal(sdpa(q.float(), key33, value33, mask), orig(q.float(), key33, value33, mask))
    assert torchfix.report().events == []


def test_a_row_in_force_for_another_device_type_costs_nothing_here(monkeypatch):
    from torchfix.guards import known_issues as ki

    row = torchfix.add_known_issue(torchfix.KnownIssue("cpu", ("mm",), ki.any_noncontiguous, "test#other", "contiguous"))
    try:
        assert "cpu" in ki.holder("mm")[0] and not ki.holder("conv")[0]
    finally:
        torchfix.remove_known_issue(row)
    assert "cpu" not in ki.holder("mm")[0]
