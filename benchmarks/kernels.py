"""torch.ops.torchfix.matmul against what users do today, side by side in one run.

    .venv/bin/python benchmarks/kernels.py [--quick]

(a) ``torch.matmul`` on operands already cast to one dtype and contiguous (the
    vendor BLAS at its best; the preparation is not timed),
(b) cast + ``.contiguous()`` + ``torch.matmul`` (what a user writes to get past
    the error; all of it timed),
(c) ``torch.ops.torchfix.matmul`` on the operands as they are.

On a CUDA machine: SD-sized shapes, TFLOP/s and peak bytes (``max_memory_allocated``
above the inputs). On a CPU: smaller shapes, GFLOP/s and the bytes the call
allocates (profiler). Writes the "kernels" (CPU) or "kernels-cuda" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TORCHFIX_MODE", "off")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _common import machine, write_section
from torch.profiler import ProfilerActivity, profile

import torchfix  # noqa: F401  (registers torch.ops.torchfix.matmul)

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
# (label, a shape, rhs stored as (n, k) then transposed, a dtype, b dtype, out dtype)
GPU_CASES = [
    ("2x4096x4096 @ (512x4096)^T fp16 x bf16 -> bf16", (2, 4096, 4096), (512, 4096), F16, BF16, BF16),
    ("2x4096x4096 @ (512x4096)^T fp16 x bf16 -> fp32", (2, 4096, 4096), (512, 4096), F16, BF16, F32),
    ("2x4096x320 @ (1280x320)^T bf16 x fp16 -> bf16", (2, 4096, 320), (1280, 320), BF16, F16, BF16),
    ("1x1x4096x4096 @ (512x4096)^T fp16 x fp16 (seed, strides only)", (1, 1, 4096, 4096), (512, 4096), F16, F16, F16),
]
CPU_CASES = [
    ("1x1x4096x4096 @ (512x4096)^T fp32 (seed, strides only)", (1, 1, 4096, 4096), (512, 4096), F32, F32, F32),
    ("2x1024x1024 @ (512x1024)^T fp16 x bf16 -> fp32", (2, 1024, 1024), (512, 1024), F16, BF16, F32),
    ("2x1024x320 @ (1280x320)^T bf16 x fp32 -> fp32", (2, 1024, 320), (1280, 320), BF16, F32, F32),
]


def operands(case, device):
    _, a_shape, b_shape, da, db, out = case
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(a_shape, generator=g).to(device=device, dtype=da)
    b = torch.randn(b_shape, generator=g).to(device=device, dtype=db).t()  # non-contiguous view
    return a, b, out


def variants(a, b, out):
    a_pre, b_pre = a.to(out).contiguous(), b.to(out).contiguous()
    return {
        "a": lambda: torch.matmul(a_pre, b_pre),
        "b": lambda: torch.matmul(a.to(out).contiguous(), b.to(out).contiguous()),
        "c": lambda: torch.ops.torchfix.matmul(a, b, out_dtype=out),
    }


def flops(a, b) -> float:
    m, k = a.shape[-2:]
    n = b.shape[-1]
    batch = a.numel() // (m * k)
    return 2.0 * batch * m * n * k


def time_gpu(fn, reps: int) -> float:
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / 1e3 / reps


def peak_gpu(fn) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del result
    return peak


def time_cpu(fn, reps: int) -> float:
    fn()
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def allocated_cpu(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(e.self_cpu_memory_usage, 0) for e in prof.events())


def run(cases, device: str, reps: int, rounds: int) -> tuple[list[str], list[tuple[float, float]]]:
    """The table's lines, and per case (c)'s speed against (b) and against (a)."""
    rows, speeds = [], []
    for case in cases:
        a, b, out = operands(case, device)
        fns = variants(a, b, out)
        times = {k: [] for k in fns}
        for _ in range(rounds):  # interleaved rounds, best of
            for k, fn in fns.items():
                times[k].append(time_gpu(fn, reps) if device == "cuda" else time_cpu(fn, reps))
        best = {k: min(v) for k, v in times.items()}
        mem = {k: (peak_gpu(fn) if device == "cuda" else allocated_cpu(fn)) for k, fn in fns.items()}
        out_bytes = fns["a"]().numel() * torch.empty(0, dtype=out).element_size()
        scale, unit = (1e12, "TFLOP/s") if device == "cuda" else (1e9, "GFLOP/s")
        f = flops(a, b)
        rate = {k: f / t / scale for k, t in best.items()}
        rows.append(
            f"| {case[0]} | {rate['a']:.1f} | {rate['b']:.1f} | {rate['c']:.1f} | {best['b'] / best['c']:.2f}x | "
            f"{best['a'] / best['c']:.2f}x | {mem['b'] / 2**20:.1f} | {mem['c'] / 2**20:.1f} | {out_bytes / 2**20:.1f} |"
        )
        speeds.append((best["b"] / best["c"], best["a"] / best["c"]))
        print(rows[-1], flush=True)
    header = (
        f"| shape | (a) {unit} | (b) {unit} | (c) {unit} | (c) vs (b) speed | (c) vs (a) speed | "
        "(b) MiB | (c) MiB | output MiB |\n|---|---|---|---|---|---|---|---|---|"
    )
    return [header, *rows], speeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    reps, rounds = (3, 2) if args.quick else ((20, 5) if cuda else (5, 3))
    if not cuda:
        torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    table, speeds = run(GPU_CASES if cuda else CPU_CASES, device, reps, rounds)
    memory = "peak bytes above the inputs (max_memory_allocated)" if cuda else "bytes the call allocates (profiler)"
    body = [
        "## Kernels on a GPU: torch.ops.torchfix.matmul (`benchmarks/kernels.py` on CUDA)"
        if cuda
        else "## Kernels: torch.ops.torchfix.matmul (`benchmarks/kernels.py`)",
        "",
        f"Machine: {machine()}. Device: {device}. Best of {rounds} interleaved rounds of {reps} calls. "
        f"(a) torch.matmul on pre-cast contiguous operands (preparation not timed); (b) cast + .contiguous() + "
        f"torch.matmul; (c) torch.ops.torchfix.matmul on the operands as they are. Memory: {memory}.",
        "",
        *table,
        "",
    ]
    if cuda:
        faster = sum(vs_b > 1 for vs_b, _ in speeds)
        close = sum(vs_a >= 0.9 for _, vs_a in speeds)
        body.append(
            f"Speed goals: (c) faster than (b) on {faster} of {len(speeds)} shapes, within 0.9x of (a) on {close} of "
            f"{len(speeds)}. With an fp32 result, (a) is cuBLAS's fp32 GEMM (TF32 off by default) while (c) runs the "
            "fp16/bf16 operands in TF32, which holds them exactly. This script times; correctness on the GPU is "
            "tests/kernels/test_cuda.py's (see torchfix.kernels.HARDWARE_RUNS for what has passed)."
        )
    else:
        body.append(
            "GPU figures are missing: no GPU was available for this run. On the CPU, (c) is the BLAS reference "
            "(low-precision operands are upcast to fp32, which is its accumulation), so (b) and (c) do the same work "
            "for mixed dtypes; what (c) saves on a CPU is the copy of a transposed operand. The Triton kernel's "
            "speed goals ((c) faster than (b), within 0.9x of (a)) can only be checked on a CUDA machine: "
            "rerun this script there."
        )
    write_section("kernels-cuda" if cuda else "kernels", "\n".join(body))


if __name__ == "__main__":
    main()
