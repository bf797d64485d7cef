"""torch.ops.torchfix.matmul under torch.compile(fullgraph=True), torch.export
(save/load, dynamic batch) and torch-mlir (through the shipped decomposition)."""

from __future__ import annotations

import pytest
import torch

import torchfix


class Attn(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.ops.torchfix.matmul(a, b.transpose(-1, -2), out_dtype=torch.float32)


def inputs(batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(batch)
    return torch.randn(batch, 8, 16, generator=g).half(), torch.randn(batch, 12, 16, generator=g).bfloat16()


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compile_fullgraph(backend):
    torch._dynamo.reset()
    model = Attn()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    for batch in (2, 3):
        a, b = inputs(batch)
        assert torch.equal(compiled(a, b), model(a, b))


def test_export_save_load_with_dynamic_batch(tmp_path):
    a, b = inputs(2)
    batch = torch.export.Dim("batch")
    ep = torch.export.export(Attn(), (a, b), dynamic_shapes=({0: batch}, {0: batch}))
    assert "torchfix.matmul" in ep.graph_module.code
    path = tmp_path / "attn.pt2"
    torch.export.save(ep, path)
    loaded = torch.export.load(path).module()
    a5, b5 = inputs(5)
    assert torch.equal(loaded(a5, b5), Attn()(a5, b5))


def test_export_decomposes_to_aten():
    a, b = inputs(2)
    ep = torch.export.export(Attn(), (a, b)).run_decompositions(torchfix.kernels.DECOMPOSITIONS)
    assert "torchfix" not in ep.graph_module.code
    assert torch.allclose(ep.module()(a, b), Attn()(a, b), atol=1e-5)


def test_torch_mlir_lowers_through_the_decomposition():
    fx = pytest.importorskip("torch_mlir.fx", reason="torch-mlir is the `audit` extra")
    a, b = inputs(2)
    module = fx.export_and_import(Attn(), a, b, output_type="linalg-on-tensors", decomposition_table=torchfix.kernels.DECOMPOSITIONS)
    text = str(module)
    assert "linalg.batch_matmul" in text or "linalg.matmul" in text
    assert "torch.operator" not in text
