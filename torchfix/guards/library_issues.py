"""Bugs in the libraries around the denoiser (not in a torch op), keyed on the library's version and the machine — as
data, like :mod:`torchfix.guards.known_issues`. Each row says where the bug is, which versions have it, when it is in
force here, where the range comes from, and what torchfix does about it (the patch lives in
:mod:`torchfix.patches.libraries`). Pure: nothing here imports the library or patches it.

>>> [row.issue for row in ROWS][1:3]
['vladmandic/sdnext#2193', 'torchfix: diffusers cache state after an interrupted call']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .known_issues import _in_range, _span, parse_version

__all__ = [
    "CACHE_STATE",
    "CP_ON_CPU",
    "ROWS",
    "STALE_UNWATCHED",
    "TAYLORSEER_SHAPES",
    "VAE_OVERFLOW",
    "LibraryIssue",
    "cpu_build",
    "explain",
    "stale",
]


def cpu_build() -> bool:
    """Whether torch sees no accelerator (a CPU build, or none attached): ``torch.accelerator.device_count()`` is 0.

    >>> isinstance(cpu_build(), bool)
    True
    """
    accelerator = getattr(torch, "accelerator", None)
    return accelerator is not None and accelerator.device_count() == 0


@dataclass(frozen=True)
class LibraryIssue:
    """One bug in a library torchfix works around.

    Args:
        library: the distribution (``"diffusers"``).
        where: the attribute that has it (``module:Class.method``), which torchfix's patch wraps.
        issue: reference (upstream issue, or ``torchfix: ...`` where found here and not reported upstream).
        description: what goes wrong, in a sentence.
        fix: what torchfix does instead, in a sentence.
        basis: where the version range comes from, and which bound is an estimate.
        version_min, version_max: affected versions, half-open (``None``: any before / not fixed yet).
        condition: when it is in force on this machine (beyond the version), and its name.
    """

    library: str
    where: str
    issue: str
    description: str
    fix: str
    basis: str
    version_min: str | None = None
    version_max: str | None = None
    condition: Callable[[], bool] = lambda: True
    condition_name: str = "always"

    @property
    def versions(self) -> str:
        return _span(self.version_min, self.version_max, self.library)


def stale(before: tuple | None, now: tuple) -> str | None:
    """What changed between the latent signature ``(shape, dtype, device)`` of a denoiser's previous call and this
    one, in words; ``None`` for the same (or a first call). A change means the state a cache hook holds was made for
    other latents.

    >>> stale(((2, 16, 8), "torch.float32", "cpu"), ((2, 36, 8), "torch.float32", "cpu"))
    'latents (2, 16, 8) → (2, 36, 8)'
    >>> stale(None, ((1, 4), "f", "cpu")) is None
    True
    """
    if before is None or before == now:
        return None
    names = ("latents", "dtype", "device")
    return ", ".join(f"{n} {a} → {b}" for n, a, b in zip(names, before, now) if a != b)


def explain(row: LibraryIssue, version: str | None) -> tuple[bool, str]:
    """Whether ``row`` is in force with the library at ``version`` (``None``: not installed) on this machine, and why.

    >>> explain(ROWS[0], None)
    (False, 'diffusers is not installed')
    """
    if version is None:
        return False, f"{row.library} is not installed"
    if not _in_range(parse_version(version, f"{row.library} version"), row.version_min, row.version_max):
        return False, f"{row.library} {version} is not in {row.versions}"
    if not row.condition():
        return False, f"{row.library} {version} in {row.versions}, but not {row.condition_name} here"
    return True, f"{row.library} {version} in {row.versions}; {row.condition_name}"


ROWS: tuple[LibraryIssue, ...] = (
    LibraryIssue(
        library="diffusers",
        where="diffusers.models.modeling_utils:ModelMixin._resolve_parallel_config",
        issue="torchfix: diffusers context parallelism on a CPU build",
        description=(
            "enable_parallelism / from_pretrained(parallel_config=...) pick each rank's device as "
            "rank % torch.accelerator.device_count(), which is 0 without an accelerator: ZeroDivisionError, so context "
            "parallelism cannot run on gloo CPU ranks at all"
        ),
        fix=(
            "where torch sees no accelerator, the same resolution with the CPU as every rank's device (the mesh on the "
            "CPU, gloo); with an accelerator diffusers' own code runs untouched"
        ),
        basis=(
            "found here with diffusers 0.42.1 and torch 2.13 (CPU wheel), 2026-11; no upstream report found in the "
            "stored issues. The lower bound is read off the releases: 0.36.0 to 0.41.0 divide by "
            "torch.get_device_module(accelerator type).device_count(), which is torch.cpu's 1 on a CPU build, and 0.42.0 "
            "switched to torch.accelerator.device_count(); not fixed in 0.42.1"
        ),
        version_min="0.42.0",
        condition=cpu_build,
        condition_name="torch sees no accelerator",
    ),
    LibraryIssue(
        library="diffusers",
        where="diffusers.models.autoencoders.*:<every autoencoder class>.decode",
        issue="vladmandic/sdnext#2193",
        description=(
            "a VAE decode in fp16/bf16 whose activations exceed the dtype's range returns NaN/inf: a black image, no error "
            "(SDXL's VAE; diffusers' force_upcast decodes in fp32 only in the pipelines that honour it, and only when the "
            "flag is set)"
        ),
        fix=(
            "a non-finite reduced-precision decode of finite latents is re-run in float32 with float32 copies of the VAE's "
            "weights (the VAE is not changed) and returned in its dtype, recorded as an event (strict: NonFiniteError); a "
            "finite decode is returned as it is"
        ),
        basis=(
            "vladmandic/sdnext#2193 (diffusers 0.21.1: black SDXL images until an explicit upcast), invoke-ai/InvokeAI#4083 "
            "and #4454 (fixed by fp32 VAE precision), AUTOMATIC1111's automatic VAE revert to fp32; the overflow is the "
            "weights', not a diffusers version's: every version"
        ),
    ),
    LibraryIssue(
        library="diffusers",
        where=(
            "diffusers.models.cache_utils:CacheMixin.enable_cache, disable_cache, _reset_stateful_cache; "
            "diffusers.pipelines.pipeline_utils:DiffusionPipeline.progress_bar"
        ),
        issue="torchfix: diffusers cache state after an interrupted call",
        description=(
            "diffusers' cache hooks (FirstBlockCache, TaylorSeer, MagCache, FasterCache, PAB, ...) keep tensors from the "
            "previous call and reset them only in maybe_free_model_hooks() at the end of a pipeline call; a call that "
            "raises or is interrupted (Ctrl-C, a callback that stops it), or a loop that calls the denoiser itself, "
            "leaves them: the next call at another size crashes inside FirstBlockCache ('The size of tensor a (36) must "
            "match the size of tensor b (16)'), and TaylorSeer, MagCache, FasterCache and PAB return another result than "
            "a fresh pipeline, silently (measured here: MagCache max |diff| 0.197 on a tiny Flux)"
        ),
        fix=(
            "a cache enabled while torchfix is on is watched: the denoising loop of a pipeline call (progress_bar) resets "
            "the state of a denoiser that ran since diffusers' last end-of-call reset, and a denoiser call whose latents "
            "differ in shape, dtype or device from its previous call (a loop of one's own) resets it first; with "
            "diffusers' reset done, calls are left alone; recorded as events (strict: ModelMismatchError)"
        ),
        basis=(
            "found here with diffusers 0.42.1 (a tiny Flux, each cache, a call interrupted at step 1 or 2 then another "
            "at the same or another size, compared with a fresh pipeline); the end-of-call reset is diffusers' own design "
            "(pipeline_utils.maybe_free_model_hooks); ESTIMATE: every version with CacheMixin (0.33.0 on), not fixed in 0.42.1"
        ),
        version_min="0.33.0",
    ),
    LibraryIssue(
        library="diffusers",
        where="diffusers.hooks.taylorseer_cache:TaylorSeerState.update",
        issue="huggingface/diffusers#14829",
        description=(
            "TaylorSeer differences each computed output against the previous computed output of the same module, "
            "whatever its shape: where that shape changes within a generation (Qwen-Image 2.1 with its default KV "
            "cache: the prefill step's proj_out returns text + image tokens, later steps image tokens only) the second "
            "step crashes ('The size of tensor a (1024) must match the size of tensor b (1038)')"
        ),
        fix=(
            "what the maintainers' fix (huggingface/diffusers#14831) does: an output whose shape differs from the one "
            "the state holds starts its Taylor expansion again at order 0 (a new stream), recorded as an event; where "
            "shapes do not change, diffusers' own update runs untouched (bit-identical)"
        ),
        basis=(
            "the released wheels: TaylorSeer came in 0.36.0 (0.35.2 has no hooks/taylorseer_cache.py); 0.36.0 to "
            "0.40.0 difference without a shape check; 0.41.0 (the first release with QwenImage21Pipeline), 0.42.0 and "
            "0.42.1 carry #14831's check (`prev.shape != new_factors[j].shape`), so the installed 0.42.1 needs no "
            "patch. A source build of main between Qwen-Image 2.1's merge and the fix's (the report's: main at cc8644b) is "
            "a 0.40.0.dev0 or 0.41.0.dev0, both below 0.41.0: covered; a dev build after the fix is patched too, where "
            "the patch changes nothing (it restarts the outputs the fix restarts, before the fix looks)"
        ),
        version_min="0.36.0",
        version_max="0.41.0",
    ),
    LibraryIssue(
        library="diffusers",
        where="diffusers.models.cache_utils:CacheMixin.cache_context",
        issue="torchfix: diffusers cache state torchfix does not watch, met by other latents",
        description=(
            "a cache torchfix does not watch (enabled before torchfix was on, or put on with diffusers.hooks.apply_* "
            "directly) keeps its state between two generations of a loop of one's own; met by latents of another "
            "shape, FirstBlockCache crashes on its stale residual ('The size of tensor a (36) must match the size of "
            "tensor b (16)'), with no word of the cache or of the reset that fixes it"
        ),
        fix=(
            "that crash, and only it, is raised again as a ModelMismatchError naming the cache's hooks, the state they "
            "hold (its tensors' shapes), the change of latents and the fix (the model's _reset_stateful_cache() between "
            "generations, or the cache enabled after torchfix is on, which then resets it); a call that runs is left as "
            "diffusers runs it (TaylorSeer restarts its expansion at a new shape by design, huggingface/diffusers#14831)"
        ),
        basis=(
            "reproduced here with diffusers 0.42.1 and 0.35.2 (a tiny Flux transformer, a loop of one's own at 64² then "
            "96², each cache enabled while torchfix was off, or applied with diffusers.hooks.apply_*): FirstBlockCache "
            "crashes on both; TaylorSeer (0.42.1) runs and differs from a fresh cache; MagCache, FasterCache and "
            "PyramidAttentionBroadcast equal a fresh cache. CacheMixin.cache_context came with the caches (0.33.0); "
            "not fixed in 0.42.1"
        ),
        version_min="0.33.0",
    ),
)

# The rows by what they are about (the patches name them so, never by position).
CP_ON_CPU, VAE_OVERFLOW, CACHE_STATE, TAYLORSEER_SHAPES, STALE_UNWATCHED = ROWS
