"""Exceptions and warnings raised by torchfix.

All errors subclass :class:`RuntimeError`, because that is what torch itself
raises for the same faults, so existing ``except RuntimeError`` blocks keep
working.

>>> import torchfix
>>> issubclass(torchfix.DtypeMismatchError, RuntimeError)
True
"""

from __future__ import annotations

__all__ = [
    "DeviceMismatchError",
    "DtypeMismatchError",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "InvalidCallError",
    "LayoutError",
    "ModelMismatchError",
    "NonFiniteError",
    "TorchfixError",
    "TorchfixWarning",
    "UnknownNameError",
    "UnsupportedModelError",
    "UnsupportedUNetError",
]


class TorchfixError(RuntimeError):
    """Base class of every error torchfix raises."""


class DtypeMismatchError(TorchfixError):
    """Tensors of different floating dtypes met in one op (and torchfix may not fix it)."""


class DeviceMismatchError(TorchfixError):
    """Tensors on different devices (or on ``meta``) met in one op."""


class LayoutError(TorchfixError):
    """A tensor layout hits a known backend bug and ``strict`` mode forbids the workaround."""


class ModelMismatchError(TorchfixError):
    """A pipeline was given state (embeddings, components) made for another model."""


class NonFiniteError(TorchfixError):
    """A reduced-precision component (a VAE decode in fp16) turned finite input into NaN/inf (``strict`` mode)."""


class InvalidArgumentError(TorchfixError, ValueError):
    """An argument torchfix cannot use (a setting, a config value, a size): the message names it, its value and
    what it must be. Also a ``ValueError``, which these refusals were before, so ``except ValueError`` still works.

    >>> import torchfix
    >>> try:
    ...     torchfix.DeepCacheConfig(interval=0)
    ... except torchfix.TorchfixError as exc:
    ...     isinstance(exc, ValueError)
    True
    """


class InvalidArgumentTypeError(TorchfixError, TypeError):
    """An argument of a type torchfix cannot use (a string where a config is expected). Also a ``TypeError``."""


class UnknownNameError(TorchfixError, KeyError):
    """A name torchfix does not know (a family, a guarded op). Also a ``KeyError``."""


class InvalidCallError(InvalidArgumentError):
    """A pipeline call's arguments that cannot make a picture (a height of 0, no inference steps), refused before
    step 0, naming the argument and what it must be. Also a ``ValueError``, as diffusers' own argument errors are."""


class UnsupportedModelError(TorchfixError, ValueError):
    """A model torchfix cannot drive as asked (a cache on a model family it does not know, or whose blocks do not
    behave as its registry entry says); the message names the model, what was found and what is supported. Also a
    ``ValueError``, as its earlier name was."""


UnsupportedUNetError = UnsupportedModelError  # the name before every model family had an entry


class TorchfixWarning(UserWarning):
    """Emitted in ``warn`` mode, once per call site, for every fix torchfix applies."""
