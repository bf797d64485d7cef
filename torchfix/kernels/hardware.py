"""Where torchfix's kernels have run on real hardware.

Routing to a kernel by default (``kernels=None``) happens only on device types
listed here with a passing run: a kernel that has only run in an interpreter or
an emulation is opt-in (``torchfix.enable(kernels=True)`` or
``TORCHFIX_KERNELS=1``). Add a row after running, on that hardware,
``pytest tests/kernels`` and ``python benchmarks/kernels.py`` with
``TRITON_INTERPRET`` unset.

The CPU kernel is the ATen reference and runs in every test session, so it
needs no row.

>>> verified("cpu"), verified("cuda")
(True, False)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HARDWARE_RUNS", "HardwareRun", "verified"]


@dataclass(frozen=True)
class HardwareRun:
    """One recorded run of the kernel tests on real hardware.

    Attributes:
        date: ISO date of the run.
        torch: ``torch.__version__`` there.
        device_type: ``cuda`` or ``mps``.
        device: the device's name (``NVIDIA H100 80GB HBM3``).
        command: what was run.
        result: what it printed at the end (``41 passed``).
        passed: every test passed.
    """

    date: str
    torch: str
    device_type: str
    device: str
    command: str
    result: str
    passed: bool


# Runs on real hardware, passing or not (see docs/kernels.md). None recorded here has passed, so the kernels stay opt-in
# (tests/kernels passed on an H200 on 2026-11-26; not a row yet: a passing row turns CUDA routing on, a speed decision).
HARDWARE_RUNS: tuple[HardwareRun, ...] = (
    HardwareRun(
        date="2026-11-26",
        torch="2.11.0+cu130 (triton 3.6.0)",
        device_type="cuda",
        device="NVIDIA H200",
        command="TRITON_INTERPRET=0 python -m pytest tests/kernels; python benchmarks/kernels.py",
        result=(
            "incomplete: tests/kernels/test_cuda.py's hypothesis test (run first) outran its 200 s limit, every new "
            "shape autotuning 6 compiled tile configs, so the module's other CUDA tests never ran; the interpreter "
            "tests failed (triton 3.6's interpreter needs TRITON_INTERPRET=1 before triton loads); "
            "benchmarks/kernels.py ran its 4 SD-sized cases on the GPU"
        ),
        passed=False,
    ),
)


def verified(device_type: str, runs: tuple[HardwareRun, ...] | None = None) -> bool:
    """Whether ``device_type``'s kernel has a passing hardware run (the CPU always has)."""
    if device_type == "cpu":
        return True
    return any(r.passed and r.device_type == device_type for r in (HARDWARE_RUNS if runs is None else runs))
