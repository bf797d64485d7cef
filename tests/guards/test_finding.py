"""A preflight's findings print readably, alone and in the list ``w.preflight()`` returns (#40)."""

from __future__ import annotations

from torchfix.guards.plan import Finding


def test_a_list_of_findings_prints_as_sentences_not_dataclass_fields():
    findings = [
        Finding(
            "model", "controlnet reads the text embeddings at width 768, unet at 2048", "load the SDXL ControlNet", component="controlnet"
        ),
        Finding("dtype", "controlnet is float16, unet is bfloat16", "nothing to do", advisory=True, component="controlnet"),
    ]
    text = str(findings)
    assert text == (
        "[<model finding: controlnet: controlnet reads the text embeddings at width 768, unet at 2048 — to fix: load the SDXL "
        "ControlNet>, <advisory dtype finding: controlnet: controlnet is float16, unet is bfloat16 — to fix: nothing to do>]"
    )
    assert "actions=" not in text and "torch_raises" not in text
