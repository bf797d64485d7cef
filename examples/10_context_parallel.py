"""Context parallelism: diffusers splits each call's tokens over the ranks (Ulysses attention), and torchfix's
cache takes the same decisions on every rank as one process would, from sums it adds over the model's
context-parallel group (never the whole world). A threshold cache here: without the sums, the ranks would measure
their own shards, decide differently, and wait for each other forever.

    torchrun --standalone --nproc-per-node 2 examples/10_context_parallel.py   # on GPUs: NCCL, as diffusers documents
    python examples/10_context_parallel.py                                     # starts the two CPU ranks itself (gloo)

On a CPU build diffusers' enable_parallelism divides by the accelerator count (0): torchfix's patch for that row
(torchfix.guards.library_issues) lets it run. Tiny Flux pipeline, random weights, 10 steps.
"""

import datetime
import os
import subprocess
import sys

if "RANK" not in os.environ:  # not under torchrun: be the launcher
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__]
    sys.exit(subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode)

import torch
import torch.distributed as dist
from diffusers import ContextParallelConfig

import torchfix
from torchfix.testing import latents, tiny_flux_pipeline

backend = "nccl" if torch.cuda.is_available() else "gloo"
dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", rank % torch.cuda.device_count()) if backend == "nccl" else torch.device("cpu")
config = torchfix.DeepCacheConfig(interval=4, threshold=0.08)

pipe = tiny_flux_pipeline().to(device)
pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
w = torchfix.wrap(pipe, deepcache=config)
cached = latents(w, "a cat", steps=10)
mine = torchfix.deepcache.stats(pipe)["last_call"]
print(f"rank {rank}: {mine['full_steps']} full, {mine['cached_steps']} cached steps", flush=True)

if rank == 0:  # one process, no context parallelism: the decisions and the result to match
    alone = tiny_flux_pipeline().to(device)
    one = latents(torchfix.wrap(alone, deepcache=config), "a cat", steps=10)
    ref = torchfix.deepcache.stats(alone)["last_call"]
    err = ((cached.double() - one.double()).norm() / one.double().norm()).item()
    print(f"one process: {ref['full_steps']} full, {ref['cached_steps']} cached; rel-L2 context parallel vs one process {err:.1e}")
    assert (ref["full_steps"], ref["cached_steps"]) == (mine["full_steps"], mine["cached_steps"]) and err < 1e-5
dist.barrier()
dist.destroy_process_group()
