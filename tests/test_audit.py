"""torchfix.audit: findings read from torch-mlir's typed IR, mapped to module paths."""

from __future__ import annotations

import pytest
import torch

import torchfix
from torchfix.audit import AuditError


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda: torchfix.audit(lambda x: x, torch.randn(2)), TypeError, r"model must be a torch.nn.Module .* got function"),
        (
            lambda: torchfix.audit(torch.nn.Linear(2, 2), torch.randn(1, 2), backend="tpu"),
            ValueError,
            r"backend='tpu' .* allowed: 'cpu', 'cuda', 'mps'",
        ),
        (
            lambda: torchfix.audit(torch.nn.Linear(2, 2), torch.randn(1, 2), torch_version="banana"),
            ValueError,
            r"torch_version='banana' is not a version",
        ),
        (
            lambda: torchfix.audit(torch.nn.Linear(2, 2), torch.randn(1, 2), os_version="fifteen"),
            ValueError,
            r"os_version='fifteen' is not a version",
        ),
        (
            lambda: torchfix.audit(torch.nn.Linear(2, 2), torch.randn(1, 2), torch_version=2.13),
            TypeError,
            r"torch_version must be a version string",
        ),
    ],
)
def test_bad_arguments_are_named_before_anything_is_traced(call, error, match):
    with pytest.raises(error, match=match):
        call()


pytest.importorskip("torch_mlir", reason="torch-mlir is the `audit` extra")


def test_a_bf16_model_with_a_stray_fp16_layer():
    """Needs ml_dtypes (in the audit and dev extras): torch-mlir imports bf16 constants through it."""
    model = named(encoder=torch.nn.Linear(8, 8), head=torch.nn.Linear(8, 4).half()).to(torch.bfloat16)
    model.head.half()
    report = torchfix.audit(model, torch.randn(2, 8, dtype=torch.bfloat16))
    assert hazards(report) == [("head", "aten.linear", "mixed-dtype")]
    assert "bf16[2,8]" in report.findings[0].detail and "f16[4,8] → bf16" in report.findings[0].detail


def named(**modules: torch.nn.Module) -> torch.nn.Sequential:
    seq = torch.nn.Sequential()
    for name, m in modules.items():
        seq.add_module(name, m)
    return seq


def hazards(report) -> list[tuple[str, str, str]]:
    return [(f.module, f.op, f.hazard) for f in report.findings]


def test_stray_fp16_layer():
    model = named(encoder=torch.nn.Linear(8, 8), head=torch.nn.Linear(8, 4).half())
    report = torchfix.audit(model, torch.randn(2, 8))
    assert hazards(report) == [("head", "aten.linear", "mixed-dtype")]
    [f] = report.findings
    assert f.fixed_at_run_time and "f16[4,8] → f32" in f.detail and "f32[2,8]" in f.detail
    assert "!torch.vtensor<[4,8],f16>" in report.ir  # the typed IR the finding was read from
    assert "head" in report.summary() and "mixed-dtype" in report.summary()


def test_meta_weight():
    with torch.device("meta"):
        head = torch.nn.Linear(8, 4)
    report = torchfix.audit(named(body=torch.nn.Linear(8, 8), head=head), torch.randn(2, 8))
    assert hazards(report) == [("head", "aten.linear", "meta-device")]
    assert "weight float32[4, 8] on meta" in report.findings[0].detail and not report.findings[0].fixed_at_run_time


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, _ = self.qkv(x).view(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
        return q @ k.transpose(-1, -2)


def test_permute_feeding_a_matmul_under_mps():
    model = named(block=named(attn=Attention()))
    report = torchfix.audit(model, torch.randn(2, 5, 8), backend="mps", torch_version="1.12.1")
    assert ("block.attn", "aten.matmul", "known-issue") in hazards(report)
    f = next(f for f in report.findings if f.hazard == "known-issue")
    assert "pytorch/pytorch#78511" in f.detail and "strides" in f.detail
    # the row is fixed in torch 1.13; no backend, no layout findings
    assert not [h for h in hazards(torchfix.audit(model, torch.randn(2, 5, 8), backend="mps")) if h[2] == "known-issue"]
    assert not torchfix.audit(model, torch.randn(2, 5, 8)).findings


class Promote(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.half() + x


def test_silent_fp32_promotion():
    report = torchfix.audit(Promote(), torch.randn(3, 4))
    assert hazards(report) == [("", "aten.add.Tensor", "fp32-promotion")]
    assert "f16[3,4]" in report.findings[0].detail and not report.findings[0].fixed_at_run_time


def test_clean_model_and_torchfix_op_inside():
    class UsesKernel(torch.nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.ops.torchfix.matmul(a, b.transpose(-1, -2))

    assert not torchfix.audit(torch.nn.Linear(4, 2), torch.randn(3, 4)).findings
    report = torchfix.audit(UsesKernel(), torch.randn(3, 4), torch.randn(5, 4))
    assert not report.findings and "torch.aten.matmul" in report.ir


def test_unexportable_model_is_a_clear_error():
    class DataDependent(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[x > 0].sum() if float(x.sum()) > 0 else x

    with pytest.raises(AuditError, match=r"torch\.export could not trace DataDependent") as err:
        torchfix.audit(DataDependent(), torch.randn(3))
    assert err.value.__cause__ is not None


def test_audit_leaves_torchfix_as_it_was():
    torchfix.audit(named(a=torch.nn.Linear(4, 4), b=torch.nn.Linear(4, 2).half()), torch.randn(2, 4))
    assert not torchfix.is_enabled() and not torchfix.report().events


class _Autocast(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            z = self.a(x) + x  # linear runs in bf16 under autocast; the add then widens it back to f32
        return self.b(z)


def test_autocast_regions_are_named_and_their_casts_are_not_torchfix_casts():
    report = torchfix.audit(_Autocast(), torch.randn(2, 4))
    assert hazards(report) == [("", "aten.add.Tensor", "fp32-promotion")]  # autocast's own casts feed aten.linear: no mixed-dtype
    assert "inside torch.autocast(cpu, bfloat16)" in report.findings[0].detail
    assert "torchfix-audit:" in report.ir  # the locations the findings were mapped through


def test_transformers_text_encoders_audit():
    """CLIP and T5 keep position ids as non-persistent buffers, which torch.export puts in `constants`: torch-mlir's
    importer failed with "Could not find state mapping for buffer" (llvm/torch-mlir#4744), so the README's own stray
    `text_projection` could not be audited (#40)."""
    pytest.importorskip("transformers")
    from torchfix import testing

    ids = torch.zeros(1, 77, dtype=torch.long)
    clip = testing.tiny_text_encoder(with_projection=True)
    assert torchfix.audit(clip, ids).findings == []
    assert torchfix.audit(testing.tiny_t5_encoder(), ids[:, :16]).findings == []
    clip.text_projection.to(torch.float16)  # the stray layer of a bf16/fp32 pipeline
    found = torchfix.audit(clip, ids).findings
    assert [(f.module, f.op, f.hazard) for f in found] == [("text_projection", "aten.linear", "mixed-dtype")]
    assert "plain torch raises" in found[0].detail
    assert clip.text_projection.weight.dtype == torch.float16  # audited, not changed
