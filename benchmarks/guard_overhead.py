"""What the guards cost on the fast path (valid inputs), plain vs enabled, interleaved in one run.

    .venv/bin/python benchmarks/guard_overhead.py [--quick] [--no-sd15]

Writes the "guard_overhead" section of docs/benchmarks.md. One thread, so the
numbers are about dispatch overhead (what a GPU run is bound by), not BLAS.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import timeit

os.environ.setdefault("TORCHFIX_MODE", "off")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.nn.functional as F
from _common import machine, write_section

import torchfix

torch.set_num_threads(1)


def per_call_ns(stmt, number: int) -> float:
    return min(timeit.repeat(stmt, number=number, repeat=5)) / number * 1e9


def interleaved(measure, rounds: int, stat=statistics.median) -> tuple[float, float]:
    """``stat`` (median, or min for noisy model forwards) of ``rounds`` plain and enabled measurements, alternating."""
    plain, guarded = [], []
    for _ in range(rounds):
        torchfix.disable()
        plain.append(measure())
        torchfix.enable("fix")
        guarded.append(measure())
    torchfix.disable()
    return stat(plain), stat(guarded)


def unet_forward(unet, latents, t, ehs, repeats: int):
    def run():
        with torch.no_grad():
            start = time.perf_counter()
            for _ in range(repeats):
                unet(latents, t, encoder_hidden_states=ehs)
            return (time.perf_counter() - start) / repeats * 1e3

    return run


def tiny_unet():
    from torchfix.testing import tiny_sd15_unet

    unet = tiny_sd15_unet()
    return unet, torch.randn(1, 4, 16, 16), torch.tensor(10), torch.randn(1, 77, unet.config.cross_attention_dim)


def sd15_unet():
    from diffusers import UNet2DConditionModel

    config = dict(
        sample_size=64,
        in_channels=4,
        out_channels=4,
        layers_per_block=2,
        block_out_channels=(320, 640, 1280, 1280),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=768,
        attention_head_dim=8,
    )
    with torch.device("meta"):
        unet = UNet2DConditionModel(**config)
    unet = unet.to_empty(device="cpu").eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in unet.parameters():  # random weights without the slow default initialisers
            p.normal_(0, 0.02, generator=gen)
    return unet, torch.randn(1, 4, 32, 32), torch.tensor(10), torch.randn(1, 77, 768)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer rounds (for a smoke run)")
    ap.add_argument("--no-sd15", action="store_true", help="skip the SD1.5-config UNet (3.4 GB of weights)")
    args = ap.parse_args()
    rounds = 3 if args.quick else 9
    n = 20_000 if args.quick else 100_000

    x8, w8, b8 = torch.randn(8, 8), torch.randn(8, 8), torch.randn(8)
    rows = []
    for label, stmt in (
        ("F.linear 8×8 (guarded)", lambda: F.linear(x8, w8, b8)),
        ("torch.matmul 8×8 (guarded)", lambda: torch.matmul(x8, w8)),
        ("a @ b 8×8 (guarded)", lambda: x8 @ w8),
        ("torch.cat 2×(8×8) (guarded)", lambda: torch.cat([x8, w8])),
        ("torch.add 8×8 (unguarded)", lambda: torch.add(x8, w8)),
        ("x.shape (unguarded)", lambda: x8.shape),
    ):
        p, g = interleaved(lambda stmt=stmt: per_call_ns(stmt, n), rounds)
        rows.append((label, f"{p / 1e3:.2f} µs", f"{g / 1e3:.2f} µs", f"{(g - p) / 1e3:+.2f} µs", f"{g / p:.3f}×"))
        print(rows[-1], flush=True)

    model_rows = []
    builders = [("tiny SD1.5-like UNet, 16×16 latents", tiny_unet, 20)]
    if not args.no_sd15:
        builders.append(("SD1.5-config UNet (random weights), 32×32 latents", sd15_unet, 1))
    for label, build, reps in builders:
        unet, lat, t, ehs = build()
        run = unet_forward(unet, lat, t, ehs, reps)
        run()  # warm up
        # Forward times swing ±20% between rounds here; the best round is the stable statistic.
        p, g = interleaved(run, 2 * rounds if reps > 1 else max(3, rounds // 2), stat=min)
        model_rows.append((label, f"{p:.1f} ms", f"{g:.1f} ms", f"{(g / p - 1) * 100:+.2f}%"))
        print(model_rows[-1], flush=True)
        del unet
        gc.collect()

    def table(header, body):
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in body]
        return "\n".join(lines)

    body = f"""## Guard overhead (`benchmarks/guard_overhead.py`)

Machine: {machine()}.

Plain (torchfix disabled, nothing patched) and enabled (`torchfix.enable("fix")`), valid inputs, measured
alternately in one process. Per call: medians of {rounds} rounds, each the best of 5 repeats. Model forwards: the
best of {2 * rounds} rounds (tiny UNet, 20 forwards a round) or of {max(3, rounds // 2)} rounds (SD1.5-config, 1 forward a round):
a forward's time swings by ±20% between rounds on this machine, and the best round is the stable statistic.
Rerun: `.venv/bin/python benchmarks/guard_overhead.py`.

Per call:

{table(("call", "plain", "enabled", "added", "ratio"), rows)}

Model forward (one thread, no grad):

{table(("model", "plain", "enabled", "added"), model_rows)}

Goals (issue #2): ≤ +0.6 µs per guarded call on the fast path, nothing added to unguarded ops, ≤ +2% on the
tiny UNet. Unguarded ops are never wrapped (no `TorchFunctionMode`), so their rows differ by noise only.
"""
    write_section("guard_overhead", body)
    print("wrote docs/benchmarks.md")


if __name__ == "__main__":
    main()
