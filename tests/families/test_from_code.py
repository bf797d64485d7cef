"""Entries read off a denoiser's code (torchfix.families.from_code): they agree with every hand-written entry, a model
cached through one computes what it computes through the hand-written entry, and what cannot be read is refused
at apply, naming what was found."""

from __future__ import annotations

import pytest
import torch

import torchfix
from torchfix import families
from torchfix.families import from_code as inference

pytest.importorskip("diffusers")

from torchfix.testing.families import FAMILIES, denoise

REGISTERED = sorted(
    key
    for key, tiny in FAMILIES.items()
    if not tiny.family.startswith(inference.PREFIX) and families.get(tiny.family).kind == "transformer"
)
# Where inference reads less than the hand-written entry, and why (anything else must agree exactly).
READS_LESS = {
    # Its single blocks run in a loop over a local alias sliced into encoder and decoder layers: not a list loop.
    "motif-video": "transformer_blocks only",
}
REFUSES = {
    # The double blocks return the Llama-joined text as a new name (initial_encoder_hidden_states): not a stream.
    "hidream": "initial_encoder_hidden_states, which it does not take",
    # Spatial and temporal blocks are zipped into one loop.
    "latte": "outside `for block in self.<list>` loops",
}
CFG = torchfix.DeepCacheConfig(interval=3, num_steps=8)


@pytest.fixture
def registry_off(monkeypatch):
    """The registry knows no model: every denoiser goes through inference."""
    from torchfix.families import spec

    monkeypatch.setattr(spec, "find", lambda model: None)
    monkeypatch.setattr(families, "find", lambda model: None)


def _latents(out) -> torch.Tensor:
    x = out.latents
    return torch.cat([t.flatten() for t in x]) if isinstance(x, list) else x


@pytest.mark.parametrize("key", REGISTERED)
def test_inferred_entries_agree_with_every_hand_written_one(key):
    tiny = FAMILIES[key]
    if (why := tiny.unavailable()) is not None:
        pytest.skip(why)
    model, entry = tiny.build(), families.get(tiny.family)
    if key in REFUSES:
        with pytest.raises(torchfix.UnsupportedModelError, match=REFUSES[key]):
            families.infer(model)
        return
    got = families.infer(model)
    assert got.name == "auto:" + type(model).__name__ and families.is_inferred(got) and not families.is_inferred(entry)
    assert got.keep_last == entry.keep_last and got.latent == entry.latent
    if key in READS_LESS:
        assert len(got.blocks) < len(entry.blocks) and all(b in entry.blocks for b in got.blocks)
    else:
        assert got.blocks == entry.blocks, (got.describe(), entry.describe())


@pytest.mark.parametrize("key", [k for k in REGISTERED if k not in REFUSES])
def test_a_model_cached_through_its_inferred_entry_computes_what_the_registered_entry_computes(key, monkeypatch):
    """Without a registry entry the cache reads the same blocks and streams off the code, verifies them on the first
    call, and computes the same steps: bit-identical where the entries agree and the registered one adds no
    measured defaults or revisable output layers; within the conformance bar otherwise."""
    tiny = FAMILIES[key]
    if (why := tiny.unavailable()) is not None:
        pytest.skip(why)
    model = tiny.build()
    entry = families.get(tiny.family)
    plain = denoise(model, tiny)
    torchfix.deepcache.apply(model, CFG)
    registered = denoise(model, tiny)
    work = torchfix.deepcache.stats(model)
    torchfix.deepcache.remove(model)
    from torchfix.families import spec

    monkeypatch.setattr(spec, "find", lambda m: None)
    monkeypatch.setattr(families, "find", lambda m: None)
    try:
        torchfix.deepcache.apply(model, CFG)
        inferred = denoise(model, tiny)
        s = torchfix.deepcache.stats(model)
    finally:
        torchfix.deepcache.remove(model)
    assert s["family"] == "auto:" + type(model).__name__
    assert (s["full_steps"], s["cached_steps"]) == (work["full_steps"], work["cached_steps"]) == (3, 5)
    if key not in READS_LESS and entry.tail is None and not entry.defaults:
        assert torch.equal(_latents(inferred), _latents(registered))
    ref = _latents(plain)
    assert ((_latents(inferred) - ref).norm() / ref.norm()).item() < 0.1


# --- what inference refuses, at apply ------------------------------------------------------------------------------


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, hidden_states: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        return hidden_states + self.proj(hidden_states) * temb


class Chain(torch.nn.Module):
    """A tiny day-0 transformer: one list of blocks, the image stream handed on."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(n))
        self.out = torch.nn.Linear(4, 4)

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        temb = torch.sigmoid(timestep)[:, None, None]
        for block in self.blocks:
            hidden_states = block(hidden_states, temb)
        return self.out(hidden_states)


class Skips(Chain):
    """Keeps every block's output for later (a long skip connection): a cached block's output is used elsewhere."""

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        temb = torch.sigmoid(timestep)[:, None, None]
        kept = []
        for block in self.blocks:
            hidden_states = block(hidden_states, temb)
            kept.append(hidden_states)
        return self.out(hidden_states + sum(kept))


class Adapter(Chain):
    """An adapter that reads the stream between blocks and adds to it (Wan-Animate's face adapter): recomputed on a
    cached step from the stand-in, so the chain splits there and still caches."""

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        temb = torch.sigmoid(timestep)[:, None, None]
        for i, block in enumerate(self.blocks):
            hidden_states = block(hidden_states, temb)
            if i % 2 == 0:
                adapted = self.out(hidden_states)
                hidden_states = hidden_states + 0.1 * adapted
        return self.out(hidden_states)


class Leaks(Chain):
    """A temporary computed from the stream in the loop and read after it: a cached block's output kept."""

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        temb = torch.sigmoid(timestep)[:, None, None]
        first = hidden_states
        for block in self.blocks:
            hidden_states = block(hidden_states, temb)
            first = hidden_states * 1.0
        return self.out(hidden_states + first)


class Starred(Chain):
    """The stream goes to the blocks inside a tuple built elsewhere: which parameter takes it cannot be read."""

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        temb = torch.sigmoid(timestep)[:, None, None]
        for block in self.blocks:
            hidden_states = block(*self._arguments(hidden_states, temb))
        return self.out(hidden_states)

    @staticmethod
    def _arguments(hidden_states: torch.Tensor, temb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return hidden_states, temb


class Packed(Chain):
    """The blocks' arguments packed into a tuple in the loop (Kandinsky 6), conditioning by keyword from a dict:
    read item by item."""

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        extra = {"temb": torch.sigmoid(timestep)[:, None, None]}
        for block in self.blocks:
            args = (hidden_states,)
            hidden_states = block(*args, **extra)
        return self.out(hidden_states)


class NoLoop(Chain):
    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        temb = torch.sigmoid(timestep)[:, None, None]
        hidden_states = self.blocks[0](hidden_states, temb)
        return self.out(self.blocks[1](hidden_states, temb))


class Twice(Chain):
    """Each loop reads as a chain, but the blocks run twice a call: only the first call can tell."""

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        temb = torch.sigmoid(timestep)[:, None, None]
        for block in self.blocks:
            hidden_states = block(hidden_states, temb)
        for block in self.blocks:
            hidden_states = block(hidden_states, temb)
        return self.out(hidden_states)


def _steps(model: torch.nn.Module, steps: int = 8) -> list[torch.Tensor]:
    """The model's outputs over ``steps`` Euler steps, then the final latents."""
    x = torch.randn(2, 6, 4, generator=torch.Generator().manual_seed(0))
    outs = []
    with torch.no_grad():
        for i in range(steps):
            out = model(x, torch.full((2,), 1.0 - i / steps))
            outs.append(out)
            x = x - out / steps
    return [*outs, x]


def _plain_and_cached(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
    """:func:`_steps` plain, then with the cache (CFG), and the cache's stats; the model is left plain."""
    plain = _steps(model)
    torchfix.deepcache.apply(model, CFG)
    try:
        return plain, _steps(model), torchfix.deepcache.stats(model)
    finally:
        torchfix.deepcache.remove(model)


def _seeded(cls: type) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return cls()


def test_a_day0_chain_is_read_verified_and_cached():
    model = _seeded(Chain)
    family = families.infer(model)
    assert family.describe() == "blocks(hidden_states=image) -> image" and family.name == "auto:Chain"
    plain, cached, s = _plain_and_cached(model)
    assert (s["family"], s["full_steps"], s["cached_steps"]) == ("auto:Chain", 3, 5)
    assert torch.equal(cached[0], plain[0]) and not torch.equal(cached[1], plain[1])
    assert ((cached[-1] - plain[-1]).norm() / plain[-1].norm()).item() < 0.05


@pytest.mark.parametrize(
    "model, found",
    [
        (Skips(), r"hidden_states is used outside the block call \(kept.append"),
        (Leaks(), r"first, computed from a stream in the loop, is read after it"),
        (Starred(), r"passes \*args or \*\*kwargs that may hold hidden_states"),
        (NoLoop(), r"outside `for block in self.<list>` loops"),
        (torch.nn.Sequential(torch.nn.Linear(2, 2)), r"no block lists it can read"),
    ],
    ids=["skip-connection", "temporary-read-after", "starred", "no-loop", "no-lists"],
)
def test_what_cannot_be_read_is_refused_at_apply_naming_what_was_found(model, found):
    with pytest.raises(torchfix.UnsupportedModelError, match=found) as caught:
        torchfix.deepcache.apply(model, CFG)
    assert type(model).__name__ in str(caught.value) and "docs/families.md" in str(caught.value)
    assert torchfix.deepcache.stats(model) == {"applied": False}


def test_a_tuple_of_arguments_built_in_the_loop_is_read_item_by_item():
    model = _seeded(Packed)
    assert families.infer(model).describe() == "blocks(hidden_states=image) -> image"
    plain, cached, s = _plain_and_cached(model)
    assert (s["full_steps"], s["cached_steps"]) == (3, 5)
    assert ((cached[-1] - plain[-1]).norm() / plain[-1].norm()).item() < 0.05


def test_an_adapter_between_blocks_splits_the_chain_and_still_caches():
    model = _seeded(Adapter)
    plain, cached, s = _plain_and_cached(model)
    assert (s["full_steps"], s["cached_steps"]) == (3, 5) and "in 3 run(s)" in s["blocks"]  # split after blocks 0 and 2
    assert ((cached[-1] - plain[-1]).norm() / plain[-1].norm()).item() < 0.05


def test_a_reading_the_blocks_contradict_is_refused_at_the_first_call_and_nothing_is_cached():
    model = _seeded(Twice)
    assert families.infer(model).describe() == "blocks(hidden_states=image) -> image"  # what the source seems to say
    plain = _steps(model, 1)
    torchfix.deepcache.apply(model, CFG)
    try:
        with pytest.raises(torchfix.UnsupportedModelError, match="blocks called more than once"):
            _steps(model, 1)
    finally:
        torchfix.deepcache.remove(model)
    assert torch.equal(_steps(model, 1)[0], plain[0])


def test_roles_come_from_the_models_names_first():
    assert [inference.role(n) for n in ("x", "img", "txt", "text_embed", "control_hidden_states", "joint_hidden_states")] == [
        "image",
        "image",
        "text",
        "text",
        "control",
        "image",
    ]


def test_the_text_side_of_a_day0_model_is_reused_exactly_on_cached_steps(monkeypatch):
    """HunyuanImage 2.1's byT5 mapper (``context_embedder_2``) is 91% of its tiny config's step and depends on the
    prompt alone: the read entry names it prompt-only, and cached steps reuse its output, bit-identically."""
    import dataclasses

    from torchfix.families import from_code

    tiny = FAMILIES["auto:HunyuanImageTransformer2DModel"]
    if (why := tiny.unavailable()) is not None:
        pytest.skip(why)
    model = tiny.build()
    assert "context_embedder_2" in families.infer(model).prompt_only
    state = torchfix.deepcache.apply(model, CFG)
    try:
        reused = denoise(model, tiny)
        assert state.prompt_only_reused > 0
    finally:
        torchfix.deepcache.remove(model)
    read = from_code.infer
    monkeypatch.setattr(from_code, "infer", lambda m: dataclasses.replace(read(m), prompt_only=()))
    torchfix.deepcache.apply(model, CFG)
    try:
        assert torch.equal(_latents(denoise(model, tiny)), _latents(reused))
    finally:
        torchfix.deepcache.remove(model)


# --- ComfyUI's forward shapes (classes of comfy.ldm, or deriving from one) -------------------------------------------


class _ComfyBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, vec: torch.Tensor, transformer_options: dict = {}) -> torch.Tensor:  # noqa: B006
        return x + self.proj(x) * vec


class ComfyShaped(torch.nn.Module):
    """ComfyUI's shape: ``forward`` hands on to ``_forward`` (its wrapper executor), which calls ``forward_orig``; each
    block runs inside a ``patches_replace`` branch (through ``block_wrap``) or directly, and ControlNet residuals are
    added in place under ``if control is not None``. Outside ComfyUI's packages: read as any other class."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_ComfyBlock() for _ in range(n))
        self.out = torch.nn.Linear(4, 4)

    def forward(self, x, timestep, context=None, control=None, transformer_options={}, **kwargs):  # noqa: B006
        return self._forward(x, timestep, context, control, transformer_options)

    def _forward(self, x, timestep, context, control, transformer_options):
        return self.forward_orig(x, torch.sigmoid(timestep)[:, None, None], control, transformer_options)

    def forward_orig(self, x, vec, control, transformer_options):
        blocks_replace = transformer_options.get("patches_replace", {}).get("dit", {})
        for i, block in enumerate(self.blocks):
            if ("double_block", i) in blocks_replace:

                def block_wrap(args):
                    out = {}
                    out["img"] = block(args["img"], vec=args["vec"], transformer_options=args["transformer_options"])  # noqa: B023
                    return out

                given = {"img": x, "vec": vec, "transformer_options": transformer_options}
                out = blocks_replace[("double_block", i)](given, {"original_block": block_wrap})
                x = out["img"]
            else:
                x = block(x, vec=vec, transformer_options=transformer_options)
            if control is not None:
                add = control["input"][i]
                if add is not None:
                    x[:, : add.shape[1]] += add
        return self.out(x)


class ComfyChain(ComfyShaped):
    """:class:`ComfyShaped` as one of ComfyUI's own classes."""

    __module__ = "comfy.ldm.tiny.model"


class ComfyHints(ComfyChain):
    """Wan VACE's shape: a hint added to the stream in place between blocks (``x += hint``), always."""

    def forward_orig(self, x, vec, control, transformer_options):
        for block in self.blocks:
            x = block(x, vec=vec, transformer_options=transformer_options)
            hint = self.out(vec.expand_as(x))
            x += 0.1 * hint
        return self.out(x)


class ComfyNoOptions(ComfyChain):
    """A ComfyUI-shaped forward that takes no ``transformer_options``: cond and uncond cannot be told apart."""

    def forward(self, x, timestep):
        return self.forward_orig(x, torch.sigmoid(timestep)[:, None, None], None, {})


def test_a_comfyui_class_is_read_through_its_executor_and_forward_orig():
    model = _seeded(ComfyChain)
    family = families.infer(model)
    assert family.describe() == "blocks(x=image) -> image" and family.name == "auto:ComfyChain"
    assert (family.host, family.latent, family.prompt, family.classes) == ("comfyui", "x", None, ("comfy.ldm.tiny.model.ComfyChain",))
    assert "control" in family.full_only_arguments
    assert family.context({"transformer_options": {"cond_or_uncond": [1]}}) == "cond_or_uncond=1"
    plain, cached, s = _plain_and_cached(model)
    assert (s["family"], s["full_steps"], s["cached_steps"]) == ("auto:ComfyChain", 3, 5)
    assert torch.equal(cached[0], plain[0]) and ((cached[-1] - plain[-1]).norm() / plain[-1].norm()).item() < 0.05


def test_a_comfyui_stream_changed_in_place_between_blocks_is_refused():
    with pytest.raises(torchfix.UnsupportedModelError, match=r"x is changed in place between blocks \(x \+= 0.1 \* hint\)"):
        torchfix.deepcache.apply(ComfyHints(), CFG)
    with pytest.raises(torchfix.UnsupportedModelError, match="takes no transformer_options"):
        torchfix.deepcache.apply(ComfyNoOptions(), CFG)


def test_the_comfyui_reading_leaves_a_class_outside_comfyui_as_it_was():
    """The same code outside ComfyUI's packages is read as before: no methods followed below ``forward``."""
    derived = type("Derived", (ComfyChain,), {"__module__": __name__})
    assert not inference.is_comfy(ComfyShaped) and inference.is_comfy(derived)  # derives from a ComfyUI class: read as one
    with pytest.raises(torchfix.UnsupportedModelError, match=r"outside `for block in self\.<list>` loops"):
        families.infer(ComfyShaped())


def test_comfyui_block_patches_are_placed_on_the_entrys_lists():
    """``("double_block", i)`` is block i of a ComfyUI entry's first list, ``("single_block", i)`` of its second;
    ``patches["double_block"]`` follows every block of the first; a key torchfix cannot place touches every block."""
    from torchfix.families.entries import comfy_patched

    def options(**to):
        return {"transformer_options": to}

    dit = {("double_block", 3): print, ("single_block", 0): print}
    assert comfy_patched(options(patches_replace={"dit": dit})) == {(0, 3), (1, 0)}
    assert comfy_patched(options(patches={"double_block": [print], "post_input": [print]})) == {(0, -1)}
    assert comfy_patched(options(patches_replace={"dit": {("block", 2): print}})) == {(-1, -1)}
    assert comfy_patched(options(patches_replace={"attn1": {("input", 1): print}}, cond_or_uncond=[0])) == frozenset()
    assert comfy_patched({"x": None}) == frozenset()
    for name in families.names(builtin=True):
        family = families.get(name)
        assert (family.patched is comfy_patched) == (family.host == "comfyui"), name
