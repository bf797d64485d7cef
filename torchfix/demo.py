"""``torchfix demo``: the five incidents torchfix exists for, each run plainly and
then with torchfix, and the DeepCache speedup at 720x960.

Offline: tiny SD1.5-like and SDXL-like diffusers pipelines with random weights
(:mod:`torchfix.testing`). Each incident ends FIXED, REFUSED CLEARLY, NO FAULT HERE (the
plain run did not fail on this machine) or NOT FIXED; exit code 0 unless one is NOT FIXED.

>>> from torchfix import demo
>>> outcome = demo.strides(quick=True)      # doctest: +SKIP
>>> outcome.fixed                           # doctest: +SKIP
True
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import torchfix
from torchfix import testing
from torchfix.guards import known_issues as ki

__all__ = ["Outcome", "devices", "main", "mixed_precision", "resolution", "speedup", "strides", "switching"]


@dataclass
class Outcome:
    """One incident: what plain torch did, what torchfix did, and whether it is fixed."""

    incident: str
    plain: str
    torchfix: str
    fixed: bool
    seconds: float = 0.0
    # True: the plain run failed here (raised, or returned garbage); False: it did not (nothing to fix here);
    # None: not run plainly here (counted as no fault)
    reproduced: bool | None = None
    refused: bool = False  # torchfix's answer is a clear error before anything runs, not a run

    @property
    def status(self) -> str:
        """``FIXED`` (failed plainly, runs with torchfix), ``REFUSED CLEARLY`` (failed plainly, torchfix stops it with a
        clear error first), ``NO FAULT HERE`` (the plain run did not fail here: never counted fixed) or ``NOT FIXED``."""
        if not self.fixed:
            return "NOT FIXED"
        if not self.reproduced:
            return "NO FAULT HERE"
        return "REFUSED CLEARLY" if self.refused else "FIXED"


STATUSES = ("FIXED", "REFUSED CLEARLY", "NO FAULT HERE", "NOT FIXED")


def headline(outcomes: list[Outcome]) -> str:
    """What the incidents came to here, counting only what failed here.

    >>> headline([Outcome("1 strides", "ok", "ok", True, reproduced=False), Outcome("4 mixed", "raised", "ran", True, reproduced=True)])
    '2 incidents: 1 fixed, 0 refused clearly, 1 no fault here (1 strides), 0 not fixed'
    """
    counts = {s: [o.incident.split(":")[0] for o in outcomes if o.status == s] for s in STATUSES}
    parts = []
    for s in STATUSES:
        names = f" ({', '.join(counts[s])})" if counts[s] and s not in ("FIXED", "REFUSED CLEARLY") else ""
        parts.append(f"{len(counts[s])} {s.lower()}{names}")
    return f"{len(outcomes)} incidents: " + ", ".join(parts)


def _clip(text: str, width: int) -> str:
    """``text`` cut at a word boundary to at most ``width`` characters, marked with an ellipsis (never mid-word).

    >>> _clip("Sizes of tensors must match except in dimension 1", 30)
    'Sizes of tensors must match …'
    """
    if len(text) <= width:
        return text
    cut = text[: width - 2]
    if " " in cut:
        cut = cut[: cut.rindex(" ")]
    return cut.rstrip(" ,;:") + " …"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@contextlib.contextmanager
def _stderr_fd_silenced() -> Iterator[None]:
    """The profiler's C++ side prints start/stop lines to fd 2; keep them out of the demo."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _copied_bytes(fn: Callable[[], torch.Tensor]) -> int:
    """Bytes ``fn`` allocates beyond its result (copies of operands), from the profiler."""
    with _stderr_fd_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    allocated = sum(max(e.self_cpu_memory_usage, 0) for e in prof.events())
    return max(allocated - out.numel() * out.element_size(), 0)


def _bars(pipe: object, desc: str, show: bool) -> None:
    pipe.set_progress_bar_config(desc=desc, leave=False, disable=not show)


# --- 1. strides --------------------------------------------------------------------------------------


def strides(quick: bool = False) -> Outcome:
    """``[1,1,4096,4096] @ [1,1,4096,512]`` with a transposed (non-contiguous) rhs view."""
    n = 1024 if quick else 4096
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1, 1, n, n, generator=g)
    b = torch.randn(1, 1, 512, n, generator=g).transpose(-1, -2)
    rows = ki.matching("matmul", {"input": a, "other": b}, device_type="mps", torch_version="1.12.1", os_version="13.0")
    here = ki.matching("matmul", {"input": a, "other": b}, device_type=a.device.type)  # rows in force here
    rows_checked = slice(0, 256)  # the error is read on 256 rows: a float64 product of all of them takes seconds
    reference = a[..., rows_checked, :].double() @ b.double()
    plain_err = _rel_l2(torch.matmul(a, b)[..., rows_checked, :], reference)
    quick_fix = _copied_bytes(lambda: torch.matmul(a, b.contiguous()))
    wrong_here = bool(here) or plain_err > 1e-5
    where = "wrong here" if wrong_here else f"correct on this {a.device.type.upper()} (rel err {plain_err:.1e})"
    plain = (
        f"{where}; MPS on torch < 1.13 returned wrong values for this layout ({', '.join(e.issue for e, _ in rows)}); "
        f"the usual fix b.contiguous() copies {quick_fix / 2**20:.1f} MiB per call"
    )
    ours = torch.ops.torchfix.matmul(a, b)
    copied = _copied_bytes(lambda: torch.ops.torchfix.matmul(a, b))
    err = _rel_l2(ours[..., rows_checked, :], reference)
    text = f"torch.ops.torchfix.matmul reads the strides: {copied / 2**20:.1f} MiB copied, rel err vs float64 {err:.1e}"
    return Outcome("1 strides: [1,1,N,N] @ transposed [1,1,N,512]", plain, text, copied == 0 and err < 1e-5, reproduced=wrong_here)


# --- 2. resolution -----------------------------------------------------------------------------------------


def resolution(quick: bool = False, show: bool = True) -> Outcome:
    """DeepCache at 720x960 (45-row latents one level down: OneDiff's concat of 45 vs 46 rows), then
    img2img at another size on the same UNet (DeepCache 0.1.1 keeps its step count: issue #54)."""
    from diffusers import StableDiffusionXLImg2ImgPipeline

    # The sizes and steps of the report in both modes (8 s on 2 cores): at smaller sizes, or 6 steps (img2img's
    # strength 0.5 leaves 3, too few to reach a cached step at the odd size), DeepCache 0.1.1 does not fail.
    big, small = (720, 960), (360, 480)
    steps = 10
    pipe = testing.tiny_sdxl_pipeline()
    img2img = StableDiffusionXLImg2ImgPipeline(**pipe.components)
    image = torch.rand(1, 3, *big, generator=torch.Generator().manual_seed(1))

    def txt2img() -> torch.Tensor:
        return testing.latents(pipe, steps=steps, size=small)

    def i2i() -> torch.Tensor:
        return testing.latents(img2img, steps=steps, size=big, image=image, strength=0.5)

    for p, name in ((pipe, "txt2img"), (img2img, "img2img")):
        _bars(p, f"{name} (no cache)", show)
    ref_small, ref_big = txt2img(), i2i()
    plain = "DeepCache 0.1.1 not installed: plain run skipped"
    reproduced = None
    try:
        from DeepCache import DeepCacheSDHelper
    except ImportError:
        DeepCacheSDHelper = None
    if DeepCacheSDHelper is not None:
        helper = DeepCacheSDHelper(pipe=pipe)
        helper.set_params(cache_interval=3, cache_branch_id=0)
        helper.enable()
        for p, name in ((pipe, "txt2img"), (img2img, "img2img")):
            _bars(p, f"{name} DeepCache 0.1.1", show)
        try:
            txt2img()
            out = i2i()
            plain = f"DeepCache 0.1.1: img2img after txt2img ran, rel-L2 vs no cache {_rel_l2(out, ref_big):.3f}"
            reproduced = False
        except Exception as exc:  # the failure is the point of the demo; it is shown, not hidden
            plain = f"DeepCache 0.1.1, txt2img {small[0]}x{small[1]} then img2img {big[0]}x{big[1]}: {_clip(_first_line(exc), 110)}"
            reproduced = True
        finally:
            helper.disable()
    torchfix.deepcache.apply(pipe, torchfix.DeepCacheConfig(interval=3, branch=0))
    for p, name in ((pipe, "txt2img"), (img2img, "img2img")):
        _bars(p, f"{name} torchfix DeepCache", show)
    try:
        errs = {small: _rel_l2(txt2img(), ref_small), big: _rel_l2(i2i(), ref_big)}
    finally:
        torchfix.deepcache.remove(pipe)
    kinds = ("txt2img", "img2img")
    text = "; ".join(f"{s[0]}x{s[1]} {kind} runs (rel-L2 vs no cache {e:.3f})" for (s, e), kind in zip(errs.items(), kinds))
    ok = all(e < 0.15 for e in errs.values())
    incident = f"2 resolution: DeepCache txt2img {small[0]}x{small[1]}, then img2img {big[0]}x{big[1]}"
    return Outcome(incident, plain, text, ok, reproduced=reproduced)


# --- 3. switching -------------------------------------------------------------------------------------------


def switching(quick: bool = False, show: bool = True) -> Outcome:
    """SD1.5 given SDXL-made embeddings; then SD1.5 -> SDXL -> SD1.5 in one process."""
    steps = 4 if quick else 6
    sdxl = testing.tiny_sdxl_pipeline()
    sd15 = testing.tiny_sd15_pipeline()
    for p in (sdxl, sd15):
        _bars(p, type(p).__name__, show)
    embeds, negative, _, _ = sdxl.encode_prompt("a cat", do_classifier_free_guidance=True)
    kw = dict(num_inference_steps=steps, height=64, width=64, output_type="latent")
    try:
        sd15(prompt_embeds=embeds, negative_prompt_embeds=negative, **kw)
        plain, failed = "ran with another model's embeddings (no error)", False
    except RuntimeError as exc:
        plain, failed = f"SDXL embeddings reach the SD1.5 UNet mid-run: {_first_line(exc)}", True
    w = torchfix.wrap(sd15)
    refused = ""
    try:
        w(prompt_embeds=embeds, negative_prompt_embeds=negative, **kw)
    except torchfix.ModelMismatchError:
        refused = "refused before running (ModelMismatchError)"
    first = testing.latents(w, steps=steps)
    w.unwrap()
    outs = []
    for pipe in (sdxl, testing.tiny_sd15_pipeline()):
        _bars(pipe, type(pipe).__name__, show)
        w = torchfix.wrap(pipe)
        outs.append(testing.latents(w, steps=steps))
        w.unwrap()
    same = torch.equal(outs[-1], first)
    text = f"{refused or 'NOT refused'}; SD1.5 -> SDXL -> SD1.5 ran, last SD1.5 bit-identical to the first: {same}"
    incident = "3 switching: SD1.5 with SDXL embeddings; SD1.5 -> SDXL -> SD1.5"
    return Outcome(incident, plain, text, bool(refused) and same, reproduced=failed, refused=True)


# --- 4. mixed precision --------------------------------------------------------------------------------------


def mixed_precision(quick: bool = False, show: bool = True) -> Outcome:
    """A bf16 SDXL-like pipeline whose ``text_encoder_2.text_projection`` stayed fp16."""
    pipe = testing.tiny_sdxl_pipeline().to(torch.bfloat16)
    pipe.text_encoder_2.text_projection.to(torch.float16)
    _bars(pipe, "bf16 pipeline", show)
    steps = 3 if quick else 4
    try:
        testing.latents(pipe, steps=steps)
        plain, failed = "ran (no error)", False
    except RuntimeError as exc:
        plain, failed = _first_line(exc), True
    torchfix.report().clear()
    with torchfix.enabled("fix"):
        out = testing.latents(pipe, steps=steps)
    modules = sorted({e.module or "?" for e in torchfix.report().events if e.guard == "dtype" and e.op == "F.linear"})
    w = torchfix.wrap(pipe)
    first = testing.latents(w, steps=steps)  # the guards fix the first call; wrap then casts the stray layer once
    findings = [f"{f.component}: {f.fix}" for f in w.findings if "text_projection" in f.component]
    same = torch.equal(testing.latents(w, steps=steps), first)
    w.unwrap()
    findings.append("later calls bit-identical" if same else "later calls DIFFER")
    ok = bool(torch.isfinite(out.float()).all()) and any("text_projection" in m for m in modules) and same
    text = f"import torchfix: runs, casts per call in {', '.join(modules)}; torchfix.wrap instead: {'; '.join(findings)}"
    return Outcome("4 mixed precision: bf16 pipeline, fp16 text_projection", plain, text, ok, reproduced=failed)


# --- 5. devices ------------------------------------------------------------------------------------------------


def devices(quick: bool = False, show: bool = True) -> Outcome:
    """A text-encoder weight left on ``meta`` next to CPU tensors; and cpu vs cpu:0."""
    pipe = testing.tiny_sd15_pipeline()
    _bars(pipe, "meta weight", show)
    name = next(n for n, m in pipe.text_encoder.named_modules() if n.endswith("layers.0.mlp.fc2"))
    fc2 = pipe.text_encoder.get_submodule(name)
    fc2.weight = torch.nn.Parameter(torch.empty_like(fc2.weight, device="meta"))  # never loaded
    x = torch.randn(2, fc2.in_features)
    out = F.linear(x, fc2.weight)
    same_plain = torch.device("cpu") == torch.device("cpu", 0)
    try:
        testing.latents(pipe, steps=2)
        ran = "the pipeline ran to the end on it, no error"
    except RuntimeError as exc:
        ran = f"the pipeline failed later: {_clip(_first_line(exc), 70)}"
    plain = f"F.linear(cpu, meta weight) returned a {out.device} tensor of garbage; {ran}; torch.device('cpu') == 'cpu:0' is {same_plain}"
    named = ""
    with torchfix.enabled("fix"):
        try:
            testing.latents(pipe, steps=2)
        except torchfix.DeviceMismatchError as exc:
            named = name if name in str(exc) else ""
    same = torchfix.devices.same("cpu", "cpu:0")
    text = f"DeviceMismatchError before the op runs, naming {named or '(no module!)'}; torchfix.devices.same('cpu', 'cpu:0') is {same}"
    garbage = out.device.type != "meta"  # a result with no data behind it, not an error
    incident = "5 devices: a weight left on meta; two handles to one device"
    return Outcome(incident, plain, text, bool(named) and same, reproduced=garbage or not same_plain, refused=True)


# --- DeepCache speedup ---------------------------------------------------------------------------------------------


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def speed_verdict(wall: float, work: float, bound: float) -> str:
    """What a measured wall-time ratio may be trusted for, next to the counted work ratio and the
    most the interval allows (every cached step free): a wall figure above the bound, or below 1, was
    made by the machine's load changing between runs, not by the cache.

    >>> speed_verdict(2.1, 2.2, 2.5)
    ''
    >>> speed_verdict(3.2, 2.2, 2.5)[:40]
    'wall figure above the 2.50x the interval'
    """
    if wall > bound * 1.05:
        return f"wall figure above the {bound:.2f}x the interval allows: the machine's load changed between runs; trust the work figure"
    if wall < 1.0 < work:
        return "wall figure below 1x: the machine's load changed between runs (the cache did less work); trust the work figure"
    return ""


def speedup(quick: bool = False, show: bool = True, kind: str = "sdxl", runs: int = 3) -> Outcome:
    """Plain vs torchfix DeepCache (interval 3, branch 0) at 720x960, 10 steps, on the SDXL-like
    (``kind="sdxl"``) or SD1.5-like (``"sd15"``) tiny pipeline: the work each does (FLOPs counted by
    torch, attention included, one generation each), the median wall time of ``runs`` generations each (plain and cached
    taking turns, so a change of load hits both), and whether the wall figure is one the interval allows."""
    size = (360, 480) if quick else (720, 960)
    steps = 6 if quick else 10
    config = torchfix.DeepCacheConfig(interval=3, branch=0)
    bound = steps / len(torchfix.deepcache.full_steps(steps, config))
    # One attention head per block in the SD1.5-like UNet: its top-level self-attention at 90x120 latents
    # (a 10,800-token softmax per head) would otherwise take most of the demo's time.
    pipe = testing.tiny_sdxl_pipeline() if kind == "sdxl" else testing.tiny_sd15_pipeline(heads=1)

    def generate() -> torch.Tensor:
        return testing.latents(pipe, steps=steps, size=size)

    def timed() -> tuple[torch.Tensor, float]:
        start = time.perf_counter()
        out = generate()
        return out, time.perf_counter() - start

    # The FLOPs are counted on one generation each before the timed ones, which also warms both paths up.
    _bars(pipe, "counting FLOPs (plain)", show)
    plain_flops = testing.flops(generate)
    torchfix.deepcache.apply(pipe, config)
    _bars(pipe, "counting FLOPs (DeepCache)", show)
    try:
        cached_flops = testing.flops(generate)
    finally:
        torchfix.deepcache.remove(pipe)
    plain_s: list[float] = []
    cached_s: list[float] = []
    for _ in range(runs):
        _bars(pipe, f"plain {size[0]}x{size[1]}", show)
        ref, t = timed()
        plain_s.append(t)
        torchfix.deepcache.apply(pipe, config)
        _bars(pipe, f"DeepCache {size[0]}x{size[1]}", show)
        try:
            out, t = timed()
        finally:
            torchfix.deepcache.remove(pipe)
        cached_s.append(t)
    work = plain_flops / cached_flops
    wall = _median(plain_s) / _median(cached_s)
    flag = speed_verdict(wall, work, bound)
    spread = f"{min(cached_s):.1f}-{max(cached_s):.1f}"
    return Outcome(
        f"DeepCache speedup, {'SDXL' if kind == 'sdxl' else 'SD1.5'}-like at {size[0]}x{size[1]}, {steps} steps",
        f"{_median(plain_s):.1f} s (median of {runs}, {min(plain_s):.1f}-{max(plain_s):.1f}), {plain_flops / 1e9:.1f} GFLOP",
        f"{_median(cached_s):.1f} s (median of {runs}, {spread}), {cached_flops / 1e9:.1f} GFLOP: "
        f"work {work:.2f}x less, wall {wall:.2f}x faster (interval 3 over {steps} steps allows at most {bound:.2f}x), "
        f"rel-L2 vs plain {_rel_l2(out, ref):.3f}" + (f"\n                    ! {flag}" if flag else ""),
        work > 1.0,
    )


# --- the command ----------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Keep diffusers'/transformers' own chatter (warnings, info logs) out of the demo's output."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    levels = diffusers_logging.get_verbosity(), transformers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    transformers_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        diffusers_logging.set_verbosity(levels[0])
        transformers_logging.set_verbosity(levels[1])


def _table(outcomes: list[Outcome]) -> str:
    lines = []
    for o in outcomes:
        status = "shown" if o.incident.startswith("DeepCache") else o.status
        lines.append(f"{status:15s}  {o.incident}  ({o.seconds:.0f} s)\n{'':17s}plain:    {o.plain}\n{'':17s}torchfix: {o.torchfix}")
    return "\n".join(lines)


def main(quick: bool = False, show: bool | None = None, full: bool = False) -> int:
    """Run every incident plain and with torchfix; print a table; 0 unless an incident is ``NOT FIXED``.
    ``full`` adds the SD1.5-like speedup line (two more minutes on 2 cores)."""
    show = sys.stderr.isatty() if show is None else show
    torchfix.disable()  # plain torch first, whatever TORCHFIX_MODE says
    torch.manual_seed(0)
    steps: list[tuple[str, Callable[..., Outcome]]] = [
        ("strides", lambda: strides(quick)),
        ("resolution", lambda: resolution(quick, show)),
        ("switching", lambda: switching(quick, show)),
        ("mixed precision", lambda: mixed_precision(quick, show)),
        ("devices", lambda: devices(quick, show)),
        ("DeepCache speedup, SDXL-like", lambda: speedup(quick, show, "sdxl")),
    ]
    if full:  # the SD1.5-like UNet spends its time at the top resolution (attention at 90x120 latents)
        steps.append(("DeepCache speedup, SD1.5-like", lambda: speedup(quick, show, "sd15")))
    outcomes = []
    total = time.perf_counter()
    print(f"torchfix demo: 5 incidents, plain torch vs torchfix, then DeepCache{' (quick sizes)' if quick else ''}\n", flush=True)
    for i, (name, fn) in enumerate(steps, 1):
        print(f"[{i}/{len(steps)}] {name} ...", flush=True)
        start = time.perf_counter()
        with _quiet():
            try:
                outcome = fn()
            except Exception as exc:  # a crash in one incident is reported and counts as not fixed
                outcome = Outcome(name, "-", f"demo step crashed: {_first_line(exc)}", False)
        outcome.seconds = time.perf_counter() - start
        outcomes.append(outcome)
        verdict = "" if outcome.incident.startswith("DeepCache") else f"\n      => {outcome.status}"
        print(f"      plain:    {outcome.plain}\n      torchfix: {outcome.torchfix}{verdict}", flush=True)
    incidents = [o for o in outcomes if not o.incident.startswith("DeepCache")]
    print(f"\n{'=' * 100}\n{_table(outcomes)}\n{'=' * 100}")
    load = f", load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores" if hasattr(os, "getloadavg") else ""
    print(f"{headline(incidents)}; {time.perf_counter() - total:.0f} s{load}. torch {torch.__version__}.")
    print(
        "FIXED: failed plainly here, runs with torchfix. REFUSED CLEARLY: failed plainly here (an error deep inside, or "
        "garbage), torchfix stops it first with an error that names the cause. NO FAULT HERE: the plain run did not fail "
        "on this machine (shown for what torchfix does instead)."
    )
    return 0 if all(o.status != "NOT FIXED" for o in incidents) else 1
