"""Patch mechanics: by handle, reversible, never stacked, polite to others."""

from __future__ import annotations

import types

import pytest
import torch

import torchfix
from torchfix.patches import PATCHES, Patch


def test_round_trip_on_module_and_inherited_attribute():
    ns = types.SimpleNamespace(f=len)
    p = Patch(ns, "f", "ns.f", lambda orig: lambda x: orig(x) * 10)
    p.install()
    p.install()  # idempotent: no wrapper over a wrapper
    assert ns.f("abc") == 30
    p.remove()
    assert ns.f is len

    class Base:
        def g(self):
            return 1

    class Child(Base):
        pass

    q = Patch(Child, "g", "Child.g", lambda orig: lambda self: orig(self) + 1)
    q.install()
    assert Child().g() == 2 and "g" in vars(Child)
    q.remove()
    assert "g" not in vars(Child) and Child.g is Base.g


def test_someone_patching_after_us_is_left_alone():
    ns = types.SimpleNamespace(f=len)
    p = Patch(ns, "f", "ns.f", lambda orig: lambda x: orig(x))
    p.install()
    theirs = lambda x: 0  # noqa: E731
    ns.f = theirs
    with pytest.warns(torchfix.TorchfixWarning, match="replaced by someone else"):
        p.remove()
    assert ns.f is theirs and not p.installed


def test_wrappers_carry_spec_and_original():
    torchfix.enable()
    for p in PATCHES:
        wrapper = getattr(p.owner, p.name)
        assert wrapper.__wrapped__ is p.original
        assert wrapper.__torchfix_spec__.name in p.label or p.label.endswith(p.name)


def test_tensor_subclasses_and_torch_function_still_dispatch():
    class Tagged(torch.Tensor):
        pass

    a = torch.randn(2, 2).as_subclass(Tagged)
    with torchfix.enabled():
        out = a @ torch.randn(2, 2)
        assert type(out) is Tagged
        assert type(torch.cat([a, a])) is Tagged


def test_non_tensor_arguments_reach_torch_unchanged():
    with torchfix.enabled():
        with pytest.raises(TypeError):
            torch.matmul(torch.randn(2, 2), [[1.0, 2.0], [3.0, 4.0]])
        assert (torch.randn(2, 2) @ torch.eye(2)).shape == (2, 2)
    with pytest.raises((RuntimeError, ValueError)) as plain:
        torch.cat([])
    with torchfix.enabled(), pytest.raises((RuntimeError, ValueError)) as guarded:
        torch.cat([])  # torch's own error, unchanged
    assert type(guarded.value) is type(plain.value) and str(guarded.value) == str(plain.value)


def test_a_wrapper_put_over_ours_is_adopted_on_the_next_enable_never_stacked():
    import functools

    import torch.nn.functional as F

    from .. import conftest

    original = conftest.ORIGINALS["torch.nn.functional.linear"]
    torchfix.enable()
    ours = F.linear

    @functools.wraps(ours)
    def theirs(*args, **kwargs):  # another library's instrumentation, installed after torchfix
        return ours(*args, **kwargs)

    F.linear = theirs
    try:
        with pytest.warns(torchfix.TorchfixWarning, match="replaced by someone else"):
            torchfix.disable()
        assert F.linear is theirs
        x, w = torch.randn(2, 4, dtype=torch.bfloat16), torch.randn(3, 4, dtype=torch.float16)
        with pytest.raises(RuntimeError):
            F.linear(x, w)  # torchfix off: ours inside theirs calls straight through
        torchfix.enable()
        assert F.linear is theirs  # ours is active again inside theirs; no second torchfix wrapper on top
        F.linear(x, w)
        assert len(torchfix.report().events) == 1  # guarded and recorded once, not twice
        torchfix.disable()
    finally:
        F.linear = original


def test_a_failed_install_counts_nothing_and_leaves_nothing_installed(monkeypatch):
    from torchfix import _context, _state, patches
    from torchfix.config import OFF

    def broken(orig):
        raise RuntimeError("cannot build the wrapper")

    monkeypatch.setattr(PATCHES[3], "_make", broken)
    monkeypatch.setattr(PATCHES[3], "_built", None)  # no wrapper kept from an earlier install: this one must be built
    with pytest.raises(RuntimeError, match="cannot build"):
        torchfix.enable()
    assert patches.installed() == [] and _state._holders == 0 and _context.get_global() is OFF
    with pytest.raises(RuntimeError, match="cannot build"), torchfix.enabled():
        pass
    assert patches.installed() == [] and _state._holders == 0
    monkeypatch.undo()
    torchfix.enable()
    assert patches.installed() == [p.label for p in patches.ALL] + patches.libraries.installed()


def test_every_restore_path_leaves_theirs_and_says_so():
    from torchfix.patches import instance

    ns = types.SimpleNamespace()
    handle = instance.set_attr(ns, "forward", len)
    ns.forward = abs  # replaced by someone else since
    with pytest.warns(torchfix.TorchfixWarning, match="SimpleNamespace.forward was replaced by someone else"):
        handle.restore()
    assert ns.forward is abs
    lin = torch.nn.Linear(2, 2)
    swap = instance.swap_tensor(lin, "weight", lambda t: t.half())
    lin.weight.data = torch.zeros(2, 2)
    with pytest.warns(torchfix.TorchfixWarning, match="Linear.weight was replaced by someone else"):
        swap.restore()
    assert torch.equal(lin.weight, torch.zeros(2, 2))


def test_dynamo_table_names_torch_originals_after_torchfix_was_on():
    """Dynamo builds its table of torch functions once; built while torchfix's wrappers were
    installed it knew a wrapper, not torch.cat, and plain torch.compile graph-broke afterwards."""
    rules = pytest.importorskip("torch._dynamo.trace_rules")
    torchfix.disable()
    rules.clear_lru_cache()
    try:
        with torchfix.enabled():
            rules.get_torch_obj_rule_map()  # built while the wrappers are installed
        table = rules.get_torch_obj_rule_map()
        assert torch.cat in table and torch.matmul in table
        assert not [k for k in table if getattr(k, "__torchfix_spec__", None) is not None]

        def f(x):
            return torch.cat([torch.matmul(x, x), x], dim=1)

        torch._dynamo.reset()
        assert torch._dynamo.explain(f)(torch.randn(3, 3)).graph_break_count == 0
    finally:
        torch._dynamo.reset()


def test_dynamo_set_of_tensor_methods_names_torch_originals():
    """Dynamo's set of Tensor methods is built once too; built while a wrapper sat on Tensor.mm it
    lacked TensorBase.mm, and torch.Tensor.mm(x, y) failed under fullgraph compile, with torchfix on
    and after disable() alike."""
    rules = pytest.importorskip("torch._dynamo.trace_rules")

    def f(x, y):
        return torch.Tensor.mm(x, y) + torch.Tensor.__matmul__(x, y) + torch.Tensor.addmm(x, x, y)

    def compiled_matches(x):
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="eager")(x, x), f(x, x), rtol=0, atol=0)

    def build_while_on() -> None:
        rules.get_tensor_method.cache_clear()
        rules.get_tensor_method()  # built from the attributes in place: the wrappers
        assert torch.Tensor.mm not in rules.get_tensor_method()  # Tensor.mm is the wrapper here

    torchfix.disable()
    x = torch.randn(3, 3)
    try:
        with torchfix.enabled():
            build_while_on()
        assert torch.Tensor.mm in rules.get_tensor_method()  # set right again on removal
        assert torch.Tensor.__matmul__ in rules.get_tensor_method()
        compiled_matches(x)  # plain torch.compile after torchfix was on
        with torchfix.enabled():
            build_while_on()
            compiled_matches(x)  # torchfix on: torch.compile sets it right before tracing
            originals = [p.original for p in PATCHES if p.owner is torch.Tensor and p.installed]
            builtin = [o for o in originals if isinstance(o, (types.MethodDescriptorType, types.WrapperDescriptorType))]
            assert len(builtin) >= 6 and all(o in rules.get_tensor_method() for o in builtin)
            assert isinstance(torch.Tensor.mm, types.FunctionType)  # the wrapper is back after the rebuild
    finally:
        torch._dynamo.reset()


def test_torchscript_sees_through_the_wrappers_of_torch_builtins():
    """torch.jit.script of nn.Linear / nn.Conv2d failed while torchfix was on: TorchScript looked
    for F.linear among its builtins by identity and tried to compile the wrapper instead."""
    from torchfix.patches import compilers

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(2, 2, 1)
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(self.conv(x))
            return torch.cat([torch.matmul(y, y), y], dim=1)

    net, x = Net().eval(), torch.randn(1, 2, 4, 4)
    torchfix.disable()
    want = net(x)
    with torchfix.enabled():  # scripted first here: TorchScript caches what it compiled per class
        got = torch.jit.script(net)(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert compilers._scripted == {}  # every registration dropped with the wrappers
    table = torch.jit._builtins._get_builtin_table()
    assert all(table.get(id(p.original)) for p in PATCHES if p.label in ("torch.cat", "torch.nn.functional.linear"))


def test_torchscript_compiles_torchs_own_python_functions_under_the_wrappers():
    """torch.jit.script of nn.LayerNorm / nn.GroupNorm failed while torchfix was on ("undefined value
    has_torch_function_variadic"): TorchScript compiled F.layer_norm's source with the wrapper's globals."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = torch.nn.LayerNorm(4)
            self.gn = torch.nn.GroupNorm(2, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.ln(self.gn(x)) + torch.nn.functional.layer_norm(x, (4,))

    net, x = Net().eval(), torch.randn(2, 4, 3, 4)
    torchfix.disable()
    want = net(x)
    with torchfix.enabled():
        scripted = torch.jit.script(net)
        assert torch.equal(scripted(x), want)
    assert torch.equal(scripted(x), want)
