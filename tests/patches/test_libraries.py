"""diffusers' bugs around the denoiser (torchfix.guards.library_issues) and their patches: in force where the row
says, installed with torchfix (or when diffusers is imported after it), gone after disable()."""

from __future__ import annotations

import os
import sys

import pytest

import torchfix
from torchfix.guards import library_issues

pytest.importorskip("diffusers")


def test_the_cpu_build_row_and_its_patch_come_and_go_with_torchfix():
    import diffusers
    from diffusers.models.modeling_utils import ModelMixin

    row = library_issues.ROWS[0]
    in_force, why = library_issues.explain(row, diffusers.__version__)
    assert in_force == library_issues.cpu_build(), why
    assert not library_issues.explain(row, "0.35.0")[0]
    was_on = torchfix.status().enabled
    torchfix.disable()
    try:
        raw = vars(ModelMixin)["_resolve_parallel_config"]
        assert getattr(raw, "__torchfix_patch__", None) is None  # torchfix off: diffusers' own
        torchfix.enable()
        patched = vars(ModelMixin)["_resolve_parallel_config"]
        assert (getattr(patched, "__torchfix_patch__", None) is not None) == in_force
        assert ("diffusers ModelMixin._resolve_parallel_config" in torchfix.status().patched) == in_force
        torchfix.disable()
        assert vars(ModelMixin)["_resolve_parallel_config"] is raw
    finally:
        if was_on:
            torchfix.enable()


def test_the_patch_waits_for_diffusers_to_be_imported():
    """torchfix enabled first, diffusers imported after (the usual script): patched on import, in a fresh process."""
    import subprocess

    code = (
        "import torchfix, sys; assert 'diffusers.models.modeling_utils' not in sys.modules; "
        "from diffusers.models.modeling_utils import ModelMixin as M; "
        "p = vars(M)['_resolve_parallel_config']; "
        "from torchfix.guards.library_issues import cpu_build; "
        "assert (getattr(p, '__torchfix_patch__', None) is not None) == cpu_build(); "
        "torchfix.disable(); assert getattr(vars(M)['_resolve_parallel_config'], '__torchfix_patch__', None) is None; print('ok')"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCHFIX_MODE"}  # the default: `import torchfix` enables
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.stdout.strip().endswith("ok"), done.stderr[-2000:]
