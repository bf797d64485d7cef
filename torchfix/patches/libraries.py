"""The fixes for :mod:`torchfix.guards.library_issues`: one :class:`~torchfix.patches.core.Patch` per row in force,
installed with the other patches (``import torchfix``) where the library is loaded already, or the moment it is
imported later (a finder on ``sys.meta_path``, wrapt's post-import hook idea: a script imports torchfix first, then
diffusers). Removed with the others: every patched attribute ``is`` the original again, and the finder is gone.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
from typing import Any

import torch

from .. import _context, _frames
from ..guards import library_issues as li
from ..runtime import finite
from .core import Patch

__all__ = ["install", "installed", "remove"]

_MODULE = "diffusers.models.modeling_utils"


def _resolve_on_cpu(original: Any) -> Any:
    """diffusers' ``_resolve_parallel_config`` with the CPU as every rank's device where torch sees no accelerator
    (its own takes ``rank % torch.accelerator.device_count()``: 0). The rest as diffusers does it."""

    def _resolve_parallel_config(self: Any, config: Any) -> Any:
        if not li.cpu_build():
            return original(self, config)
        from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig, TensorParallelConfig

        if not torch.distributed.is_available() or not torch.distributed.is_initialized():
            return original(self, config)  # diffusers' own error
        if isinstance(config, ContextParallelConfig):
            config = ParallelConfig(context_parallel_config=config)
        elif isinstance(config, TensorParallelConfig):
            config = ParallelConfig(tensor_parallel_config=config)
        rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        mesh = None
        if config.context_parallel_config is not None:
            cp = config.context_parallel_config
            shape, names = cp.mesh_shape, cp.mesh_dim_names
            mesh = cp.mesh or torch.distributed.device_mesh.init_device_mesh("cpu", mesh_shape=shape, mesh_dim_names=names)
        elif config.tensor_parallel_config is not None:
            tp = config.tensor_parallel_config
            mesh = tp.mesh or torch.distributed.device_mesh.init_device_mesh("cpu", mesh_shape=(tp.tp_degree,), mesh_dim_names=("tp",))
        config.setup(rank, world_size, torch.device("cpu"), mesh=mesh)
        self._parallel_config = config
        return config

    return _resolve_parallel_config


def _rescue_decode(original: Any) -> Any:
    """An autoencoder's ``decode`` whose non-finite fp16/bf16 result from finite latents is re-run in float32
    (:mod:`torchfix.runtime.finite`); where torchfix is off or its dtype guard is, exactly the original."""

    @functools.wraps(original)
    def decode(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        settings = _context.current()
        if not settings.active or not settings.dtype_on or torch.compiler.is_compiling():
            return out
        sample = out[0] if isinstance(out, tuple) and out else getattr(out, "sample", out)
        if not finite.needs_rescue(sample, (*args, *kwargs.values())):
            return out

        def rerun() -> tuple[torch.Tensor, int]:
            with finite.upcast(self) as state:
                again = original(self, *map(finite.up, args), **{k: finite.up(v) for k, v in kwargs.items()})
            result = again[0] if isinstance(again, tuple) else again.sample
            return result, sum(t.numel() * 4 for t in state.values() if t.dtype == torch.float32)

        path = f"{_frames.owner([self])[1]}.decode"  # "vae" when a pipeline holds it, else its class
        result = finite.rescued(path, sample.dtype, settings.mode, "torchfix", rerun)
        if isinstance(out, tuple):
            return (result, *out[1:])
        out.sample = result
        return out

    return decode


# patch label -> Patch, for the rows in force
_PATCHES: dict[str, Patch] = {}
_AUTOENCODERS = "diffusers.models.autoencoders."


def _version() -> str | None:
    return getattr(sys.modules.get("diffusers"), "__version__", None)


def _patch(owner: Any, name: str, label: str, make: Any) -> None:
    if label in _PATCHES or not callable(getattr(owner, name, None)):
        return
    patch = Patch(owner, name, label, make)
    patch.install()
    _PATCHES[label] = patch


def _patch_module(name: str) -> None:
    """Patch what the rows in force need in the loaded module ``name``."""
    module = sys.modules.get(name)
    if module is None:
        return
    if name == _MODULE and li.explain(li.ROWS[0], _version())[0]:
        owner = getattr(module, "ModelMixin", None)
        _patch(owner, "_resolve_parallel_config", "diffusers ModelMixin._resolve_parallel_config", _resolve_on_cpu)
    if name.startswith(_AUTOENCODERS) and li.explain(li.ROWS[1], _version())[0]:
        for cls in list(vars(module).values()):
            if isinstance(cls, type) and cls.__module__ == name and callable(vars(cls).get("decode")):
                _patch(cls, "decode", f"diffusers {cls.__name__}.decode", _rescue_decode)


def _watched(name: str) -> bool:
    return name == _MODULE or name.startswith(_AUTOENCODERS)


def _patch_loaded() -> None:
    for name in [n for n in list(sys.modules) if _watched(n)]:
        _patch_module(name)


class _Finder(importlib.abc.MetaPathFinder):
    """Patches diffusers' modules right after each is first imported (torchfix enabled before diffusers)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if not _watched(name) or name in sys.modules:
            return None
        sys.meta_path.remove(self)  # find the real spec without us, then wrap its loader
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                if _FINDER in sys.meta_path:
                    _patch_module(name)

        spec.loader = _Loader()
        return spec


_FINDER = _Finder()


def install() -> None:
    """Patch each library row in force whose library is loaded; watch for the import of those that are not yet."""
    _patch_loaded()
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def remove() -> None:
    """Every patched attribute back to its original; the import watch gone."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for patch in _PATCHES.values():
        patch.remove()
    _PATCHES.clear()


def installed() -> list[str]:
    """Labels of the library patches in place."""
    return [p.label for p in _PATCHES.values() if p.installed]
