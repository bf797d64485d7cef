"""DeepCache speed and error, side by side in one process.

    .venv/bin/python benchmarks/deepcache.py            # the grid below (~30-40 min on 2 cores)
    .venv/bin/python benchmarks/deepcache.py --quick    # 512x512 only, fewer configs

For each pipeline (tiny SD1.5-like and SDXL-like, random weights) and size, 10 DDIM steps:
plain; torchfix DeepCache (uniform and nonuniform, intervals 2-5, branches 0-2); DeepCache 0.1.1
(PyPI) with the same interval/branch; diffusers 0.42's pyramid_attention_broadcast and
taylorseer_cache. Each row: wall time ratio vs plain, relative L2 of the final latents vs plain,
and the step-aware bound S / (F + C*f) with f the measured cost of a cached step over a full one.
Writes the "deepcache" section of docs/benchmarks.md and docs/deepcache.png.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import warnings

os.environ.setdefault("TORCHFIX_MODE", "off")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from _common import DOCS, machine, rel_l2, write_section  # noqa: E402

import torchfix  # noqa: E402
from torchfix.deepcache import DeepCacheConfig, full_steps  # noqa: E402
from torchfix.testing import latents, tiny_sd15_pipeline, tiny_sdxl_pipeline  # noqa: E402

STEPS = 10


REPEATS = [1]  # best-of for cheap generations, set in main()


def generate(pipe, size, prompt="a photo of a cat", seed=0):
    """Latents and the best wall time of REPEATS[0] identical generations (each a new generation)."""
    best = float("inf")
    for _ in range(REPEATS[0]):
        start = time.perf_counter()
        out = latents(pipe, prompt, steps=STEPS, size=size, seed=seed)
        best = min(best, time.perf_counter() - start)
    return out, best


def cached_cost(pipe, size, branch, reps=2):
    """f: the time of a cached UNet step over a full one, measured on the UNet directly."""
    unet = pipe.unet
    ehs = torch.randn(2, 77, unet.config.cross_attention_dim)
    x = torch.randn(2, 4, size[0] // 8, size[1] // 8)
    kw = {}
    if unet.config.addition_embed_type == "text_time":
        kw["added_cond_kwargs"] = {"text_embeds": torch.randn(2, 32), "time_ids": torch.randn(2, 6)}
    torchfix.deepcache.apply(unet, DeepCacheConfig(interval=2, warm_up=False, branch=branch))
    full, cached = [], []
    with torch.no_grad():
        for _ in range(reps):
            torchfix.deepcache.new_call(unet)
            t0 = time.perf_counter()
            unet(x, 500, ehs, **kw)
            t1 = time.perf_counter()
            unet(x, 400, ehs, **kw)
            t2 = time.perf_counter()
            full.append(t1 - t0)
            cached.append(t2 - t1)
    torchfix.deepcache.remove(unet)
    return min(cached) / min(full)


def bound(config, f):
    n_full = len(full_steps(STEPS, config))
    return STEPS / (n_full + (STEPS - n_full) * f)


def run_deepcache_pypi(pipe, size, interval, branch):
    from DeepCache import DeepCacheSDHelper

    helper = DeepCacheSDHelper(pipe=pipe)
    helper.set_params(cache_interval=interval, cache_branch_id=branch)
    helper.enable()
    try:
        return generate(pipe, size)
    finally:
        helper.disable()


def run_diffusers_peer(pipe, size, kind, interval):
    from diffusers.hooks import (
        PyramidAttentionBroadcastConfig,
        TaylorSeerCacheConfig,
        apply_pyramid_attention_broadcast,
        apply_taylorseer_cache,
    )

    original = pipe.unet
    unet = copy.deepcopy(original)
    current = [999]
    unet.register_forward_pre_hook(lambda m, args: current.__setitem__(0, int(args[1])))
    if kind == "pyramid_attention_broadcast":
        apply_pyramid_attention_broadcast(
            unet,
            PyramidAttentionBroadcastConfig(
                spatial_attention_block_skip_range=interval,
                spatial_attention_timestep_skip_range=(100, 800),
                current_timestep_callback=lambda: current[0],
            ),
        )
    else:
        apply_taylorseer_cache(
            unet, TaylorSeerCacheConfig(cache_interval=interval, disable_cache_before_step=1, taylor_factors_dtype=torch.float32)
        )
    pipe.unet = unet
    try:
        return generate(pipe, size)
    finally:
        pipe.unet = original


def robustness(build):
    """The failure modes the issue names: resolution change between calls, and stale features."""
    from DeepCache import DeepCacheSDHelper

    pipe = build()
    rows = []
    cfg = DeepCacheConfig(interval=3, branch=0)
    # resolution change
    torchfix.deepcache.apply(pipe, cfg)
    generate(pipe, (512, 512))
    try:
        generate(pipe, (720, 960))
        ours = "runs"
    except Exception as exc:  # reported, not hidden
        ours = f"fails: {type(exc).__name__}"
    torchfix.deepcache.remove(pipe)
    helper = DeepCacheSDHelper(pipe=pipe)
    helper.set_params(cache_interval=3, cache_branch_id=0)
    helper.enable()
    generate(pipe, (512, 512))
    try:
        generate(pipe, (720, 960))
        theirs = "runs"
    except Exception as exc:
        theirs = f"fails: {type(exc).__name__}: {str(exc)[:60]}"
    helper.disable()
    rows.append(("512×512 then 720×960", ours, theirs))
    # a new prompt at the same size: error vs plain, after a first generation
    size = (512, 512)
    ref_dog, _ = generate(pipe, size, prompt="a dog")
    torchfix.deepcache.apply(pipe, cfg)
    generate(pipe, size, prompt="a cat")
    ours_dog, _ = generate(pipe, size, prompt="a dog")
    torchfix.deepcache.remove(pipe)
    torchfix.deepcache.apply(pipe, cfg)
    fresh_dog, _ = generate(pipe, size, prompt="a dog")
    torchfix.deepcache.remove(pipe)
    helper = DeepCacheSDHelper(pipe=pipe)
    helper.set_params(cache_interval=3, cache_branch_id=0)
    helper.enable()
    generate(pipe, size, prompt="a cat")
    theirs_dog, _ = generate(pipe, size, prompt="a dog")
    helper.disable()
    rows.append(
        (
            "prompt change at 512×512: rel-L2 vs plain (fresh enable)",
            f"{rel_l2(ours_dog, ref_dog):.4f} (fresh {rel_l2(fresh_dog, ref_dog):.4f}; identical: {torch.equal(ours_dog, fresh_dog)})",
            f"{rel_l2(theirs_dog, ref_dog):.4f}",
        )
    )
    # img2img after txt2img on the same UNet and scheduler (DeepCache issue #54): 0.1.1 never resets its step count
    from diffusers import StableDiffusionXLImg2ImgPipeline

    img2img = StableDiffusionXLImg2ImgPipeline(**pipe.components)
    img2img.set_progress_bar_config(disable=True)

    def i2i(size):
        image = torch.rand(1, 3, *size, generator=torch.Generator().manual_seed(1))
        return img2img("a dog", image=image, strength=0.5, num_inference_steps=STEPS, output_type="latent",
                       generator=torch.Generator().manual_seed(0)).images  # fmt: skip

    for size in ((512, 512), (720, 960)):
        ref = i2i(size)
        torchfix.deepcache.apply(pipe, cfg)
        generate(pipe, (512, 512))
        ours = f"{rel_l2(i2i(size), ref):.4f}"
        torchfix.deepcache.remove(pipe)
        torchfix.deepcache.apply(pipe, cfg)
        ours += f" (fresh {rel_l2(i2i(size), ref):.4f})"
        torchfix.deepcache.remove(pipe)
        helper = DeepCacheSDHelper(pipe=pipe)
        helper.set_params(cache_interval=3, cache_branch_id=0)
        helper.enable()
        try:
            generate(pipe, (512, 512))
            theirs = f"{rel_l2(i2i(size), ref):.4f}"
        except Exception as exc:
            theirs = f"fails: {type(exc).__name__}: {str(exc)[:60]}"
        finally:
            helper.disable()
        rows.append((f"txt2img 512×512, then img2img strength 0.5 at {size[0]}×{size[1]}: rel-L2 vs plain img2img", ours, theirs))
    return rows


def make_plot(points, path):
    """Speedup vs rel-L2, one panel per pipeline and size; returns the path, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    tags = sorted({p[0] for p in points}, key=lambda t: (t.split()[0], int(t.split()[1].split("×")[0])))
    cols = 3
    rows = (len(tags) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    methods = sorted({p[1] for p in points})
    for ax, tag in zip(axes.flat, tags):
        for method in methods:
            pts = [(s, e) for t, m, s, e in points if t == tag and m == method]
            if pts:
                ax.scatter([p[1] for p in pts], [p[0] for p in pts], label=method, s=20)
        ax.set_title(tag)
        ax.set_xlabel("relative L2 of final latents vs plain")
        ax.set_ylabel("speedup vs plain")
        ax.set_xscale("symlog", linthresh=1e-3)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(tags) :]:
        ax.axis("off")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def replot_from_docs() -> None:
    """Rebuild docs/deepcache.png from the table already in docs/benchmarks.md."""
    text = DOCS.read_text()
    section = text[text.index("<!-- deepcache:start -->") : text.index("<!-- deepcache:end -->")]
    points = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 9 and cells[5].endswith("×") and cells[1] != "plain":
            points.append((cells[0], cells[1], float(cells[5][:-1]), float(cells[6])))
    print(make_plot(points, DOCS.parent / "deepcache.png"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--replot", action="store_true", help="only rebuild the plot from docs/benchmarks.md")
    args = ap.parse_args()
    if args.replot:
        replot_from_docs()
        return
    torch.set_num_threads(2)
    sizes = [(512, 512)] if args.quick else [(512, 512), (720, 960), (1000, 1000)]
    intervals = (3,) if args.quick else (2, 3, 4, 5)
    rows = []
    plot_points = []
    for label, build in (("SD1.5-like", tiny_sd15_pipeline), ("SDXL-like", tiny_sdxl_pipeline)):
        pipe = build()
        for size in sizes:
            heavy = label == "SD1.5-like" and size != (512, 512)
            branches = (0,) if heavy or args.quick else (0, 1, 2)
            REPEATS[0] = 1
            generate(pipe, (64, 64))  # warm up
            ref, t_plain = generate(pipe, size)
            REPEATS[0] = 2 if t_plain < 15 else 1  # best of 2 where a generation is cheap
            if REPEATS[0] > 1:
                ref, t_plain = generate(pipe, size)
            tag = f"{label} {size[0]}×{size[1]}"
            rows.append((tag, "plain", "-", "-", f"{t_plain:.1f} s", "1.00×", "0", "-", "-"))
            print(rows[-1], flush=True)
            for branch in branches:
                f = cached_cost(pipe, size, branch)
                for interval in intervals:
                    for schedule in ("uniform", "nonuniform"):
                        cfg = DeepCacheConfig(interval=interval, branch=branch, schedule=schedule)
                        torchfix.deepcache.apply(pipe, cfg)
                        out, t = generate(pipe, size)
                        torchfix.deepcache.remove(pipe)
                        b = bound(cfg, f)
                        speed, err = t_plain / t, rel_l2(out, ref)
                        rows.append((tag, f"torchfix {schedule}", str(interval), str(branch), f"{t:.1f} s", f"{speed:.2f}×",
                                     f"{err:.4f}", f"{b:.2f}× (f={f:.3f})", f"{speed / b:.2f}"))  # fmt: skip
                        plot_points.append((tag, f"torchfix {schedule}", speed, err))
                        print(rows[-1], flush=True)
                    try:
                        out, t = run_deepcache_pypi(pipe, size, interval, branch)
                        speed, err = t_plain / t, rel_l2(out, ref)
                        rows.append(
                            (tag, "DeepCache 0.1.1", str(interval), str(branch), f"{t:.1f} s", f"{speed:.2f}×", f"{err:.4f}", "-", "-")
                        )
                        plot_points.append((tag, "DeepCache 0.1.1", speed, err))
                    except Exception as exc:
                        rows.append(
                            (tag, "DeepCache 0.1.1", str(interval), str(branch), f"fails: {type(exc).__name__}", "-", "-", "-", "-")
                        )
                    print(rows[-1], flush=True)
            for kind in ("pyramid_attention_broadcast", "taylorseer_cache"):
                for interval in (2, 3) if not heavy else (3,):
                    try:
                        out, t = run_diffusers_peer(pipe, size, kind, interval)
                        speed, err = t_plain / t, rel_l2(out, ref)
                        rows.append((tag, f"diffusers {kind}", str(interval), "-", f"{t:.1f} s", f"{speed:.2f}×", f"{err:.4f}", "-", "-"))
                        plot_points.append((tag, f"diffusers {kind}", speed, err))
                    except Exception as exc:
                        rows.append((tag, f"diffusers {kind}", str(interval), "-", f"fails: {type(exc).__name__}", "-", "-", "-", "-"))
                    print(rows[-1], flush=True)
    robust = robustness(tiny_sdxl_pipeline)
    for r in robust:
        print(r, flush=True)

    plot = make_plot(plot_points, DOCS.parent / "deepcache.png")

    header = ("pipeline", "method", "interval", "branch", "time", "speedup", "rel-L2", "bound S/(F+C·f)", "speed/bound")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]
    rob = ["| case | torchfix | DeepCache 0.1.1 |", "|---|---|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in robust]
    body = f"""## DeepCache (`benchmarks/deepcache.py`)

Machine: {machine()}.

Tiny SD1.5-like and SDXL-like pipelines (`torchfix.testing`, random weights), {STEPS} DDIM steps (SDXL-like: Euler),
classifier-free guidance on (batch 2), all in one process; times are the best of 2 generations where one takes under
15 s, else a single generation. `f` is the measured cost of a
cached UNet step over a full one (branch-specific); the bound is `S / (F + C·f)`. SD1.5-like at 720×960 and
1000×1000 runs branch 0 only (its attention at the highest resolution makes each step 6-14 s on 2 cores).
Rerun: `.venv/bin/python benchmarks/deepcache.py` ({"quick run" if args.quick else "full run"}).

{chr(10).join(lines)}

Robustness (SDXL-like, interval 3, branch 0):

{chr(10).join(rob)}

{"![speed vs error](deepcache.png)" if plot else "(matplotlib missing: no plot)"}
"""
    write_section("deepcache", body)
    print("wrote docs/benchmarks.md", flush=True)


if __name__ == "__main__":
    main()
