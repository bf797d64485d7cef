"""The cache across processes: which ranks share one denoiser call, and the sums every decision is taken from.

Under data parallelism (torchrun, accelerate's ``split_between_processes``) each rank runs its own prompts:
its decisions are its own, and the cache never communicates. Under diffusers' context parallelism
(``transformer.enable_parallelism(config=ContextParallelConfig(...))``) the ranks of the model's context-parallel
mesh each hold a shard of the tokens of *one* call, and every statistic a decision reads (how far the features
moved, the sensitivity fit) must be the single-process one, or the ranks decide differently and one enters the
blocks' all-to-all while the other skips to the output's all-gather: a hang. Under diffusers' tensor parallelism
the activations are whole on every rank, and the same reduction keeps the ranks agreeing to the last bit.

Every statistic here is a ratio of sums over the tokens (``Σ|now − ref| / Σ|ref|``, a slope ``Σ e·r / Σ e·e``), so
each rank sums its own shard and :func:`total` adds the ranks' sums: the single-process ratio, whether a tensor is
sharded or whole on every rank (whole: both sums scale by the group size; the ratio is the same). :func:`total`
gathers every rank's sums and adds them in rank order on every rank, so all ranks hold the very same numbers
whatever order the backend reduces in (pytorch/pytorch#129501: an all-reduce whose ranks summed in different
orders made data-dependent decisions diverge and hang).

The group comes from the model (diffusers' ``_parallel_config``: the context-parallel mesh, or the tensor-parallel
one), never from the world: two data-parallel ranks never wait for each other. A model whose call communicates
(collectives seen while its first call is observed, :class:`Watch`) with no group torchfix can see (xDiT,
ParaAttention, a hand-rolled split) is refused where a decision reads the features (``threshold``).

>>> import torch
>>> total(ALONE, torch.tensor([[1.0, 2.0]])).tolist()
[[1.0, 2.0]]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["ALONE", "Group", "Watch", "distributed", "of", "ranks", "summer", "total"]


@dataclass(frozen=True)
class Group:
    """The ranks that share one call of a denoiser.

    Args:
        group: the process group (``None``: this process alone).
        size: how many ranks.
        kind: ``"alone"``, ``"context parallel"`` or ``"tensor parallel"``.
        describe: in words, for errors and ``stats``.
    """

    group: Any
    size: int
    kind: str
    describe: str

    @property
    def shared(self) -> bool:
        """Whether other ranks take part in each call (the decisions must be reduced)."""
        return self.group is not None and self.size > 1


ALONE = Group(None, 1, "alone", "one process (or data parallel: each rank its own calls)")


def _initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def distributed() -> bool:
    """Whether this process is one of several (torch.distributed initialised, world size > 1).

    >>> distributed()
    False
    """
    return _initialized() and torch.distributed.get_world_size() > 1


def of(model: Any) -> Group:
    """The ranks that share ``model``'s calls: diffusers' context-parallel mesh (ring × Ulysses, flattened) or its
    tensor-parallel mesh, from the model's ``_parallel_config``; :data:`ALONE` otherwise (one process, or data
    parallel).

    >>> import torch
    >>> of(torch.nn.Linear(2, 2)) is ALONE
    True
    """
    config = getattr(model, "_parallel_config", None)
    if config is None or not _initialized():
        return ALONE
    cp = getattr(config, "context_parallel_config", None)
    if cp is not None and getattr(cp, "_flattened_mesh", None) is not None:
        mesh = cp._flattened_mesh
        if mesh.size() > 1:
            return Group(
                mesh.get_group(), mesh.size(), "context parallel", f"context parallel (ring {cp.ring_degree} × Ulysses {cp.ulysses_degree})"
            )
    tp = getattr(config, "tensor_parallel_config", None)
    if tp is not None and getattr(tp, "_mesh", None) is not None and tp._mesh.size() > 1:
        return Group(tp._mesh.get_group(), tp._mesh.size(), "tensor parallel", f"tensor parallel ({tp._mesh.size()} ranks)")
    return ALONE


def total(group: Group, parts: torch.Tensor) -> torch.Tensor:
    """``parts`` (each rank's partial sums) added over ``group``'s ranks, in rank order, as float64: the same
    numbers on every rank. Alone: ``parts`` as it is.

    One all-gather per call; on a gloo group the sums travel on the CPU.
    """
    if not group.shared:
        return parts
    import torch.distributed as dist

    wide = parts.detach().to(torch.float64)
    if dist.get_backend(group.group) == "gloo":
        wide = wide.cpu()
    gathered = [torch.empty_like(wide) for _ in range(group.size)]
    dist.all_gather(gathered, wide.contiguous(), group=group.group)
    out = gathered[0].clone()
    for more in gathered[1:]:
        out += more
    return out.to(parts.device)


def summer(group: Group) -> Any:
    """:func:`total` over ``group``, as the one-argument function the statistics take (``None`` alone)."""
    return None if not group.shared else (lambda parts: total(group, parts))


_COLLECTIVES = ("c10d", "_c10d_functional")
_BOOKKEEPING = ("wait_tensor", "_wrap_tensor_autograd")  # functional collectives' plumbing, not a collective


class Watch(TorchDispatchMode):
    """While active: notes the collectives (``c10d`` and functional collectives) that ops dispatch. Used once per
    call path, while the first call is observed: a model whose call communicates shares it with other ranks.

    >>> import torch
    >>> with Watch() as w:
    ...     _ = torch.ones(2) + 1
    >>> w.collectives
    []
    """

    def __init__(self) -> None:
        super().__init__()
        self.collectives: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.namespace in _COLLECTIVES and len(self.collectives) < 8 and not str(func).split(".")[1].startswith(_BOOKKEEPING):
            self.collectives.append(str(func))
        return func(*args, **(kwargs or {}))


def ranks(state: Any) -> Group:
    """The ranks that share the calls of the denoiser a cache state belongs to (context or tensor parallel), whose
    sums every decision adds; :data:`ALONE` for one process or data parallelism."""
    model = state.model() if state.model is not None else None
    return ALONE if model is None else of(model)
