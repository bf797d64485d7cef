"""Z-Image's cache default, measured on a trained model (issue: day-0 families, point 3): why its cache drifts more
than its peers', and whether holding the cached residual (``forecast=0``, its registry entry's default) beats the
transformer default (a linear forecast) once the weights are trained.

    .venv/bin/python benchmarks/zimage_forecast.py              # ~8 min on one thread: 2,000 training steps, the rows
    .venv/bin/python benchmarks/zimage_forecast.py --steps 500  # a shorter training

Trains the ``zimage`` tiny builder (torchfix.testing.FAMILIES, diffusers' test sizes) on 8×8 digits rendered with
Pillow's default font (10 digits × 9 shifts, lifted to its 16 latent channels by a fixed random vector; each digit's
caption a fixed random 16×16 embedding), flow matching as ZImagePipeline runs it: model time 1 − sigma (1 = clean),
output negated to the velocity. Then, on the trained and on the random model, mean of 6 seeds, driven as the pipeline
drives it (Euler): how much the time embedding moves per step of 8, the cache's rel-L2 of the final latents at each
default, and with the cached layers' modulation held fixed (a pre-hook gives every main layer one time embedding in
the plain and the cached run alike: what is left when a stale modulation cannot cost anything).

Measured 2026-11-27 (2-core AMD EPYC, one thread, 2,000 optimiser steps in 4.8 min, loss 1.25 -> 0.82); mean
rel-L2 of 6 seeds, forecast 1 (the transformer default) / forecast 0 (Z-Image's entry):

    trained: t-emb step change 0.171; 8 steps interval 3: 0.0507 / 0.0386 (3 full steps each); modulation fixed 0.0441
             20 steps interval 3: 0.0119 (9 full) / 0.0135 (8 full); interval 4: 0.0168 / 0.0178 (7 full each)
    random:  t-emb step change 1.005; 8 steps interval 3: 0.0563 / 0.0438; modulation fixed 0.0299
             20 steps interval 3: 0.0276 (9 full) / 0.0271 (8 full); interval 4: 0.0482 / 0.0400
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

os.environ.setdefault("TORCHFIX_MODE", "off")
os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402

import torchfix  # noqa: E402
from torchfix.testing.families import FAMILIES  # noqa: E402

TINY = FAMILIES["zimage"]
SEEDS = 6


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """10 digits × 9 one-pixel shifts, 8×8 in [-1, 1], and their labels."""
    from PIL import Image, ImageDraw, ImageFont

    def render(k: int, dx: int, dy: int) -> torch.Tensor:
        image = Image.new("L", (16, 16))
        ImageDraw.Draw(image).text((4 + dx, 1 + dy), str(k), fill=255, font=ImageFont.load_default())
        return torch.tensor(list(image.resize((8, 8), Image.BILINEAR).getdata()), dtype=torch.float32).view(8, 8) / 127.5 - 1

    pairs = [(k, dx, dy) for k in range(10) for dx in (-1, 0, 1) for dy in (-1, 0, 1)]
    return torch.stack([render(*p) for p in pairs]), torch.tensor([p[0] for p in pairs])


def captions() -> torch.Tensor:
    return torch.randn(10, 16, 16, generator=torch.Generator().manual_seed(0))


def train(steps: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)
    images, labels = digits()
    lift, caps = torch.randn(16, 1, generator=g), captions()
    model = TINY.build()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    start, losses = time.time(), []
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, len(images), (32,), generator=g)
        x0 = (images[idx][:, None] * lift[None, :, :, None])[:, :, None]  # (32, 16, 1, 8, 8)
        eps = torch.randn(x0.shape, generator=g)
        sigma = torch.rand(32, generator=g)
        xt = (1 - sigma.view(-1, 1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1, 1) * eps
        out = torch.stack(model(list(xt), 1 - sigma, [caps[k] for k in labels[idx]], return_dict=False)[0])
        loss = ((out - (x0 - eps)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    minutes = (time.time() - start) / 60
    print(f"trained {steps} steps in {minutes:.1f} min, loss {sum(losses[:50]) / 50:.2f} -> {sum(losses[-200:]) / len(losses[-200:]):.2f}")
    return model.eval()


@torch.no_grad()
def sample(model: torch.nn.Module, seed: int, steps: int) -> torch.Tensor:
    """ZImagePipeline's loop: model time 1 − sigma, velocity = −output, Euler from sigma 1 to 0."""
    x = [torch.randn(16, 1, 8, 8, generator=torch.Generator().manual_seed(seed))]
    cap = [captions()[seed % 10]]
    for i in range(steps):
        sigma, after = 1 - i / steps, 1 - (i + 1) / steps
        velocity = -model(x, torch.tensor([1 - sigma]), cap, return_dict=False)[0][0]
        x = [x[0] + (after - sigma) * velocity]
    return x[0]


def drift(model: torch.nn.Module, steps: int, interval: int, **config: object) -> tuple[float, int]:
    """Mean rel-L2 of the cached run's final latents against the plain run's, and the full steps of one run."""
    errors = []
    for seed in range(SEEDS):
        plain = sample(model, seed, steps)
        torchfix.deepcache.apply(model, torchfix.DeepCacheConfig(interval=interval, num_steps=steps, **config))
        cached = sample(model, seed, steps)
        full = torchfix.deepcache.stats(model)["full_steps"]
        torchfix.deepcache.remove(model)
        errors.append(((cached - plain).norm() / plain.norm()).item())
    return sum(errors) / len(errors), full


@torch.no_grad()
def embedding_step(model: torch.nn.Module) -> float:
    """How much the time embedding moves per step of 8 (relative L2, mean)."""
    e = model.t_embedder(torch.tensor([i / 8 for i in range(8)]) * 1000)
    return sum(((e[i + 1] - e[i]).norm() / e[i].norm()).item() for i in range(7)) / 7


def fixed_modulation(model: torch.nn.Module) -> list:
    """Give every main layer the time embedding of t = 0.5 (handles to remove)."""
    with torch.no_grad():
        fixed = model.t_embedder(torch.tensor([500.0]))

    def pre(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
        args = list(args)
        args[3] = fixed.expand_as(args[3])  # layer(x, mask, freqs, adaln_input, ...)
        return tuple(args), kwargs

    return [layer.register_forward_pre_hook(pre, with_kwargs=True) for layer in model.layers]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000, help="optimiser steps (default 2000)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for label, model in (("trained", train(args.steps)), ("random", TINY.build())):
        rows = [f"t-emb step change {embedding_step(model):.3f}"]
        for steps, interval in ((8, 3), (20, 3), (20, 4)):
            for forecast in (1, 0):
                err, full = drift(model, steps, interval, forecast=forecast)
                rows.append(f"{steps} steps interval {interval} forecast {forecast}: {err:.4f} ({full} full)")
        handles = fixed_modulation(model)
        rows.append(f"8 steps interval 3 forecast 1, modulation fixed: {drift(model, 8, 3, forecast=1)[0]:.4f}")
        for handle in handles:
            handle.remove()
        print(f"{label}:\n  " + "\n  ".join(rows), flush=True)


if __name__ == "__main__":
    main()
