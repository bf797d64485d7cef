"""The ``torchfix`` command (also ``python -m torchfix``).

    torchfix demo                       the five incidents, plain vs torchfix, and DeepCache at 720x960
    torchfix run [--mode M] [--report FILE] [--deepcache] SCRIPT [ARGS...]   an unmodified script, guards on
    torchfix run [--mode M] [--report FILE] -m MODULE [ARGS...]
    torchfix doctor                     versions, devices, kernels, known issues in force here
    torchfix audit package.module:factory [--backend mps] [--torch-version V]

>>> from torchfix.cli import build_parser
>>> build_parser().parse_args(["run", "--mode", "warn", "train.py", "--lr", "1"]).script
'train.py'
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import runpy
import sys
import traceback
from collections.abc import Sequence

from torchfix_diffusion import clash

from .errors import InvalidArgumentError

__all__ = ["build_parser", "main"]

_PACKAGES = ("torch", "diffusers", "transformers", "triton", "torch-mlir", "wrapt", "accelerate")
DISTRIBUTION = "torchfix-diffusion"  # the pip name; the import package is `torchfix` (the PyPI name `torchfix` is Meta's linter)


# --- run -----------------------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    """Run a script or module as ``__main__`` with the guards on; print the report at exit."""
    import torchfix

    if args.module is None and args.script is None:
        print("torchfix run: give a SCRIPT or -m MODULE", file=sys.stderr)
        return 2
    if args.module is None and not os.path.exists(args.script):  # checked before anything runs or is reported
        print(f"torchfix run: no such script: {args.script}", file=sys.stderr)
        return 2
    os.environ["TORCHFIX_MODE"] = args.mode  # child processes that import torchfix follow it
    torchfix.disable()
    torchfix.enable(args.mode)
    if getattr(args, "deepcache", False):
        torchfix.deepcache.auto(torchfix.DeepCacheConfig(interval=args.deepcache_interval))
    target = args.script if args.module is None else args.module
    sys.argv = [target, *args.args]
    code = 0
    try:
        if args.module is not None:
            sys.path.insert(0, os.getcwd())  # as `python -m` does: a module in the current directory imports
            runpy.run_module(args.module, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
            runpy.run_path(args.script, run_name="__main__")
    except SystemExit as exc:  # the script's own exit code is kept
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt as exc:  # Ctrl-C: the traceback and exit status Python itself gives (128 + SIGINT)
        _print_script_error(exc)
        code = 130
    except BaseException as exc:  # the script's error is shown as Python would, never swallowed
        _print_script_error(exc)
        code = 1
    finally:
        print(f"\n{torchfix.report().summary(verbose=args.verbose)}", file=sys.stderr)
        if getattr(args, "deepcache", False):
            print(_cache_summary(), file=sys.stderr)
        if getattr(args, "report", None):
            torchfix.report().to_json(args.report)
            print(f"torchfix: report written to {args.report} (JSON)", file=sys.stderr)
    return code


def _cache_summary() -> str:
    """One line per pipeline ``--deepcache`` cached: its steps, full and cached, over the run."""
    import torchfix

    applied = torchfix.deepcache.auto_applied()
    if not applied:
        return "torchfix: --deepcache: no diffusers pipeline ran a denoising loop"
    lines = []
    for name, full, cached in applied:
        lines.append(f"torchfix: DeepCache on {name}: {cached} of {full + cached} denoiser steps cached")
    return "\n".join(lines)


_RUNPY = (runpy.__file__, "<frozen runpy>")


def _print_script_error(exc: BaseException) -> None:
    """The script's error as ``python SCRIPT`` prints it: without this command's and runpy's frames (nor torchfix's,
    unless it is torchfix's own error or traceback filtering is off: ``TORCHFIX_TRACEBACK_FILTERING=off``)."""
    from ._frames import drop_frames, hide

    hide(exc)
    drop_frames(exc, (__file__, *_RUNPY))
    traceback.print_exception(exc)


# --- doctor ----------------------------------------------------------------------------------------


def cmd_doctor(args: argparse.Namespace) -> int:
    """Versions, devices, kernels and known-issue rows in force, as plain text."""
    import torch

    import torchfix
    from torchfix import devices
    from torchfix.config import installed_version
    from torchfix.guards import known_issues as ki

    print(f"torchfix {torchfix.__version__} on Python {platform.python_version()} ({platform.system()} {platform.release()})")
    found = clash()
    if found.found:  # Meta's TorchFix linter installs the same import package and console script
        print(f"\nWARNING: {found.message()}")
    print("\npackages")
    for name in _PACKAGES:
        print(f"  {name:13s} {installed_version(name)}")
    print("\ndevices")
    print(f"  cpu           yes ({os.cpu_count()} cores, torch threads {torch.get_num_threads()})")
    if devices.backend_usable("cuda"):
        names = ", ".join(f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count()))
        print(f"  cuda          yes: {names}")
    else:
        print(f"  cuda          no (torch built {'with' if torch.version.cuda else 'without'} CUDA)")
    print(f"  mps           {'yes' if devices.backend_usable('mps') else 'no'}")
    print("\nkernels (torch.ops.torchfix.matmul)")
    for b in torchfix.kernels.backends():
        state = "usable" if b.usable else "not usable here"
        print(f"  {b.device_type:5s} {b.impl:58s} registered={'yes' if b.registered else 'NO'}  {state}")
        print(f"        {b.note}")
    if os.environ.get("TORCHFIX_DISABLE_KERNELS"):
        print("  routing to the kernels is OFF (TORCHFIX_DISABLE_KERNELS is set)")
    print(f"\nknown issues (torch {ki.TORCH_VERSION}, macOS {ki.OS_VERSION or '-'}; upper ends exclusive)")
    for r in ki.states():
        here = "IN FORCE HERE" if r.in_force else "not in force"
        print(f"  {r.device_type:4s} {r.issue:23s} {','.join(r.ops):16s} {r.torch_range:27s} {r.os_range:20s} {here}")
        print(f"        {r.reason}")
    env_error = _env_error()
    if env_error is not None:
        print(f"\nmode from TORCHFIX_MODE: INVALID: {env_error}")
        return 2
    print(f"\nmode from TORCHFIX_MODE: {os.environ.get('TORCHFIX_MODE', 'fix (default)')}")
    return 0


# --- audit -------------------------------------------------------------------------------------------


def _load_factory(target: str):
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise InvalidArgumentError(f"torchfix audit: TARGET must look like package.module:factory, not {target!r}")
    sys.path.insert(0, os.getcwd())
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise InvalidArgumentError(f"torchfix audit: {module_name} has no attribute {attr!r}") from None


def cmd_audit(args: argparse.Namespace) -> int:
    """Audit ``factory() -> (model, example_inputs)``; exit 1 when hazards are found."""
    import torchfix
    from torchfix.audit import AuditError

    try:
        import torch_mlir  # noqa: F401
    except ImportError:
        print("torchfix audit needs torch-mlir, the `audit` extra: pip install 'torchfix-diffusion[audit]'", file=sys.stderr)
        return 2
    try:
        factory = _load_factory(args.target)
    except (ValueError, ImportError) as exc:
        print(str(exc), file=sys.stderr)
        return 2
    made = factory()
    if not (isinstance(made, tuple) and len(made) == 2):
        print(f"torchfix audit: {args.target}() must return (model, example_inputs), got {type(made).__name__}", file=sys.stderr)
        return 2
    model, inputs = made
    inputs = tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)
    try:
        report = torchfix.audit(model, *inputs, backend=args.backend, torch_version=args.torch_version)
    except AuditError as exc:
        print(f"{exc}\ncaused by: {exc.__cause__!r}", file=sys.stderr)
        return 2
    except (TypeError, ValueError) as exc:
        if not str(exc).startswith("torchfix.audit:"):  # the model's own error: never swallowed
            raise
        print(str(exc), file=sys.stderr)
        return 2
    print(report.summary())
    if args.ir:
        print(report.ir)
    return 1 if report.findings else 0


# --- demo ----------------------------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job: every incident plain vs torchfix, then the DeepCache speedup."""
    try:
        from torchfix import demo
    except ImportError as exc:
        print(f"torchfix demo needs diffusers and transformers: pip install 'torchfix-diffusion[diffusers]' ({exc})", file=sys.stderr)
        return 2
    return demo.main(quick=args.quick, full=args.full)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``torchfix`` command."""
    from . import __version__

    parser = argparse.ArgumentParser(prog="torchfix", description="Make diffusion scripts that break on dtype/device/layout just work.")
    parser.add_argument("--version", action="version", version=f"torchfix {__version__} (distribution {DISTRIBUTION})")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the five incidents, plain torch vs torchfix, and the DeepCache speedup")
    demo.add_argument("--quick", action="store_true", help="smaller sizes for the speedup line (for tests)")
    demo.add_argument("--full", action="store_true", help="also the SD1.5-like speedup line (two more minutes on 2 cores)")
    demo.set_defaults(fn=cmd_demo)
    run = sub.add_parser("run", help="run an unmodified script or module with the guards on")
    run.add_argument("--mode", choices=("fix", "warn", "strict"), default="fix", help="fix (the default), warn or strict")
    run.add_argument("--report", metavar="FILE", help="also write the report as JSON to FILE at exit (torchfix.report().to_json())")
    run.add_argument("--verbose", action="store_true", help="the report per call site, library-internal promotions included")
    run.add_argument(
        "--deepcache",
        action="store_true",
        help="also cache every diffusers pipeline the script runs (DeepCache; torchfix.deepcache.auto); a pipeline that "
        "has a cache keeps its own",
    )
    run.add_argument("--deepcache-interval", type=int, default=3, metavar="N", help="with --deepcache: a full step every N (default 3)")
    run.add_argument("-m", dest="module", help="run a module as a script, like python -m")
    run.add_argument("script", nargs="?", help="the script to run")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    run.set_defaults(fn=cmd_run)
    doctor = sub.add_parser("doctor", help="versions, devices, kernels and known issues in force here")
    doctor.set_defaults(fn=cmd_doctor)
    aud = sub.add_parser("audit", help="static audit of factory() -> (model, example_inputs) through torch-mlir")
    aud.add_argument("target", help="package.module:factory")
    aud.add_argument("--backend", help="device type whose known-issue rows to check, e.g. mps")
    aud.add_argument("--torch-version", help="check rows against this torch version (default: the installed one)")
    aud.add_argument("--ir", action="store_true", help="also print the torch-dialect IR")
    aud.set_defaults(fn=cmd_audit)
    return parser


def _env_error() -> str | None:
    """What is wrong with TORCHFIX_MODE, if anything (importing torchfix under the CLI defers the error here)."""
    from .config import env_mode

    try:
        env_mode()
    except ValueError as exc:
        return str(exc).removeprefix("torchfix: ")
    return None


def _parse_run(parser: argparse.ArgumentParser, rest: list[str]) -> argparse.Namespace:
    """``run [--mode M] [--report FILE] [--verbose] [--deepcache [--deepcache-interval N]] (SCRIPT | -m MODULE)
    ARGS...``: torchfix's options come before the target; everything after the target belongs to it (``run train.py
    -m resnet`` runs train.py with ``-m resnet``)."""
    mode, i, verbose, report, deepcache, interval = "fix", 0, False, None, False, "3"
    while i < len(rest) and rest[i].startswith("-") and rest[i] != "-m":
        option = rest[i]
        if option in ("-h", "--help"):
            parser.parse_args(["run", "--help"])  # prints the help and exits 0
        if option == "--mode" and i + 1 < len(rest):
            mode, i = rest[i + 1], i + 2
        elif option.startswith("--mode="):
            mode, i = option.split("=", 1)[1], i + 1
        elif option == "--report" and i + 1 < len(rest):
            report, i = rest[i + 1], i + 2
        elif option.startswith("--report="):
            report, i = option.split("=", 1)[1], i + 1
        elif option == "--verbose":
            verbose, i = True, i + 1
        elif option == "--deepcache":
            deepcache, i = True, i + 1
        elif option == "--deepcache-interval" and i + 1 < len(rest):
            interval, i = rest[i + 1], i + 2
        elif option.startswith("--deepcache-interval="):
            interval, i = option.split("=", 1)[1], i + 1
        else:
            parser.error(
                f"run: unknown option {option!r} before the script; "
                "torchfix run takes --mode, --report, --verbose, --deepcache and --deepcache-interval, then SCRIPT or -m MODULE"
            )
    if mode not in ("fix", "warn", "strict"):
        parser.error(f"run: --mode {mode!r} is not valid; use fix, warn or strict")
    if not interval.isdigit() or int(interval) < 1:
        parser.error(f"run: --deepcache-interval {interval!r} is not valid; use a whole number of steps, 1 or more")
    module = script = None
    if i < len(rest) and rest[i] == "-m":
        if i + 1 >= len(rest):
            parser.error("run: -m needs a MODULE")
        module, i = rest[i + 1], i + 2
    elif i < len(rest):
        script, i = rest[i], i + 1
    return argparse.Namespace(
        fn=cmd_run,
        command="run",
        mode=mode,
        verbose=verbose,
        report=report,
        deepcache=deepcache,
        deepcache_interval=int(interval),
        module=module,
        script=script,
        args=rest[i:],
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``torchfix`` console script.

    >>> main(["doctor"])  # doctest: +SKIP
    0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    env_error = _env_error()
    if env_error is not None and argv[:1] != ["doctor"]:
        print(f"torchfix: {env_error}", file=sys.stderr)
        return 2
    if argv[:1] == ["run"]:
        args = _parse_run(parser, argv[1:])
    else:
        args = parser.parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except BrokenPipeError:  # `torchfix doctor | head`: the reader left; exit quietly, as Python's docs advise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
