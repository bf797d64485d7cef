"""huggingface/diffusers#14829 (torchfix.guards.library_issues.TAYLORSEER_SHAPES): Qwen-Image 2.1 with its default KV
cache and a TaylorSeer cache. The prefill step's ``proj_out`` returns text + image tokens, later steps image tokens
only; a TaylorSeer without the maintainers' fix (huggingface/diffusers#14831, released in 0.41.0) differences the two
and crashes. Under torchfix the output whose shape changed starts a new expansion, as the fix does.

The installed diffusers carries the fix from 0.41.0 on, so the tests put a TaylorSeer without it in its place: the
installed ``TaylorSeerState.update`` with the fix's shape test taken out of its own source (between 0.40.0 and 0.41.0
the file differs in that condition and its comment only), and the version diffusers reports set to 0.40.0. The
maintainers' behaviour is then the installed update itself (0.41+), and ``use_kv_cache=False`` with TaylorSeer (the
thread: the fix's output is byte-identical to the workaround, which is pixel-identical to ``use_kv_cache=False``).
Everything runs the real ``QwenImage21Pipeline``, built offline from tiny components."""

from __future__ import annotations

import inspect
import textwrap
from unittest import mock

import pytest
import torch

import torchfix
from torchfix.guards import library_issues
from torchfix.patches import libraries

pytest.importorskip("diffusers")

import diffusers
from packaging.version import Version

if not hasattr(diffusers, "TaylorSeerCacheConfig"):
    pytest.skip(f"diffusers {diffusers.__version__} has no TaylorSeer (0.36.0 on)", allow_module_level=True)

from diffusers.hooks import taylorseer_cache

needs_qwen21 = pytest.mark.skipif(
    not hasattr(diffusers, "QwenImage21Pipeline"), reason=f"diffusers {diffusers.__version__} has no QwenImage21Pipeline (0.41.0 on)"
)

LABEL = "diffusers TaylorSeerState.update"
FIX = " or prev.shape != new_factors[j].shape"  # huggingface/diffusers#14831's test, as released in 0.41.0
# The issue's TaylorSeer (its reproduction and the PR thread's): Lite mode, proj_out cached, max_order 1.
ISSUE = {"cache_interval": 3, "disable_cache_before_step": 3, "max_order": 1, "use_lite_mode": True}
# Second order and classifier-free guidance (two cache contexts, each restarting): the fix's semantics, seed for
# seed, beyond what use_kv_cache=False reproduces (a second-order factor spans the prefill step there).
SECOND = {"cache_interval": 2, "disable_cache_before_step": 3, "max_order": 2, "use_lite_mode": True}


def _without_the_fix(update):
    """``update`` with #14831's shape test taken out: TaylorSeer as diffusers 0.36.0 to 0.40.0 ship it."""
    lines, start = inspect.getsourcelines(update)
    source = textwrap.dedent("".join(lines))
    if FIX not in source:  # a diffusers without the fix: its own update
        return update
    assert source.count(FIX) == 1
    namespace = dict(vars(taylorseer_cache))
    code = "\n" * (start - 1) + source.replace(FIX, "")  # tracebacks name diffusers' own lines
    exec(compile(code, taylorseer_cache.__file__, "exec"), namespace)
    return namespace["update"]


FIXED = vars(taylorseer_cache.TaylorSeerState)["update"]
HAS_FIX = FIX in inspect.getsource(FIXED)
UNFIXED = _without_the_fix(FIXED)


@pytest.fixture
def diffusers_040(monkeypatch):
    """diffusers' TaylorSeer without the fix, and diffusers reporting 0.40.0 (the row in force); torchfix off."""
    monkeypatch.setattr(taylorseer_cache.TaylorSeerState, "update", UNFIXED)
    monkeypatch.setattr(diffusers, "__version__", "0.40.0")
    monkeypatch.setattr(libraries, "_FORCE", {})
    torchfix.disable()
    yield
    torchfix.disable()
    libraries._PATCHES.pop(LABEL, None)  # a Patch made over the stand-in: not kept for the installed update


def _processor():
    """A Qwen3-VL processor: a byte-level BPE tokenizer with Qwen's special tokens and a chat template (torchvision,
    which its video processor needs, is not required: that part is left out; the pipeline reads text and images)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import Qwen2TokenizerFast, Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    from torchfix.testing import _byte_level_alphabet

    try:
        from transformers import Qwen2VLImageProcessorPil as ImageProcessor
    except ImportError:
        from transformers import Qwen2VLImageProcessor as ImageProcessor
    bpe = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(_byte_level_alphabet())}, merges=[]))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer = Qwen2TokenizerFast(tokenizer_object=bpe, unk_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
        "{% else %}{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}"
        "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda *a: None):  # video_processor=None
        return Qwen3VLProcessor(image_processor=ImageProcessor(), tokenizer=tokenizer, video_processor=None, chat_template=template)


def _pipeline():
    """The real QwenImage21Pipeline: a 2-layer Qwen3-VL text encoder (16 wide), a Qwen-Image 2.1 VAE that downsamples
    16x (16 latent channels), the tiny QwenImage21Transformer2DModel of torchfix.testing (causal_condition: the KV
    cache is on by default)."""
    from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from torchfix.testing.families import FAMILIES

    tiny = FAMILIES["auto:QwenImage21Transformer2DModel"]
    if (why := tiny.unavailable()) is not None:
        pytest.skip(why)
    processor = _processor()
    ids = processor.tokenizer.convert_tokens_to_ids
    torch.manual_seed(0)
    text = {"vocab_size": len(processor.tokenizer), "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2}
    text.update(num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=256)
    text["rope_scaling"] = {"rope_type": "default", "mrope_section": [1, 1, 2], "mrope_interleaved": True}
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 16}
    vision["deepstack_visual_indexes"] = []
    config = Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    encoder = Qwen3VLForConditionalGeneration(config).eval()
    vae = AutoencoderKLQwenImage21(
        base_dim=8,
        decoder_base_dim=8,
        z_dim=16,
        dim_mult=[1, 1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False] * 4,
        latents_mean=[0.0] * 16,
        latents_std=[1.0] * 16,
        in_channels=3,
        out_channels=3,
    ).eval()
    pipe = QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=encoder, processor=processor, transformer=tiny.build()
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipe():
    return _pipeline()


def _run(pipe, config=ISSUE, cfg=False, **kwargs):
    """A fresh TaylorSeer on the transformer, a 64x64 image (16 image tokens), 8 steps, seed 0; off again after."""
    pipe.transformer.enable_cache(diffusers.TaylorSeerCacheConfig(**config))
    guidance = {"negative_prompt": "a dog", "true_cfg_scale": 4.0} if cfg else {}
    try:
        return pipe(
            prompt="a cat sitting on a wall",
            height=64,
            width=64,
            num_inference_steps=8,
            generator=torch.Generator().manual_seed(0),
            output_type="np",
            **guidance,
            **kwargs,
        ).images
    finally:
        pipe.transformer.disable_cache()


def _restarts():
    return [e for e in torchfix.report().events if e.guard == "cache" and e.action == "restart"]


def test_the_row_covers_the_taylorseer_releases_without_the_shape_check():
    row = library_issues.TAYLORSEER_SHAPES
    assert row.where == "diffusers.hooks.taylorseer_cache:TaylorSeerState.update"
    assert [library_issues.explain(row, v)[0] for v in ("0.35.2", "0.36.0", "0.40.0", "0.41.0.dev0", "0.41.0", "0.42.1")] == [
        False,
        True,
        True,
        True,  # a build of main before the fix (the report's)
        False,
        False,
    ]
    # the basis, on the installed diffusers: the fix from 0.41.0 on, and then the row is not in force here
    assert HAS_FIX == (Version(diffusers.__version__) >= Version("0.41.0"))
    assert library_issues.explain(row, diffusers.__version__)[0] == (not HAS_FIX)


@pytest.mark.skipif(not HAS_FIX, reason="the installed diffusers predates huggingface/diffusers#14831")
def _toy():
    """A denoiser whose latents keep their shape while its output changes shape, as Qwen-Image 2.1's KV cache makes
    it: a prefix (text tokens) goes through ``proj_out`` on the first step only. ``proj_out`` is elementwise, so the
    image tokens' outputs are the same bits with or without the prefix. Runs on every diffusers with TaylorSeer."""
    from diffusers import ConfigMixin, ModelMixin
    from diffusers.configuration_utils import register_to_config
    from diffusers.models.cache_utils import CacheMixin

    class Scale(torch.nn.Module):
        def __init__(self, channels: int) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.weight = torch.nn.Parameter(torch.randn(channels, generator=g))
            self.bias = torch.nn.Parameter(torch.randn(channels, generator=g))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weight + self.bias

    class Toy(ModelMixin, ConfigMixin, CacheMixin):
        @register_to_config
        def __init__(self, channels: int = 8) -> None:
            super().__init__()
            self.proj_out = Scale(channels)

        def forward(self, hidden_states: torch.Tensor, prefix: torch.Tensor | None = None) -> torch.Tensor:
            return self.proj_out(hidden_states if prefix is None else torch.cat([prefix, hidden_states], dim=1))

    return Toy()


def _toy_loop(model, kv: bool = True, steps: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x, text = torch.randn(1, 4, 8, generator=g), torch.randn(1, 3, 8, generator=g)
    model.enable_cache(diffusers.TaylorSeerCacheConfig(**{**ISSUE, "use_lite_mode": False}, cache_identifiers=["proj_out"]))
    try:
        with torch.no_grad():
            for i in range(steps):
                with model.cache_context("cond"):
                    out = model(x, prefix=text if i == 0 or not kv else None)  # kv: the prefix on the prefill step only
                x = x - out[:, -x.shape[1] :] / steps
    finally:
        model.disable_cache()
    return x


def test_a_denoiser_whose_output_changes_shape_on_any_diffusers_with_taylorseer(diffusers_040):
    """On 0.36 to 0.40 diffusers' own TaylorSeer (on 0.41+ the stand-in): the issue's crash plainly, the fix's
    result under torchfix; shapes that never change run as plainly."""
    model = _toy()
    unchanged = _toy_loop(model, kv=False)
    with pytest.raises(RuntimeError, match=r"The size of tensor a \(4\) must match the size of tensor b \(7\)"):
        _toy_loop(model)
    with torchfix.enabled():
        assert torch.equal(_toy_loop(model), unchanged)
        assert torch.equal(_toy_loop(model, kv=False), unchanged)
    (event,) = _restarts()
    assert event.module == "proj_out" and event.change == "(1, 7, 8)→(1, 4, 8)"
    if HAS_FIX:
        with mock.patch.object(taylorseer_cache.TaylorSeerState, "update", FIXED):
            assert torch.equal(_toy_loop(model), unchanged)  # diffusers 0.41+: the same


@needs_qwen21
def test_the_installed_diffusers_runs_it_plainly_and_torchfix_leaves_it_alone(pipe):
    """diffusers 0.41+: the maintainers' fix is in; the row is not in force and patches nothing."""
    plain = _run(pipe)
    assert torch.equal(torch.from_numpy(plain), torch.from_numpy(_run(pipe, use_kv_cache=False)))
    with torchfix.enabled():
        assert vars(taylorseer_cache.TaylorSeerState)["update"] is FIXED
        assert LABEL not in torchfix.status().patched
        assert torch.equal(torch.from_numpy(_run(pipe)), torch.from_numpy(plain))
    assert not _restarts()


@needs_qwen21
@pytest.mark.parametrize("config, cfg", [(ISSUE, False), (SECOND, True)], ids=["issue", "second-order-cfg"])
def test_qwen_image_21_with_its_kv_cache_and_taylorseer(pipe, diffusers_040, config, cfg):
    # the maintainers' behaviour: diffusers' own update with #14831 (the installed one, where it has the fix)
    fixed = None
    if HAS_FIX:
        with mock.patch.object(taylorseer_cache.TaylorSeerState, "update", FIXED):
            fixed = _run(pipe, config, cfg)
    unchanged = _run(pipe, config, cfg, use_kv_cache=False)  # shapes never change: no crash without the fix

    # plain diffusers without the fix: the issue's crash at the first cached step (16 image tokens, 16 + text)
    with pytest.raises(RuntimeError, match=r"The size of tensor a \(16\) must match the size of tensor b \(\d+\)"):
        _run(pipe, config, cfg)

    with torchfix.enabled():  # import torchfix
        patched = vars(taylorseer_cache.TaylorSeerState)["update"]
        assert getattr(patched, "__torchfix_patch__", None) is not None and patched.__wrapped__ is UNFIXED
        assert LABEL in torchfix.status().patched
        out = _run(pipe, config, cfg)
        events = _restarts()
        assert torch.equal(torch.from_numpy(_run(pipe, config, cfg, use_kv_cache=False)), torch.from_numpy(unchanged))
    assert len(events) == (2 if cfg else 1) and len(_restarts()) == len(events)  # none where shapes never change
    assert all(e.module == "transformer.proj_out" and e.change.endswith("→(1, 16, 16)") for e in events)
    assert all("huggingface/diffusers#14831" in e.detail for e in events)
    assert vars(taylorseer_cache.TaylorSeerState)["update"] is UNFIXED  # torchfix off: diffusers' own again

    if fixed is not None:
        assert torch.equal(torch.from_numpy(out), torch.from_numpy(fixed))  # the maintainers' fix, bit for bit
    if config is ISSUE:
        assert torch.equal(torch.from_numpy(out), torch.from_numpy(unchanged))  # the thread's use_kv_cache=False
    else:
        assert not torch.equal(torch.from_numpy(out), torch.from_numpy(unchanged))  # second order: not that


@needs_qwen21
def test_under_wrap_and_gone_after_disable(pipe, diffusers_040):
    unchanged = _run(pipe, use_kv_cache=False)
    w = torchfix.wrap(pipe)  # torchfix off process-wide: the patch lives for the wrapped call
    try:
        assert torch.equal(torch.from_numpy(_run(w)), torch.from_numpy(unchanged))
        assert torch.equal(torch.from_numpy(_run(w, use_kv_cache=False)), torch.from_numpy(unchanged))
    finally:
        w.unwrap()
    (event,) = _restarts()
    assert event.module == "transformer.proj_out"
    assert vars(taylorseer_cache.TaylorSeerState)["update"] is UNFIXED
    with pytest.raises(RuntimeError, match="must match the size"):
        _run(pipe)

    torchfix.enable()
    assert getattr(vars(taylorseer_cache.TaylorSeerState)["update"], "__torchfix_patch__", None) is not None
    torchfix.disable()
    assert vars(taylorseer_cache.TaylorSeerState)["update"] is UNFIXED
    assert LABEL not in torchfix.status().patched


def test_patched_when_diffusers_loads_it_after_import_torchfix_in_a_fresh_process():
    """`import torchfix` first, diffusers' TaylorSeer module imported later (diffusers loads it lazily): patched on
    import where the row is in force (diffusers reporting 0.40.0 here), diffusers' own again after disable()."""
    import os
    import subprocess
    import sys

    code = (
        "import torchfix, sys, diffusers; assert 'diffusers.hooks.taylorseer_cache' not in sys.modules; "
        "diffusers.__version__ = '0.40.0'; "
        "from diffusers.hooks.taylorseer_cache import TaylorSeerState as S; "
        "assert getattr(vars(S)['update'], '__torchfix_patch__', None) is not None; "
        "torchfix.disable(); assert getattr(vars(S)['update'], '__torchfix_patch__', None) is None; print('ok')"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCHFIX_MODE"}  # the default: `import torchfix` enables
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.stdout.strip().endswith("ok"), done.stderr[-2000:]
