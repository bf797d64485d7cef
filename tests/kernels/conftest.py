"""Kernel tests run Triton in its interpreter on CPU tensors (no GPU in CI)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
