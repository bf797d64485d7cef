"""torchfix and its cache on two gloo ranks (tests/deepcache/ranks.py runs them, once for the module): data parallelism
bit-identical with no communication; diffusers' context parallelism (Ulysses) bit-identical to plain under the guards
and wrap(), and every cache mode taking the single-process decisions and landing within 10x the rounding floor
measured here (plain context parallel against one process). Then what needs no second rank: the sums, the group, the
watch, the hook order, the CPU-build row."""

from __future__ import annotations

import pytest
import torch

from torchfix.deepcache import forecast, parallel

pytest.importorskip("diffusers")
pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()), reason="needs torch.distributed with gloo"
)

from tests.deepcache import ranks  # noqa: E402

EPS = torch.finfo(torch.float32).eps


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _no_context_parallelism() -> str | None:
    """Why the installed diffusers has no context parallelism (``enable_parallelism``, ``ContextParallelConfig``: added
    in diffusers 0.36.0), or ``None``."""
    import diffusers
    from packaging.version import Version

    if hasattr(diffusers, "ContextParallelConfig") or Version(diffusers.__version__) >= Version("0.36.0"):
        return None
    return f"diffusers {diffusers.__version__} has no context parallelism (ContextParallelConfig, added in diffusers 0.36.0)"


def _no_wan_prompt() -> str | None:
    from torchfix.testing import wan_prompt_unavailable

    return wan_prompt_unavailable()


NO_CP = _no_context_parallelism()
NO_WAN = NO_CP or _no_wan_prompt()
needs_cp = pytest.mark.skipif(NO_CP is not None, reason=NO_CP or "")
# the scenarios that need diffusers' context parallelism (everything but data parallelism), and Wan's text prompts
CP_SCENARIOS = ("unseen", "context_parallel_pipeline", "context_parallel_families", "context_parallel_wan22", "applied_before")
WAN_SCENARIOS = ("context_parallel_wan22",)


@pytest.fixture(scope="module")
def ran() -> list[dict]:
    left_out = (CP_SCENARIOS if NO_CP else ()) + (WAN_SCENARIOS if NO_WAN else ())
    results = ranks.launch(tuple(n for n in ranks.SCENARIOS if n not in left_out))
    errors = [f"rank {r} {name}:\n{v['error']}" for r, res in enumerate(results) for name, v in res.items() if "error" in v]
    assert not errors, "\n".join(errors)
    return results


@pytest.fixture(scope="module")
def flux_pipe():
    from torchfix.testing import tiny_flux_pipeline

    return tiny_flux_pipeline()


def test_data_parallel_is_bit_identical_to_one_process_and_never_communicates(ran, flux_pipe):
    assert [r["data_parallel"]["collectives"] for r in ran] == [[], []]
    for rank, prompts in ((0, ranks.PROMPTS[:2]), (1, ranks.PROMPTS[2:])):  # uneven: two prompts and one
        for prompt in prompts:
            got = ran[rank]["data_parallel"][prompt]
            one = ranks.pipeline_run(flux_pipe, prompt, wrapped=False)["latents"]
            for what in ("plain", "guarded", "wrapped"):
                assert torch.equal(got[what], one), (prompt, what)
            for mode, config in ranks.modes().items():
                ref = ranks.pipeline_run(flux_pipe, prompt, config)
                assert got[mode]["decisions"] == ref["decisions"], (prompt, mode)
                assert got[mode]["ranks"].startswith("one process (or data parallel")
                assert torch.equal(got[mode]["latents"], ref["latents"]), (prompt, mode)


def _floor(plain_cp: torch.Tensor, plain_one: torch.Tensor) -> float:
    """The rounding floor: how far plain context parallelism lands from one process (never below float32's eps:
    Wan's shards happen to compute bit-identically)."""
    return max(rel(plain_cp, plain_one), EPS)


@needs_cp
def test_context_parallel_guards_and_wrap_leave_it_bit_identical(ran):
    cp = [r["context_parallel_pipeline"] for r in ran]
    assert torch.equal(cp[0]["plain"], cp[1]["plain"])
    for rank in (0, 1):
        assert torch.equal(cp[rank]["guarded"], cp[rank]["plain"])
        assert torch.equal(cp[rank]["wrapped"], cp[rank]["plain"])


@needs_cp
@pytest.mark.parametrize("mode", list(ranks.modes()))
def test_context_parallel_pipeline_takes_the_single_process_decisions(ran, flux_pipe, mode):
    cp = [r["context_parallel_pipeline"] for r in ran]
    floor = _floor(cp[0]["plain"], ranks.pipeline_run(flux_pipe, ranks.PROMPTS[0], wrapped=False)["latents"])
    ref = ranks.pipeline_run(flux_pipe, ranks.PROMPTS[0], ranks.modes()[mode])
    assert "C" in ref["decisions"]
    assert cp[0][mode]["decisions"] == cp[1][mode]["decisions"] == ref["decisions"]
    assert torch.equal(cp[0][mode]["latents"], cp[1][mode]["latents"])
    assert rel(cp[0][mode]["latents"], ref["latents"]) <= 10 * floor
    assert [c[mode]["ranks"] for c in cp] == ["context parallel (ring 1 × Ulysses 2)"] * 2  # stats() says who shares a call
    assert ref["ranks"].startswith("one process")


@needs_cp
@pytest.mark.parametrize("family", [*ranks.CP_FAMILIES, "still"])
def test_context_parallel_families_take_the_single_process_decisions(ran, family):
    from torchfix.testing.families import FAMILIES

    name, still = ("flux", True) if family == "still" else (family, False)
    cp = [r["context_parallel_families"][family] for r in ran]
    model = FAMILIES[name].build()
    floor = _floor(cp[0]["plain"], ranks.family_run(model, name, still=still)["latents"])
    for mode in cp[0]:
        if mode == "plain":
            continue
        ref = ranks.family_run(model, name, ranks.modes()[mode], still=still)
        assert "C" in ref["decisions"]
        assert cp[0][mode]["decisions"] == cp[1][mode]["decisions"] == ref["decisions"], mode
        assert rel(cp[0][mode]["latents"], ref["latents"]) <= 10 * floor, mode


@pytest.mark.skipif(NO_WAN is not None, reason=NO_WAN or "")
@pytest.mark.parametrize("mode", ["default", "threshold"])
def test_context_parallel_wan22_experts_take_the_single_process_decisions(ran, mode):
    """Wan 2.2: two experts, each parallelised on its own mesh, each with its own cache on the one scheduler, with
    classifier-free guidance (two streams per expert)."""
    from torchfix.testing import tiny_wan22_pipeline

    cp = [r["context_parallel_wan22"] for r in ran]
    pipe = tiny_wan22_pipeline()
    floor = _floor(cp[0]["plain"], ranks.wan22_run(pipe)["latents"])
    ref = ranks.wan22_run(pipe, ranks.modes()[mode])
    assert "C" in ref["decisions"]
    assert cp[0][mode]["decisions"] == cp[1][mode]["decisions"] == ref["decisions"]
    assert torch.equal(cp[0][mode]["latents"], cp[1][mode]["latents"])
    assert rel(cp[0][mode]["latents"], ref["latents"]) <= 10 * floor


@needs_cp
def test_held_still_shard_changes_the_decisions_and_both_ranks_follow(ran):
    """Half the tokens held still (rank 1's shard never moves): the single-process threshold decides otherwise than
    when everything moves, and both ranks decide as it does (each alone would measure its own shard: a hang)."""
    fam = [r["context_parallel_families"] for r in ran]
    from torchfix.testing.families import FAMILIES

    moving = ranks.family_run(FAMILIES["flux"].build(), "flux", ranks.modes()["threshold"])
    assert fam[0]["still"]["threshold"]["decisions"] != moving["decisions"]
    assert fam[0]["still"]["threshold"]["decisions"] == fam[1]["still"]["threshold"]["decisions"]


@needs_cp
def test_deepcache_applied_before_enable_parallelism(ran, flux_pipe):
    """The first call is refused with a clear error (it arrived split), the hook order is put right, and the calls
    after it cache as one process does."""
    from torchfix.testing.families import FAMILIES

    for r in ran:
        got = r["applied_before"]
        assert "came after DeepCache was applied" in got["refused"]
        assert got["order"][-1] == "torchfix_deepcache"  # outermost: it sees the whole call
        ref = ranks.family_run(FAMILIES["flux"].build(), "flux", ranks.modes()["threshold"])
        assert got["decisions"] == ref["decisions"]


@needs_cp
def test_sharding_torchfix_cannot_see_refuses_the_threshold_and_warns_about_the_fit(ran):
    for r in ran:
        got = r["unseen"]
        assert "no diffusers parallel config" in got["threshold"] and "threshold=None" in got["threshold"]
        assert any("fitted on each rank" in w for w in got["warnings"])
        assert "C" in got["default"]["decisions"]


# --- one process -------------------------------------------------------------------------------------------------


def test_sums_make_the_statistics_of_shards_the_whole_ones():
    """Two shards' sums added: the whole tensor's ratio; a tensor whole on both ranks: the same ratio."""
    g = torch.Generator().manual_seed(0)
    now, ref = torch.randn(2, 16, 8, generator=g), torch.randn(2, 16, 8, generator=g)
    shards = [(now[:, :8], ref[:, :8]), (now[:, 8:], ref[:, 8:])]

    def added(parts_of):
        return lambda _: sum(parts_of(*s) for s in shards)

    def moved_sums(a, b):
        return torch.stack(((a - b).abs().flatten(1).sum(1), b.abs().flatten(1).sum(1)), 1)

    assert forecast.moved(shards[0][0], shards[0][1], added(moved_sums)) == pytest.approx(forecast.moved(now, ref), rel=1e-6)
    assert forecast.moved(now, ref, lambda parts: 2 * parts) == pytest.approx(forecast.moved(now, ref), rel=1e-12)
    e_in, e_res = now, -0.4 * now + 0.1 * ref

    def slope_sums(a, b):
        return torch.stack(((b * b).flatten(1).sum(1), (a * b).flatten(1).sum(1)), 1)

    whole = forecast.per_sample(e_res, e_in)
    both = slope_sums(e_res[:, :8], e_in[:, :8]) + slope_sums(e_res[:, 8:], e_in[:, 8:])
    halves = forecast.per_sample(e_res[:, :8], e_in[:, :8], lambda _: both)
    torch.testing.assert_close(halves, whole, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(forecast.per_sample(e_res[:, :8], e_in[:, :8]), whole, rtol=1e-3)  # one shard alone differs


def test_the_scenarios_left_out_on_an_older_diffusers_are_the_launchers():
    assert set(CP_SCENARIOS) < set(ranks.SCENARIOS) and set(WAN_SCENARIOS) <= set(CP_SCENARIOS)


def test_alone_without_a_parallel_config_and_the_watch_sees_no_collective():
    class Fake(torch.nn.Module):
        _parallel_config = object()  # torch.distributed not initialised here

    assert parallel.of(Fake()) is parallel.ALONE and parallel.summer(parallel.ALONE) is None
    assert not parallel.distributed()
    with parallel.Watch() as watch:
        torch.ones(3).sum()
    assert watch.collectives == []
