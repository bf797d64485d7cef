"""Context parallelism: does every cache mode take the single-process decisions, and how far does it land?

    .venv/bin/python benchmarks/scaling.py

Two gloo ranks on this machine (diffusers' Ulysses, ``ulysses_degree=2``) run the scenarios of
tests/deepcache/ranks.py (tiny random-weight models: the question is agreement with one process, not cache
quality), then this process runs each one alone. Per model and mode: the decisions (F full, C cached, per call),
whether both ranks and one process took the same, and rel-L2 of the final latents against one process beside the
rounding floor (plain context parallel against one process). Writes the "scaling" section of docs/benchmarks.md.
"""

from __future__ import annotations

import os
import sys
import warnings

os.environ.setdefault("TORCHFIX_MODE", "off")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from _common import machine, rel_l2, write_section  # noqa: E402

from tests.deepcache import ranks  # noqa: E402
from torchfix.testing import tiny_flux_pipeline, tiny_wan22_pipeline  # noqa: E402
from torchfix.testing.families import FAMILIES  # noqa: E402


def row(model: str, mode: str, got: list[dict], ref: dict, floor: float) -> str:
    same = got[0]["decisions"] == got[1]["decisions"] == ref["decisions"]
    err = rel_l2(got[0]["latents"], ref["latents"])
    ratio = "bit-identical" if err == floor == 0 else f"{err / max(floor, 1e-12):.1f}x"
    return f"| {model} | {mode} | {ref['decisions']} | {'yes' if same else 'NO'} | {err:.1e} | {floor:.1e} | {ratio} |"


def main() -> None:
    torch.set_num_threads(1)
    results = ranks.launch(("context_parallel_pipeline", "context_parallel_families", "context_parallel_wan22"))
    lines = []
    pipe = tiny_flux_pipeline()
    cp = [r["context_parallel_pipeline"] for r in results]
    floor = rel_l2(cp[0]["plain"], ranks.pipeline_run(pipe, ranks.PROMPTS[0], wrapped=False)["latents"])
    for mode, config in ranks.modes().items():
        lines.append(row("Flux pipeline", mode, [c[mode] for c in cp], ranks.pipeline_run(pipe, ranks.PROMPTS[0], config), floor))
    for family in (*ranks.CP_FAMILIES, "still"):
        name, still = ("flux", True) if family == "still" else (family, False)
        got = [r["context_parallel_families"][family] for r in results]
        model = FAMILIES[name].build()
        floor = rel_l2(got[0]["plain"], ranks.family_run(model, name, still=still)["latents"])
        label = "Flux, half the tokens held still" if still else name
        for mode in (m for m in got[0] if m != "plain"):
            lines.append(row(label, mode, [g[mode] for g in got], ranks.family_run(model, name, ranks.modes()[mode], still=still), floor))
    wan = tiny_wan22_pipeline()
    got = [r["context_parallel_wan22"] for r in results]
    floor = rel_l2(got[0]["plain"], ranks.wan22_run(wan)["latents"])
    for mode in ("default", "threshold"):
        lines.append(row("Wan 2.2 pipeline (two experts)", mode, [g[mode] for g in got], ranks.wan22_run(wan, ranks.modes()[mode]), floor))
    body = "\n".join(
        [
            "## scaling: the cache under diffusers' context parallelism (`benchmarks/scaling.py`)",
            "",
            f"Machine: {machine()}. Two gloo ranks (Ulysses 2), {ranks.STEPS} steps, tiny random-weight models: the "
            "question is agreement with one process (docs/scaling.md). Decisions per denoiser call (F full, C cached; "
            "Wan 2.2: each expert's streams). Floor: plain context parallel against one process.",
            "",
            "| model | mode | one process's decisions | both ranks the same | rel-L2 vs one process | floor | ratio |",
            "|---|---|---|---|---|---|---|",
            *lines,
        ]
    )
    print(body)
    write_section("scaling", body)


if __name__ == "__main__":
    main()
