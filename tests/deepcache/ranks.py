"""What each of two gloo ranks runs for tests/deepcache/test_parallel.py, and the launcher: both ranks start once
(spawned), run every scenario, and save what they saw; a hang fails at gloo's timeout (60 s: room for one rank to
wait for the other on a loaded 2-core machine), or at the launcher's deadline, instead of eating the CI budget."""

from __future__ import annotations

import dataclasses
import datetime
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

WORLD = 2
STEPS = 10
SIZE = (64, 64)  # the tiny Flux pipeline: 16 image tokens, 8 per rank
PROMPTS = ("a cat", "a dog", "a bird")  # three prompts on two ranks: an uneven split
CP_FAMILIES = ("flux2", "qwenimage", "wan", "chronoedit")  # with a diffusers _cp_plan that runs on the CPU (LTX's cannot)


def modes() -> dict[str, Any]:
    """The cache modes every context-parallel test runs (DeepCacheConfig by name)."""
    import torchfix

    return {
        "default": torchfix.DeepCacheConfig(),
        "interval": torchfix.DeepCacheConfig(interval=3, forecast=0, sensitivity=1.0),
        "threshold": torchfix.DeepCacheConfig(interval=4, threshold=0.08),
        "revise": torchfix.DeepCacheConfig(interval=3, revise=True),
    }


# --- what a run records: its result, and the decision of each denoiser call -------------------------------


class Decisions:
    """Per denoiser call: ``"C"`` (cached) or ``"F"`` (anything else), read from the cache's counters after it."""

    def __init__(self, model: torch.nn.Module) -> None:
        import torchfix

        self.seq: list[str] = []
        self._cached = 0

        def after(module: torch.nn.Module, args: Any, output: Any) -> None:
            stats = torchfix.deepcache.stats(module)
            cached = stats.get("cached_steps", 0)
            self.seq.append("C" if cached > self._cached else "F")
            self._cached = cached

        self.handle = model.register_forward_hook(after)

    def text(self) -> str:
        self.handle.remove()
        return "".join(self.seq)


def pipeline_run(pipe: Any, prompt: str, config: Any = None, *, wrapped: bool = True) -> dict[str, Any]:
    """The final latents of ``prompt`` (``wrapped``: through ``torchfix.wrap``, with DeepCache ``config``), and the
    transformer's decisions."""
    import torchfix
    from torchfix.testing import latents

    target = torchfix.wrap(pipe, deepcache=config) if wrapped else pipe
    seen = Decisions(pipe.transformer)
    try:
        out = latents(target, prompt, steps=STEPS, size=SIZE)
        ranks = torchfix.deepcache.stats(pipe).get("ranks")
    finally:
        decisions = seen.text()
        if wrapped:
            target.unwrap()
    return {"latents": out.clone(), "decisions": decisions, "ranks": ranks}


def family_run(model: torch.nn.Module, family: str, config: Any = None, still: bool = False) -> dict[str, Any]:
    """``STEPS`` steps of a tiny family's denoiser (torchfix.testing.families.denoise's loop, ``return_dict=False``
    as pipelines call it under context parallelism) with DeepCache ``config``. ``still``: the second half of the
    tokens is held where it started after every step (an inpainting mask over half the image: one rank's shard
    never moves)."""
    import torchfix
    from torchfix.testing.families import FAMILIES, _timestep, _update, output_of

    tiny = FAMILIES[family]
    if config is not None:
        torchfix.deepcache.apply(model, dataclasses.replace(config, num_steps=STEPS))
    seen = Decisions(model)
    call = {**tiny.arguments(), "return_dict": False}
    start = x = call[tiny.latent]
    try:
        with torch.no_grad():
            for i in range(STEPS):
                out = output_of(model(**{**call, tiny.latent: x, tiny.timestep: _timestep(tiny, 1.0 - i / STEPS, x.shape[0], x)}))
                x = _update(x, out, 1.0 / STEPS)
                if still:
                    half = x.shape[1] // 2
                    x = torch.cat([x[:, :half], start[:, half:]], 1)
    finally:
        decisions = seen.text()
        if config is not None:
            torchfix.deepcache.remove(model)
    return {"latents": x.clone(), "decisions": decisions}


WAN22 = dict(prompt="a cat", negative_prompt="a dog", num_inference_steps=STEPS, height=16, width=16, num_frames=5, guidance_scale=5.0)


def wan22_run(pipe: Any, config: Any = None) -> dict[str, Any]:
    """A tiny Wan 2.2 pipeline call (two experts on one scheduler, classifier-free guidance) through ``torchfix.wrap``
    with DeepCache ``config``: the final latents and each expert's decisions."""
    import torchfix

    target = torchfix.wrap(pipe, deepcache=config)
    seen = [Decisions(pipe.transformer), Decisions(pipe.transformer_2)]
    try:
        out = target(**WAN22, max_sequence_length=16, output_type="latent", generator=torch.Generator().manual_seed(0)).frames
    finally:
        decisions = [s.text() for s in seen]
        target.unwrap()
    return {"latents": out.clone(), "decisions": " / ".join(decisions)}


def parallelise(model: torch.nn.Module) -> torch.nn.Module:
    from diffusers import ContextParallelConfig

    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=WORLD))
    return model


# --- the scenarios ----------------------------------------------------------------------------------------------


def data_parallel(rank: int) -> dict[str, Any]:
    """Each rank its own prompts (as accelerate's ``split_between_processes`` deals them: 2 and 1): plain, guarded,
    wrapped and cached, while a watch counts the collectives anything issues (none may)."""
    import torchfix
    from torchfix.deepcache.parallel import Watch
    from torchfix.testing import tiny_flux_pipeline

    mine = PROMPTS[:2] if rank == 0 else PROMPTS[2:]
    pipe = tiny_flux_pipeline()
    out: dict[str, Any] = {}
    with Watch() as watch:
        for prompt in mine:
            torchfix.disable()
            plain = pipeline_run(pipe, prompt, wrapped=False)["latents"]
            torchfix.enable()
            out[prompt] = {
                "plain": plain,
                "guarded": pipeline_run(pipe, prompt, wrapped=False)["latents"],
                "wrapped": pipeline_run(pipe, prompt)["latents"],
                **{mode: pipeline_run(pipe, prompt, config) for mode, config in modes().items()},
            }
    out["collectives"] = watch.collectives
    return out


def context_parallel_pipeline(rank: int) -> dict[str, Any]:
    """diffusers' Ulysses context parallelism on the tiny Flux pipeline: plain, guarded, wrapped, each cache mode."""
    import torchfix
    from torchfix.testing import tiny_flux_pipeline

    pipe = tiny_flux_pipeline()
    parallelise(pipe.transformer)
    torchfix.disable()
    plain = pipeline_run(pipe, PROMPTS[0], wrapped=False)["latents"]
    torchfix.enable()
    return {
        "plain": plain,
        "guarded": pipeline_run(pipe, PROMPTS[0], wrapped=False)["latents"],
        "wrapped": pipeline_run(pipe, PROMPTS[0])["latents"],
        **{mode: pipeline_run(pipe, PROMPTS[0], config) for mode, config in modes().items()},
    }


def context_parallel_families(rank: int) -> dict[str, Any]:
    """Every other family diffusers can parallelise on the CPU: plain, and the modes a bare model runs (revision
    needs a pipeline's scheduler); Flux with half its tokens held still (one rank's shard never moves)."""
    from torchfix.testing.families import FAMILIES

    out: dict[str, Any] = {}
    for family in CP_FAMILIES:
        model = parallelise(FAMILIES[family].build())
        out[family] = {"plain": family_run(model, family)["latents"]}
        out[family].update({m: family_run(model, family, c) for m, c in modes().items() if m != "revise"})
    model = parallelise(FAMILIES["flux"].build())
    out["still"] = {"plain": family_run(model, "flux", still=True)["latents"]}
    out["still"].update({m: family_run(model, "flux", c, still=True) for m, c in modes().items() if m in ("default", "threshold")})
    return out


def context_parallel_wan22(rank: int) -> dict[str, Any]:
    """Wan 2.2's two experts, each parallelised (a mesh each), each with its own cache on the one scheduler."""
    from torchfix.testing import tiny_wan22_pipeline

    pipe = tiny_wan22_pipeline()
    parallelise(pipe.transformer)
    parallelise(pipe.transformer_2)
    return {"plain": wan22_run(pipe)["latents"], **{m: wan22_run(pipe, modes()[m]) for m in ("default", "threshold")}}


def applied_before(rank: int) -> dict[str, Any]:
    """DeepCache applied to a bare model *before* enable_parallelism: the first call is refused (its streams would
    be the shard's), the order is put right, and the next calls cache as one process would."""
    import torchfix
    from torchfix.errors import UnsupportedModelError
    from torchfix.testing.families import FAMILIES

    model = FAMILIES["flux"].build()
    config = modes()["threshold"]
    torchfix.deepcache.apply(model, dataclasses.replace(config, num_steps=STEPS))
    parallelise(model)
    tiny = FAMILIES["flux"]
    try:
        model(**{**tiny.arguments(), "return_dict": False, "timestep": torch.ones(1)})
        refused = None
    except UnsupportedModelError as e:
        refused = str(e)
    order = list(model._diffusers_hook._hook_order)
    try:
        return {"refused": refused, "order": order, **family_run(model, "flux")}  # DeepCache still applied
    finally:
        torchfix.deepcache.remove(model)


def unseen(rank: int) -> dict[str, Any]:
    """A model sharded in a way torchfix cannot see (diffusers' hooks in place, its ``_parallel_config`` hidden): the
    threshold refused on every rank at the first call, the measured sensitivity warned about."""
    import warnings

    import torchfix
    from torchfix.errors import UnsupportedModelError
    from torchfix.testing.families import FAMILIES

    model = parallelise(FAMILIES["flux"].build())
    model._parallel_config = None
    out: dict[str, Any] = {}
    try:
        family_run(model, "flux", modes()["threshold"])
        out["threshold"] = None
    except UnsupportedModelError as e:
        out["threshold"] = str(e)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["default"] = family_run(model, "flux", modes()["default"])
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, torchfix.TorchfixWarning)]
    return out


SCENARIOS: dict[str, Callable[[int], dict[str, Any]]] = {
    "unseen": unseen,
    "data_parallel": data_parallel,
    "context_parallel_pipeline": context_parallel_pipeline,
    "context_parallel_families": context_parallel_families,
    "context_parallel_wan22": context_parallel_wan22,
    "applied_before": applied_before,
}


# --- the launcher -------------------------------------------------------------------------------------------------


def _worker(rank: int, store: str, out: str, names: tuple[str, ...], threads: int) -> None:
    torch.set_num_threads(threads)
    import torch.distributed as dist

    import torchfix

    torchfix.enable()  # what `import torchfix` does in a script (the test process sets TORCHFIX_MODE=off)

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    results: dict[str, Any] = {}
    try:
        for name in names:
            started = time.perf_counter()
            try:
                results[name] = SCENARIOS[name](rank)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            results[name]["seconds"] = time.perf_counter() - started
            dist.barrier()
    finally:
        torch.save(results, Path(out) / f"rank{rank}.pt")
        dist.destroy_process_group()


def launch(names: tuple[str, ...] = tuple(SCENARIOS), deadline: float = 240.0) -> list[dict[str, Any]]:
    """Run ``names`` on two spawned gloo ranks; each rank's results (a scenario that raised: ``{"error": ...}``).

    Raises:
        TimeoutError: the ranks did not finish by ``deadline`` seconds (a hang); both are killed.
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        threads = max(1, torch.get_num_threads() // WORLD)
        context = mp.start_processes(_worker, args=(store, tmp, names, threads), nprocs=WORLD, join=False, start_method="spawn")
        end = time.monotonic() + deadline
        while not context.join(timeout=1.0):
            if time.monotonic() > end:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"the two ranks did not finish {names} in {deadline:.0f} s: a hang")
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
