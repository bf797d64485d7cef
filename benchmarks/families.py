"""Every model family: torchfix's cache beside diffusers' cache hooks and cache-dit, one run, one torch thread.

    .venv/bin/python -m pip install cache-dit==1.5.3    # (the bench extra)
    .venv/bin/python benchmarks/families.py              # ~30-40 min on 2 cores
    .venv/bin/python benchmarks/families.py wan flux     # some families
    .venv/bin/python benchmarks/families.py --day0       # the classes with no registry entry (section families_day0)

Each family's tiny builder (torchfix.testing.FAMILIES), deepened to 12 blocks, 9 + 9 where a family has two lists
(cache-dit's default runs the first 8 blocks of each list on every step and needs more), random weights, 20 steps of
the builders' denoising loop, one guidance pass named with ``cache_context`` as diffusers' pipelines do. Rows:

- torchfix at the family's default (``DeepCacheConfig()``), at intervals 2-6, and with its first 8 blocks always
  running as cache-dit's default does (intervals 2-5, or refreshing when the features move, thresholds 0.05 and 0.1):
  "at cache-dit's work" is torchfix's least error among its rows saving at least cache-dit's default's work;
- diffusers 0.42's hooks at their defaults, through ``apply_first_block_cache``/``apply_taylorseer_cache``:
  FirstBlockCache (threshold 0.05) and TaylorSeerCache (its default identifiers);
- cache-dit's ``enable_cache(model)`` at its default (DBCache F8B0, 8 warm-up steps, threshold 0.08), through its
  own adapter for the family.

Columns: work speedup (the plain run's denoiser FLOPs ÷ the row's, counted by torch with attention), wall speedup
(the plain and the cached run timed one after the other) and rel-L2 of the final latents against the plain run.
Random weights say how much work each cache saves; they misrank the error (the trained models of
benchmarks/caches.py do not). Writes the "families" section of docs/benchmarks.md and docs/families.png.
"""

from __future__ import annotations

import contextlib
import io
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
from _common import machine, rel_l2, save_plot, write_section  # noqa: E402

import torchfix  # noqa: E402
from torchfix import families  # noqa: E402
from torchfix.testing import flops  # noqa: E402
from torchfix.testing.families import FAMILIES, Tiny, denoise, replace  # noqa: E402

STEPS = 20
DEPTH = 12
# How each builder gets DEPTH blocks; a family with two lists gets 9 in each (cache-dit's default caches each list
# on its own and runs its first 8 blocks on every step).
DEEPER: dict[str, dict[str, Any]] = {
    "sd3": {"num_layers": DEPTH + 1},  # its last block always runs
    "flux": {"num_layers": 9, "num_single_layers": 9},
    "flux2": {"num_layers": 9, "num_single_layers": 9},
    "chroma": {"num_layers": 9, "num_single_layers": 9},
    "qwenimage": {"num_layers": DEPTH},
    "hidream": {"num_layers": 9, "num_single_layers": 9, "llama_layers": tuple(range(18))},
    "sana": {"num_layers": DEPTH},
    "pixart": {"num_layers": DEPTH},
    "lumina2": {"num_layers": DEPTH},
    "cogview4": {"num_layers": DEPTH},
    "auraflow": {"num_mmdit_layers": 9, "num_single_dit_layers": 9},
    "zimage": {"n_layers": DEPTH},
    "kandinsky5": {"num_visual_blocks": DEPTH},
    "wan": {"num_layers": DEPTH},
    "wan-vace": {"num_layers": DEPTH, "vace_layers": [0, 4, 8]},
    "skyreels-v2": {"num_layers": DEPTH},
    "hunyuanvideo": {"num_layers": 9, "num_single_layers": 9},
    "hunyuanvideo15": {"num_layers": DEPTH},
    "ltx": {"num_layers": DEPTH},
    "ltx2": {"num_layers": DEPTH},
    "cogvideox": {"num_layers": DEPTH},
    "mochi": {"num_layers": DEPTH + 1},
    "cosmos": {"num_layers": DEPTH},
    "bria": {"num_layers": 9, "num_single_layers": 9},
    "longcat-image": {"num_layers": 9, "num_single_layers": 9},
    "ovis-image": {"num_layers": 9, "num_single_layers": 9},
    "cogview3plus": {"num_layers": DEPTH},
    "nucleus-moe": {"num_layers": DEPTH, "capacity_factors": [8.0] * DEPTH},
    "joyimage": {"num_layers": DEPTH},
    "dit": {"num_layers": DEPTH},
    "chronoedit": {"num_layers": DEPTH},
    "sana-video": {"num_layers": DEPTH},
    "allegro": {"num_layers": DEPTH},
    "easyanimate": {"num_layers": DEPTH},
    "motif-video": {"num_layers": 9, "num_single_layers": 9},
    "latte": {"num_layers": DEPTH},  # as many spatial and temporal blocks
    # the day-0 builders (no registry entry: the cache reads theirs off the code)
    "auto:QwenImage21Transformer2DModel": {"num_layers": DEPTH},
    "auto:Flux3Transformer2DModel": {"num_layers": 2, "num_single_layers": DEPTH},
    "auto:Krea2Transformer2DModel": {"num_layers": DEPTH},
    "auto:Ideogram4Transformer2DModel": {"num_layers": DEPTH},
    "auto:GlmImageTransformer2DModel": {"num_layers": DEPTH},
    "auto:ErnieImageTransformer2DModel": {"num_layers": DEPTH},
    "auto:HunyuanImageTransformer2DModel": {"num_layers": 9, "num_single_layers": 9},
    "bria-fibo2": {"n_layers": DEPTH},
    "auto:PRXTransformer2DModel": {"depth": DEPTH},
    "auto:OmniGenTransformer2DModel": {"num_layers": DEPTH},
    "auto:DreamLiteTransformer2DModel": {"num_layers": DEPTH},
    "auto:Kandinsky6SRTransformer3DModel": {"num_visual_blocks": DEPTH},
    "auto:WanAnimateTransformer3DModel": {"num_layers": DEPTH, "inject_face_latents_blocks": 4},
    "auto:HunyuanVideoFramepackTransformer3DModel": {"num_layers": 9, "num_single_layers": 9},
    "auto:HeliosTransformer3DModel": {"num_layers": DEPTH},
    "auto:JoyImageEditPlusTransformer3DModel": {"num_layers": DEPTH},
    "auto:ConsisIDTransformer3DModel": {"num_layers": DEPTH},
    "auto:SanaWMLTX2RefinerTransformer3DModel": {"num_layers": DEPTH},
    "auto:MiniMaxH3Transformer3DModel": {"num_layers": DEPTH},
    "auto:AceStepTransformer1DModel": {"num_hidden_layers": DEPTH},
    "auto:MiniMaxMusic3Transformer1DModel": {"num_layers": DEPTH},
    "auto:LongCatAudioDiTTransformer": {"dit_depth": DEPTH},
    "auto:AnyFlowTransformer3DModel": {"num_layers": DEPTH},
    "auto:SanaWMTransformer3DModel": {"num_layers": DEPTH, "chunk_plucker_post_attn_blocks": DEPTH},
}


def deeper(name: str) -> Tiny:
    tiny = FAMILIES[name]
    return replace(tiny, config={**tiny.config, **DEEPER.get(name, {})})


Setup = Callable[[torch.nn.Module], None]


def rows() -> list[tuple[str, Setup, bool]]:
    """(label, enable on a fresh model, is torchfix)."""

    def tf(cfg: torchfix.DeepCacheConfig) -> Setup:
        return lambda m: torchfix.deepcache.apply(m, cfg)

    def diffusers_hook(apply: Callable[[Any, Any], None], make: Callable[[], Any]) -> Setup:
        return lambda m: apply(m, make())  # the apply_* functions: models without diffusers' cache mixin too

    def cache_dit(m: torch.nn.Module) -> None:
        import cache_dit

        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            cache_dit.enable_cache(m)

    from diffusers import FirstBlockCacheConfig, TaylorSeerCacheConfig
    from diffusers.hooks import apply_first_block_cache, apply_taylorseer_cache

    def cache_dit_at(threshold: float) -> Setup:
        def on(m: torch.nn.Module) -> None:
            import cache_dit

            config = cache_dit.DBCacheConfig(
                Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=threshold, max_warmup_steps=2
            )
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                cache_dit.enable_cache(m, cache_config=config)

        return on

    out = [("torchfix default", tf(torchfix.DeepCacheConfig(num_steps=STEPS)), True)]
    out += [(f"torchfix interval={k}", tf(torchfix.DeepCacheConfig(interval=k, num_steps=STEPS)), True) for k in (2, 4, 6)]
    # as little work saved as cache-dit's default: the first 8 blocks run on every step, as its F8B0 does, on a fixed
    # schedule, and refreshing when the features move as it does (torchfix's threshold: the blocks' input moved)
    for t in (0.05, 0.1):
        cfg = torchfix.DeepCacheConfig(interval=4, keep_first=8, threshold=t, num_steps=STEPS)
        out.append((f"torchfix keep_first=8 threshold={t}", tf(cfg), True))
    out += [
        (f"torchfix keep_first=8 interval={k}", tf(torchfix.DeepCacheConfig(interval=k, keep_first=8, num_steps=STEPS)), True)
        for k in (2, 3, 5)
    ]
    out += [
        ("diffusers FirstBlockCache", diffusers_hook(apply_first_block_cache, lambda: FirstBlockCacheConfig(threshold=0.05)), False),
        ("diffusers TaylorSeerCache", diffusers_hook(apply_taylorseer_cache, lambda: TaylorSeerCacheConfig()), False),
        ("cache-dit DBCache (default)", cache_dit, False),
    ]
    # as much work saved as torchfix's default: cache-dit's lightest setting (F1B0) at higher thresholds
    out += [(f"cache-dit DBCache F1B0 threshold={t}", cache_dit_at(t), False) for t in (0.2, 0.4, 0.8)]
    return out


def measure(tiny: Tiny, setup: Setup | None) -> dict[str, Any]:
    """Work, wall time and final latents of one run on a fresh model with ``setup`` applied (None: plain)."""
    model = tiny.build()
    if setup is not None:
        setup(model)
    run = lambda: denoise(model, tiny, steps=STEPS, context=True)  # noqa: E731
    work = flops(run)
    start = time.perf_counter()
    out = run()
    return {"work": work, "wall": time.perf_counter() - start, "latents": out.latents}


def family(name: str) -> list[dict[str, Any]]:
    tiny = deeper(name)
    try:
        plain = measure(tiny, None)
    except Exception as exc:  # a builder that cannot be deepened is a row, not the end of the run
        print(f"  plain run failed: {type(exc).__name__}: {exc}", flush=True)
        note = f"the plain run failed: {type(exc).__name__}"
        return [{"family": name, "label": label, "ours": ours, "work": math.nan, "wall": math.nan, "err": math.nan, "note": note}
                for label, _, ours in rows()]  # fmt: skip
    results = []
    for label, setup, ours in rows():
        row = {"family": name, "label": label, "ours": ours, "work": math.nan, "wall": math.nan, "err": math.nan, "note": ""}
        try:
            got = measure(tiny, setup)
            row.update(work=plain["work"] / got["work"], wall=plain["wall"] / got["wall"], err=rel_l2(got["latents"], plain["latents"]))
            if got["work"] >= plain["work"] * 0.999:
                row["note"] = "did not engage"
        except Exception as exc:  # a cache that cannot run on this family is a row too
            row["note"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
        results.append(row)
        print(f"  {label:32s} work {row['work']:.2f}x wall {row['wall']:.2f}x rel-L2 {row['err']:.4f} {row['note']}", flush=True)
    return results


def matched(results: list[dict[str, Any]], speed: float, ours: bool) -> dict[str, Any] | None:
    """The least error among torchfix's (``ours``) or the others' rows that save at least ``speed``× the work."""
    rows = [r for r in results if r["ours"] is ours and math.isfinite(r["err"]) and not r["note"] and r["work"] >= speed * 0.98]
    return min(rows, key=lambda r: r["err"]) if rows else None


def cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "—"
    if row["note"] and not math.isfinite(row["err"]):
        return f"cannot run ({row['note']})" if "engage" not in row["note"] else "did not engage"
    text = f"{row['work']:.2f}× · {row['err']:.4f}"
    return text + (" (did not engage)" if row["note"] == "did not engage" else "")


def report(all_rows: dict[str, list[dict[str, Any]]]) -> str:
    lines = [
        "Each cell: work speedup (denoiser FLOPs, plain ÷ cached) · rel-L2 of the final latents vs plain; "
        f"{STEPS} steps, one guidance pass, random weights, {DEPTH} blocks per chain (9 + 9 where a family has two lists). "
        "\"at cache-dit's work\": torchfix's least error among its rows that save at least as much work as cache-dit's default; "
        '"cache-dit at torchfix\'s work": the same '
        "for cache-dit's rows (its default and F1B0 at thresholds 0.2-0.8) against torchfix's default.",
        "",
        "| family | torchfix default | cache-dit default | torchfix at cache-dit's work | cache-dit at torchfix's work "
        "| diffusers FirstBlockCache | diffusers TaylorSeer |",
        "|---|---|---|---|---|---|---|",
    ]
    both, up, down = [], [], []
    for name, results in all_rows.items():
        by = {r["label"]: r for r in results}
        ours, dit = by["torchfix default"], by["cache-dit DBCache (default)"]
        runs = math.isfinite(dit["err"]) and not dit["note"]
        at = matched(results, dit["work"], True) if runs else None
        theirs = matched([r for r in results if r["label"].startswith("cache-dit")], ours["work"], False)
        name_of = lambda r: f" ({r['label'].removeprefix('torchfix ').removeprefix('cache-dit DBCache ')})" if r else ""  # noqa: E731
        lines.append(
            f"| {name} | {cell(ours)} | {cell(dit)} | {cell(at)}{name_of(at)} | {cell(theirs)}{name_of(theirs)} | "
            f"{cell(by['diffusers FirstBlockCache'])} | {cell(by['diffusers TaylorSeerCache'])} |"
        )
        if runs:
            both.append(ours["work"] >= dit["work"] * 0.98 and ours["err"] <= dit["err"])
            down.append(at is not None and at["err"] <= dit["err"])
        if theirs is not None:
            up.append(ours["err"] <= theirs["err"])
    lines += [
        "",
        f"Where cache-dit's default runs and engages ({len(both)} families): torchfix's default saves at least its work at lower or "
        f"equal error on {sum(both)}; at its work, torchfix's error is lower or equal on {sum(down)}. Where a cache-dit setting "
        f"saves as much work as torchfix's default ({len(up)} families), torchfix's error is lower or equal on {sum(up)}.",
    ]
    return "\n".join(lines)


def plot(all_rows: dict[str, list[dict[str, Any]]]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(all_rows)
    fig, ax = plt.subplots(figsize=(12, 4))
    width = 0.27
    for k, (label, colour) in enumerate(
        (("torchfix default", "tab:blue"), ("cache-dit DBCache (default)", "tab:orange"), ("diffusers FirstBlockCache", "tab:green"))
    ):
        values = [next((r["work"] for r in all_rows[n] if r["label"] == label and math.isfinite(r["err"])), 0.0) for n in names]
        ax.bar([i + (k - 1) * width for i in range(len(names))], values, width, label=label, color=colour)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=45, ha="right")
    ax.set_ylabel("work speedup (FLOPs)")
    ax.legend()
    return save_plot(fig, "Work saved per family at each cache's default (random weights)", "families.png", "work per family")


def main() -> None:
    torch.set_num_threads(1)
    args = sys.argv[1:]
    day0 = args == ["--day0"]  # the builders of the classes with no registry entry: a section of their own
    if day0:
        args = [n for n in FAMILIES if n.startswith("auto:")]
    # the transformer families: the UNets (SD, AnimateDiff, SVD) have no blocks for the hooks and cache-dit to compare on
    wanted = args or [n for n in FAMILIES if not n.startswith("auto:") and families.get(FAMILIES[n].family).kind != "unet"]
    all_rows = {}
    for name in wanted:
        print(name, flush=True)
        all_rows[name] = family(name)
    text = report(all_rows)
    print(text)
    if day0:
        body = (
            "## Day-0 families: torchfix through the entry it reads off the code, diffusers' hooks and cache-dit\n\n"
            "`benchmarks/families.py --day0` (issue: day-0 families), as the section above. " + machine() + ", cache-dit 1.5.3.\n\n" + text
        )
        write_section("families_day0", body)
    if not sys.argv[1:]:
        body = (
            "## Every family: torchfix, diffusers' hooks and cache-dit\n\n"
            "`benchmarks/families.py` (issue: every model family). " + machine() + ", cache-dit 1.5.3.\n\n" + text + "\n\n" + plot(all_rows)
        )
        write_section("families", body)


if __name__ == "__main__":
    main()
