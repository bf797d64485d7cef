"""The seed incident: a bf16 CLIP text encoder whose text_projection stayed fp16."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")

BUILD = """
import torch
from transformers import CLIPTextConfig, CLIPTextModelWithProjection
torch.manual_seed(0)
cfg = CLIPTextConfig(vocab_size=1000, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                     num_attention_heads=4, projection_dim=16, max_position_embeddings=77,
                     pad_token_id=1, bos_token_id=0, eos_token_id=2)
model = CLIPTextModelWithProjection(cfg).to(torch.bfloat16).eval()
model.text_projection.to(torch.float16)          # the stray fp16 layer
ids = torch.randint(1, 999, (2, 12))
"""


def _build():
    ns: dict = {}
    exec(BUILD, ns)
    return ns["model"], ns["ids"]


def test_plain_torch_crashes():
    model, ids = _build()
    with torch.no_grad(), pytest.raises(RuntimeError, match="same dtype"):
        model(input_ids=ids)


def test_import_torchfix_makes_it_run():
    code = BUILD + textwrap.dedent(
        """
        import torchfix
        with torch.no_grad():
            out = model(input_ids=ids)
        assert out.text_embeds.dtype == torch.bfloat16, out.text_embeds.dtype
        evs = torchfix.report().events
        assert [e.module for e in evs] == ["text_projection"], evs
        print(torchfix.report().summary())
        """
    )
    import os

    env = {k: v for k, v in os.environ.items() if k != "TORCHFIX_MODE"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "text_projection" in r.stdout and "modeling_clip.py" in r.stdout


def test_fixed_output_equals_a_manual_fix():
    import torchfix

    model, ids = _build()
    with torch.no_grad(), torchfix.enabled():
        got = model(input_ids=ids).text_embeds
    model.text_projection.to(torch.bfloat16)
    with torch.no_grad():
        want = model(input_ids=ids).text_embeds
    assert torch.equal(got, want)


def test_strict_names_text_projection():
    import torchfix

    model, ids = _build()
    with torch.no_grad(), torchfix.enabled(mode="strict"), pytest.raises(torchfix.DtypeMismatchError) as info:
        model(input_ids=ids)
    msg = str(info.value)
    assert "text_projection" in msg and "F.linear" in msg and "modeling_clip.py" in msg
    assert isinstance(info.value.__cause__, RuntimeError)
