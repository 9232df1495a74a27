"""An async fit's tasks Spark ran again alone (a normal stage retries a failed task; the other
workers train on against the parameter server): each return is logged and recorded for
`FitResult.failures`, with what Spark's status store says of the failed attempt."""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("sparkdl_avg")


class TaskRetries:
    def __init__(self) -> None:
        self.records: list[dict] = []
        self.job = None
        """The running `BarrierJob` (its status store names the failed attempt)."""
        self._started = time.monotonic()
        self._lock = threading.Lock()

    def back(self, rank: int) -> None:
        """A later attempt of partition `rank`'s task claimed its worker key (`LoadMonitor`'s
        `evict`): Spark ran the task again. It takes up its data where the server's count of
        its applied steps says; the server serves it, and refuses the earlier attempt."""
        failed = (self.job.failed_tasks(rank) or [{}])[-1] if self.job is not None else {}
        record = {"partition": rank, "host": failed.get("host"),
                  "executor": failed.get("executor"), "error": failed.get("error"),
                  "retried_alone": True,
                  "back_at_s": round(time.monotonic() - self._started, 3), "restart_at": None}
        with self._lock:
            self.records.append(record)
        log.warning("partition %d: Spark runs its task again (%s); the other workers train "
                    "on, and the new attempt takes up where the server's count of its applied "
                    "steps says", rank, record["error"] or "its earlier attempt ended")
