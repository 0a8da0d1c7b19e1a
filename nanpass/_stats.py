"""Guard statistics: how many elements each guard changed, so a guard that is silently
rewriting a model's numbers is seen. Counts stay on the device; reading them is the only sync."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ._errors import NanpassError


class GuardWarning(UserWarning):
    """mode="guard+check": guards changed values in this call (which, and how many)."""


def warn_fired(counters, before: list[int]) -> None:
    """After a call: one sync for all guards that ran, one warning naming those that fired."""
    ran = [c for c, n in zip(counters, before, strict=True) if c.calls > n and c.last is not None]
    if not ran:
        return
    counts = torch.stack([c.last.to(ran[0].last.device) for c in ran]).tolist()
    fired = [(c.change, int(n)) for c, n in zip(ran, counts, strict=True) if n]
    if fired:
        listed = "; ".join(f"{ch.spelling} in {ch.module or '<root>'}"
                           f"{' at ' + ch.source if ch.source else ''}: {n} elements" for ch, n in fired)
        warnings.warn(f"nanpass: {len(fired)} guard{'s' if len(fired) > 1 else ''} fired: {listed}",
                      GuardWarning, stacklevel=3)


class Counter:
    """Per guarded node: elements changed in the last call and in all calls."""

    def __init__(self, change):
        self.change = change  # set by the rewrite once the node is rewritten
        self.calls = 0
        self.last = None
        self.total = None
        self._fresh = True

    def begin(self) -> None:
        self.calls += 1
        self._fresh = True

    def add(self, changed: torch.Tensor) -> None:
        n = changed.detach().sum()
        self.last = n if self._fresh or self.last is None else self.last + n
        self._fresh = False
        self.total = n.clone() if self.total is None else self.total.add_(n.to(self.total.device))


@dataclass(frozen=True)
class StatRow:
    op: str
    spelling: str
    module: str
    source: str | None
    calls: int
    last: int
    total: int


class Stats:
    """Rows per guard; ``str()`` gives a table, most changed first."""

    def __init__(self, rows: list[StatRow]):
        self.rows = rows

    def __str__(self) -> str:
        head = ("op", "spelling", "module", "calls", "last call", "total", "source")
        body = [(r.op, r.spelling, r.module or "<root>", str(r.calls), str(r.last), str(r.total),
                 r.source or "") for r in sorted(self.rows, key=lambda r: -r.total)]
        widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
        return "\n".join("  ".join(f"{v:{w}}" for v, w in zip(x, widths, strict=True)).rstrip()
                         for x in [head, *body]) + "\n"


def stats(model) -> Stats:
    """The guard statistics of ``nanpass.harden(model, count=True)``."""
    config = getattr(model, "nanpass_config", None)  # a Hardened (this module sits below it)
    if config is None or not config.count:
        raise NanpassError("nanpass: stats() needs a model hardened with count=True, e.g. "
                           "nanpass.harden(model, count=True)")
    rows = []
    for g in model.graphs:
        for c in g.counters:
            ch = c.change
            rows.append(StatRow(ch.op, ch.spelling, ch.module, ch.source, c.calls,
                                int(c.last) if c.last is not None else 0,
                                int(c.total) if c.total is not None else 0))
    return Stats(rows)
