"""The process-wide record of what torchfix fixed.

>>> import torchfix
>>> rep = torchfix.report()
>>> rep.clear()
>>> len(rep.events)
0
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

from ._text import align
from .config import env_max_events

__all__ = ["FixEvent", "Report", "report"]


@dataclass(frozen=True)
class FixEvent:
    """One fix torchfix applied.

    Attributes:
        op: the guarded callable, e.g. ``F.linear``.
        guard: ``dtype``, ``device`` or ``stride``.
        action: ``cast``, ``upcast``, ``promote``, ``move``, ``contiguous``, ``cpu`` or ``kernel``.
        site: ``file:line`` of the caller (the first frame outside torch and torchfix).
        module: dotted path of the innermost ``nn.Module`` being run, or ``None``.
        detail: what changed, in words.
        internal: a ``noted`` promotion inside diffusers', transformers', peft's or accelerate's own code
            (the library's to handle, not the user's): never warned, not counted by ``summary()`` unless
            ``verbose``.
    """

    op: str
    guard: str
    action: str
    site: str
    module: str | None
    detail: str
    internal: bool = False


class Report:
    """Events in the order they happened, plus exact counts per site.

    ``events`` keeps at most ``TORCHFIX_MAX_EVENTS`` (default 10,000) events so
    that a per-call fix in a long loop cannot grow memory without bound;
    ``summary()`` counts every event, kept or not.
    """

    def __init__(self, max_events: int | None = None) -> None:
        self._lock = threading.Lock()
        self._max = env_max_events() if max_events is None else max_events
        self.events: list[FixEvent] = []
        self.dropped = 0
        self._counts: Counter[tuple[str, str, str, str, str | None]] = Counter()
        self._internal: Counter[tuple[str, str, str, str, str | None]] = Counter()

    def add(self, event: FixEvent) -> None:
        """Record one event."""
        with self._lock:
            counts = self._internal if event.internal else self._counts
            counts[(event.site, event.op, event.guard, event.action, event.module)] += 1
            if len(self.events) < self._max:
                self.events.append(event)
            else:
                self.dropped += 1

    def clear(self) -> None:
        """Forget every event and count."""
        with self._lock:
            self.events = []
            self.dropped = 0
            self._counts.clear()
            self._internal.clear()

    def counts(self, internal: bool = False) -> dict[tuple[str, str, str, str, str | None], int]:
        """``{(site, op, guard, action, module): count}`` over every event (``internal``: library-internal
        promotions instead)."""
        with self._lock:
            return dict(self._internal if internal else self._counts)

    def __len__(self) -> int:
        with self._lock:
            return sum(self._counts.values())

    @property
    def fixes(self) -> int:
        """Calls torchfix changed (every event but ``noted`` ones)."""
        return sum(n for (_, _, _, action, _), n in self.counts().items() if action != "noted")

    @property
    def notes(self) -> int:
        """Calls left as torch computes them but worth knowing (a silent promotion in your code)."""
        return sum(n for (_, _, _, action, _), n in self.counts().items() if action == "noted")

    def summary(self, verbose: bool = False) -> str:
        """A readable table: one row per (site, op, guard, action, module), with counts. Fixes and notes
        are counted apart; promotions inside diffusers/transformers/peft/accelerate code (which they undo
        themselves) are listed only with ``verbose``.

        >>> Report().summary()
        'torchfix: nothing was fixed.'
        """
        internal = self.counts(internal=True)
        rows = sorted({**self.counts(), **(internal if verbose else {})}.items(), key=lambda kv: (-kv[1], kv[0][0]))
        fixes = self.fixes
        notes = self.notes + (sum(internal.values()) if verbose else 0)
        hidden = "" if verbose or not internal else (
            f" ({sum(internal.values())} library-internal promotion(s) not shown: report().summary(verbose=True))"
        )
        if not rows:
            return "torchfix: nothing was fixed." + hidden
        sites = len({k[0] for k in self.counts() if k[3] != "noted"})
        first = f"torchfix: {fixes} fix(es) at {sites} site(s)" if fixes else "torchfix: nothing was fixed"
        lines = [first + (f"; {notes} note(s)" if notes else "") + hidden]
        header = ("count", "op", "guard", "action", "module", "site")
        table = [header] + [(str(n), op, guard, action, module or "-", site) for (site, op, guard, action, module), n in rows]
        lines += align(table, rule=True)
        if self.dropped:
            lines.append(f"({self.dropped} event(s) counted but not kept in .events; raise TORCHFIX_MAX_EVENTS to keep more)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<torchfix.Report {len(self)} event(s)>"


_REPORT = Report()


def report() -> Report:
    """The process-wide :class:`Report`.

    >>> import torchfix
    >>> isinstance(torchfix.report(), torchfix.Report)
    True
    """
    return _REPORT
