"""DeepCache on the model families users run today: a Wan 2.2 pipeline (two experts on one scheduler) through
torchfix.wrap, and what happens to a model whose blocks do not behave as its family's entry says.

Tiny Wan 2.2 pipeline, random weights, 10 steps with classifier-free guidance (each expert's "cond" and "uncond"
passes are streams of their own, told apart by the cache_context names Wan's pipeline sets).
"""

import dataclasses

import torch

import torchfix
from torchfix import families
from torchfix.testing import tiny_wan22_pipeline
from torchfix.testing.families import FAMILIES, denoise

pipe = tiny_wan22_pipeline()
kw = dict(prompt="a cat", negative_prompt="a dog", num_inference_steps=10, height=16, width=16, num_frames=5)
kw.update(guidance_scale=5.0, max_sequence_length=16, output_type="latent")
plain = pipe(**kw, generator=torch.Generator().manual_seed(0)).frames

w = torchfix.wrap(pipe, deepcache=torchfix.DeepCacheConfig(interval=3))
cached = w(**kw, generator=torch.Generator().manual_seed(0)).frames
stats = torchfix.deepcache.stats(pipe)
for name, expert in stats["denoisers"].items():
    print(f"{name}: family {expert['family']!r}, {expert['full_steps']} full and {expert['cached_steps']} cached calls, {expert['blocks']}")
err = ((cached - plain).norm() / plain.norm()).item()
print(f"rel-L2 vs no cache: {err:.4f}")
assert stats["cached_steps"] > 0 and err < 0.1
w.unwrap()
assert torch.equal(pipe(**kw, generator=torch.Generator().manual_seed(0)).frames, plain)  # nothing left behind

# A model whose blocks return their streams in another order than its entry says (CogVideoX's blocks return
# (image, text); here its entry claims (text, image)): refused at the first call, before anything is cached.
tiny = FAMILIES["cogvideox"]
model = tiny.build()
entry = families.get("cogvideox")
wrong = dataclasses.replace(entry.blocks[0], returns=("text", "image"))
families.register(dataclasses.replace(entry, blocks=(wrong,)), replace=True)
try:
    torchfix.deepcache.apply(model, torchfix.DeepCacheConfig(interval=3))
    denoise(model, tiny)
except torchfix.UnsupportedModelError as exc:
    print(f"refused: {str(exc)[:220]}...")
else:
    raise AssertionError("a wrong entry was not refused")
finally:
    families.register(entry, replace=True)
    torchfix.deepcache.remove(model)
