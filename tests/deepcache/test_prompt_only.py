"""Prompt-only modules (a family entry's ``prompt_only``): a cached step reuses what they returned at the last full
step, only where they are called with what they got then, so the result is bit-identical to running them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import torchfix
from torchfix import families

pytest.importorskip("diffusers")

from torchfix.deepcache import prompt_only
from torchfix.testing.families import FAMILIES, _timestep, _update, denoise, output_of

CFG = torchfix.DeepCacheConfig(interval=3, num_steps=8)
# the registered families that name prompt-only modules (the day-0 ones: tests/families/test_from_code.py)
NAMES = [n for n in sorted(FAMILIES) if not n.startswith("auto:") and families.get(FAMILIES[n].family).prompt_only]


def built(name: str):
    """The builder ``name``, skipped where the installed diffusers predates its class."""
    tiny = FAMILIES[name]
    if (why := tiny.unavailable()) is not None:
        pytest.skip(why)
    return tiny


def flat(x) -> torch.Tensor:
    return torch.cat([t.flatten() for t in x]) if isinstance(x, list) else x.flatten()


@pytest.fixture
def without_prompt_only():
    """Run a family as if its entry named no prompt-only modules (put back afterwards)."""
    changed = []

    def off(name: str) -> None:
        family = families.get(name)
        changed.append(family)
        families.register(dataclasses.replace(family, prompt_only=()), replace=True)

    yield off
    for family in changed:
        families.register(family, replace=True)


def test_the_families_that_name_prompt_only_modules_have_them():
    assert set(NAMES) >= {"hunyuanvideo15", "zimage"}
    for name in NAMES:
        tiny = FAMILIES[name]
        if tiny.unavailable() is not None:  # a diffusers older than its class
            continue
        paths = families.get(tiny.family).prompt_only
        assert len(prompt_only.modules(tiny.build(), paths)) >= len(paths), name


@pytest.mark.parametrize("name", NAMES)
def test_cached_steps_reuse_them_bit_identically(name, without_prompt_only):
    tiny = built(name)
    model = tiny.build()
    state = torchfix.deepcache.apply(model, CFG)
    reused = denoise(model, tiny, prompts=(0, 1))
    names = state.plan.prompt_only_names
    assert state.prompt_only_reused == len(names) * 5 * 2  # every prompt-only call of 5 cached steps, 2 guidance passes
    assert "prompt-only, reused on cached steps" in torchfix.deepcache.stats(model)["blocks"]
    torchfix.deepcache.remove(model)
    without_prompt_only(tiny.family)
    state = torchfix.deepcache.apply(model, CFG)
    ran = denoise(model, tiny, prompts=(0, 1))
    assert state.prompt_only_reused == 0
    assert all(torch.equal(flat(a), flat(b)) for p in range(2) for a, b in zip(reused[p], ran[p]))
    torchfix.deepcache.remove(model)


def test_a_prompt_changed_in_place_or_replaced_runs_them(without_prompt_only):
    """A cached step whose prompt-only module gets other values than at the last full step runs it: the prompt
    tensor changed in place after step 2 (full), then replaced by a new tensor of other values after step 5 (full)."""
    tiny = built("hunyuanvideo15")

    def run(model: torch.nn.Module) -> list[torch.Tensor]:
        args = tiny.arguments()
        latents, outs = args[tiny.latent], []
        with torch.no_grad():
            for i in range(8):
                if i == 3:
                    args["encoder_hidden_states_2"].mul_(2.0)
                if i == 6:
                    args["encoder_hidden_states_2"] = args["encoder_hidden_states_2"] + 1.0
                out = output_of(model(**{**args, tiny.latent: latents, tiny.timestep: _timestep(tiny, 1 - i / 8, 1, latents)}))
                outs.append(out)
                latents = _update(latents, out, 1 / 8)
        return outs

    model = tiny.build()
    state = torchfix.deepcache.apply(model, CFG)
    checked = run(model)
    # cached steps 1, 3, 4, 6, 7: the ByT5 projection is reused on 1, on 4 (3 saw the tensor changed in place and ran
    # it) and on 7 (6 got a new tensor of other values and ran it); the image projection on all 5
    assert state.prompt_only_reused == 3 + 5
    torchfix.deepcache.remove(model)
    without_prompt_only(tiny.family)
    torchfix.deepcache.apply(model, CFG)
    assert all(torch.equal(a, b) for a, b in zip(checked, run(model)))
    torchfix.deepcache.remove(model)


def test_what_counts_as_the_same_call():
    a = torch.arange(4.0)
    held = prompt_only._marked(prompt_only.leaves(((a, None, 3), {"mask": a > 1, "scale": 1.0})))
    assert prompt_only.same(held, prompt_only.leaves(((a, None, 3), {"mask": a > 1, "scale": 1.0})))
    assert prompt_only.same(held, prompt_only.leaves(((a.clone(), None, 3), {"mask": a > 1, "scale": 1.0})))  # equal values
    for other in (
        ((a.double(), None, 3), {"mask": a > 1, "scale": 1.0}),  # another dtype
        ((a, None, 4), {"mask": a > 1, "scale": 1.0}),  # another number
        ((a, None, 3), {"mask": a > 1, "scale": 1.0, "more": 1}),  # another argument
        ((a, None, 3), {"mask": a > 2, "scale": 1.0}),  # other values
        ((a, None, 3), {"mask": a > 1, "scale": object()}),  # something it cannot compare
    ):
        assert not prompt_only.same(held, prompt_only.leaves(other)), other
    a.add_(1.0)  # the very tensor, changed in place since
    assert not prompt_only.same(held, prompt_only.leaves(((a, None, 3), {"mask": a > 1, "scale": 1.0})))


def test_with_a_threshold_the_steps_the_features_decide_reuse_them(without_prompt_only):
    tiny = built("hunyuanvideo15")
    model = tiny.build()
    config = torchfix.DeepCacheConfig(interval=4, threshold=1e9, num_steps=8, stop=1.0)  # 0 full, 1-3 cached, 4 full, ...
    state = torchfix.deepcache.apply(model, config)
    reused = denoise(model, tiny)[0]
    assert state.prompt_only_reused == len(state.plan.prompt_only_names) * 6
    torchfix.deepcache.remove(model)
    without_prompt_only(tiny.family)
    torchfix.deepcache.apply(model, config)
    assert all(torch.equal(a, b) for a, b in zip(reused, denoise(model, tiny)[0]))
    torchfix.deepcache.remove(model)
