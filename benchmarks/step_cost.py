"""What the guards cost a launch-bound denoiser step, and what ``import torchfix`` costs: this checkout beside a
reference commit, side by side in one run.

    .venv/bin/python benchmarks/step_cost.py [--ref 981f59f] [--rounds 15] [--quick]

On a GPU an eager SD1.5-size UNet step at 256², batch 1, is launch-bound: the host's Python time per op is the step
time, and every microsecond a guard spends is seen (H200, torch 2.11, 2026-11-27: 1.10x in ``torchfix.enabled()``,
1.21x after ``torchfix.enable()``; the CUDA sdpa known-issue row, pytorch/pytorch#191937, sent every attention call
down the checked path, ~78 us each). This is the CPU proxy: a tiny SD1.5-like UNet at 8x8 latents, one torch thread,
whose kernels are as small as a GPU's launches, measured in the thread's CPU time (what the host spends; a loaded
machine's waiting left out). Two conditions:

- *CPU today*: no known-issue row in force (as on a CPU or on CUDA with torch >= 2.15);
- *CUDA path*: the CUDA sdpa row's predicate registered for the CPU (``torchfix.add_known_issue``), so every
  attention call meets a row in force, as it does on CUDA with torch < 2.15.

Per condition: plain (torchfix off, nothing patched), ``with torchfix.enabled()`` and ``torchfix.enable()`` (global),
interleaved in every round; the minimum over rounds of the CPU time per step, and the ratio to plain of the same
process. Counted beside the time: the guarded calls per step and how many of them took the checked path
(``torchfix.runtime.guarded_call``: binding, decision, the row's workaround). Each checkout runs in its own
interpreter (``--ref`` is checked out into a temporary git worktree), the two alternating.

Import: ``import torchfix`` after ``import torch`` in fresh interpreters, with the bytecode cache in place (as a pip
install leaves it) and without it (``PYTHONDONTWRITEBYTECODE=1`` and no ``__pycache__``: every module compiled), the
checkouts alternating; medians. Writes the "step_cost" section of docs/benchmarks.md. Timings stay out of the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = 10  # UNet steps per timed loop


def _worker(rounds: int) -> dict:
    """Runs inside the checkout under test (its torchfix first on sys.path): every variant, interleaved."""
    os.environ["TORCHFIX_MODE"] = "off"
    import torch

    torch.set_num_threads(1)
    from diffusers import UNet2DConditionModel

    import torchfix
    import torchfix.runtime as runtime
    from torchfix.guards import known_issues as ki

    checked = [0]
    real = runtime.guarded_call

    def counted(*args, **kwargs):
        checked[0] += 1
        return real(*args, **kwargs)

    runtime.guarded_call = counted  # read by each wrapper when it is built (at install)
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=32, attention_head_dim=4, norm_num_groups=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        sample_size=8,
    ).eval()  # fmt: skip
    x, e, t = torch.randn(1, 4, 8, 8), torch.randn(1, 77, 32), torch.tensor([500])

    def loop() -> None:
        with torch.no_grad():
            for _ in range(STEPS):
                unet(x, t, e)

    def plain() -> float:
        start = time.thread_time()
        loop()
        return time.thread_time() - start

    def context() -> float:  # a pipeline call inside `with torchfix.enabled()`: entering and leaving it counted
        start = time.thread_time()
        with torchfix.enabled(mode="fix"):
            loop()
        return time.thread_time() - start

    def global_() -> float:  # `import torchfix`: switched on once, before the steps
        torchfix.enable(mode="fix")
        try:
            return plain()
        finally:
            torchfix.disable()

    variants = {"plain": plain, "enabled()": context, "enable()": global_}
    guarded = _count_guarded(torch, torchfix, loop)
    out: dict = {"guarded_calls_per_step": guarded / STEPS, "torch": torch.__version__}
    for condition in ("cpu", "cuda-path"):
        row = None
        if condition == "cuda-path":
            cuda_row = next(r for r in ki.entries() if r.issue == "pytorch/pytorch#191937")
            row = torchfix.add_known_issue(torchfix.KnownIssue("cpu", cuda_row.ops, cuda_row.predicate, "proxy of #191937", "contiguous"))
        try:
            for fn in variants.values():
                fn()  # warm
            times: dict[str, list[float]] = {k: [] for k in variants}
            for _ in range(rounds):
                for name, fn in variants.items():
                    times[name].append(fn())
            checked[0] = 0
            context()
            per_step = {k: 1000 * min(v) / STEPS for k, v in times.items()}
            checked_per_step = checked[0] / STEPS  # read before the sdpa calls below add their own
            added = _sdpa_added(torch, torchfix)
            out[condition] = {"ms_per_step": per_step, "checked_per_step": checked_per_step, "sdpa_us_added": added}
        finally:
            if row is not None:
                torchfix.remove_known_issue(row)
    return out


def _sdpa_added(torch, torchfix, calls: int = 2000, rounds: int = 7) -> float:
    """What ``with torchfix.enabled()`` adds to one attention call of the UNet's shape, in microseconds (the
    minimum over rounds of each, plain and guarded alternating): the per-call price behind the step's ratio."""
    import torch.nn.functional as F

    q, k, v = (torch.randn(1, 4, 64, 8) for _ in range(3))

    def run() -> float:
        start = time.thread_time()
        for _ in range(calls):
            F.scaled_dot_product_attention(q, k, v)
        return time.thread_time() - start

    plain, guarded = [], []
    for _ in range(rounds):
        plain.append(run())
        with torchfix.enabled(mode="fix"):
            guarded.append(run())
    return 1e6 * (min(guarded) - min(plain)) / calls


def _count_guarded(torch, torchfix, loop) -> int:
    """Calls per loop of the callables torchfix guards (counted with torchfix off, by a TorchFunctionMode)."""
    from torchfix.patches import PATCHES

    guarded = {getattr(p.owner, p.name) for p in PATCHES}
    guarded |= {getattr(f, "__wrapped__", f) for f in guarded}
    n = [0]

    class Count(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in guarded:
                n[0] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        loop()
    return n[0]


def _run_worker(checkout: Path, rounds: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "step_cost.py"), "--worker", "--rounds", str(rounds)]
    done = subprocess.run(cmd, env=env, cwd=checkout, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _import_once(checkout: Path, bytecode: bool) -> float:
    """``import torchfix`` after ``import torch`` in a fresh interpreter, seconds."""
    code = "import time; import torch; t = time.perf_counter(); import torchfix; print(time.perf_counter() - t)"
    env = {**os.environ, "PYTHONPATH": str(checkout), "TORCHFIX_MODE": "fix"}
    if bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    else:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        for cache in (checkout / "torchfix").rglob("__pycache__"):
            shutil.rmtree(cache, ignore_errors=True)
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=checkout, capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def _imports(checkouts: dict[str, Path], runs: int) -> dict[tuple[str, bool], float]:
    found: dict[tuple[str, bool], list[float]] = {}
    for path in checkouts.values():
        _import_once(path, True)  # writes the cache
    for bytecode in (True, False):
        for _ in range(runs):
            for label, path in checkouts.items():
                found.setdefault((label, bytecode), []).append(_import_once(path, bytecode))
    return {k: statistics.median(v) for k, v in found.items()}


def _worktree(ref: str) -> Path:
    where = Path(tempfile.mkdtemp(prefix="torchfix-ref-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(where), ref], check=True)
    return where


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ref", default="981f59f", help="the reference commit measured beside this checkout")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=3, help="worker runs per checkout, alternating")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.rounds)))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    from _common import machine, write_section

    torch.set_num_threads(1)  # as in the workers

    rounds, repeats = (3, 1) if args.quick else (args.rounds, args.repeats)
    ref_tree = _worktree(args.ref)
    checkouts = {"this checkout": ROOT, f"{args.ref} (before)": ref_tree}
    try:
        runs: dict[str, list[dict]] = {k: [] for k in checkouts}
        for _ in range(repeats):
            for label, path in checkouts.items():
                runs[label].append(_run_worker(path, rounds))
        imports = _imports(checkouts, 3 if args.quick else 7)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(ref_tree)], check=False)

    lines = [
        "| checkout | condition | plain ms/step | `enabled()` | `enable()` | checked-path calls / step | guarded calls / step "
        "| one sdpa call: µs added |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, results in runs.items():
        for condition, name in (("cpu", "CPU today (no row in force)"), ("cuda-path", "CUDA path (sdpa row in force)")):
            plain = statistics.median(r[condition]["ms_per_step"]["plain"] for r in results)
            ratio = {
                v: statistics.median(r[condition]["ms_per_step"][v] / r[condition]["ms_per_step"]["plain"] for r in results)
                for v in ("enabled()", "enable()")
            }
            lines.append(
                f"| {label} | {name} | {plain:.2f} | {ratio['enabled()']:.3f}x | {ratio['enable()']:.3f}x | "
                f"{results[0][condition]['checked_per_step']:.0f} | {results[0]['guarded_calls_per_step']:.0f} | "
                f"{statistics.median(r[condition]['sdpa_us_added'] for r in results):+.2f} |"
            )
    import_lines = ["| checkout | bytecode cache | `import torchfix` adds (median) |", "|---|---|---|"]
    for (label, bytecode), seconds in sorted(imports.items(), key=lambda kv: (not kv[0][1], kv[0][0])):
        import_lines.append(f"| {label} | {'yes (as pip installs it)' if bytecode else 'no (every module compiled)'} | {seconds:.3f} s |")
    body = f"""## Guard cost on a launch-bound step, and the import (`benchmarks/step_cost.py`)

Machine: {machine()}.

Rerun: `.venv/bin/python benchmarks/step_cost.py` (`--ref COMMIT` for another reference, `--quick` for a smoke run).
A CPU proxy of the GPU's launch-bound UNet step (tiny SD1.5-like UNet, 8x8 latents, one thread, the thread's CPU
time; {rounds} interleaved rounds per process, the minimum; {repeats} process(es) per checkout, alternating, the
median of their ratios). "CUDA path": the CUDA sdpa row's predicate (pytorch/pytorch#191937, in force on CUDA for
torch < 2.15) registered for the CPU. Goal (#48): a guarded step <= 1.02x plain; `enable()` no slower than `enabled()`.

{chr(10).join(lines)}

Import, fresh interpreters alternating, {3 if args.quick else 7} runs each (goal: <= 0.1 s over `import torch`):

{chr(10).join(import_lines)}
"""
    write_section("step_cost", body)
    print(body)


if __name__ == "__main__":
    main()
