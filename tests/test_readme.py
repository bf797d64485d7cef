"""The README is short and true (#40): it starts with the two commands, its support table says what the family
registry says, the changelog lives in CHANGELOG.md and the research notes out of the user docs."""

from __future__ import annotations

import re
from pathlib import Path

import torchfix.families as families

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _support_rows() -> list[list[str]]:
    table = README.split("## What works where", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("|")]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows[2:]]


def test_it_starts_with_the_two_commands():
    block = README.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert [line.split()[:2] for line in block[:2]] == [["make", "demo"], ["make", "test"]]
    assert len(README) < 10_000, f"the README grew to {len(README)} characters: details belong in docs/"


def test_the_support_table_says_what_the_registry_says():
    builtin = families.names(builtin=True)
    diffusers = [n for n in builtin if families.get(n).host == "diffusers"]
    comfy = {n for n in builtin if families.get(n).host == "comfyui"}
    named = []
    for model, family, guards, widths, cache, comfy_cell in _support_rows():
        name = re.fullmatch(r"`([a-z0-9-]+)`", family)
        if name is None:
            continue
        entry = families.get(name.group(1))
        named.append(entry.name)
        assert entry.host == "diffusers" and guards == "yes" and cache == "yes", model
        assert (widths == "yes") == bool(entry.widths), f"{model}: widths column says {widths!r}"
        comfy_name = f"comfy-{entry.name}"
        assert (comfy_cell == f"yes (`{comfy_name}`)") == (comfy_name in comfy), f"{model}: ComfyUI column says {comfy_cell!r}"
    shown = {m for row in _support_rows() for m in re.findall(r"`(comfy-[a-z0-9-]+)`", row[-1])}
    assert comfy == shown  # every ComfyUI entry has its row (Chroma Radiance's is ComfyUI's alone)
    more = next(r for r in _support_rows() if "more diffusers families" in r[0])
    assert int(more[0].split()[0]) == len(diffusers) - len(named)
    assert f"lists all {len(builtin)}" in README


def test_the_changelog_and_research_notes_live_outside_the_user_docs():
    assert (ROOT / "CHANGELOG.md").is_file() and "Before that:" not in README
    assert "CHANGELOG.md" in README
    notes = ROOT / "docs" / "research" / "deepcache.md"
    assert notes.is_file() and "## Forecast instead of reuse" in notes.read_text(encoding="utf-8")
    assert "## Forecast instead of reuse" not in (ROOT / "docs" / "deepcache.md").read_text(encoding="utf-8")


def test_every_link_in_the_readme_resolves():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        assert (ROOT / target).exists(), target


def test_the_claimed_versions_are_the_tested_ones():
    """setup.cfg claims only what is tested (#48): every torch minor in its range is in `make test-matrix` (or is the
    pinned one), CI runs the lower bounds together, and the README says the same range."""
    import configparser

    from packaging.requirements import Requirement
    from packaging.version import Version

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    torch_spec = next(r.specifier for r in map(Requirement, cfg["options"]["install_requires"].split()) if r.name == "torch")
    extras = {Requirement(line).name: Requirement(line).specifier for line in cfg["options.extras_require"]["diffusers"].split()}
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    matrix = re.search(r"^MATRIX \?= (.+)$", makefile, re.M).group(1).split()
    pinned = re.search(r"^TORCH \?= (\S+)$", makefile, re.M).group(1)
    tested = {Version(pinned)} | {Version(entry.split(":")[0]) for entry in matrix}
    low, high = (Version(s.version) for s in sorted(torch_spec, key=lambda s: s.operator != ">="))
    minors = {(v.major, v.minor) for v in tested}
    assert all(v in torch_spec for v in tested), (tested, torch_spec)
    assert minors == {(low.major, m) for m in range(low.minor, high.minor)}, (minors, torch_spec)
    oldest = next(entry for entry in matrix if entry.startswith(f"{low.major}.{low.minor}."))
    _, diffusers_low, transformers_low = oldest.split(":")
    for name, version in (("diffusers", diffusers_low), ("transformers", transformers_low)):
        spec = extras[name]
        assert Version(version) in spec and not any(
            Version(version).release[:2] > Version(s.version).release[:2] for s in spec if s.operator == ">="
        ), (name, version, spec)
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert f"make test-torch TORCH={oldest.split(':')[0]} DIFFUSERS={diffusers_low} TRANSFORMERS={transformers_low}" in ci
    assert f"torch {low.major}.{low.minor} to {high.major}.{high.minor - 1}" in README
