"""Shared benchmark helpers: machine description and writing a section of docs/benchmarks.md."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import re
from pathlib import Path

import torch

from torchfix.config import installed_version

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def machine() -> str:
    """One paragraph: CPU, cores, OS, Python, torch and friends, threads used."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            m = re.search(r"model name\s*:\s*(.+)", fh.read())
            if m:
                cpu = m.group(1).strip()
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return (
        f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}; GPU: {gpu}; "
        f"Python {platform.python_version()}, torch {torch.__version__}, diffusers {installed_version('diffusers')}, "
        f"transformers {installed_version('transformers')}, wrapt {installed_version('wrapt')}; torch threads {torch.get_num_threads()}; "
        f"measured {_dt.date.today().isoformat()}"
    )


def rel_l2(a: torch.Tensor | list[torch.Tensor], b: torch.Tensor | list[torch.Tensor]) -> float:
    """``||a - b|| / ||b||`` in float32; a list (LTX-2's video and audio latents) counts as one flat tensor."""

    def flat(x: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.flatten().float() for t in x]) if isinstance(x, list) else x.flatten().float()

    a, b = flat(a), flat(b)
    return ((a - b).norm() / b.norm()).item()


def write_section(name: str, body: str) -> None:
    """Replace (or append) the block between ``<!-- name:start -->`` and ``<!-- name:end -->``."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n\nEach section is written by the script it names; rerun it to refresh.\n"
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    DOCS.parent.mkdir(parents=True, exist_ok=True)
    DOCS.write_text(text)


def pareto(points: list[tuple[float, float]]) -> list[bool]:
    """(speedup, error): True where no other point is at least as fast and as exact, and better in one."""
    return [not any((s2 >= s and e2 <= e) and (s2 > s or e2 < e) for s2, e2 in points) for s, e in points]


def save_plot(fig, title: str, png: str, alt: str) -> str:
    """Title, lay out and save ``fig`` beside docs/benchmarks.md; the Markdown line that shows it."""
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(DOCS.parent / png, dpi=110)
    return f"![{alt}]({png})"
