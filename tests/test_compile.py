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
