"""torchfix's own frames stay out of the tracebacks of errors that are not torchfix's (#40): an ordinary torch
error in the user's code ends on the user's line, as it does without torchfix; ``traceback_filtering(False)``
(or ``TORCHFIX_TRACEBACK_FILTERING=off``) shows every frame; torchfix's own errors keep theirs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import traceback

import pytest
import torch
import torch.nn.functional as F

import torchfix
from torchfix import _frames

TORCHFIX_DIR = os.path.dirname(torchfix.__file__)


def _files(exc: BaseException) -> list[str]:
    return [frame.filename for frame in traceback.extract_tb(exc.__traceback__)]


def _ours(exc: BaseException) -> list[str]:
    return [f for f in _files(exc) if f.startswith(TORCHFIX_DIR)]


def _frames_below(exc: BaseException) -> list[tuple[str, int | None, str]]:
    return [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(exc.__traceback__)[1:]]


@pytest.fixture
def guards(fix_mode):
    try:
        yield
    finally:
        torchfix.traceback_filtering(True)


CALLS = {
    "F.linear": lambda: F.linear(torch.randn(2, 3), torch.randn(4, 5)),
    "torch.matmul": lambda: torch.matmul(torch.randn(2, 3), torch.randn(4, 5)),
    "Tensor.__matmul__": lambda: torch.randn(2, 3) @ torch.randn(4, 5),
    "F.conv2d": lambda: F.conv2d(torch.randn(1, 3, 5, 5), torch.randn(2, 4, 3, 3)),
    "F.layer_norm": lambda: F.layer_norm(torch.randn(2, 3), (4,)),
    "torch.cat": lambda: torch.cat([torch.randn(2, 3), torch.randn(2, 4)]),
    "F.scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(
        *(torch.randn(1, 2, 4, 8) for _ in range(3)), attn_mask=torch.randn(3, 3)
    ),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_torch_error_ends_on_the_users_line(guards, name):
    with pytest.raises(Exception) as plain_info:
        with torchfix.enabled("off"):
            torchfix.disable()
            CALLS[name]()
    torchfix.enable("fix")
    with pytest.raises(type(plain_info.value)) as info:
        CALLS[name]()
    assert str(info.value) == str(plain_info.value)
    assert _ours(info.value) == [], name
    # below the test's own line: the frames a plain call has (the lambda, torch's Python functions), no more
    assert _frames_below(info.value) == _frames_below(plain_info.value)


def _every_tensor(tensors):
    return tuple(n for n, t in tensors.items() if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("matches", [False, True], ids=["row-does-not-match", "row-matches"])
@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_torch_error_ends_on_the_users_line_where_a_known_issue_row_is_in_force(guards, name, matches):
    """On CUDA the sdpa row of pytorch/pytorch#191937 is in force (torch < 2.15): a row for the CPU puts this machine on
    that path, where the call is screened by the row's predicate and, if it matches, fixed on the checked path."""
    from torchfix.guards import known_issues as ki
    from torchfix.guards.ops import SPECS

    with pytest.raises(Exception) as plain_info:
        CALLS[name]()
    predicate = _every_tensor if matches else ki.any_noncontiguous
    row = torchfix.add_known_issue(torchfix.KnownIssue("cpu", (SPECS[name].family,), predicate, "test#frames", "contiguous"))
    try:
        torchfix.enable("fix")
        with pytest.raises(type(plain_info.value)) as info:
            CALLS[name]()
    finally:
        torchfix.remove_known_issue(row)
    assert str(info.value) == str(plain_info.value)
    assert _ours(info.value) == [], name
    assert _frames_below(info.value) == _frames_below(plain_info.value)


def test_every_frame_when_filtering_is_off(guards):
    assert torchfix.traceback_filtering(False) is False
    with pytest.raises(RuntimeError) as info:
        CALLS["F.linear"]()
    assert any(f.endswith(os.path.join("patches", "torch_ops.py")) for f in _ours(info.value))


def test_torchfix_errors_keep_their_frames(guards):
    with torchfix.enabled("strict"), pytest.raises(torchfix.DtypeMismatchError) as info:
        F.linear(torch.randn(2, 3), torch.randn(4, 3, dtype=torch.bfloat16))
    assert _ours(info.value)


def test_traceback_filtering_takes_a_bool():
    with pytest.raises(TypeError, match="True, False or None"):
        torchfix.traceback_filtering("off")  # type: ignore[arg-type]


def test_a_wrapped_pipelines_error_ends_in_diffusers(guards):
    from torchfix import testing

    w = torchfix.wrap(testing.tiny_sd15_pipeline())
    try:
        with pytest.raises(ValueError) as info:
            w(prompt="a cat", prompt_embeds=torch.zeros(1, 77, 32), num_inference_steps=1, output_type="latent")
    finally:
        w.unwrap()
    assert _ours(info.value) == []
    assert "diffusers" in _files(info.value)[-1]


SCRIPT = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    import torchfix

    def user():
        return F.linear(torch.randn(2, 3), torch.randn(4, 5))

    user()
    """
)


@pytest.mark.parametrize("setting", ["", "off"])
def test_plain_python_with_import_torchfix(tmp_path, setting):
    script = tmp_path / "user.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TORCHFIX_MODE"} | {"TORCHFIX_TRACEBACK_FILTERING": setting}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert "mat1 and mat2 shapes cannot be multiplied" in r.stderr
    assert ("torch_ops.py" in r.stderr) == (setting == "off"), r.stderr
    assert r.stderr.rstrip().splitlines()[-4].strip().startswith(f'File "{script}", line 7') or setting == "off"


def test_hide_keeps_what_is_not_torchfixs():
    def inner():
        raise KeyError("x")

    try:
        inner()
    except KeyError as exc:
        before = _files(exc)
        _frames.hide(exc)
        assert _files(exc) == before  # nothing of torchfix's in it: the same traceback object


@pytest.mark.parametrize("kind", ["unet", "transformer"])
def test_an_error_inside_a_cached_model_shows_no_cache_frames(kind):
    """The cache's forward on the model is a boundary too: a shape error in the model's own layers reads as it would
    without the cache (the frames below the caller are the model's and torch's)."""
    pytest.importorskip("diffusers")
    from torchfix import testing

    if kind == "unet":
        model = testing.tiny_sd15_unet()
        args = (torch.randn(1, 4, 8, 8), 10, torch.randn(1, 77, 24))  # text width 24, the UNet's is 32

        def call():
            return model(*args)
    else:
        from torchfix.testing.families import FAMILIES

        tiny = FAMILIES["flux"]
        model = tiny.build()
        inputs = {**tiny.arguments(), "timestep": torch.tensor([0.5])}
        inputs["encoder_hidden_states"] = inputs["encoder_hidden_states"][..., :-1]  # one channel short

        def call():
            return model(**inputs)

    with pytest.raises(RuntimeError) as plain:
        call()
    torchfix.deepcache.apply(model, torchfix.DeepCacheConfig(interval=3))
    try:
        with pytest.raises(RuntimeError) as cached:
            call()
    finally:
        torchfix.deepcache.remove(model)
    assert str(cached.value) == str(plain.value)
    assert _ours(cached.value) == []
    assert _frames_below(cached.value)[-3:] == _frames_below(plain.value)[-3:]
