"""The process-wide record of what torchfix fixed.

>>> import torchfix
>>> rep = torchfix.report()
>>> rep.clear()
>>> len(rep.events)
0
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
        change: what changed, in short: ``float32→float16``, ``cpu→cuda:0``, ``strided→contiguous``.
        nbytes: bytes of the tensors the fix made (casts, moves, copies; for a ``noted`` promotion, the
            bytes its result costs over the narrowest input).

    >>> FixEvent("F.linear", "dtype", "cast", "x.py:3", "unet.conv_in", "...", change="float32→float16").component
    'unet'
    """

    op: str
    guard: str
    action: str
    site: str
    module: str | None
    detail: str
    internal: bool = False
    change: str = ""
    nbytes: int = 0

    @property
    def component(self) -> str:
        """The first part of ``module`` (the pipeline component or outermost module), ``-`` for a bare call."""
        return self.module.split(".", 1)[0] if self.module else "-"


_Cause = tuple[str, str, str, str, str]  # component, op, guard, action, change


class Report:
    """Events in the order they happened, plus exact counts per site and per cause.

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
        self._causes: dict[tuple[bool, _Cause], list] = {}  # (internal, cause) -> [count, bytes, {sites}, first site]

    def add(self, event: FixEvent) -> None:
        """Record one event."""
        with self._lock:
            counts = self._internal if event.internal else self._counts
            counts[(event.site, event.op, event.guard, event.action, event.module)] += 1
            key = (event.internal, (event.component, event.op, event.guard, event.action, event.change))
            row = self._causes.get(key)
            if row is None:
                row = self._causes[key] = [0, 0, set(), event.site]
            row[0] += 1
            row[1] += event.nbytes
            row[2].add(event.site)
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
            self._causes.clear()

    def counts(self, internal: bool = False) -> dict[tuple[str, str, str, str, str | None], int]:
        """``{(site, op, guard, action, module): count}`` over every event (``internal``: library-internal
        promotions instead)."""
        with self._lock:
            return dict(self._internal if internal else self._counts)

    def causes(self, internal: bool = False) -> dict[_Cause, tuple[int, int, int, str]]:
        """``{(component, op, guard, action, change): (count, bytes, sites, first site)}`` over every
        event: what :meth:`summary` prints, one row per component and cause.

        >>> r = Report()
        >>> r.add(FixEvent("F.linear", "dtype", "cast", "a.py:1", "unet.x", "", change="float32→float16", nbytes=64))
        >>> r.causes()
        {('unet', 'F.linear', 'dtype', 'cast', 'float32→float16'): (1, 64, 1, 'a.py:1')}
        """
        with self._lock:
            return {
                cause: (n, b, len(sites), first) for (inner, cause), (n, b, sites, first) in self._causes.items() if inner == internal
            }

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
        """A readable table, one row per component and cause (op, guard, action, from→to) with counts,
        bytes and the first call site (and how many more); fixes and notes are counted apart. ``verbose``: one row per
        call site and module instead, with the promotions inside diffusers/transformers/peft/accelerate
        code (which they undo themselves); every event's full text is in :attr:`events`.

        >>> Report().summary()
        'torchfix: nothing was fixed.'
        """
        internal = self.counts(internal=True)
        n_internal = sum(internal.values())
        fixes = self.fixes
        notes = self.notes + (n_internal if verbose else 0)
        hidden = "" if verbose or not internal else (
            f" ({n_internal} library-internal promotion(s) not shown: report().summary(verbose=True))"
        )
        if not self.counts() and not (verbose and internal):
            return "torchfix: nothing was fixed." + hidden
        sites = len({k[0] for k in self.counts() if k[3] != "noted"})
        first = f"torchfix: {fixes} fix(es) at {sites} site(s)" if fixes else "torchfix: nothing was fixed"
        lines = [first + (f"; {notes} note(s)" if notes else "") + hidden]
        if verbose:
            rows = sorted({**self.counts(), **internal}.items(), key=lambda kv: (-kv[1], kv[0][0]))
            header = ("count", "op", "guard", "action", "module", "site")
            table = [header] + [(str(n), op, guard, action, module or "-", site) for (site, op, guard, action, module), n in rows]
        else:
            causes = sorted(self.causes().items(), key=lambda kv: (kv[0][0], -kv[1][0], kv[0]))
            header = ("component", "count", "bytes", "op", "guard", "action", "change", "first site")
            table = [header] + [
                (component, str(n), _size(b), op, guard, action, change or "-", first + (f" (+{k - 1} more)" if k > 1 else ""))
                for (component, op, guard, action, change), (n, b, k, first) in causes
            ]
        lines += align(table, rule=True)
        if not verbose:
            lines.append("(one row per component and cause; per call site: report().summary(verbose=True), every event: report().events)")
        if self.dropped:
            lines.append(f"({self.dropped} event(s) counted but not kept in .events; raise TORCHFIX_MAX_EVENTS to keep more)")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Everything :meth:`summary` prints, as plain data (JSON-ready): the totals, one row per component and
        cause (``causes``; library-internal promotions apart, ``internal_causes``) and the events kept.

        >>> r = Report()
        >>> r.add(FixEvent("F.linear", "dtype", "cast", "a.py:1", "unet.x", "weight cast", change="float32→float16", nbytes=64))
        >>> d = r.to_dict()
        >>> d["fixes"], d["causes"][0]["change"], d["events"][0]["site"]
        (1, 'float32→float16', 'a.py:1')
        """

        names = ("component", "op", "guard", "action", "change", "count", "bytes", "sites", "first_site")

        def rows(internal: bool) -> list[dict[str, Any]]:
            causes = sorted(self.causes(internal).items(), key=lambda kv: (kv[0][0], -kv[1][0], kv[0]))
            return [dict(zip(names, (*cause, *numbers))) for cause, numbers in causes]

        with self._lock:
            events = list(self.events)
            dropped = self.dropped
        return {
            "fixes": self.fixes,
            "notes": self.notes,
            "internal": sum(self.counts(internal=True).values()),
            "causes": rows(False),
            "internal_causes": rows(True),
            "events": [dataclasses.asdict(e) for e in events],
            "events_dropped": dropped,
        }

    def to_json(self, path: str | Path | None = None, *, indent: int | None = 2) -> str:
        """:meth:`to_dict` as JSON text; written to ``path`` too where one is given (UTF-8).

        >>> Report().to_json(indent=None)[:24]
        '{"fixes": 0, "notes": 0,'
        """
        text = json.dumps(self.to_dict(), indent=indent, ensure_ascii=False)
        if path is not None:
            Path(path).write_text(text + "\n", encoding="utf-8")
        return text

    def __repr__(self) -> str:
        return f"<torchfix.Report {len(self)} event(s)>"


def _size(nbytes: int) -> str:
    """``512 B``, ``1.5 KiB``, ``3.2 MiB``, ``1.1 GiB``.

    >>> _size(1536)
    '1.5 KiB'
    """
    if nbytes < 1024:
        return f"{nbytes} B"
    for unit in ("KiB", "MiB", "GiB"):
        nbytes /= 1024
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.1f} {unit}"
    raise AssertionError  # pragma: no cover


_REPORT = Report()


def report() -> Report:
    """The process-wide :class:`Report`.

    >>> import torchfix
    >>> isinstance(torchfix.report(), torchfix.Report)
    True
    """
    return _REPORT
