"""Model switching: SD1.5-like ↔ SDXL-like through torchfix.wrap with DeepCache, 20 switches, resident memory.

    .venv/bin/python benchmarks/switching.py

After each switch (build, wrap, generate, unwrap, drop) the process's resident set size is read from
/proc/self/statm. Writes the "switching" section of docs/benchmarks.md.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import warnings
import weakref

os.environ.setdefault("TORCHFIX_MODE", "off")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from _common import machine, write_section  # noqa: E402

import torchfix  # noqa: E402
from torchfix.testing import tiny_sd15_pipeline, tiny_sdxl_pipeline  # noqa: E402

SWITCHES = 20


def rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        pages = int(fh.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    torch.set_num_threads(1)  # one torch thread: two spin against each other on a shared 2-core machine
    cfg = torchfix.DeepCacheConfig(interval=3, branch=0)
    levels, alive, times = [], [], []
    for i in range(SWITCHES + 1):
        build = tiny_sd15_pipeline if i % 2 == 0 else tiny_sdxl_pipeline
        start = time.perf_counter()
        pipe = build()
        unet = weakref.ref(pipe.unet)
        w = torchfix.wrap(pipe, deepcache=cfg)
        w("a cat", num_inference_steps=6, height=128, width=128, output_type="latent", generator=torch.Generator().manual_seed(0))
        w.unwrap()
        del w, pipe
        gc.collect()
        times.append(time.perf_counter() - start)
        alive.append(unet() is not None)
        levels.append(rss_mib())
        print(f"switch {i:2d} {build.__name__:20s} rss {levels[-1]:7.1f} MiB  old UNet alive: {alive[-1]}", flush=True)
    first = levels[1]  # the level after the first switch
    drift = (max(levels[1:]) - first) / first * 100
    body = f"""## Model switching (`benchmarks/switching.py`)

Machine: {machine()}.

{SWITCHES} switches alternating tiny SD1.5-like and SDXL-like pipelines, each built, wrapped with
`torchfix.wrap(pipe, deepcache=DeepCacheConfig(interval=3))`, run for 6 steps at 128×128, unwrapped and dropped.
Rerun: `.venv/bin/python benchmarks/switching.py`.

| measure | value |
|---|---|
| RSS after the first switch | {first:.1f} MiB |
| RSS after the last switch | {levels[-1]:.1f} MiB |
| highest RSS after switch 1 | {max(levels[1:]):.1f} MiB ({drift:+.2f}% vs after the first switch; goal within 5%) |
| old UNet still alive after unwrap + del + gc | {sum(alive)} of {len(alive)} switches |
| time per switch (build + run + unwrap) | {min(times):.2f}–{max(times):.2f} s |
"""
    write_section("switching", body)
    print(f"drift {drift:+.2f}%; wrote docs/benchmarks.md")


if __name__ == "__main__":
    main()
