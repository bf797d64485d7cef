"""The bar every cached family meets (issue "Day-0 families"): at interval 3 over 8 steps, at least 1.5x less
denoiser work and a final rel-L2 of at most 0.05 against the uncached run, on random weights. One row per tiny
builder of torchfix.testing.FAMILIES, registered (``flux``) and read off the code (``auto:<class>``), one torch
thread; work is counted (FLOPs with attention, torchfix.testing.flops), not timed.

    .venv/bin/python benchmarks/family_bar.py            # every builder (~3 min on 2 cores); writes the docs section
    .venv/bin/python benchmarks/family_bar.py wan flux   # some builders, printed only

Writes the "family_bar" section of docs/benchmarks.md. The builders are diffusers' own test sizes (two blocks a list,
a few tokens): the work a cached step keeps (embedders, output layers, the blocks that always run) is a larger share
than at full size, so the work ratios here are lower bounds of a real model's.
"""

from __future__ import annotations

import math
import os
import sys
import warnings

os.environ.setdefault("TORCHFIX_MODE", "off")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from _common import machine, rel_l2, write_section  # noqa: E402

import torchfix  # noqa: E402
from torchfix.testing import flops  # noqa: E402
from torchfix.testing.families import FAMILIES, Tiny, denoise  # noqa: E402

STEPS = 8
CONFIG = torchfix.DeepCacheConfig(interval=3, num_steps=STEPS)
WORK, ERROR = 1.5, 0.05


def _latents(out) -> torch.Tensor:
    x = out.latents
    return torch.cat([t.flatten() for t in x]) if isinstance(x, list) else x


def measure(key: str) -> dict:
    """One builder: the cache's family, work ratio and rel-L2 (or why the cache refused it)."""
    tiny: Tiny = FAMILIES[key]
    row = {"key": key, "model": tiny.model, "family": "", "work": math.nan, "err": math.nan, "note": ""}
    if (why := tiny.unavailable()) is not None:
        row["note"] = why
        return row
    model = tiny.build()
    run = lambda: denoise(model, tiny, steps=STEPS)  # noqa: E731
    try:
        plain_work, plain = flops(run), run()
    except NotImplementedError as exc:  # torch's FLOP counter has no rule for flex attention (Kandinsky 6 SR)
        row["note"] = f"work not countable: {str(exc).split('.')[0][:80]}"
        return row
    try:
        torchfix.deepcache.apply(model, CONFIG)
        cached_work = flops(run)
        torchfix.deepcache.apply(model, CONFIG)  # a fresh cache for the measured run
        cached = run()
        row["family"] = torchfix.deepcache.state_of(model).family.name
    except torchfix.UnsupportedModelError as exc:
        row["note"] = "refused: " + str(exc).split(". ")[0][:110]
        return row
    finally:
        torchfix.deepcache.remove(model)
    row.update(work=plain_work / cached_work, err=rel_l2(_latents(cached), _latents(plain)))
    return row


def report(rows: list[dict]) -> str:
    lines = ["| builder | family | work | rel-L2 | meets the bar |", "|---|---|---|---|---|"]
    for r in rows:
        if math.isnan(r["work"]):
            lines.append(f"| `{r['key']}` | | | | {r['note']} |")
            continue
        ok = r["work"] >= WORK and r["err"] <= ERROR
        lines.append(f"| `{r['key']}` | `{r['family']}` | {r['work']:.2f}× | {r['err']:.4f} | {'yes' if ok else '**no**'} |")
    measured = [r for r in rows if not math.isnan(r["work"])]
    short = [r["key"] for r in measured if not (r["work"] >= WORK and r["err"] <= ERROR)]
    inferred = [r for r in measured if r["family"].startswith("auto:")]
    lines += [
        "",
        f"{len(measured)} builders cached ({len(inferred)} through an entry read off the code), "
        f"{len(measured) - len(short)} meet the bar (≥ {WORK}× less work, rel-L2 ≤ {ERROR})"
        + (f"; short: {', '.join(short)}." if short else "."),
    ]
    return "\n".join(lines)


def main() -> None:
    torch.set_num_threads(1)
    keys = sys.argv[1:] or sorted(FAMILIES)
    rows = []
    for key in keys:
        rows.append(measure(key))
        r = rows[-1]
        print(f"{key:45s} {r['family']:40s} work {r['work']:.2f}x rel-L2 {r['err']:.4f} {r['note']}", flush=True)
    text = report(rows)
    print(text)
    if not sys.argv[1:]:
        body = (
            "## The bar every family meets: interval 3 over 8 steps\n\n"
            "`benchmarks/family_bar.py` (issue: day-0 families). " + machine() + ".\n\n" + text
        )
        write_section("family_bar", body)


if __name__ == "__main__":
    main()
