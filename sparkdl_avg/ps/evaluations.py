"""The parameter server's evaluation requests (async mode), as plain bookkeeping.

The driver asks for an evaluation; the server keeps a copy of its parameters under a new
request id. Each worker learns of the request from the server's answers (`Ack.evaluate`),
fetches that copy, evaluates it on its own evaluation rows and sends its sums back. Once every
announced worker has answered, the sums are one result, which the driver reads from the
server's stats. A worker with no evaluation rows answers too (count 0): completion is simply
"every worker", whatever the data's layout.

When every worker has pushed its last update (FINISHED), a final request is made of the final
parameters; a finished worker waits for it and ends once it has answered it. What is kept is
bounded: one pending request (a newer one replaces it: newest wins; the final one replaces
any), and the newest `KEEP_RESULTS` results. Only the results go into the server's
checkpoint (saved at once when the final one completes, as the workers then end); after a
restart, workers announce themselves finished again and the driver asks again.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from sparkdl_avg._eval_sums import merge

KEEP_RESULTS = 8
"""Completed results kept for the driver to read (it reads them every eval_interval_s)."""


@dataclass(slots=True)
class Request:
    request: int
    applied: int
    """The updates applied to `params` (its step is applied // workers)."""
    params: np.ndarray
    final: bool
    answered: dict[int, dict] = field(default_factory=dict)
    """Per worker: its EVAL's sums and score tables (`_eval_sums.received_part`)."""


class Evaluations:
    """Not thread-safe: the server calls it with its lock held."""

    def __init__(self) -> None:
        self.reset(0)

    def reset(self, workers: int, results: Iterable[dict] = ()) -> None:
        """A new fit (INIT) or a restored server (with its checkpoint's `results`): workers
        0..workers-1, nothing pending."""
        self.workers = workers
        self.pending: Request | None = None
        self.results: collections.deque[dict] = collections.deque(results, maxlen=KEEP_RESULTS)
        self.finished: set[int] = set()
        self.final_answered: set[int] | None = None
        """Who has answered the final request; None until it is made."""
        self._next = 1 + max((r["request"] for r in self.results), default=-1)  # ids stay unique

    def request(self, params: np.ndarray, applied: int, *, final: bool = False) -> Request:
        """A new request of a copy of `params`, replacing any pending one."""
        self.pending = Request(self._next, applied, params.copy(), final)
        self._next += 1
        if final:
            self.final_answered = set()
        return self.pending

    def ask(self, params: np.ndarray, applied: int) -> Request | None:
        """The driver's request; none once the final request is made (the parameters are
        final, and that request must not be replaced)."""
        if self.final_answered is not None or not self.workers:
            return None
        return self.request(params, applied)

    def offer(self, worker: int) -> int | None:
        """The pending request `worker` has yet to answer."""
        pending = self.pending
        return pending.request if pending and worker not in pending.answered else None

    def snapshot(self, worker: int) -> Request | None:
        return self.pending if self.offer(worker) is not None else None

    def answer(self, worker: int, request: int, result: dict) -> dict | None:
        """A worker's sums {loss_sum, loss_weight, correct, scored, count, eval_s, metrics,
        tables} for `request`; returns the result it completes, if it does. An answer to a
        request no longer pending (replaced, or already complete) or a second answer from the
        same worker changes nothing."""
        pending = self.pending
        if pending is None or pending.request != request or worker in pending.answered \
                or not 0 <= worker < self.workers:
            return None
        pending.answered[worker] = result
        if pending.final:
            self.final_answered.add(worker)
        if len(pending.answered) < self.workers:
            return None
        self.results.append(_summed(pending))
        self.pending = None
        return self.results[-1]

    def finish(self, worker: int, params: np.ndarray, applied: int) -> None:
        """`worker` has pushed its last update; the last one to do so makes the final
        request."""
        if not 0 <= worker < self.workers:
            return
        self.finished.add(worker)
        if self.final_answered is None and len(self.finished) == self.workers:
            self.request(params, applied, final=True)

    def done(self, worker: int) -> bool:
        """`worker` may end: it has answered the final request, or the server cannot count
        the workers (no INIT announced them), so no final request will come."""
        if not self.workers:
            return True
        return self.final_answered is not None and worker in self.final_answered

    def report(self) -> dict:
        pending = self.pending
        return {"pending": None if pending is None else {
                    "request": pending.request, "applied": pending.applied,
                    "final": pending.final, "answered": sorted(pending.answered)},
                "results": list(self.results), "finished": sorted(self.finished)}


def _summed(request: Request) -> dict:
    """One result from every worker's part (`_eval_sums.merge`): plain sums, the score tables
    reduced to theirs, so the result is small JSON (STATS, the checkpoint)."""
    return {"request": request.request, "applied": request.applied, "final": request.final,
            **merge(list(request.answered.values()))}
