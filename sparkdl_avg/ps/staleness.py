"""The staleness bound's two gates (SSP, Ho et al. 2013), as pure functions of the workers'
clocks (their pushes so far). Bound 0 is bulk synchronous; None is no bound."""

from __future__ import annotations


def may_read(clocks: dict[int, int], worker: int, bound: int | None) -> bool:
    """A worker at clock c reads once every worker has reached c - bound."""
    return bound is None or min(clocks.values()) >= clocks[worker] - bound


def may_apply(read_clocks: dict[int, int], worker: int, clock: int, bound: int | None) -> bool:
    """A push from a worker at `clock` waits until every *other* worker has read at clock
    - bound, so no read sees updates from beyond its round (bound 0: exactly synchronous)."""
    return bound is None or all(read >= clock - bound for w, read in read_clocks.items()
                                if w != worker)
