"""DeepCache for diffusion transformers against diffusers' own caches, side by side in one process.

    .venv/bin/python benchmarks/transformer_cache.py            # SD3-like and Flux-like at 512², 20 steps (~7 min, one torch thread)
    .venv/bin/python benchmarks/transformer_cache.py --quick    # 256², 10 steps

For each tiny pipeline (random weights; SD3-like with 8 joint blocks and CFG, Flux-like with 4 double and
8 single blocks): plain; torchfix DeepCache (intervals 2-5, keep_first/keep_last 1/1 and 2/1);
diffusers 0.42's FirstBlockCache (thresholds), PyramidAttentionBroadcast (block skip ranges),
FasterCache and TaylorSeerCache, each with the identifiers/thresholds printed. Every row counts the
attention calls that actually computed: a cache row that computed as many as plain did not engage,
and the script stops (that is a bug in the benchmark, not a result). Each row: wall time ratio vs
plain (best of 2, interleaved with plain), relative L2 of the final latents vs plain, and whether the
row is on the speed/error Pareto front of its model. A threshold that never skipped is listed as
excluded (FirstBlockCache's threshold is relative to the model's residual change: random weights need
higher ones than a trained model); a cache that cannot run on a model is listed with its error. Writes the "transformer-cache" section of
docs/benchmarks.md and docs/transformer_cache.png.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TORCHFIX_MODE", "off")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from _common import machine, pareto, rel_l2, save_plot, write_section  # noqa: E402
from caches import faster_cache_config  # noqa: E402

import torchfix  # noqa: E402
from torchfix.deepcache import DeepCacheConfig, analyse_transformer  # noqa: E402
from torchfix.testing import latents, tiny_flux_pipeline, tiny_sd3_pipeline  # noqa: E402


class Counter:
    """Attentions that computed: a pre-hook on every block's ``attn.to_q``, which runs only when the attention
    really computes (a cache that hooks the attention or the block returns before it)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.n = 0
        self.handles = [b.attn.to_q.register_forward_pre_hook(self._hook) for b in analyse_transformer(model).blocks]

    def _hook(self, *args: Any) -> None:
        self.n += 1

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def timed(pipe: Any, steps: int, size: tuple[int, int]) -> tuple[torch.Tensor, float, int]:
    counter = Counter(pipe.transformer)
    try:
        best, out = float("inf"), None
        for _ in range(2):
            counter.n = 0
            start = time.perf_counter()
            out = latents(pipe, "a photo of a cat", steps=steps, size=size)
            best = min(best, time.perf_counter() - start)
        return out, best, counter.n
    finally:
        counter.close()


def torchfix_rows(quick: bool) -> list[tuple[str, Callable[[Any], None], Callable[[Any], None]]]:
    rows = []
    for interval in (2, 3, 5) if quick else (2, 3, 4, 5, 8):
        for first, last in ((1, 1), (2, 1)):
            cfg = DeepCacheConfig(interval=interval, keep_first=first, keep_last=last)
            rows.append(
                (
                    f"torchfix DeepCache interval={interval} keep_first={first} keep_last={last}",
                    lambda p, c=cfg: torchfix.deepcache.apply(p, c),
                    lambda p: torchfix.deepcache.remove(p),
                )
            )
    return rows


def diffusers_rows(quick: bool) -> list[tuple[str, Callable[[Any], None], Callable[[Any], None]]]:
    from diffusers import FasterCacheConfig, FirstBlockCacheConfig, PyramidAttentionBroadcastConfig, TaylorSeerCacheConfig
    from diffusers.hooks import apply_faster_cache, apply_first_block_cache, apply_pyramid_attention_broadcast, apply_taylorseer_cache

    appliers = {
        FirstBlockCacheConfig: apply_first_block_cache,
        PyramidAttentionBroadcastConfig: apply_pyramid_attention_broadcast,
        FasterCacheConfig: apply_faster_cache,
        TaylorSeerCacheConfig: apply_taylorseer_cache,
    }

    def enable(make: Callable[[Any], Any]) -> Callable[[Any], None]:
        # diffusers 0.42's SD3/Flux transformers have no enable_cache(); its hooks apply to any module.
        # The hooks stay on the pipeline they were applied to: each row gets a fresh, identically seeded one.
        def on(p: Any) -> None:
            config = make(p)
            appliers[type(config)](p.transformer, config)

        return on

    def disable(p: Any) -> None:
        pass  # the row's pipeline is discarded

    rows = []
    for threshold in (0.3, 1.0) if quick else (0.1, 0.3, 0.6, 1.0, 2.0):
        rows.append(
            (f"diffusers FirstBlockCache threshold={threshold}", enable(lambda p, t=threshold: FirstBlockCacheConfig(threshold=t)), disable)
        )
    for skip in (2,) if quick else (2, 3):
        rows.append(
            (
                f"diffusers PyramidAttentionBroadcast spatial_attention_block_skip_range={skip}, timestep range (0, 1000), "
                "identifiers transformer_blocks/single_transformer_blocks",
                enable(
                    lambda p, s=skip: PyramidAttentionBroadcastConfig(
                        spatial_attention_block_skip_range=s,
                        spatial_attention_timestep_skip_range=(0, 1000),
                        current_timestep_callback=lambda: p.current_timestep,
                    )
                ),
                disable,
            )
        )
    rows.append(
        (
            "diffusers FasterCache spatial_attention_block_skip_range=2, timestep range (-1, 1000), tensor_format BCHW",
            enable(lambda p: faster_cache_config(p, p.transformer)),
            disable,
        )
    )
    for interval in (3,) if quick else (2, 3):
        rows.append(
            (
                f"diffusers TaylorSeerCache cache_interval={interval} disable_cache_before_step=1 (default identifiers)",
                enable(
                    lambda p, i=interval: TaylorSeerCacheConfig(
                        cache_interval=i, disable_cache_before_step=1, taylor_factors_dtype=torch.float32
                    )
                ),
                disable,
            )
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)  # one torch thread: two spin against each other on a shared 2-core machine
    size, steps = ((256, 256), 10) if args.quick else ((512, 512), 20)
    models = {
        "SD3-like (8 joint blocks, CFG)": lambda: tiny_sd3_pipeline(layers=8),
        "Flux-like (4 double + 8 single blocks)": lambda: tiny_flux_pipeline(layers=4, single_layers=8),
    }
    results: dict[str, list[tuple[str, float, float, int, int]]] = {}
    for model_name, build in models.items():
        pipe = build()
        latents(pipe, steps=2, size=size)  # warm-up
        rows = []
        for label, on, off in torchfix_rows(args.quick) + diffusers_rows(args.quick):
            ref, plain_s, plain_calls = timed(pipe, steps, size)
            target = pipe if label.startswith("torchfix") else build()  # diffusers' hooks: a fresh, identical pipeline
            on(target)
            try:
                out, cached_s, calls = timed(target, steps, size)
            except Exception as exc:  # a cache that cannot run on this model is reported, not hidden
                off(target)
                print(f"{model_name} | {label}: FAILED {type(exc).__name__}: {exc}", flush=True)
                rows.append((label + f" (failed: {type(exc).__name__}: {str(exc)[:60]})", float("nan"), float("nan"), -1, plain_calls))
                continue
            off(target)
            if calls >= plain_calls:  # not a result: this configuration never skipped anything on this model
                print(f"{model_name} | {label}: computed {calls} attention calls of {plain_calls}: did not engage, excluded", flush=True)
                rows.append((label + " (did not engage: excluded)", float("nan"), float("nan"), -2, plain_calls))
                continue
            rows.append((label, plain_s / cached_s, rel_l2(out, ref), calls, plain_calls))
            print(
                f"{model_name} | {label}: {plain_s / cached_s:.2f}x, rel-L2 {rel_l2(out, ref):.4f}, attention {calls}/{plain_calls}",
                flush=True,
            )
        results[model_name] = rows

    lines = [
        f"Machine: {machine()}.",
        "",
        f"`benchmarks/transformer_cache.py{' --quick' if args.quick else ''}`: {size[0]}×{size[1]}, {steps} FlowMatch Euler steps, "
        "final latents vs plain in the same process (plain rerun next to every row, best of 2). Attention = attention "
        "modules that computed (plain computes every one); ✓ = on the speed/error Pareto front of its model.",
        "",
        "Random weights: they misrank feature caches (issue #25), so read this as wall time and cost, and the section "
        '"Caches on trained denoisers and random weights" below for which cache is more exact; the torchfix rows keep '
        "the transformer defaults chosen there (linear forecast, warm-up, last 10% of steps full, measured sensitivity), "
        "with `keep_first`/`keep_last` as labelled (Flux's default caches every block).",
        "",
    ]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5))
    except ImportError:
        plt, axes = None, None
    for k, (model_name, rows) in enumerate(results.items()):
        ok = [r for r in rows if r[3] >= 0]
        front = dict(zip([r[0] for r in ok], pareto([(r[1], r[2]) for r in ok])))
        lines += [f"**{model_name}**", "", "| cache | speedup | rel-L2 | attention | Pareto |", "|---|---|---|---|---|"]
        for label, speed, err, calls, plain_calls in rows:
            if calls < 0:  # failed to run, or did not engage: not a result
                lines.append(f"| {label} | — | — | — | |")
            else:
                lines.append(f"| {label} | {speed:.2f}× | {err:.4f} | {calls}/{plain_calls} | {'✓' if front[label] else ''} |")
        ours = [r for r in ok if r[0].startswith("torchfix")]
        lines += ["", f"torchfix rows on the front: {sum(front[r[0]] for r in ours)} of {len(ours)}.", ""]
        if plt is not None:
            ax = axes[k] if len(results) > 1 else axes
            for label, speed, err, _, _ in ok:
                mine = label.startswith("torchfix")
                ax.scatter(err, speed, marker="o" if mine else "x", color="tab:blue" if mine else "tab:red")
            ax.set_xscale("log")
            ax.set_xlabel("rel-L2 vs plain (log)")
            ax.set_ylabel("speedup vs plain")
            ax.set_title(model_name)
    if plt is not None:
        lines.append(save_plot(fig, "torchfix DeepCache (o) vs diffusers caches (x)", "transformer_cache.png", "speed vs error"))
    write_section("transformer-cache", "## DeepCache for transformers vs diffusers' caches\n\n" + "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
