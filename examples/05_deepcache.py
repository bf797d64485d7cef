"""Seed incident 2 (resolution): DeepCache at odd latent sizes and across a resolution change.

OneDiff's DeepCache crashed at 720x960 (a concat of 45 vs 46 rows); DeepCache 0.1.1 crashes when img2img
follows txt2img at another size. torchfix's DeepCache takes upsample sizes from the skip tensors and starts
every generation with a full step. Tiny SDXL-like pipeline, random weights, 10 steps.
"""

import time

import torchfix
from torchfix.testing import latents, tiny_sdxl_pipeline

pipe = tiny_sdxl_pipeline()


def run(size, prompt="a cat"):
    start = time.perf_counter()
    out = latents(pipe, prompt, steps=10, size=size)
    return out, time.perf_counter() - start


sizes = [(360, 480), (720, 960), (360, 480)]  # odd latents: 45x60, then 90x120, then back
plain = {s: run(s) for s in sizes[:2]}
torchfix.deepcache.apply(pipe, torchfix.DeepCacheConfig(interval=3, branch=0, schedule="nonuniform"))
for size in sizes:
    out, secs = run(size)
    ref, plain_secs = plain[size]
    err = ((out - ref).norm() / ref.norm()).item()
    print(f"{size[0]}x{size[1]}: latents {tuple(out.shape[-2:])}, {plain_secs / secs:.2f}x faster, rel-L2 vs plain {err:.4f}")
    assert out.shape == ref.shape and err < 0.1
stats = torchfix.deepcache.stats(pipe)
print(f"{stats['generations']} generations, {stats['full_steps']} full + {stats['cached_steps']} cached steps, "
      f"cache holds {stats['cache_bytes'] / 1024:.0f} KiB; {stats['branch']}")  # fmt: skip
torchfix.deepcache.remove(pipe)
assert "forward" not in vars(pipe.unet)
