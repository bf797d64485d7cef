"""What the do-no-harm rule (#10) costs per call, side by side in one process, one thread.

- the settings read (``torchfix._context.current``) against the plain ContextVar read it replaced
  (the new one also asks ``torch.compiler.is_compiling()`` so that compiled code reads a
  thread-local that dynamo can guard on);
- a valid single-dtype ``F.linear`` (the fast path) plain and guarded;
- mixes torch accepts (since #11 on the fast path: torch runs them first, nothing is read):
  sdpa with bf16 q/k/v and an fp32 mask, layer_norm with bf16 input and fp32 parameters;
- a mix torch rejects (a stray fp16 weight, fixed per call) against the manual cast.

Best of 7 repeats, rounds interleaved. Writes the ``do-no-harm`` section of docs/benchmarks.md.
Rerun: ``.venv/bin/python benchmarks/do_no_harm.py``.
"""

from __future__ import annotations

import timeit

import torch
import torch.nn.functional as F
from _common import machine, write_section

import torchfix
from torchfix import _context

torch.set_num_threads(1)
torchfix.disable()


def _old_current():
    s = _context.scoped.get()
    return _context._global if s is None else s


def best(fn, n: int) -> float:
    return min(timeit.repeat(fn, number=n, repeat=7)) / n * 1e6


def main() -> None:
    bf16, f16 = torch.bfloat16, torch.float16
    x, w, b = torch.randn(8, 8), torch.randn(8, 8), torch.randn(8)
    q, mask = torch.randn(1, 2, 8, 8, dtype=bf16), torch.randn(8, 8)
    xn, wn, bn = torch.randn(4, 8, dtype=bf16), torch.ones(8), torch.zeros(8)
    ws, bs = torch.randn(8, 8, dtype=f16), torch.randn(8, dtype=f16)
    xs = torch.randn(8, 8, dtype=bf16)
    cases = [
        ("settings read: current() vs the former ContextVar read", _old_current, _context.current, 200_000, False),
        ("F.linear 8×8 fp32 (fast path)", lambda: F.linear(x, w, b), lambda: F.linear(x, w, b), 20_000, True),
        (
            "sdpa bf16 q/k/v + fp32 mask (accepted mix)",
            lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=mask),
            lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=mask),
            5_000,
            True,
        ),
        (
            "layer_norm bf16 input, fp32 params (accepted mix)",
            lambda: F.layer_norm(xn, (8,), wn, bn),
            lambda: F.layer_norm(xn, (8,), wn, bn),
            20_000,
            True,
        ),
        (
            "F.linear bf16 input, fp16 weight (rejected: cast per call) vs manual cast",
            lambda: F.linear(xs, ws.to(bf16), bs.to(bf16)),
            lambda: F.linear(xs, ws, bs),
            5_000,
            True,
        ),
    ]
    rows = []
    for name, plain, guarded, n, enable in cases:
        p = g = float("inf")
        for _ in range(3):  # interleaved rounds
            p = min(p, best(plain, n))
            if enable:
                torchfix.enable()
            g = min(g, best(guarded, n))
            torchfix.disable()
            torchfix.report().clear()
        rows.append(f"| {name} | {p:.2f} µs | {g:.2f} µs | {g - p:+.2f} µs |")
        print(rows[-1])
    body = "\n".join(
        [
            "## Do no harm (#10): what the rule costs per call",
            "",
            f"Machine: {machine()}. Rerun: `.venv/bin/python benchmarks/do_no_harm.py` (best of 7 × 3 interleaved rounds).",
            "",
            "| call | plain (or before) | torchfix | added |",
            "|---|---|---|---|",
            *rows,
            "",
            "Since #11 an accepted mix takes the fast path: torch runs it first and nothing is read unless torch raises.",
            "The rejected case pays torch's failed call (its exception), then the guards' cached decision, the cast and",
            "the event; `torchfix.wrap` removes that per-call cost by casting the stray parameters once.",
            "The settings-read row is `current()`, which only compiled code calls now; eager wrappers inline the read.",
        ]
    )
    write_section("do-no-harm", body)


if __name__ == "__main__":
    main()
