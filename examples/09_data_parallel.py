"""Data parallelism: each rank runs its own prompts (accelerate's split_between_processes), torchfix.wrap with
DeepCache on each. Nothing torchfix does communicates: every rank's images are what one process would make from
the same prompts, bit for bit, also when the prompts do not divide evenly.

    torchrun --standalone --nproc-per-node 2 examples/09_data_parallel.py   # on a cluster: your launcher
    python examples/09_data_parallel.py                                     # starts the two CPU ranks itself

On the CPU use ``PartialState(cpu=True)``: without it accelerate reports no distributed setup and every rank runs
every prompt. Tiny Flux pipeline, random weights, 8 steps.
"""

import os
import subprocess
import sys

if "RANK" not in os.environ:  # not under torchrun: be the launcher
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__]
    sys.exit(subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode)

import torch
from accelerate import PartialState

import torchfix
from torchfix.testing import latents, tiny_flux_pipeline

state = PartialState(cpu=True)
pipe = tiny_flux_pipeline()
w = torchfix.wrap(pipe, deepcache=torchfix.DeepCacheConfig(interval=3))
prompts = ["a cat", "a dog", "a bird"]
with state.split_between_processes(prompts) as mine:
    for prompt in mine:
        cached = latents(w, prompt, steps=8)
        stats = torchfix.deepcache.stats(pipe)["last_call"]
        print(f"rank {state.process_index}: {prompt!r}: {stats['full_steps']} full, {stats['cached_steps']} cached steps", flush=True)
        w.unwrap()
        alone = latents(torchfix.wrap(tiny_flux_pipeline(), deepcache=torchfix.DeepCacheConfig(interval=3)), prompt, steps=8)
        assert torch.equal(cached, alone), "a data-parallel rank differs from one process"
        w = torchfix.wrap(pipe, deepcache=torchfix.DeepCacheConfig(interval=3))
state.wait_for_everyone()
if state.is_main_process:
    print("every rank: bit-identical to one process with the same prompts")
