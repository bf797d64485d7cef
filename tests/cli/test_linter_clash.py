"""Meta's TorchFix linter installs the same ``torchfix`` import package and console script (#40): whichever was
installed last, ``torchfix-diffusion doctor`` / ``python -m torchfix_diffusion doctor`` say what is in the way and
the two commands that fix it, and our ``torchfix`` command says it instead of an ImportError.

The linter is a stand-in here (no network): a ``TorchFix`` distribution in a directory of its own, with the
linter's layout (``torchfix/__init__.py``, ``torchfix/__main__.py``, a ``torchfix`` console script)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def _linter(root: Path, files: bool = True) -> Path:
    """A site directory holding the stand-in linter: its package (unless ``files`` is False: ours overwrote them, as
    a non-editable install of ours after the linter does), and its dist-info with RECORD and entry points."""
    if files:
        pkg = root / "torchfix"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "__main__.py").write_text("def main():\n    return 0\n\nif __name__ == '__main__':\n    main()\n")
    info = root / "TorchFix-0.7.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: TorchFix\nVersion: 0.7.0\nSummary: TorchFix - a linter for PyTorch code\n")
    (info / "RECORD").write_text("torchfix/__init__.py,,\ntorchfix/__main__.py,,\nTorchFix-0.7.0.dist-info/METADATA,,\n")
    (info / "top_level.txt").write_text("torchfix\n")
    (info / "entry_points.txt").write_text("[console_scripts]\ntorchfix = torchfix.__main__:main\n")
    return root


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHFIX_MODE", "PYTHONPATH")}
    env.update(extra)
    return env


def _run(cmd: list[str], cwd: Path, **extra: str) -> subprocess.CompletedProcess:
    # run outside the repository: `python -m` puts the working directory first on the path
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(**extra), cwd=cwd, timeout=300)


def test_the_linter_answering_import_torchfix_is_named_with_the_two_fixes(tmp_path):
    site = _linter(tmp_path / "site")  # first on the path: `import torchfix` finds the linter
    commands = ([sys.executable, "-m", "torchfix_diffusion"], [str(BIN / "torchfix-diffusion")], [str(BIN / "torchfix")])
    for cmd in ([*c, "doctor"] for c in commands):
        r = _run(cmd, tmp_path, PYTHONPATH=str(site))
        assert r.returncode == 2, (cmd, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr and "ImportError" not in r.stderr
        assert "TorchFix" in r.stderr and "is not torchfix-diffusion" in r.stderr
        assert "pip uninstall -y TorchFix" in r.stderr and "pip install --force-reinstall --no-deps" in r.stderr, r.stderr


def test_our_doctor_names_the_linter_installed_beside_it(tmp_path):
    """Ours answers the import (its files overwrote the linter's), the linter's metadata and command are still there."""
    site = _linter(tmp_path / "site", files=False)
    code = f"import sys; sys.path.append({str(site)!r}); import torchfix_diffusion; sys.exit(torchfix_diffusion.main(['doctor']))"
    r = _run([sys.executable, "-c", code], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "WARNING: torchfix-diffusion: the name `torchfix` is shared with another distribution (TorchFix)" in r.stdout
    assert "the `torchfix` command is TorchFix's" in r.stdout or "pip uninstall -y TorchFix" in r.stdout
    assert "pip install --force-reinstall --no-deps" in r.stdout and "packages" in r.stdout  # then the usual report


def test_no_clash_no_warning(tmp_path):
    import torchfix_diffusion

    found = torchfix_diffusion.clash()
    if found.found:
        pytest.skip(f"this environment has a clash of its own: {found.message()}")
    assert found.ours_answers and found.others == []
    r = _run([sys.executable, "-m", "torchfix_diffusion", "doctor"], tmp_path)
    assert r.returncode == 0 and "WARNING" not in r.stdout and "packages" in r.stdout, r.stdout + r.stderr


def test_the_reinstall_command_names_where_this_project_came_from():
    import torchfix_diffusion

    source = torchfix_diffusion._source()
    here = str(Path(__file__).resolve().parents[2])
    assert source in (f"-e {here}", here, "torchfix-diffusion")
    assert torchfix_diffusion.Clash("x", False, ["TorchFix"], "TorchFix", source).fixes() == [
        "pip uninstall -y TorchFix",
        f"pip install --force-reinstall --no-deps {source}",
    ]
