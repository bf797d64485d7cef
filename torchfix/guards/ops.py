"""What each guarded callable looks like: its name, kind and tensor arguments.

Pure data. ``torchfix.patches`` decides *where* each spec is installed; the
guards read ``kind`` (which dtype rule applies) and ``family`` (which
known-issue rows can match).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UnknownNameError

__all__ = ["SPECS", "OpSpec", "spec"]


@dataclass(frozen=True)
class OpSpec:
    """One guarded callable.

    Args:
        name: display name, e.g. ``F.linear`` or ``Tensor.__matmul__``.
        kind: dtype rule: ``matmul`` (family policy), ``linear``/``conv``/``norm``
            (the activations win over parameters), ``attention`` (the query wins), ``cat``;
            ``index`` (an integer index and the data it reads: the device guard only).
        family: the op as known-issue rows name it (``matmul``, ``mm``, ``bmm``,
            ``linear``, ``conv``, ``layer_norm``, ``group_norm``, ``sdpa``, ``cat``,
            ``embedding``, ``index_select``, ``gather``).
        params: positional parameter names, in order.
        tensors: which of ``params`` hold tensors (for ``cat``: the sequence).

    >>> spec("F.linear").tensors
    ('input', 'weight', 'bias')
    """

    name: str
    kind: str
    family: str
    params: tuple[str, ...]
    tensors: tuple[str, ...]

    @property
    def tensor_positions(self) -> tuple[int, ...]:
        return tuple(self.params.index(t) for t in self.tensors)

    @property
    def sequence(self) -> bool:
        return self.kind == "cat"


def _mm(name: str, family: str, params: tuple[str, ...]) -> OpSpec:
    return OpSpec(name, "matmul", family, params, params)


SPECS: dict[str, OpSpec] = {
    s.name: s
    for s in (
        _mm("torch.matmul", "matmul", ("input", "other")),
        _mm("torch.mm", "mm", ("input", "mat2")),
        _mm("torch.bmm", "bmm", ("input", "mat2")),
        _mm("torch.addmm", "mm", ("input", "mat1", "mat2")),
        _mm("torch.baddbmm", "bmm", ("input", "batch1", "batch2")),
        _mm("Tensor.matmul", "matmul", ("self", "other")),
        _mm("Tensor.__matmul__", "matmul", ("self", "other")),
        _mm("Tensor.__rmatmul__", "matmul", ("self", "other")),
        _mm("Tensor.mm", "mm", ("self", "mat2")),
        _mm("Tensor.bmm", "bmm", ("self", "mat2")),
        _mm("Tensor.addmm", "mm", ("self", "mat1", "mat2")),
        _mm("Tensor.baddbmm", "bmm", ("self", "batch1", "batch2")),
        OpSpec("F.linear", "linear", "linear", ("input", "weight", "bias"), ("input", "weight", "bias")),
        OpSpec("F.conv1d", "conv", "conv", ("input", "weight", "bias"), ("input", "weight", "bias")),
        OpSpec("F.conv2d", "conv", "conv", ("input", "weight", "bias"), ("input", "weight", "bias")),
        OpSpec("F.conv3d", "conv", "conv", ("input", "weight", "bias"), ("input", "weight", "bias")),
        OpSpec(
            "F.scaled_dot_product_attention",
            "attention",
            "sdpa",
            ("query", "key", "value", "attn_mask"),
            ("query", "key", "value", "attn_mask"),
        ),
        OpSpec("F.layer_norm", "norm", "layer_norm", ("input", "normalized_shape", "weight", "bias"), ("input", "weight", "bias")),
        OpSpec("F.group_norm", "norm", "group_norm", ("input", "num_groups", "weight", "bias"), ("input", "weight", "bias")),
        # the same builtins under torch's other spellings (torch.conv2d is F.conv2d's builtin; F.layer_norm
        # and F.group_norm call torch.layer_norm / torch.group_norm; torch.linalg.matmul is matmul's twin)
        _mm("torch.linalg.matmul", "matmul", ("input", "other")),
        OpSpec("torch.conv1d", "conv", "conv", ("input", "weight", "bias"), ("input", "weight", "bias")),
        OpSpec("torch.conv2d", "conv", "conv", ("input", "weight", "bias"), ("input", "weight", "bias")),
        OpSpec("torch.conv3d", "conv", "conv", ("input", "weight", "bias"), ("input", "weight", "bias")),
        OpSpec("torch.layer_norm", "norm", "layer_norm", ("input", "normalized_shape", "weight", "bias"), ("input", "weight", "bias")),
        OpSpec("torch.group_norm", "norm", "group_norm", ("input", "num_groups", "weight", "bias"), ("input", "weight", "bias")),
        # an index and the data it reads (the device reports behind most text-encoder crashes: input ids on the CPU
        # into a CUDA encoder's token embedding); the index is an integer tensor, so only the device guard applies
        OpSpec("F.embedding", "index", "embedding", ("input", "weight"), ("input", "weight")),
        OpSpec("torch.index_select", "index", "index_select", ("input", "dim", "index"), ("input", "index")),
        OpSpec("Tensor.index_select", "index", "index_select", ("self", "dim", "index"), ("self", "index")),
        OpSpec("torch.gather", "index", "gather", ("input", "dim", "index"), ("input", "index")),
        OpSpec("Tensor.gather", "index", "gather", ("self", "dim", "index"), ("self", "index")),
        OpSpec("torch.cat", "cat", "cat", ("tensors",), ("tensors",)),
        OpSpec("torch.concat", "cat", "cat", ("tensors",), ("tensors",)),
        OpSpec("torch.concatenate", "cat", "cat", ("tensors",), ("tensors",)),
    )
}

PARAM_ROLES = frozenset({"weight", "bias"})


def spec(name: str) -> OpSpec:
    """The spec of a guarded callable by display name."""
    try:
        return SPECS[name]
    except KeyError:
        raise UnknownNameError(f"torchfix: {name!r} is not a guarded op; guarded: {', '.join(SPECS)}") from None
