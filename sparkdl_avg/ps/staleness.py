"""The staleness bound's two gates (SSP, Ho et al. 2013), as pure functions of the workers'
clocks (their pushes so far). Bound 0 is bulk synchronous; None is no bound."""

from __future__ import annotations

import collections
from collections.abc import Iterable


def may_read(clocks: dict[int, int], worker: int, bound: int | None) -> bool:
    """A worker at clock c reads once every worker has reached c - bound."""
    return bound is None or min(clocks.values()) >= clocks[worker] - bound


def may_apply(read_clocks: dict[int, int], worker: int, clock: int, bound: int | None) -> bool:
    """A push from a worker at `clock` waits until every *other* worker has read at clock
    - bound, so no read sees updates from beyond its round (bound 0: exactly synchronous)."""
    return bound is None or all(read >= clock - bound for w, read in read_clocks.items()
                                if w != worker)


class Clocks:
    """The SSP members' clocks: per worker its pushes applied (`pushed`) and the clock at its
    last read (`read`). Members are the workers the driver announced, or the connected ones
    when it announced none, less those that finished (FINISHED) or left. Not thread-safe: the
    server calls it with its lock held."""

    def __init__(self) -> None:
        self.reset(())

    def reset(self, members: Iterable[int]) -> None:
        """A new fit (INIT, restore): exactly `members`, none has pushed; no push applies
        before its first read. The old set goes: a worker of an earlier fit that is not
        announced again holds no one back."""
        members = list(members)
        self.pushed = dict.fromkeys(members, 0)
        self.read = dict.fromkeys(members, -1)

    def join(self, worker: int) -> None:
        """A connected worker; one new to the set starts level with the slowest."""
        start = min(self.pushed.values(), default=0)
        self.pushed.setdefault(worker, start)
        self.read.setdefault(worker, start - 1)  # has read nothing yet

    def leave(self, worker: int) -> None:
        """Gone or finished: it will not push again, so it holds no one back."""
        self.pushed.pop(worker, None)
        self.read.pop(worker, None)

    def may_read(self, worker: int, bound: int | None) -> bool:
        return may_read(self.pushed, worker, bound)

    def may_apply(self, worker: int, bound: int | None) -> bool:
        return may_apply(self.read, worker, self.pushed[worker], bound)

    def has_read(self, worker: int) -> None:
        self.read[worker] = self.pushed[worker]

    def has_pushed(self, worker: int) -> None:
        self.pushed[worker] += 1


def pushes_between_fetches(push_every: int, fetch_every: int | None,
                           bound: int | None) -> int:
    """How many pushes a worker makes between two fetches: fetch_every's, but at most
    bound + 1. A push at clock c waits until every other worker has read at c - bound or
    later; a worker that fetched only every F > bound + 1 pushes would hold its last read
    for F clocks, and the workers would wait on each other's next fetch, each stuck in a push
    (until the server's timeout). Fetching every bound + 1 pushes or sooner, the slowest
    worker can always push and fetch, so no worker waits for good."""
    every = (fetch_every or push_every) // push_every
    return every if bound is None else min(every, bound + 1)


def summary(counts: collections.Counter) -> dict:
    """One worker's staleness (updates applied between its pull and its push), for stats,
    from how many of its updates had each: a count a value, not a list an update, so a long
    fit's stats cost neither memory nor time under the server's lock as it goes on."""
    count = sum(counts.values())
    return {"count": count,
            "mean": sum(k * n for k, n in counts.items()) / count if count else 0.0,
            "max": max(counts, default=0),
            "histogram": {str(k): n for k, n in sorted(counts.items())}}
