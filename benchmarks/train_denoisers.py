"""Train the tiny SD1.5-like UNet, SD3-like, Flux-like and Wan-like (video) transformers on scikit-learn's digits, offline.

    .venv/bin/python benchmarks/train_denoisers.py               # all four (make denoisers; ~1 CPU-hour)
    .venv/bin/python benchmarks/train_denoisers.py --kind flux   # one
    .venv/bin/python benchmarks/train_denoisers.py --check       # only re-check the saved ones

Data: ``sklearn.datasets.load_digits`` (1,797 8×8 digits, shipped inside scikit-learn), lifted to 128×128
RGB, encoded by each pipeline's own (random, frozen) VAE and standardised; for the Wan-like video model, 9 frames
of each digit (24×24) moving across a 64×64 frame, in a direction and from a start set per digit image. Conditioning: "a handwritten digit
k" through each pipeline's own frozen text encoders, dropped to "" 10% of the time so classifier-free
guidance has an unconditional branch to work with. Objective: the pipeline's own (SD1.5: ε-prediction on the
DDIM scheduler's noise schedule; SD3/Flux/Wan: rectified flow, velocity ε − x₀ at logit-normal σ). AdamW, batch
32, one torch thread, seeded.

Check: each model samples 2 latents per digit with its pipeline (20 steps, the pipeline's own guidance):
how near they land to the training latents (against an untrained model's samples), and the prompted digit by
each sample's 5 nearest training latents; chance is 10%. The checkpoint
(``save_pretrained``), the loss curve and the check are written under benchmarks/_trained.py's cache_dir().
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

os.environ.setdefault("TORCHFIX_MODE", "off")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _common import machine  # noqa: E402
from _trained import BUILDERS, KINDS, SIZE, VIDEO, cache_dir, call, denoiser_name, prompt, trained_pipeline  # noqa: E402

from torchfix.testing import latents  # noqa: E402

# Optimiser steps (10-25 CPU-minutes each on one thread). The checkpoints of docs/benchmarks.md were trained in
# two runs for SD3 (700, then --resume 800) and Flux (500, then --resume 500): the same steps, the learning-rate
# schedule restarted once.
STEPS = {"sd15": 1500, "sd3": 1500, "flux": 1000, "wan": 2500}
BATCH = 32


def moving(digits: torch.Tensor, frames: int, size: tuple[int, int]) -> torch.Tensor:
    """``(N, 3, frames, H, W)`` clips in [-1, 1]: each 8×8 digit, scaled to 24×24, moving across a black frame in a
    straight line whose start and direction are set per digit image (seeded)."""
    n, (h, w), d = len(digits), size, 24
    big = F.interpolate(digits, size=(d, d), mode="bilinear", align_corners=False)  # (N, 1, 24, 24)
    g = torch.Generator().manual_seed(0)
    start = torch.stack([torch.randint(0, h - d + 1, (n,), generator=g), torch.randint(0, w - d + 1, (n,), generator=g)], 1)
    angle = torch.rand(n, generator=g) * 2 * torch.pi
    speed = torch.stack([angle.sin(), angle.cos()], 1) * 2.5  # pixels per frame
    clips = torch.zeros(n, 1, frames, h, w)
    for f in range(frames):
        at = (start + speed * (f - frames // 2)).round().long()
        at[:, 0].clamp_(0, h - d)
        at[:, 1].clamp_(0, w - d)
        for i in range(n):
            y, x = int(at[i, 0]), int(at[i, 1])
            clips[i, :, f, y : y + d, x : x + d] = big[i]
    return clips.repeat(1, 3, 1, 1, 1) * 2 - 1


def digit_latents(pipe, kind: str = "") -> tuple[torch.Tensor, torch.Tensor, tuple[float, float]]:
    """(standardised latents, labels, (mean, std)) of every digit (a clip of it, for a video kind), through the
    pipeline's VAE."""
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32)[:, None] / 16.0  # (N, 1, 8, 8) in [0, 1]
    if kind in VIDEO:
        images = moving(images, VIDEO[kind]["num_frames"], VIDEO[kind]["size"])
    else:
        images = F.interpolate(images, size=SIZE, mode="bilinear", align_corners=False).repeat(1, 3, 1, 1) * 2 - 1
    with torch.no_grad():
        z = torch.cat([pipe.vae.encode(images[i : i + 128]).latent_dist.mean for i in range(0, len(images), 128)])
    mean, std = z.mean().item(), z.std().item()
    return (z - mean) / std, torch.tensor(data.target), (mean, std)


def conditions(pipe, kind: str) -> dict[str, torch.Tensor]:
    """Per class 0-9 and index 10 = "" (the unconditional branch): the embeddings the pipeline passes its denoiser."""
    texts = [prompt(k) for k in range(10)] + [""]
    out: dict[str, list[torch.Tensor]] = {}
    with torch.no_grad():
        for text in texts:
            if kind == "sd15":
                embeds, _ = pipe.encode_prompt(text, "cpu", 1, False)
                parts = {"encoder_hidden_states": embeds}
            elif kind == "sd3":
                embeds, _, pooled, _ = pipe.encode_prompt(text, None, None, do_classifier_free_guidance=False)
                parts = {"encoder_hidden_states": embeds, "pooled_projections": pooled}
            elif kind == "wan":
                length = VIDEO[kind]["max_sequence_length"]
                embeds, _ = pipe.encode_prompt(text, do_classifier_free_guidance=False, max_sequence_length=length)
                parts = {"encoder_hidden_states": embeds}
            else:
                embeds, pooled, _ = pipe.encode_prompt(text, None)
                parts = {"encoder_hidden_states": embeds, "pooled_projections": pooled}
            for key, value in parts.items():
                out.setdefault(key, []).append(value)
    return {k: torch.cat(v) for k, v in out.items()}


def loss_of(pipe, kind: str, model, x0: torch.Tensor, cond: dict[str, torch.Tensor], text_len: int) -> torch.Tensor:
    noise = torch.randn_like(x0)
    b = x0.shape[0]
    if kind == "sd15":
        t = torch.randint(0, pipe.scheduler.config.num_train_timesteps, (b,))
        xt = pipe.scheduler.add_noise(x0, noise, t)
        pred = model(xt, t, encoder_hidden_states=cond["encoder_hidden_states"]).sample
        return F.mse_loss(pred, noise)
    sigma = torch.sigmoid(torch.randn(b))  # logit-normal, as SD3 trains
    s = sigma.view(b, *([1] * (x0.dim() - 1)))
    xt = (1 - s) * x0 + s * noise
    target = noise - x0
    if kind in ("sd3", "wan"):
        pred = model(hidden_states=xt, timestep=sigma * 1000, **cond).sample
        return F.mse_loss(pred, target)
    c, h, w = x0.shape[1:]
    packed = pipe._pack_latents(xt, b, c, h, w)
    img_ids = pipe._prepare_latent_image_ids(b, h // 2, w // 2, x0.device, x0.dtype)
    txt_ids = torch.zeros(text_len, 3)
    pred = model(hidden_states=packed, timestep=sigma, guidance=None, txt_ids=txt_ids, img_ids=img_ids, **cond).sample
    return F.mse_loss(pred, pipe._pack_latents(target, b, c, h, w))


def train(kind: str, steps: int, resume: bool = False) -> dict:
    torch.manual_seed(1 if resume else 0)
    pipe = trained_pipeline(kind) if resume else BUILDERS[kind]()
    before = json.loads((cache_dir() / kind / "training.json").read_text()) if resume else None
    name = denoiser_name(pipe)
    model = getattr(pipe, name)
    z, labels, (mean, std) = digit_latents(pipe, kind)
    cond = conditions(pipe, kind)
    text_len = cond["encoder_hidden_states"].shape[1]
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=steps, pct_start=0.05)
    g = torch.Generator().manual_seed(0)
    curve, start, running = [], time.perf_counter(), None
    for step in range(steps):
        idx = torch.randint(0, len(z), (BATCH,), generator=g)
        y = labels[idx].clone()
        y[torch.rand(BATCH, generator=g) < 0.1] = 10  # the unconditional branch
        batch_cond = {k: v[y] for k, v in cond.items()}
        loss = loss_of(pipe, kind, model, z[idx], batch_cond, text_len)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if step % 100 == 0 or step == steps - 1:
            curve.append((step, round(running, 4)))
            print(f"{kind} step {step}/{steps} loss {running:.4f} ({time.perf_counter() - start:.0f} s)", flush=True)
    model.eval()
    out = cache_dir() / kind
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if before is not None:  # a continued run: one record of both
        shift = before["steps"]
        curve = before["curve"] + [(s + shift, v) for s, v in curve]
        steps += shift
    info = {
        "kind": kind,
        "steps": steps,
        "batch": BATCH,
        "seconds": round(time.perf_counter() - start + (before["seconds"] if before else 0), 1),
        "loss_first": curve[0][1],
        "loss_last": curve[-1][1],
        "curve": curve,
        "latent_mean": mean,
        "latent_std": std,
        "machine": machine(),
    }
    (out / "training.json").write_text(json.dumps(info, indent=1))
    return info


def training_latents(pipe, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(every training latent, flattened as the pipeline outputs it, labels)."""
    z, labels, _ = digit_latents(pipe, kind)
    if kind == "flux":
        b, c, h, w = z.shape
        z = pipe._pack_latents(z, b, c, h, w)
    return z.flatten(1), labels


def samples(pipe, kind: str, per_digit: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    outs, digits = [], []
    for k in range(10):
        for seed in range(per_digit):
            outs.append(latents(pipe, prompt(k), steps=steps, seed=seed, **call(kind)))
            digits.append(k)
    return torch.cat(outs).flatten(1).float(), torch.tensor(digits)


def check(kind: str, per_digit: int = 2, steps: int = 20) -> dict:
    """Two checks on ``per_digit`` samples per digit from the trained pipeline (20 steps, its own guidance):
    **fidelity**, the mean distance from each sample to its nearest training latent over the same for the
    untrained pipeline's samples (a model that learned the data lands near it: well below 1); and
    **the prompted digit**, each sample's class by its 5 nearest training latents (chance 10%)."""
    from sklearn.neighbors import KNeighborsClassifier

    pipe = trained_pipeline(kind)
    data, labels = training_latents(pipe, kind)
    got, digits = samples(pipe, kind, per_digit, steps)
    untrained, _ = samples(BUILDERS[kind](), kind, per_digit, steps)
    fidelity = (torch.cdist(got, data).min(1).values.mean() / torch.cdist(untrained, data).min(1).values.mean()).item()
    knn = KNeighborsClassifier(n_neighbors=5).fit(data.numpy(), labels.numpy())
    right = int((torch.from_numpy(knn.predict(got.numpy())) == digits).sum())
    total = 10 * per_digit
    path = cache_dir() / kind / "training.json"
    info = json.loads(path.read_text())
    info["check"] = {"right": right, "of": total, "chance": 0.1, "steps": steps, "fidelity": round(fidelity, 3)}
    path.write_text(json.dumps(info, indent=1))
    print(
        f"{kind}: samples {fidelity:.2f}x as far from the data as the untrained model's; the prompted digit in {right} of {total} "
        "(5 nearest training latents; chance 10%)",
        flush=True,
    )
    return info


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", choices=KINDS, action="append")
    ap.add_argument("--check", action="store_true", help="only check the saved checkpoints")
    ap.add_argument("--steps", type=int, help="optimiser steps (default: per kind)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (training is not timed)")
    ap.add_argument("--resume", action="store_true", help="continue training the saved checkpoint for --steps more")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    failed = []
    for kind in args.kind or KINDS:
        if not args.check:
            train(kind, args.steps or STEPS[kind], args.resume)
        info = check(kind)
        if info["check"]["fidelity"] > 0.6 and info["check"]["right"] <= 2 * info["check"]["of"] * 0.1:
            print(f"{kind}: did not learn (samples not near the data, the prompted digit at most twice chance)", flush=True)
            failed.append(kind)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
