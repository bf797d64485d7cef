"""The device guard: CPU vs meta (silent garbage in plain torch), policies, scalars."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import torchfix
from torchfix.guards import device as device_guard
from torchfix.guards.plan import Operand

CPU, META = torch.device("cpu"), torch.device("meta")


def test_plain_torch_returns_garbage_for_meta_weights():
    # The reason the default policy is "error": torch does not raise here.
    out = torch.mm(torch.randn(2, 4), torch.empty(4, 3, device="meta"))
    assert out.device.type == "cpu"


def test_meta_weight_raises_before_the_op_runs():
    model = torch.nn.Sequential()
    model.add_module("proj", torch.nn.Linear(4, 3, device="meta"))
    for mode in ("fix", "warn", "strict"):
        with torchfix.enabled(mode=mode, device_policy="align"), pytest.raises(torchfix.DeviceMismatchError) as info:
            model(torch.randn(2, 4))
        msg = str(info.value)
        assert "meta" in msg and "never loaded" in msg and "proj" in msg and "test_device.py:" in msg
        assert "silently" in msg and "weight" in msg and "load" in msg


def test_mm_meta_raises():
    with torchfix.enabled(), pytest.raises(torchfix.DeviceMismatchError, match=r"torch\.mm"):
        torch.mm(torch.randn(2, 4), torch.empty(4, 3, device="meta"))


def test_all_meta_is_fine():
    with torchfix.enabled():
        out = F.linear(torch.empty(2, 4, device="meta"), torch.empty(3, 4, device="meta"))
    assert out.device.type == "meta" and out.shape == (2, 3)


def test_policy_error_and_align_pure():
    ops = [Operand("input", torch.float32, torch.device("cuda", 1)), Operand("weight", torch.float32, torch.device("cuda", 0))]
    f = device_guard.decide(ops, "error")
    assert f.actions == () and "cuda:1" in f.problem and "device_policy='align'" in f.fix
    f = device_guard.decide(ops, "align")
    assert [(a.operand, a.to) for a in f.actions] == [("input", torch.device("cuda", 0))]


def test_align_goes_to_first_tensor_without_weights():
    ops = [Operand("input", torch.float32, torch.device("cuda", 0)), Operand("other", torch.float32, CPU)]
    f = device_guard.decide(ops, "align")
    assert [(a.operand, a.to) for a in f.actions] == [("other", torch.device("cuda", 0))]


def test_cpu_scalars_are_legal_next_to_accelerators():
    ops = [Operand("input", torch.float32, torch.device("cuda", 0)), Operand("other", torch.float32, CPU, scalar=True)]
    assert device_guard.decide(ops, "error") is None
    # ...but not next to meta, and a 0-dim tensor on an accelerator is not special
    ops = [Operand("input", torch.float32, torch.device("cuda", 0), scalar=True), Operand("other", torch.float32, CPU)]
    assert device_guard.decide(ops, "error") is not None


def test_two_handles_to_one_device_are_one_device():
    ops = [Operand("input", torch.float32, torch.device("cpu")), Operand("other", torch.float32, torch.device("cpu", 0))]
    assert device_guard.decide(ops, "error") is None


def test_device_guard_off_lets_torch_decide():
    with torchfix.enabled(guards=("dtype",)):
        out = torch.mm(torch.randn(2, 4), torch.empty(4, 3, device="meta"))
    assert out.device.type == "cpu"


# --- an index and its data: embedding, index_select, gather (#48) ----------------------------------------------------
# The device reports behind most text-encoder crashes: input ids on the CPU into a CUDA encoder's token embedding
# (diffusers#5060, sdnext#3592, transformers#34706). The CUDA path runs here under FakeTensorMode, where a "cuda"
# tensor needs no GPU and torch's device check raises as on a GPU; the meta device stands in where torch computes.


class _TokenEmbeddings(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.token_embedding = torch.nn.Embedding(*weight.shape, _weight=weight, _freeze=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.token_embedding(ids)


class _TextEncoder(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.embeddings = _TokenEmbeddings(weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embeddings(ids)


@pytest.fixture
def fake_cuda():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), torch.no_grad():
        yield


def test_cpu_ids_into_a_cuda_token_embedding_name_op_module_devices_and_fix(fake_cuda):
    encoder = _TextEncoder(torch.empty(100, 8, device="cuda"))
    ids = torch.zeros(1, 77, dtype=torch.long)
    # plain torch's error (FakeTensor's wording before torch 2.13: "found two different devices")
    same_device = "Expected all tensors to be on the same device|found two different devices"
    with pytest.raises(RuntimeError, match=same_device):
        encoder(ids)
    with torchfix.enabled("fix"), pytest.raises(torchfix.DeviceMismatchError) as info:
        encoder(ids)
    text = str(info.value)
    for part in ("F.embedding", "embeddings.token_embedding", "input on cpu", "weight on cuda:0", "input.to('cuda:0')", "align"):
        assert part in text, (part, text)
    assert re.search(same_device, str(info.value.__cause__))


def test_align_moves_the_ids_to_the_embedding_never_the_table(fake_cuda):
    encoder = _TextEncoder(torch.empty(100, 8, device="cuda"))
    ids = torch.zeros(1, 77, dtype=torch.long)
    torchfix.report().clear()
    with torchfix.enabled("fix", device_policy="align"):
        out = encoder(ids)
    assert out.device == torch.device("cuda", 0) and out.shape == (1, 77, 8)
    assert encoder.embeddings.token_embedding.weight.device.type == "cuda" and ids.device.type == "cpu"
    assert [(e.op, e.guard, e.action, e.change, e.module) for e in torchfix.report().events] == [
        ("F.embedding", "device", "move", "cpu→cuda:0", "embeddings.token_embedding")
    ]


LOOKUPS = {
    "torch.index_select": lambda x, i: torch.index_select(x, 0, i),
    "Tensor.index_select": lambda x, i: x.index_select(0, i),
    "torch.gather": lambda x, i: torch.gather(x, 0, i.view(-1, 1).expand(-1, x.shape[1])),
    "Tensor.gather": lambda x, i: x.gather(0, i.view(-1, 1).expand(-1, x.shape[1])),
}


@pytest.mark.parametrize("op", sorted(LOOKUPS))
def test_a_cpu_index_into_cuda_data_is_named_and_aligned_to_the_data(fake_cuda, op):
    data, index = torch.empty(6, 4, device="cuda"), torch.tensor([0, 2, 5])
    with torchfix.enabled("fix"), pytest.raises(torchfix.DeviceMismatchError) as info:
        LOOKUPS[op](data, index)
    assert op in str(info.value) and "index on cpu" in str(info.value) and "index.to('cuda:0')" in str(info.value)
    torchfix.report().clear()
    with torchfix.enabled("fix", device_policy="align"):
        out = LOOKUPS[op](data, index)
    assert out.device == torch.device("cuda", 0)
    assert [(e.action, e.change) for e in torchfix.report().events] == [("move", "cpu→cuda:0")]


INDEX_CALLS = {  # (data, index) -> the call
    "F.embedding": lambda w, i: F.embedding(i, w),
    "nn.Embedding": lambda w, i: torch.nn.Embedding(*w.shape, _weight=w, _freeze=True)(i),
    **LOOKUPS,
}


@pytest.mark.parametrize("meta", ["data", "index"])
@pytest.mark.parametrize("op", sorted(INDEX_CALLS))
def test_a_meta_data_or_index_is_named_where_torch_computes_garbage(op, meta):
    data, index = torch.randn(6, 4), torch.tensor([0, 2, 5])
    plain = INDEX_CALLS[op](data, index)
    args = (data.to("meta"), index) if meta == "data" else (data, index.to("meta"))
    INDEX_CALLS[op](*args)  # plain torch: no error (a meta result, or a CPU tensor computed from no data)
    with torchfix.enabled("fix"), pytest.raises(torchfix.DeviceMismatchError, match="meta"):
        INDEX_CALLS[op](*args)
    with torchfix.enabled("fix"):
        assert torch.equal(INDEX_CALLS[op](data, index), plain)  # one device: torch's own result
        assert INDEX_CALLS[op](data.to("meta"), index.to("meta")).is_meta  # all on meta: shape inference, left alone


def test_torchs_own_index_error_runs_once_and_comes_back_untouched():
    class Count(torch.overrides.TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") == "embedding":
                Count.calls += 1
            return func(*args, **(kwargs or {}))

    weight, ids = torch.randn(5, 4), torch.tensor([7])
    with pytest.raises(IndexError) as plain:
        F.embedding(ids, weight)
    with torchfix.enabled("fix"), Count(), pytest.raises(IndexError) as guarded:
        F.embedding(ids, weight)
    assert str(guarded.value) == str(plain.value) and Count.calls == 1
