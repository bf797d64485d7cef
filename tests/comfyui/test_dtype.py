"""ComfyUI's own models and the dtype rule: a model built of ComfyUI's cast ops (``comfy.ops.manual_cast``) computes
in its input's dtype, so where torch rejects a mix inside it the input's dtype wins, as ComfyUI's fix does
(Comfy-Org/ComfyUI#12808, fixed in 0.16.4 by #12811)."""

from __future__ import annotations

import pytest
import torch

import torchfix

f16, f32 = torch.float16, torch.float32


def wav2vec2(pos_conv_dtype):
    """ComfyUI's wav2vec2 audio encoder as ``AudioEncoderModel`` builds it (fp16, ``comfy.ops.manual_cast``), with the
    weights an fp16 checkpoint gives it. Its positional conv is a plain ``nn.Conv1d`` with weight norm: ComfyUI 0.16.3's
    loading (``assign=True``) left it fp16 (#12808: "Input type (float) and bias type (c10::Half)"); 0.16.4 keeps its
    model-defined fp32 (``pos_conv_dtype``), holding the same fp16 values."""
    import comfy.ops
    from comfy.audio_encoders.wav2vec2 import Wav2Vec2Model

    torch.manual_seed(0)
    model = Wav2Vec2Model(
        embed_dim=64, num_heads=4, num_layers=2, conv_norm=True, conv_bias=True, do_normalize=True, do_stable_layer_norm=True,
        dtype=f16, device="cpu", operations=comfy.ops.manual_cast,
    ).eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # ComfyUI's ops skip weight init: seeded values, as a checkpoint's
        for name, p in model.named_parameters():
            values = 0.05 * torch.randn(p.shape, generator=g)
            p.copy_(values + 1.0 if "norm" in name and name.endswith("weight") else values)
    model.encoder.pos_conv_embed.to(pos_conv_dtype)
    return model


def test_an_fp16_wav2vec2_fed_an_fp32_waveform_computes_in_fp32_as_comfyui_0_16_4():
    wave = torch.randn(1, 1, 3200, generator=torch.Generator().manual_seed(1))  # AudioEncoderEncode hands fp32 audio
    with pytest.raises(RuntimeError, match="should be the same"):
        wav2vec2(f16)(wave)  # ComfyUI 0.16.3
    reference, _ = wav2vec2(f32)(wave)  # ComfyUI 0.16.4: every layer in the waveform's fp32
    with torchfix.enabled():
        out, layers = wav2vec2(f16)(wave)
    assert out.dtype == reference.dtype == f32 and all(t.dtype == f32 for t in layers)
    # the positional conv in fp32 too (its fp16 weights cast up for the call); only its weight norm, computed from the
    # fp16 parameters before the cast, differs from 0.16.4's
    assert ((out - reference).norm() / reference.norm()).item() < 1e-5
    (event,) = [e for e in torchfix.report().events if e.guard == "dtype"]
    assert event.module == "encoder.pos_conv_embed.conv" and "weight float16→float32" in event.detail
    assert "its layers compute in their input's dtype" in event.detail
