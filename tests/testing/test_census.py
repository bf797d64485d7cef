"""docs/families.md's list of every denoiser class is what the code does with each (torchfix.testing.census)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("diffusers")

from torchfix.testing import census

DOCS = Path(__file__).resolve().parents[2] / "docs" / "families.md"


@pytest.fixture(scope="module")
def found() -> list[census.Status]:
    return census.statuses()


def test_every_denoiser_class_is_cached_or_refused_with_a_reason(found):
    assert len(found) >= 30  # 35 on diffusers 0.35, 75 on 0.42
    for s in found:
        assert s.how in (
            "registered",
            "read off its code",
            "refused at apply",
            "refused at its first call",
            "accepted at apply, not run here",
        ), s
        if s.how.startswith("refused"):
            assert s.model in s.detail and len(s.detail) > 60, s  # the class and what was found


def test_the_list_in_the_docs_is_the_codes(found):
    import diffusers

    text = DOCS.read_text()
    section = text[text.index("<!-- census:start -->") : text.index("<!-- census:end -->")]
    if f"diffusers {diffusers.__version__}:" not in section:
        pytest.skip(f"docs/families.md lists diffusers {section.split('diffusers ')[1].split(':')[0]}'s classes")
    assert census.table(found) in section, "rerun: python -m torchfix.testing.census"


def test_every_class_read_off_its_code_has_a_builder_the_conformance_suite_runs(found):
    from torchfix.testing.families import FAMILIES

    for s in found:
        if s.how == "read off its code":
            assert s.builder in FAMILIES and FAMILIES[s.builder].family == "auto:" + s.model, s
