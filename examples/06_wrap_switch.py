"""Seed incident 3 (model switching) and the `torchfix.wrap` entry point.

A benchmark app ran SD1.5, then SDXL, and failed with `mat1 and mat2 shapes cannot be multiplied
(154x2048 and 768x320)`: SDXL-made conditioning reached an SD1.5 UNet. With torchfix.wrap, stale
embeddings are refused before anything runs, and switching models leaks nothing.
"""

import gc
import weakref

import torch

import torchfix
from torchfix.testing import latents, tiny_sd15_pipeline, tiny_sdxl_pipeline

kw = dict(num_inference_steps=6, height=64, width=64, output_type="latent")
sdxl = tiny_sdxl_pipeline()
embeds, negative, _, _ = sdxl.encode_prompt("a cat", do_classifier_free_guidance=True)  # SDXL-made: width 64 here
sd15 = tiny_sd15_pipeline()
try:
    sd15(prompt_embeds=embeds, negative_prompt_embeds=negative, **kw)
except RuntimeError as exc:
    print(f"plain diffusers, mid-run: RuntimeError: {exc}")

w = torchfix.wrap(sd15, deepcache=torchfix.DeepCacheConfig(interval=3))
try:
    w(prompt_embeds=embeds, negative_prompt_embeds=negative, **kw)
except torchfix.ModelMismatchError as exc:
    print(f"torchfix.wrap, before running:\n  {exc}")
first = latents(w, steps=6)
old_unet = weakref.ref(sd15.unet)
w.unwrap()
del w, sd15
gc.collect()

for pipe in (sdxl, tiny_sd15_pipeline()):
    w = torchfix.wrap(pipe, deepcache=torchfix.DeepCacheConfig(interval=3))
    out = latents(w, steps=6)
    print(f"{type(pipe).__name__}: latents {tuple(out.shape)}, preflight findings: {w.findings or 'none'}")
    w.unwrap()
print(f"SD1.5 again equals the first SD1.5 run bit for bit: {torch.equal(out, first)}; first UNet freed: {old_unet() is None}")
assert torch.equal(out, first) and old_unet() is None
