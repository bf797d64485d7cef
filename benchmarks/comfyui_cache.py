"""The torchfix cache node in ComfyUI: work (blocks that computed), wall time and error against plain ComfyUI, per
ComfyUI model class the family registry covers, through ComfyUI's own sampler (comfy.sample.sample, as KSampler).

Error figures come from the two models trained here (an SD1.5-like UNetModel and a Qwen-Image-like DiT of ComfyUI's
own classes, trained on scikit-learn's digits lifted to latents, a few CPU-minutes each, kept under
$TORCHFIX_CACHE/comfyui-denoisers); the other classes run with random weights, so only their work and time count.

    .venv/bin/python benchmarks/comfyui_cache.py            # trains what is missing, measures, writes docs/benchmarks.md
    .venv/bin/python benchmarks/comfyui_cache.py --quick    # no training, fewer repeats, prints only
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine, rel_l2, write_section

from torchfix.comfyui import TorchfixCache, TorchfixGuards
from torchfix.testing import comfyui

TRAINED = ("sd15", "qwenimage")  # ComfyUI's Flux/Chroma/HunyuanVideo blocks update tensors in place: no autograd
LATENT = (16, 16)  # the size the trained models learned (digits lifted to 16x16 latents)
STEPS = 20
EASY_THRESHOLDS = (0.2, 0.05, 0.01)  # EasyCache's default reuse threshold, and lower (less reuse, less error)


def store() -> Path:
    return Path(os.environ.get("TORCHFIX_CACHE", Path.home() / ".cache" / "torchfix")) / "comfyui-denoisers"


def digits(channels: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 digits in [-1, 1], lifted to ``channels`` latent channels at 16x16 by a fixed random map."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32) / 8.0 - 1.0
    images = torch.nn.functional.interpolate(images[:, None], size=LATENT, mode="bilinear", align_corners=False)
    g = torch.Generator().manual_seed(seed)
    lift = torch.randn(channels, generator=g)[None, :, None, None] * 0.8
    shift = torch.randn(channels, generator=g)[None, :, None, None] * 0.2
    return images * lift + shift, torch.tensor(data.target)


def prompts(model: comfyui.TinyComfy) -> torch.Tensor:
    """One fixed random text embedding per digit (the conditioning the model learns to follow)."""
    g = torch.Generator().manual_seed(7)
    return torch.randn(10, 7, model.context, generator=g)


def extra(model: comfyui.TinyComfy, batch: int) -> dict[str, torch.Tensor]:
    out = {}
    if model.adm:
        out["y"] = torch.zeros(batch, model.adm)
    if model.name == "flux":
        out["guidance"] = torch.full((batch,), 3.5)
    return out


def train(name: str, minutes: float) -> comfyui.TinyComfy:
    """Train ``name`` on the digits with ComfyUI's own model sampling (the denoised output against the clean latent)."""
    model = comfyui.tiny(name)
    path = store() / f"{name}.pt"
    if path.exists():
        model.patcher.model.load_state_dict(torch.load(path))
        return model
    x0_all, labels = digits(model.channels)
    if model.frames:  # a video latent (Qwen-Image's: one frame)
        x0_all = x0_all[:, :, None].expand(-1, -1, model.frames, -1, -1).contiguous()
    text = prompts(model)
    base = model.patcher.model
    sampling = base.model_sampling
    opt = torch.optim.AdamW(base.diffusion_model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    start, step, losses = time.time(), 0, []
    base.diffusion_model.train()
    while time.time() - start < minutes * 60:
        index = torch.randint(0, len(labels), (32,), generator=g)
        x0, context = x0_all[index], text[labels[index]]
        t = torch.rand(32, generator=g) * 0.98 + 0.01
        sigma = torch.tensor([float(sampling.percent_to_sigma(float(p))) for p in t])
        noise = torch.randn(x0.shape, generator=g)
        noisy = sampling.noise_scaling(sigma.view(-1, 1, 1, 1), noise, x0)
        denoised = base.apply_model(noisy, sigma, c_crossattn=context, transformer_options={}, **extra(model, 32))
        loss = torch.nn.functional.mse_loss(denoised, x0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        step += 1
    base.diffusion_model.eval()
    store().mkdir(parents=True, exist_ok=True)
    torch.save(base.state_dict(), path)
    first, last = statistics.mean(losses[:20]), statistics.mean(losses[-20:])
    print(f"trained {name}: {step} steps in {minutes:.0f} min, loss {first:.3f} -> {last:.3f}")
    return model


def conditioning(model: comfyui.TinyComfy, digit: int, text: torch.Tensor | None) -> list:
    if text is None:
        return model.conditioning(digit)
    extra_cond = {"pooled_output": torch.zeros(1, model.pooled)} if model.pooled else {}
    return [[text[digit : digit + 1], extra_cond]]


def run(
    model: comfyui.TinyComfy, patcher, size: tuple[int, int], digit: int, text: torch.Tensor | None
) -> tuple[torch.Tensor, int, float]:
    import comfy.sample

    latent = model.latent(*size)
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(digit))
    positive, negative = conditioning(model, digit, text), conditioning(model, (digit + 5) % 10, text)
    with comfyui.BlockCounter(model.diffusion_model) as counter, torch.inference_mode():  # as ComfyUI runs nodes
        start = time.perf_counter()
        out = comfy.sample.sample(
            patcher, noise, STEPS, 3.0, "euler", "normal", positive, negative, latent, seed=digit, disable_pbar=True
        )
        wall = time.perf_counter() - start
    return out, counter.calls, wall


def measure(name: str, trained: bool, repeats: int, minutes: float) -> dict:
    model = train(name, minutes) if trained else comfyui.tiny(name)
    text = prompts(model) if trained else None
    size = LATENT if trained else model.sizes[1]
    (cached,) = TorchfixCache().patch(model.patcher, 3, 0.0, 0)
    errors, blocks, walls = [], {}, {"plain": [], "cache": []}
    # ComfyUI core's own cache node, side by side on the trained models: its default threshold and two lower ones
    easy = {t: easycache(model.patcher, t) for t in EASY_THRESHOLDS} if trained else {}
    easy_errors: dict[float, list[float]] = {t: [] for t in easy}
    easy_blocks: dict[float, list[int]] = {t: [] for t in easy}  # EasyCache's skips depend on the prompt
    for digit in range(repeats):
        plain, plain_blocks, plain_wall = run(model, model.patcher, size, digit, text)
        out, cached_blocks, cached_wall = run(model, cached, size, digit, text)
        errors.append(rel_l2(out, plain))
        blocks = {"plain": plain_blocks, "cache": cached_blocks}
        walls["plain"].append(plain_wall)
        walls["cache"].append(cached_wall)
        for t, patcher in easy.items():
            easy_out, n, _ = run(model, patcher, size, digit, text)
            easy_blocks[t].append(n)
            easy_errors[t].append(rel_l2(easy_out, plain))
    return {
        "easycache": {t: (blocks["plain"] / statistics.median(easy_blocks[t]), statistics.median(easy_errors[t])) for t in easy},
        "name": name,
        "family": type(model.diffusion_model).__module__.removeprefix("comfy.ldm.") + "." + type(model.diffusion_model).__name__,
        "trained": trained,
        "size": size,
        "blocks": blocks,
        "work": blocks["plain"] / blocks["cache"],
        "wall": statistics.median(walls["plain"]) / statistics.median(walls["cache"]),
        "error": statistics.median(errors),
    }


def easycache(patcher, threshold: float):
    """ComfyUI core's EasyCache node on ``patcher`` (its defaults: reuse threshold 0.2, 15%..95% of the steps)."""
    from comfy_extras.nodes_easycache import EasyCacheNode

    return EasyCacheNode.execute(patcher, threshold, 0.15, 0.95, False).result[0]


def guards_cost(name: str, repeats: int) -> dict:
    """The guards node on a sound model: sampling time plain and guarded (fix mode), interleaved; outputs compared."""
    model = comfyui.tiny(name)
    (guarded,) = TorchfixGuards().patch(model.patcher, "fix")
    walls: dict[str, list[float]] = {"plain": [], "guarded": []}
    same = True
    for digit in range(repeats):
        plain, _, plain_wall = run(model, model.patcher, model.sizes[0], digit, None)
        out, _, guarded_wall = run(model, guarded, model.sizes[0], digit, None)
        same &= torch.equal(out, plain)
        walls["plain"].append(plain_wall)
        walls["guarded"].append(guarded_wall)
    plain_s, guarded_s = statistics.median(walls["plain"]), statistics.median(walls["guarded"])
    per_call = (guarded_s - plain_s) / STEPS * 1e3  # cond and uncond batched: one denoiser call a step
    return {"name": name, "plain": plain_s, "guarded": guarded_s, "same": same, "per_call_ms": per_call}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="no training, 1 repeat, print only")
    parser.add_argument("--minutes", type=float, default=4.0, help="training time per trained model (default 4)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    nodes, why = comfyui.load()
    if nodes is None:
        sys.exit(f"comfyui_cache: {why}")
    rows = []
    for name in sorted(comfyui.MODELS):
        trained = name in TRAINED and not args.quick
        rows.append(measure(name, trained, 1 if args.quick else 3, args.minutes))
        r = rows[-1]
        blocks = f"{r['blocks']['plain']} -> {r['blocks']['cache']} ({r['work']:.2f}x)"
        print(f"{name}: blocks {blocks}, wall {r['wall']:.2f}x, rel-L2 {r['error']:.4f}, EasyCache {r['easycache']}")
    costs = [guards_cost(name, 1 if args.quick else 5) for name in ("sd15", "flux")]
    for c in costs:
        print(f"guards {c['name']}: {c['plain']:.3f} s plain, {c['guarded']:.3f} s guarded, bit-identical {c['same']}")
    if args.quick:
        return
    lines = [
        "## ComfyUI: the torchfix cache node (benchmarks/comfyui_cache.py)",
        "",
        f"Machine: {machine()}; ComfyUI 0.3.64 (vendor tarball). Each model sampled by `comfy.sample.sample` (euler, normal, "
        f"{STEPS} steps, cfg 3: cond and uncond in one batch), plain and through the cache node (interval 3, the family's "
        "defaults), 3 prompts/seeds interleaved, median. *blocks*: the denoiser's blocks that computed (a UNet's block layers, "
        "a transformer's blocks), counted by forward hooks inside each block; *wall*: sampling time plain / cached, one torch "
        "thread. Error: rel-L2 of the final latents against plain ComfyUI; a quality figure only for the two models trained "
        "here (digits, 16×16 latents); with random weights it is not one (shown in brackets).",
        "",
        "| ComfyUI class | weights | latent | blocks plain → cached | work saved | wall | error (rel-L2) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        err = f"{r['error']:.4f}" if r["trained"] else f"({r['error']:.4f})"
        lines.append(
            f"| `{r['family']}` ({r['name']}) | {'trained' if r['trained'] else 'random'} | {r['size'][0]}×{r['size'][1]} | "
            f"{r['blocks']['plain']} → {r['blocks']['cache']} | {r['work']:.2f}× | {r['wall']:.2f}× | {err} |"
        )
    for r in rows:
        for t, (work, error) in r["easycache"].items():
            lines.append(
                f"| ComfyUI's EasyCache (threshold {t}{', its default' if t == 0.2 else ''}) on ({r['name']}) | trained | "
                f"{r['size'][0]}×{r['size'][1]} | — | {work:.2f}× | — | {error:.4f} |"
            )
    lines += [
        "",
        f"The guards node on a sound model (fix mode, {STEPS} steps, one denoiser call a step; median of 5 interleaved):",
        "",
        "| model | plain | guarded | per denoiser call | output |",
        "|---|---|---|---|---|",
    ]
    for c in costs:
        lines.append(
            f"| {c['name']} | {c['plain'] * 1e3:.0f} ms | {c['guarded'] * 1e3:.0f} ms | {c['per_call_ms']:+.1f} ms | "
            f"{'bit-identical' if c['same'] else 'DIFFERS'} |"
        )
    write_section("comfyui-cache", "\n".join(lines))
    print("written to docs/benchmarks.md (comfyui-cache)")


if __name__ == "__main__":
    main()
