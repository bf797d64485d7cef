"""torch.compile(fullgraph=True) with the guards on: no graph breaks, fixes traced in."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchfix


class Block(torch.nn.Module):
    def __init__(self, stray_dtype: torch.dtype | None = None):
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.conv = torch.nn.Conv1d(4, 4, 3, padding=1)
        self.proj = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 8)
        if stray_dtype is not None:
            self.out.to(stray_dtype)

    def forward(self, x):
        h = self.conv(self.norm(x))
        q = self.proj(h).unsqueeze(1)
        a = F.scaled_dot_product_attention(q, q, q).squeeze(1)
        h = torch.cat([h, a], dim=1)[:, :4]
        h = torch.matmul(h, torch.eye(8, dtype=h.dtype))
        return self.out(h)


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("stray", [None, torch.bfloat16])
def test_no_graph_breaks(stray):
    model = Block(stray).eval()
    x = torch.randn(2, 4, 8)
    with torchfix.enabled():
        explain = torch._dynamo.explain(model)(x)
    assert explain.graph_break_count == 0, explain.break_reasons
    assert explain.graph_count == 1


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compiled_matches_eager_including_a_fix(backend):
    model = Block(torch.bfloat16).eval()
    x = torch.randn(2, 4, 8)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="dtype"):
            model(x)
        with torchfix.enabled():
            eager = model(x)
            compiled = torch.compile(model, fullgraph=True, backend=backend)
            got = compiled(x)
            got2 = compiled(torch.randn(2, 4, 8))
    assert got.dtype == eager.dtype == torch.float32
    assert got2.shape == eager.shape
    if backend == "eager":
        assert torch.equal(got, eager)
    else:
        torch.testing.assert_close(got, eager, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("fullgraph", [False, True])
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_settings_changes_reach_compiled_code_and_strict_raises_torchfix_error(backend, fullgraph):
    lin = torch.nn.Linear(8, 8).half()
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    compiled = torch.compile(lin, backend=backend, fullgraph=fullgraph)
    with torchfix.enabled():
        fixed = compiled(x)
    assert fixed.dtype == torch.float16  # the model (the fp16 Linear) wins, compiled as eagerly
    with torchfix.enabled():
        assert torch.equal(lin(x), fixed)
    with torchfix.enabled(mode="strict"), pytest.raises(torchfix.DtypeMismatchError, match=r"F\.linear.*input is bfloat16") as info:
        compiled(x)  # compiled under fix: the mode change still reaches it
    assert "torch.compile" in str(info.value) and "fix:" in str(info.value)
    with pytest.raises(RuntimeError, match="same dtype") as off:
        compiled(x)  # torchfix off: plain torch's error, no fix baked in
    assert not isinstance(off.value, torchfix.TorchfixError)
    with torchfix.enabled():
        assert torch.equal(compiled(x), fixed)


def test_compiled_accepted_mix_is_untouched_and_strict_does_not_raise():
    def f(q, mask, x, w):
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask), F.layer_norm(x, (4,), w)

    q, mask = torch.randn(1, 2, 3, 4, dtype=torch.bfloat16), torch.randn(3, 3)
    x, w = torch.randn(2, 4, dtype=torch.bfloat16), torch.randn(4)
    plain = f(q, mask, x, w)
    compiled = torch.compile(f, backend="eager", fullgraph=True)
    for mode in ("fix", "strict"):
        with torchfix.enabled(mode=mode):
            got = compiled(q, mask, x, w)
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, plain))


def test_no_graph_breaks_with_a_scoped_block_inside_another():
    model = Block(torch.bfloat16).eval()
    with torchfix.enabled(), torchfix.enabled(mode="warn"):
        explain = torch._dynamo.explain(model)(torch.randn(2, 4, 8))
    assert explain.graph_break_count == 0, explain.break_reasons


def test_known_issue_rows_apply_compiled_as_eagerly():
    """A row in force here is traced into the compiled graph (before, rows were skipped while compiling)."""
    from torch._dynamo.backends.common import aot_autograd

    from torchfix.guards import known_issues as ki

    graphs = []

    def keep(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm

    row = torchfix.add_known_issue(torchfix.KnownIssue("cpu", ("mm",), ki.any_noncontiguous, "test#compiled", "contiguous"))
    try:
        a, b = torch.randn(8, 8), torch.randn(8, 8).t()
        with torchfix.enabled(), torch.no_grad():
            eager = torch.mm(a, b)
            compiled = torch.compile(lambda x, y: torch.mm(x, y), backend=aot_autograd(fw_compiler=keep), fullgraph=True)(a, b)
    finally:
        torchfix.remove_known_issue(row)
    assert torch.equal(compiled, eager)
    assert any("aten.clone.default" in g for g in graphs), graphs  # the row's contiguous copy is in the graph


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_compiled_pipeline_matches_eager_bit_for_bit_with_a_fix_and_strict_raises(backend):
    pytest.importorskip("diffusers")
    from torchfix import testing

    pipe = testing.tiny_sd15_pipeline(layers=1)  # one resnet per block: half the graph to compile
    pipe.unet.down_blocks[1].attentions[0].proj_in.half()  # a stray fp16 layer: torch raises, torchfix casts per call
    with pytest.raises(RuntimeError, match="type"):
        testing.latents(pipe, steps=2)
    with torchfix.enabled():
        eager = testing.latents(pipe, steps=3)
        unet = pipe.unet
        pipe.unet = torch.compile(unet, backend=backend)
        try:
            assert torch.equal(testing.latents(pipe, steps=3), eager)
            with torchfix.enabled(mode="strict"), pytest.raises(torchfix.DtypeMismatchError):
                testing.latents(pipe, steps=2)  # the mode change reaches the compiled UNet
        finally:
            pipe.unet = unet


class _Kept(torch.nn.Module):
    """A bf16 model whose ``proj`` stays float32 (listed), with an fp16 buffer it multiplies by."""

    _keep_in_fp32_modules = ("proj",)

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 8).to(torch.bfloat16)
        self.proj = torch.nn.Linear(8, 8)  # float32 on purpose: F.linear(bf16, fp32) raises, its input is cast up
        self.register_buffer("mix", torch.randn(8, 8, dtype=torch.float16))  # a buffer follows the activations

    def forward(self, x):
        return torch.matmul(self.proj(self.inp(x)).to(torch.bfloat16), self.mix)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("how", ["torch.compile", "Module.compile"])
def test_kept_modules_and_buffers_decide_compiled_as_eagerly(backend, how):
    """_keep_in_fp32_modules and buffers are known from marks on the tensors, which dynamo reads and
    guards on: compiled == eager, bit for bit (without the marks the compiled proj casts its weight
    down and the matmul promotes to float32)."""
    model = _Kept()
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    with torchfix.enabled(), torch.no_grad():
        eager = model(x)
        if how == "torch.compile":
            compiled = torch.compile(model, backend=backend, fullgraph=True)
        else:
            compiled = _Kept()
            compiled.load_state_dict(model.state_dict())
            compiled.compile(backend=backend, fullgraph=True)
        got = compiled(x)
    assert eager.dtype == torch.bfloat16  # the model's dtype (bf16: the kept fp32 proj does not count) won against the buffer
    assert eager.dtype == got.dtype and torch.equal(got, eager)
    upcast = torch.nn.functional.linear(model.inp(x).float(), model.proj.weight, model.proj.bias)
    assert torch.equal(eager, torch.matmul(upcast.to(torch.bfloat16), model.mix.to(torch.bfloat16)))


def test_keep_dtype_decides_compiled_as_eagerly_and_the_decorator_form_is_torchs():
    lin = torchfix.keep_dtype(torch.nn.Linear(8, 8))  # kept in float32 on purpose: its input is cast up
    x = torch.randn(2, 8, dtype=torch.bfloat16)

    def f(x):
        return lin(x * 2)

    with torchfix.enabled(), torch.no_grad():
        eager = f(x)
        decorated = torch.compile(backend="eager", fullgraph=True)(f)  # torch.compile(...)(fn), as torch gives it
        got = decorated(x)
    assert eager.dtype == torch.float32 and torch.equal(got, eager)


def test_wrap_marks_kept_tensors_and_unwrap_removes_its_marks():
    pytest.importorskip("diffusers")
    from torchfix import _kept, testing

    pipe = testing.tiny_sd15_pipeline()
    pipe.text_encoder._keep_in_fp32_modules = ["final_layer_norm"]
    try:
        weight = next(m for n, m in pipe.text_encoder.named_modules() if n.endswith("final_layer_norm")).weight
        buffer = next(pipe.text_encoder.buffers())
        wrapped = torchfix.wrap(pipe)
        wrapped.preflight()
        assert _kept.is_kept(weight, ()) and _kept.is_owned(buffer, None)
        wrapped.unwrap()
        assert not _kept.is_kept(weight, ()) and not _kept.is_owned(buffer, None)
        assert _kept.KEEP not in weight.__dict__ and _kept.OWNED not in buffer.__dict__
    finally:
        del pipe.text_encoder._keep_in_fp32_modules
