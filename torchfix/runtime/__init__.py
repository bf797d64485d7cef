"""The runtime: executes the guards' plans on real calls.

- :mod:`.call`: one guarded call end to end (:func:`guarded_call`);
- :mod:`.binding`: the call's arguments by name;
- :mod:`.apply`: one action (cast / move / copy) on an operand;
- :mod:`.kernel`: routing to ``torch.ops.torchfix.matmul`` and its fallback;
- :mod:`.record`: events, log lines and warn-mode warnings.

The guards (:mod:`torchfix.guards`) decide and never act; the patches
(:mod:`torchfix.patches`) install the wrappers that call in here.
"""

from .._warn import reset as reset_warnings
from .call import guarded_call

__all__ = ["guarded_call", "reset_warnings"]
