"""Per-object handles (torchfix.patches.instance): where torchfix's forward sits among diffusers' hooks."""

from __future__ import annotations

import pytest
import torch

from torchfix.patches import instance

pytest.importorskip("diffusers")


def test_place_moves_torchfix_inside_or_outside_diffusers_context_parallel_hooks():
    from diffusers.hooks import HookRegistry, ModelHook

    class Split(ModelHook):  # stands in for diffusers' ContextParallelSplitHook: halves the input's tokens
        def pre_forward(self, module, *args, **kwargs):
            return (args[0][:, :2],), kwargs

    def seen_by_us(outside: bool) -> tuple:
        module = torch.nn.Linear(3, 3)
        HookRegistry.check_if_exists_or_initialize(module).register_hook(Split(), "cp_input---")
        seen = []

        def make(original, source):
            def forward(x):
                seen.append(x.shape[1])
                return original(x)

            return forward

        handle = instance.wrap_forward(module, "torchfix_test", make)
        before = list(module._diffusers_hook._hook_order)
        moved = instance.place(handle, lambda n: n.startswith("cp_input---"), outside=outside)
        out = module(torch.ones(1, 4, 3))
        assert handle.in_path()
        assert instance.place(handle, lambda n: n.startswith("cp_input---"), outside=outside) is False  # in place now
        handle.restore()
        assert module._diffusers_hook._hook_order == ["cp_input---"] and module(torch.ones(1, 4, 3)).shape[1] == 2
        return before, moved, list(seen), out.shape[1]

    assert seen_by_us(outside=True) == (["cp_input---", "torchfix_test"], False, [4], 2)  # already outside: the whole input
    assert seen_by_us(outside=False) == (["cp_input---", "torchfix_test"], True, [2], 2)  # moved inside: the shard


def test_place_refuses_to_move_past_another_librarys_hook():
    from diffusers.hooks import HookRegistry, ModelHook

    module = torch.nn.Linear(3, 3)
    registry = HookRegistry.check_if_exists_or_initialize(module)
    registry.register_hook(ModelHook(), "cp_input---")
    registry.register_hook(ModelHook(), "someone_else")
    handle = instance.wrap_forward(module, "torchfix_test", lambda original, source: original)
    with pytest.raises(RuntimeError, match="someone_else"):
        instance.place(handle, lambda n: n.startswith("cp_input---"), outside=False)
    assert registry._hook_order == ["cp_input---", "someone_else", "torchfix_test"]  # nothing moved
    handle.restore()


def test_shadowed_lists_stand_in_for_a_module_list_and_are_put_back_even_when_the_block_raises():
    model = torch.nn.Module()
    model.blocks = blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    keys = set(model.state_dict())
    stand_in = [blocks[0], lambda x: x]
    with instance.shadowed(model, {"blocks": stand_in}):
        assert model.blocks is stand_in and set(model.state_dict()) == keys  # the children stay registered
        x = torch.ones(1, 2)
        assert model.blocks[1](x) is x
    assert model.blocks is blocks and "blocks" not in vars(model)
    with pytest.raises(RuntimeError, match="inside"):
        with instance.shadowed(model, {"blocks": stand_in}):
            raise RuntimeError("inside")
    assert model.blocks is blocks and "blocks" not in vars(model)


def test_shadowed_refuses_a_name_someone_else_shadows_and_leaves_a_replacement_in_place():
    from torchfix import TorchfixWarning
    from torchfix.errors import TorchfixError

    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([torch.nn.Identity()])
    theirs = ["theirs"]
    vars(model)["blocks"] = theirs
    with pytest.raises(TorchfixError, match="already an instance attribute"):
        with instance.shadowed(model, {"blocks": []}):
            pass
    assert model.blocks is theirs
    del vars(model)["blocks"]
    with pytest.warns(TorchfixWarning, match="replaced by someone else"):
        with instance.shadowed(model, {"blocks": []}):
            vars(model)["blocks"] = theirs
    assert model.blocks is theirs
