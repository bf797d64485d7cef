"""Feature caches on denoisers trained here and on random weights: work, wall time and error, one run.

    .venv/bin/python benchmarks/train_denoisers.py   # once: the trained checkpoints (make denoisers)
    .venv/bin/python benchmarks/caches.py            # ~40-60 min on 2 cores, one torch thread
    .venv/bin/python benchmarks/caches.py --quick    # fewer rows, trained models only

For each tiny pipeline (SD1.5-like UNet; SD3-like, 8 joint blocks, CFG; Flux-like, 4 double + 8 single blocks),
trained on scikit-learn's digits (benchmarks/train_denoisers.py) and with random weights, 20 steps at 128×128,
prompts "a handwritten digit k": plain, torchfix DeepCache (fixed intervals with forecast orders 0-2 and a full
last 10% of steps; on transformers also refresh-when-the-features-move thresholds, and on Flux keep_last=0), and
every other cache that runs on the model: DeepCache 0.1.1 (UNet), diffusers 0.42's FirstBlockCache, TaylorSeer (attention and whole
blocks), MagCache (calibrated on this model first), PyramidAttentionBroadcast, FasterCache, and cache-dit's
DBCache (with and without its TaylorSeer calibrator). Each row: work speedup (plain FLOPs ÷ cached FLOPs,
counted by torch, attention included), wall speedup (plain and cached timed one after the other), and rel-L2 of
the final latents vs plain, averaged over the prompts. A row that did no less work than plain did not engage
and is listed as such; a cache that cannot run on a model is listed with its error.

The goal (issue #25): on each trained model, torchfix is on the Pareto front at every work speedup from 1.5× to
4×, and at 2× and 3× its rel-L2 is at most 0.8× the best other method's at that speed (the best error among rows
at least that fast). The verdict is printed per model with the numbers. Writes the "caches" section of
docs/benchmarks.md and docs/caches.png.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TORCHFIX_MODE", "off")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from _common import machine, pareto, rel_l2, save_plot, write_section  # noqa: E402
from _trained import BUILDERS, LABELS, SIZE, VIDEO, cache_dir, call, meta, prompt, trained_pipeline  # noqa: E402

import torchfix  # noqa: E402
from torchfix.deepcache import DeepCacheConfig  # noqa: E402
from torchfix.testing import flops, latents  # noqa: E402

STEPS = 20
PROMPTS = (prompt(1), prompt(4), prompt(7))
Row = tuple[str, Callable[[Any], Any], bool]  # (label, apply to a pipeline -> undo or None, needs a fresh pipeline)


def kind_of(pipe: Any) -> str:
    """The video kind a pipeline belongs to (its call takes frames), else ''."""
    return "wan" if type(pipe).__name__.startswith("Wan") else ""


def generate(pipe: Any, text: str) -> torch.Tensor:
    return latents(pipe, text, steps=STEPS, seed=0, **call(kind_of(pipe)))


# --- the rows ------------------------------------------------------------------------------------------


def torchfix_rows(kind: str, quick: bool) -> list[Row]:
    transformer = kind != "sd15"

    def row(cfg: DeepCacheConfig) -> Row:
        parts = [f"interval={cfg.interval}", f"forecast={cfg.forecast}"]
        if cfg.stop < 1:
            parts.append(f"stop={cfg.stop}")
        if cfg.threshold is not None:
            parts.append(f"threshold={cfg.threshold}")
        if transformer and cfg.keep_first != 1:
            parts.append(f"keep_first={cfg.keep_first}")
        if transformer and cfg.keep_last != 1:
            parts.append(f"keep_last={cfg.keep_last}")
        if cfg.sensitivity is not None:
            parts.append(f"sensitivity={cfg.sensitivity}")
        if cfg.revise is False:
            parts.append("revise=False")

        def on(p: Any) -> Callable[[], None]:
            torchfix.deepcache.apply(p, cfg)
            return lambda: torchfix.deepcache.remove(p)

        return (f"torchfix DeepCache {' '.join(parts)}", on, False)

    rows = []
    intervals = (2, 3, 4, 6) if quick else (2, 3, 4, 5, 6, 8)
    for interval in intervals:
        for order in (0, 1, 2):
            for stop in (1.0, 0.9):
                rows.append(row(DeepCacheConfig(interval=interval, forecast=order, stop=stop, keep_first=1, keep_last=1)))
    if transformer:  # faster: only the last block runs on cached steps
        for interval in (3, 4, 5, 6, 8) if not quick else (4, 8):
            for order in (1, 2):
                rows.append(row(DeepCacheConfig(interval=interval, forecast=order, stop=0.9, keep_first=0, keep_last=1)))
        if kind in ("flux", "wan"):  # the last block keeps every stream (keep_last=0, their default): no block runs on a cached step
            for interval in intervals:
                for stop in (1.0, 0.95, 0.9):
                    rows.append(row(DeepCacheConfig(interval=interval, forecast=1, stop=stop, keep_first=0, keep_last=0)))
                # the same without revising the cached steps at each full step (the default where it can, as here)
                for stop in (1.0, 0.9):
                    cfg = DeepCacheConfig(interval=interval, forecast=1, stop=stop, keep_first=0, keep_last=0, revise=False)
                    rows.append(row(cfg))
        # the measured sensitivity (the default) against a fixed one: 1.0 adds the forecast residual to the input (as
        # before), 0.0 forecasts the blocks' output (TaylorSeer's whole-block forecast)
        for interval in (3, 4) if kind in ("flux", "wan") else (3, 4, 6):
            for s in (1.0, 0.0):
                kw = dict(stop=1.0, keep_last=0) if kind in ("flux", "wan") else dict(stop=0.9, keep_last=1)
                rows.append(row(DeepCacheConfig(interval=interval, forecast=1, keep_first=0, sensitivity=s, **kw)))
        for cap in (4, 8):
            for threshold in (0.03, 0.06, 0.1, 0.2) if not quick else (0.06, 0.2):
                for order in (1, 2):
                    cfg = DeepCacheConfig(interval=cap, threshold=threshold, forecast=order, stop=0.9, keep_first=1, keep_last=1)
                    rows.append(row(cfg))
    return rows


def deepcache_011_rows(quick: bool) -> list[Row]:
    try:
        from DeepCache import DeepCacheSDHelper
    except ImportError:
        return []

    def row(interval: int) -> Row:
        def on(p: Any) -> Callable[[], None]:
            helper = DeepCacheSDHelper(pipe=p)
            helper.set_params(cache_interval=interval, cache_branch_id=0)
            helper.enable()
            return helper.disable

        return (f"DeepCache 0.1.1 cache_interval={interval} cache_branch_id=0", on, False)

    return [row(i) for i in ((2, 3, 5) if quick else (2, 3, 4, 5, 6))]


def faster_cache_config(pipe: Any, model: Any, video: bool = False) -> Any:
    """diffusers' FasterCache as both cache benchmarks run it: attention skip 2 at every timestep, the
    unconditional batch every other step (guidance-distilled for Flux)."""
    from diffusers import FasterCacheConfig

    return FasterCacheConfig(
        spatial_attention_block_skip_range=2,
        spatial_attention_timestep_skip_range=(-1, 1000),
        unconditional_batch_skip_range=2,
        unconditional_batch_timestep_skip_range=(-1, 1000),
        tensor_format="BCFHW" if video else "BCHW",
        is_guidance_distilled=type(model).__name__.startswith("Flux"),
        current_timestep_callback=lambda: pipe.current_timestep,
    )


def diffusers_rows(transformer: bool, quick: bool, kind: str = "") -> list[Row]:
    from diffusers import (
        FirstBlockCacheConfig,
        MagCacheConfig,
        PyramidAttentionBroadcastConfig,
        TaylorSeerCacheConfig,
    )
    from diffusers.hooks import (
        apply_faster_cache,
        apply_first_block_cache,
        apply_mag_cache,
        apply_pyramid_attention_broadcast,
        apply_taylorseer_cache,
    )

    def model_of(p: Any) -> Any:
        return p.transformer if transformer else p.unet

    def row(label: str, apply: Callable[[Any, Any], None], make: Callable[[Any], Any]) -> Row:
        def on(p: Any) -> None:
            apply(model_of(p), make(p))
            return None  # the row's pipeline is discarded

        return (f"diffusers {label}", on, True)

    rows = []
    for t in (0.05, 0.1, 0.2, 0.4) if not quick else (0.1, 0.3):
        rows.append(row(f"FirstBlockCache threshold={t}", apply_first_block_cache, lambda p, t=t: FirstBlockCacheConfig(threshold=t)))
    for interval in (2, 3, 4) if not quick else (3,):
        rows.append(
            row(
                f"TaylorSeerCache attention cache_interval={interval} max_order=1",
                apply_taylorseer_cache,
                lambda p, i=interval: TaylorSeerCacheConfig(cache_interval=i, disable_cache_before_step=1, max_order=1),
            )
        )
    blocks = [r"^(transformer_blocks|single_transformer_blocks)\.\d+$"] if transformer else [r"^(down_blocks|up_blocks)\.\d+$|^mid_block$"]
    if kind in VIDEO:
        blocks = [r"^blocks\.\d+$"]  # Wan's
    for interval, order in ((2, 1), (3, 1), (4, 1), (5, 1), (3, 2)) if not quick else ((3, 1),):
        rows.append(
            row(
                f"TaylorSeerCache whole blocks cache_interval={interval} max_order={order}",
                apply_taylorseer_cache,
                lambda p, i=interval, o=order: TaylorSeerCacheConfig(
                    cache_interval=i, disable_cache_before_step=1, max_order=o, cache_identifiers=blocks
                ),
            )
        )
    for skip in (2, 3) if not quick else (2,):
        rows.append(
            row(
                f"PyramidAttentionBroadcast spatial skip={skip}",
                apply_pyramid_attention_broadcast,
                lambda p, s=skip: PyramidAttentionBroadcastConfig(
                    spatial_attention_block_skip_range=s,
                    spatial_attention_timestep_skip_range=(0, 1000),
                    current_timestep_callback=lambda: p.current_timestep,
                ),
            )
        )
    rows.append(row("FasterCache spatial skip=2", apply_faster_cache, lambda p: faster_cache_config(p, model_of(p), kind in VIDEO)))
    if transformer:
        for t in (0.03, 0.06, 0.12, 0.24) if not quick else (0.06, 0.24):
            rows.append(
                row(
                    f"MagCache threshold={t} (calibrated here)",
                    apply_mag_cache,
                    lambda p, t=t: MagCacheConfig(threshold=t, num_inference_steps=STEPS, mag_ratios=MAG_RATIOS[id(type(model_of(p)))]),
                )
            )
    return rows


MAG_RATIOS: dict[int, list[float]] = {}


def calibrate_magcache(build: Callable[[], Any]) -> str:
    """MagCache needs its magnitude ratios from a calibration run on this model; '' or the error."""
    from diffusers import MagCacheConfig
    from diffusers.hooks import apply_mag_cache

    p = build()
    try:
        apply_mag_cache(p.transformer, MagCacheConfig(calibrate=True, num_inference_steps=STEPS))
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            generate(p, PROMPTS[0])
        text = printed.getvalue()
        at = text.index("mag_ratios")
        ratios = ast.literal_eval(text[text.index("[", at) : text.index("]", at) + 1])
        MAG_RATIOS[id(type(p.transformer))] = [float(r) for r in ratios]
        return ""
    except Exception as exc:  # a cache that cannot calibrate is reported
        return f"{type(exc).__name__}: {str(exc)[:80]}"


def cache_dit_rows(quick: bool) -> list[Row]:
    try:
        import cache_dit
    except ImportError:
        return []

    def row(label: str, threshold: float, calibrator: bool) -> Row:
        def on(p: Any) -> Callable[[], None]:
            config = cache_dit.DBCacheConfig(
                Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=threshold, max_warmup_steps=2,
                max_continuous_cached_steps=4, num_inference_steps=STEPS,
            )  # fmt: skip
            extra = {"calibrator_config": cache_dit.TaylorSeerCalibratorConfig(taylorseer_order=1)} if calibrator else {}
            cache_dit.enable_cache(p, cache_config=config, **extra)
            return lambda: cache_dit.disable_cache(p)

        return (f"cache-dit {label}", on, True)

    rows = [row(f"DBCache F1B0 threshold={t}", t, False) for t in ((0.05, 0.1, 0.2, 0.4) if not quick else (0.1, 0.3))]
    rows += [row(f"DBCache F1B0 + TaylorSeer calibrator threshold={t}", t, True) for t in ((0.1, 0.2) if not quick else (0.2,))]
    return rows


# --- one model -------------------------------------------------------------------------------------------


def run_model(kind: str, trained: bool, quick: bool) -> list[dict[str, Any]]:
    build = (lambda: trained_pipeline(kind)) if trained else BUILDERS[kind]
    transformer = kind != "sd15"
    pipe = build()
    generate(pipe, PROMPTS[0])  # warm-up
    refs = [generate(pipe, t) for t in PROMPTS]
    plain_flops = flops(lambda: generate(pipe, PROMPTS[0]))
    rows = torchfix_rows(kind, quick)
    if transformer:
        problem = calibrate_magcache(build)
        rows += [r for r in diffusers_rows(True, quick, kind) if "MagCache" not in r[0] or not problem] + cache_dit_rows(quick)
        if problem:
            rows.append(("diffusers MagCache (calibration failed: " + problem + ")", None, True))
    else:
        rows += deepcache_011_rows(quick) + diffusers_rows(False, quick)
    results = []
    name = f"{LABELS[kind]}, {'trained' if trained else 'random weights'}"
    for label, on, fresh in rows:
        result = {"label": label, "ours": label.startswith("torchfix"), "work": math.nan, "wall": math.nan, "err": math.nan, "note": ""}
        results.append(result)
        if on is None:
            result["note"] = "failed"
            continue
        target = build() if fresh else pipe
        undo = None
        try:
            undo = on(target)
            outs = [generate(target, t) for t in PROMPTS]
            cached_flops = flops(lambda target=target: generate(target, PROMPTS[0]))
            start = time.perf_counter()
            generate(target, PROMPTS[0])
            cached_s = time.perf_counter() - start
        except Exception as exc:  # a cache that cannot run on this model is reported, not hidden
            result["note"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:70] if str(exc) else ''}"
            print(f"{name} | {label}: {result['note']}", flush=True)
            continue
        finally:
            if undo is not None:
                undo()
        start = time.perf_counter()
        generate(pipe, PROMPTS[0])
        plain_s = time.perf_counter() - start
        if cached_flops >= plain_flops * 0.999:
            result["note"] = "did not engage (as much work as plain)"
            print(f"{name} | {label}: {result['note']}", flush=True)
            continue
        result.update(
            work=plain_flops / cached_flops, wall=plain_s / cached_s, err=sum(rel_l2(o, r) for o, r in zip(outs, refs)) / len(refs)
        )
        print(f"{name} | {label}: work {result['work']:.2f}x, wall {result['wall']:.2f}x, rel-L2 {result['err']:.4f}", flush=True)
    return results


# --- verdicts and the page -----------------------------------------------------------------------------------


def best_at(rows: list[dict[str, Any]], speed: float) -> dict[str, Any] | None:
    """The most exact row doing at least ``speed``× less work."""
    fast = [r for r in rows if r["work"] >= speed]
    return min(fast, key=lambda r: r["err"]) if fast else None


def front(rows: list[dict[str, Any]]) -> set[str]:
    """The labels of the rows on the work/error Pareto front."""
    return {r["label"] for r, on in zip(rows, pareto([(r["work"], r["err"]) for r in rows])) if on}


def verdict(rows: list[dict[str, Any]]) -> tuple[bool, list[str]]:
    ok = [r for r in rows if not math.isnan(r["err"])]
    ours, others = [r for r in ok if r["ours"]], [r for r in ok if not r["ours"]]
    lines, met = [], True
    behind = []
    speed = 1.5
    while speed <= 4.0 + 1e-9:
        a, b = best_at(ours, speed), best_at(others, speed)
        if b is not None and (a is None or a["err"] > b["err"]):
            behind.append(f"{speed:.2f}×")
        speed += 0.05
    if behind:
        met = False
        lines.append(f"- Pareto front 1.5×-4×: **not met**: another method is more exact at work speedups {', '.join(behind[:8])}"
                     + (f" and {len(behind) - 8} more" if len(behind) > 8 else ""))  # fmt: skip
    else:
        lines.append("- Pareto front 1.5×-4×: **met** (at every work speedup, torchfix's most exact row is at least as exact)")
    for speed in (2.0, 3.0):
        a, b = best_at(ours, speed), best_at(others, speed)
        if b is None:
            ours_text = f"{a['err']:.4f} ({a['label']})" if a else "neither"
            lines.append(f"- at {speed:.0f}×: no other method reaches it; torchfix {ours_text}")
            continue
        if a is None:
            met = False
            lines.append(f"- at {speed:.0f}×: **not met**: torchfix has no row this fast; best other {b['err']:.4f} ({b['label']})")
            continue
        good = a["err"] <= 0.8 * b["err"]
        met &= good
        lines.append(
            f"- at {speed:.0f}×: {'met' if good else '**not met**'}: torchfix {a['err']:.4f} ({a['label']}, {a['work']:.2f}×) "
            f"vs best other {b['err']:.4f} ({b['label']}, {b['work']:.2f}×): ratio {a['err'] / b['err']:.2f} (goal ≤ 0.80)"
        )
    return met, lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer rows, trained models only")
    ap.add_argument("--kind", action="append", choices=tuple(BUILDERS), help="measure these models only (kept for --render)")
    ap.add_argument("--render", action="store_true", help="write the page from every model's kept results, measuring nothing")
    ap.add_argument("--section", default="caches", help="the section of docs/benchmarks.md to write (and its plot, <section>.png)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    kinds = args.kind or list(BUILDERS)
    missing = [k for k in kinds if meta(k) is None]
    if missing:
        print(f"no trained checkpoints for {', '.join(missing)}: run `make denoisers` first", file=sys.stderr)
        return 2
    started = time.perf_counter()
    results: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    kept = cache_dir().parent / "cache-benchmark.json"  # per model, so models can be measured in separate processes
    store = json.loads(kept.read_text()) if kept.exists() else {}
    if args.render:
        kinds = [k for k in args.kind or BUILDERS if any(key.startswith(k + "/") for key in store)]
        results = {(k, t == "trained"): v["rows"] for key, v in store.items() for k, t in [key.split("/")] if k in kinds}
        minutes = sum(v["minutes"] for v in store.values())
        when = ", ".join(sorted({v["when"] for v in store.values()}))
    else:
        for kind in kinds:
            for trained in (True,) if args.quick else (True, False):
                begun = time.perf_counter()
                results[(kind, trained)] = run_model(kind, trained, args.quick)
                store = json.loads(kept.read_text()) if kept.exists() else {}  # another process may have added a model
                store[f"{kind}/{'trained' if trained else 'random'}"] = {
                    "rows": results[(kind, trained)],
                    "minutes": (time.perf_counter() - begun) / 60,
                    "when": time.strftime("%Y-%m-%d"),
                    "load": os.getloadavg()[0],
                }
                kept.write_text(json.dumps(store))
        minutes, when = (time.perf_counter() - started) / 60, time.strftime("%Y-%m-%d")
    results = dict(sorted(results.items(), key=lambda kv: (list(BUILDERS).index(kv[0][0]), not kv[0][1])))
    loads = ", ".join(f"{k} {v['load']:.1f}" for k, v in store.items() if (k.split("/")[0], k.endswith("trained")) in results)

    from importlib.metadata import PackageNotFoundError, version

    def ver(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    lines = [
        f"Machine: {machine()}. cache-dit {ver('cache-dit')}, DeepCache {ver('DeepCache')}, scikit-learn {ver('scikit-learn')}.",
        "",
        f"`benchmarks/caches.py{' --quick' if args.quick else ''}` ({when}, {minutes:.0f} min of measuring; load average at the end "
        f"of each model: {loads}): images {SIZE[0]}×{SIZE[1]}, videos "
        + ", ".join(f"{k} {v['size'][0]}×{v['size'][1]}×{v['num_frames']} frames" for k, v in VIDEO.items() if k in kinds)
        + ", "
        f"{STEPS} steps, prompts {', '.join(repr(p) for p in PROMPTS)}, seed 0, one torch thread. Work = plain FLOPs ÷ cached FLOPs "
        "(torch's counter, CPU flash attention included); wall = plain ÷ cached seconds, one run each, back to back; rel-L2 = final "
        "latents vs plain, mean over the prompts; ✓ = on the work/error Pareto front of its model. Trained checkpoints: "
        "benchmarks/train_denoisers.py (scikit-learn digits; " + "; ".join(
            f"{k}: loss {m['loss_first']}→{m['loss_last']} in {m['seconds'] / 60:.0f} min, prompted digit in "
            f"{m.get('check', {}).get('right', '?')}/{m.get('check', {}).get('of', '?')} samples"
            for k in kinds if (m := meta(k)) is not None
        ) + ").",
        "",
    ]  # fmt: skip
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        grid = (1 if args.quick else 2, len(kinds))
        fig, axes = plt.subplots(*grid, figsize=(5.5 * grid[1], 4.5 * grid[0]), squeeze=False)
    except ImportError:
        plt, axes = None, None
    verdicts = []
    for (kind, trained), rows in results.items():
        ok = [r for r in rows if not math.isnan(r["err"])]
        on_front = front(ok)
        title = f"{LABELS[kind]}, {'trained' if trained else 'random weights'}"
        lines += [f"**{title}**", "", "| cache | work | wall | rel-L2 | Pareto |", "|---|---|---|---|---|"]
        for r in sorted(rows, key=lambda r: (not r["ours"], r["label"])):
            if math.isnan(r["err"]):
                lines.append(f"| {r['label']} | — | — | — | {r['note']} |")
            else:
                mark = "✓" if r["label"] in on_front else ""
                lines.append(f"| {r['label']} | {r['work']:.2f}× | {r['wall']:.2f}× | {r['err']:.4f} | {mark} |")
        met, why = verdict(rows)
        lines += ["", f"Goal on this model: **{'met' if met else 'not met'}**", *why, ""]
        if trained:
            verdicts.append(f"{title}: goal {'met' if met else 'NOT met'}\n  " + "\n  ".join(why))
        if plt is not None:
            ax = axes[0 if trained else 1][kinds.index(kind)]
            for r in ok:
                ax.scatter(r["err"], r["work"], marker="o" if r["ours"] else "x", color="tab:blue" if r["ours"] else "tab:red", s=14)
            ax.set_xscale("log")
            ax.set_xlabel("rel-L2 vs plain (log)")
            ax.set_ylabel("work speedup (FLOPs)")
            ax.set_title(title, fontsize=9)
    if plt is not None:
        lines.append(save_plot(fig, "torchfix DeepCache (o) vs other caches (x)", f"{args.section.replace('-', '_')}.png", "work vs error"))
    heading = "Caches on trained denoisers and random weights" + (" (issue #25)" if args.section == "caches" else ": video")
    write_section(args.section, f"## {heading}\n\n" + "\n".join(lines))
    print("\n".join(lines))
    print("\n".join(verdicts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
