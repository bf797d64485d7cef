"""The fixes for :mod:`torchfix.guards.library_issues`: one :class:`~torchfix.patches.core.Patch` per row in force,
installed with the other patches (``import torchfix``) where the library is loaded already, or the moment it is
imported later (a finder on ``sys.meta_path``, wrapt's post-import hook idea: a script imports torchfix first, then
diffusers). Removed with the others: every patched attribute ``is`` the original again, and the finder is gone.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

import torch

from ..guards import library_issues as li
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


_PATCHES: dict[str, Patch] = {}


def _patch_loaded() -> None:
    module = sys.modules.get(_MODULE)
    if module is None or "diffusers" in _PATCHES:
        return
    version = getattr(sys.modules.get("diffusers"), "__version__", None)
    if not li.explain(li.ROWS[0], version)[0]:
        return
    owner = getattr(module, "ModelMixin", None)
    if owner is None or not callable(getattr(owner, "_resolve_parallel_config", None)):
        return
    patch = Patch(owner, "_resolve_parallel_config", "diffusers ModelMixin._resolve_parallel_config", _resolve_on_cpu)
    patch.install()
    _PATCHES["diffusers"] = patch


class _Finder(importlib.abc.MetaPathFinder):
    """Patches diffusers' modeling_utils right after it is first imported (torchfix enabled before diffusers)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _MODULE:
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
                    sys.meta_path.remove(_FINDER)
                    _patch_loaded()

        spec.loader = _Loader()
        return spec


_FINDER = _Finder()


def install() -> None:
    """Patch each library row in force whose library is loaded; watch for the import of those that are not yet."""
    _patch_loaded()
    if "diffusers" not in _PATCHES and _MODULE not in sys.modules and _FINDER not in sys.meta_path:
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
