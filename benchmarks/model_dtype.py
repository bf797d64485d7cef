"""The model's own dtype wins (#23): what the rule costs and what it saves, side by side, one thread.

    .venv/bin/python benchmarks/model_dtype.py

- A stray fp32 input into a bf16 tiny UNet (fp32 latents and text embeddings, as an extension or a
  hand-made prompt_embeds gives them): forward time and cast events against the maintainers' fix
  (inputs cast to the UNet's dtype by hand), and against what "the activations win" did before
  (every weight cast to fp32 per call: its cost is the UNet run in fp32 plus a cast of every weight).
- Finding the model's dtype after torch rejected a mix: a cached answer (checked against the
  parameters' dtypes) and a fresh walk, on the SD1.5-config UNet (686 parameter tensors, built on meta).
- The non-finite check of a VAE decode (``wrap()``'s hook, and since #38 the patched ``decode`` of every diffusers
  autoencoder under ``import torchfix``): one ``isfinite`` pass over an fp16 image, against the decode it guards
  (tiny VAE, 256×256 image), and the patched decode beside diffusers' own.

Medians of interleaved rounds. Writes the ``model-dtype`` section of docs/benchmarks.md.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from _common import machine, write_section  # noqa: E402

import torchfix  # noqa: E402
from torchfix import _model  # noqa: E402
from torchfix.testing import tiny_sd15_unet, tiny_vae  # noqa: E402

torch.set_num_threads(1)
torchfix.disable()
ROUNDS = 15


def median_ms(fns: dict[str, object], rounds: int = ROUNDS) -> dict[str, float]:
    """Interleaved rounds: each round runs every variant once; the median per variant, in ms."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def stray_input() -> tuple[list[str], dict[str, int]]:
    bf16 = torch.bfloat16
    unet = tiny_sd15_unet().to(bf16).eval()
    unet32 = tiny_sd15_unet().eval()  # what "the activations win" ran: the UNet in fp32 ...
    g = torch.Generator().manual_seed(0)
    sample, text = torch.randn(2, 4, 32, 32, generator=g), torch.randn(2, 77, 32, generator=g)
    weights = list(unet.parameters())

    @torch.no_grad()
    def plain_fix():
        unet(sample.to(bf16), 10, text.to(bf16))

    @torch.no_grad()
    def maintainers_fix():  # the same, with torchfix on: what the guards' fast path costs
        with torchfix.enabled():
            unet(sample.to(bf16), 10, text.to(bf16))

    @torch.no_grad()
    def torchfix_rule():
        with torchfix.enabled():
            unet(sample, 10, text)

    @torch.no_grad()
    def activations_won():  # ... plus a per-call cast of every bf16 weight to fp32
        for p in weights:
            p.float()
        unet32(sample, 10, text)

    ms = median_ms({"plain": plain_fix, "fix": maintainers_fix, "torchfix": torchfix_rule, "before": activations_won})
    torchfix.report().clear()
    with torch.no_grad(), torchfix.enabled():
        unet(sample.clone(), 10, text.clone())  # fresh tensors: what a first forward reports
        first = len(torchfix.report().events)
        unet(sample.clone(), 10, text)  # a pipeline step: new latents, the same prompt embeddings
        events = len(torchfix.report().events) - first
    cast_bytes = sum(p.numel() * 4 for p in weights)
    rows = [
        "| variant | forward | dtype events | weight bytes cast per forward | output |",
        "|---|---|---|---|---|",
        f"| maintainers' fix: inputs cast to bf16 by hand, torchfix off | {ms['plain']:.1f} ms | 0 | 0 | bf16 |",
        f"| maintainers' fix, torchfix on (fast path only) | {ms['fix']:.1f} ms | 0 | 0 | bf16 |",
        f"| torchfix on, stray fp32 inputs: the model's dtype wins | {ms['torchfix']:.1f} ms "
        f"| {first} first, {events} a later step | 0 | bf16 |",
        f"| before (#2's rule): the activations won, every weight cast to fp32 | {ms['before']:.1f} ms "
        f"| one per layer | {cast_bytes:,} | fp32 |",
    ]
    return rows, {"events": events}


def owner_cost() -> list[str]:
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        big = UNet2DConditionModel()  # the SD1.5 config
    n = sum(1 for _ in big.parameters())
    _model.model_dtype(big)
    reps = 50
    start = time.perf_counter()
    for _ in range(reps):
        _model.model_dtype(big)
    cached = (time.perf_counter() - start) / reps * 1e6
    start = time.perf_counter()
    for _ in range(reps):
        _model.forget(big)
        _model.model_dtype(big)
    fresh = (time.perf_counter() - start) / reps * 1e6
    return [
        f"| lookup (SD1.5-config UNet, {n} parameter tensors) | time |",
        "|---|---|",
        f"| cached, checked against the parameters' dtypes | {cached:.0f} µs |",
        f"| fresh walk (first rejected call, or after a parameter was replaced) | {fresh:.0f} µs |",
    ]


def finite_check() -> list[str]:
    vae = tiny_vae().to(torch.float16).eval()
    z = torch.randn(1, 4, 32, 32, generator=torch.Generator().manual_seed(0)).to(torch.float16)
    torchfix.enable()  # import torchfix: every autoencoder's decode patched (#38); the guards' fast path in every row
    try:
        original = type(vae).decode.__wrapped__  # diffusers' own decode, under the patch
        with torch.no_grad():
            image = vae.decode(z).sample
            assert torch.equal(image, original(vae, z).sample)  # a finite decode comes back bit-identical

        @torch.no_grad()
        def decode():
            original(vae, z)

        @torch.no_grad()
        def patched():
            vae.decode(z)

        def check():
            bool(torch.isfinite(image).all())

        ms = median_ms({"decode": decode, "patched": patched, "check": check})
    finally:
        torchfix.disable()
    return [
        f"| fp16 decode, image {tuple(image.shape)} | the check (`isfinite(out).all()`) | share | "
        "decode under `import torchfix` (the patched `decode`) | ratio to diffusers' decode |",
        "|---|---|---|---|---|",
        f"| {ms['decode']:.2f} ms | {ms['check'] * 1e3:.0f} µs | {ms['check'] / ms['decode'] * 100:.1f}% | "
        f"{ms['patched']:.2f} ms | {ms['patched'] / ms['decode']:.3f} |",
    ]


def main() -> None:
    rows, _ = stray_input()
    print("\n".join(rows))
    owner = owner_cost()
    print("\n".join(owner))
    finite = finite_check()
    print("\n".join(finite))
    body = f"""## The model's own dtype wins (#23): cost and savings (`benchmarks/model_dtype.py`)

Machine: {machine()}. Rerun: `.venv/bin/python benchmarks/model_dtype.py` (medians of {ROUNDS} interleaved rounds).

A stray fp32 input (latents and text embeddings) into the tiny bf16 UNet, batch 2 at 32×32 latents:

{chr(10).join(rows)}

The "before" row prices the old rule as what it ran (the UNet in fp32 plus a cast of every weight per call),
not the old code; it is faster *on this CPU* only because its bf16 kernels are slower than its fp32 ones (on a
GPU the bf16 run is the fast one), and it returned fp32 where the maintainers' fix returns bf16. torchfix's
events in a first forward: the latents at `conv_in`, the timestep embedding (which the UNet makes in the
latents' dtype) at `time_embedding.linear_1`, and the text embeddings at the first cross-attention; later
cross-attentions reuse that cast, and a later step with the same embeddings reports only what is new. Each of
the ~34 cross-attention projections that meets the stray text still takes the checked path (torch's own
error, then a frame walk that finds the same model's earlier cast and reuses it, about 45 µs a layer), and the
two new tensors per step are cast and reported: together the gap between the two "torchfix on" rows.

Finding the model's dtype, paid only after torch rejected a mix (never on the fast path):

{chr(10).join(owner)}

The non-finite check under `wrap()` and, since #38, under `import torchfix` (the patched `decode`; one pass over a
reduced-precision VAE output, a re-run only when it fails; a finite decode comes back bit-identical):

{chr(10).join(finite)}

The fast path (`torchfix/patches/torch_ops.py`) is unchanged by #23: the rule runs only after torch raised,
so the per-call rows in "Guard overhead" stand.
"""
    write_section("model-dtype", body)


if __name__ == "__main__":
    main()
