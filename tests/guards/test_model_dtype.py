"""The model's own dtype wins (issue: mixed precision the way maintainers fix it).

Each test re-enacts a reported pattern with a tiny model and compares torchfix's result with
the maintainers' fix: cast the stray input to ``model.dtype``, or upcast the latents for a VAE
kept in fp32.
"""

from __future__ import annotations

import pytest
import torch

import torchfix
from torchfix import _model

pytest.importorskip("diffusers")

from torchfix.testing import tiny_sd15_unet, tiny_vae

f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32


def dtype_events():
    return [e for e in torchfix.report().events if e.guard == "dtype"]


def unet_inputs(dtype):
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, 4, 8, 8, generator=g).to(dtype), torch.randn(1, 77, 32, generator=g).to(dtype)


def test_fp32_timestep_embedding_into_an_fp16_unet_is_cast_once_and_the_unet_stays_fp16():
    # An extension builds the timestep embedding in fp32 and feeds it to an fp16 UNet
    # (the maintainers' fix: t_emb.to(sample.dtype), as UNet2DConditionModel.get_time_embed does).
    unet = tiny_sd15_unet().to(f16)
    sample, text = unet_inputs(f16)
    reference = unet(sample, 10, text).sample
    native = unet.get_time_embed
    unet.get_time_embed = lambda sample, timestep: native(sample, timestep).float()
    with torchfix.enabled():
        out = unet(sample, 10, text).sample
    assert out.dtype == f16 and torch.equal(out, reference)
    (event,) = dtype_events()  # one event per forward, never one per layer
    assert event.module == "time_embedding.linear_1" and "input float32→float16" in event.detail
    assert "model's own dtype (float16, UNet2DConditionModel)" in event.detail
    assert all(p.dtype == f16 for p in unet.parameters())


def test_fp32_encoder_hidden_states_meet_every_cross_attention_but_are_one_event():
    unet = tiny_sd15_unet().to(bf16)
    sample, text = unet_inputs(bf16)
    reference = unet(sample, 10, text).sample
    with torchfix.enabled():
        for _ in range(2):
            out = unet(sample, 10, text.float()).sample  # a new fp32 tensor each forward
    assert out.dtype == bf16 and torch.equal(out, reference)
    events = dtype_events()
    assert len(events) == 2 and all("input float32→bfloat16" in e.detail for e in events)  # one per forward
    assert {e.module.rsplit(".", 1)[-1] for e in events} == {"to_k"}  # the first cross-attention; to_v reuses the cast


class AudioEncoder(torch.nn.Module):
    """Whisper/wav2vec2-like: two conv1d over features, then a projection."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv1d(8, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv1d(16, 16, 3, stride=2, padding=1)
        self.proj = torch.nn.Linear(16, 4)

    def forward(self, features):
        x = torch.nn.functional.gelu(self.conv1(features))
        x = torch.nn.functional.gelu(self.conv2(x))
        return self.proj(x.transpose(1, 2))


def test_fp32_features_into_an_fp16_conv1d_encoder():
    torch.manual_seed(0)
    encoder = AudioEncoder().to(f16)
    features = torch.randn(2, 8, 20)
    with pytest.raises(RuntimeError):
        encoder(features)  # plain torch rejects it
    with torchfix.enabled():
        out = encoder(features)
    assert out.dtype == f16 and torch.equal(out, encoder(features.to(f16)))  # the maintainers' fix
    (event,) = dtype_events()
    assert event.module == "conv1" and event.action == "cast"


def overflowing_vae(dtype=f32):
    """A tiny VAE whose decoder activations exceed fp16's range (the reason SDXL's VAE is kept in fp32)."""
    vae = tiny_vae()
    with torch.no_grad():
        vae.decoder.conv_in.weight.mul_(2e5)
    return vae.to(dtype)


def test_fp16_latents_into_an_fp32_vae_are_cast_up_and_the_decode_is_finite():
    vae = overflowing_vae()
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0)).to(f16)
    reference = vae.decode(latents.float()).sample  # diffusers' fix: latents.to(vae.dtype)
    assert torch.isfinite(reference).all()
    assert not torch.isfinite(vae.to(f16).decode(latents).sample).all()  # cast down: non-finite
    vae.to(f32)
    with torchfix.enabled():
        out = vae.decode(latents).sample
    assert out.dtype == f32 and torch.isfinite(out).all()
    assert (out - reference).abs().max() <= 1e-3
    (event,) = dtype_events()
    assert event.action == "upcast" and event.module == "post_quant_conv"  # vae.decode is not forward: the VAE is still the model
    assert "model's own dtype (float32, AutoencoderKL)" in event.detail
    assert all(p.dtype == f32 for p in vae.parameters())  # a VAE kept in fp32 is never cast down


def test_fp32_lora_adapters_inside_a_bf16_unet_are_left_to_peft():
    pytest.importorskip("peft")
    from peft import LoraConfig

    unet = tiny_sd15_unet().to(bf16)
    unet.add_adapter(LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_lora_weights=False))
    for name, p in unet.named_parameters():
        if "lora" in name:
            p.data = p.data.float()  # peft keeps adapters in fp32 (autocast_adapter_dtype)
    sample, text = unet_inputs(bf16)
    plain = unet(sample, 10, text).sample  # peft casts to its adapters itself: torch accepts
    for mode in ("fix", "strict"):
        with torchfix.enabled(mode=mode):
            assert torch.equal(unet(sample, 10, text).sample, plain)
    assert torchfix.report().events == []


def test_a_bare_call_keeps_the_input_wins_rule():
    x, w = torch.randn(2, 4, dtype=bf16), torch.randn(3, 4, dtype=f16)
    with torchfix.enabled():
        assert torch.nn.functional.linear(x, w).dtype == bf16


# --- the model and its dtype ----------------------------------------------------------------


def test_model_dtype_is_by_bytes_and_follows_a_cast():
    m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(4, 4).to(f16))
    assert _model.model_dtype(m) == f32
    m.to(bf16)
    assert _model.model_dtype(m) == bf16  # the cache sees the parameters' new dtype
    m[0].to(f16)
    assert _model.model_dtype(m) == f16


def test_layerwise_casting_counts_its_compute_dtype():
    unet = tiny_sd15_unet()
    unet.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=bf16)
    assert _model.model_dtype(unet) == bf16


def test_layerwise_cast_unet_with_a_stray_fp32_input_runs_in_its_compute_dtype():
    unet = tiny_sd15_unet()
    unet.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=bf16)
    sample, text = unet_inputs(bf16)
    reference = unet(sample, 10, text).sample
    with torchfix.enabled():
        out = unet(sample.float(), 10, text).sample
    assert out.dtype == bf16 and torch.equal(out, reference)


def test_the_owner_of_a_compiled_module_is_the_module_it_holds():
    from torchfix import _frames

    m = torch.nn.Linear(2, 2)
    compiled = torch.compile(m)
    assert _frames.owner([compiled])[0] is m


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_stray_input_into_a_compiled_model_decides_as_eagerly(backend):
    torch.manual_seed(0)
    encoder = AudioEncoder().to(f16)
    features = torch.randn(2, 8, 20)
    with torchfix.enabled(), torch.no_grad():
        eager = encoder(features)
        got = torch.compile(encoder, backend=backend, fullgraph=True)(features)
    assert got.dtype == eager.dtype == f16 and torch.equal(got, eager)


def test_a_compiled_submodule_belongs_to_the_model_around_it():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2).to(bf16))
    model[2] = torch.compile(model[2], backend="eager")
    x = torch.randn(3, 8)
    with torchfix.enabled(), torch.no_grad():
        out = model(x)  # the fp32 model wins over its stray bf16 layer, compiled or not
        model[2] = model[2]._orig_mod
        assert torch.equal(out, model(x)) and out.dtype == f32
