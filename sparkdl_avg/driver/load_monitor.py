"""The load phase, seen from the driver: a small authenticated server the training tasks
report to (`task.load_report`) while they read their partitions into their data caches, so
the driver can say how far the load has got. It keeps one (rows, of, done) per partition,
and hands a task's CPU fallback to `on_cpu_fallback` once, as soon as it hears of it.

It is also where each task claims its own worker key (`task.enrolment`): the key of rank r
under `worker_secret` (the coordinator's or the parameter server's; None: no keys, as for
the probe job). Each rank is claimed once per monitor (per launch), by one claim id, whatever
attempt number the claimant gives (its word: kept for the log only). The same claim id again
(the task's retry after a lost reply) gets the key anew, under a fresh nonce; any other claim
for that rank is refused ("claimed"), counted and logged: the task refused fails the fit.

An elastic fit's stage is a normal one, whose failed task Spark runs again (`evict` given):
there a claim for a rank is also answered when it comes from a later task attempt (Spark's
task attempt id, unique in the application) than the holder's, and `evict(rank)` then ends
the older attempt's place in the fit, so that one attempt of a partition trains at a time: a
retry after a loss, or the second live attempt Spark starts when an executor's loss takes
shuffle output with it and it reruns the stage's unfinished tasks."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

from sparkdl_avg._errors import ProtocolError
from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.auth import new_secret, role_key, role_of
from sparkdl_avg.net.frames import Connection
from sparkdl_avg.net.server import Server
from sparkdl_avg.task.enrolment import Enrolment, is_enrolment, seal
from sparkdl_avg.task.load_report import LoadReport


class LoadMonitor(Server):
    def __init__(self, *, host: str, advertise: str, num_workers: int,
                 worker_secret: bytes | None = None, port: int = 0, name: str = "load monitor",
                 on_cpu_fallback: Callable[[int, str], None] | None = None,
                 evict: Callable[[int], None] | None = None) -> None:
        super().__init__(secret=new_secret(), host=host, port=port,
                         max_connections=2 * num_workers, name=name)
        self.advertise, self.num_workers = advertise, num_workers
        self._loaded: dict[int, tuple[int, int, bool]] = {}
        self._on_cpu_fallback = on_cpu_fallback
        self._fallbacks: set[int] = set()
        self._worker_secret = worker_secret
        self._claimed: dict[int, tuple[str, int]] = {}
        """Per rank, the claim id that claimed its key and its attempt."""
        self._evict = evict

    @property
    def secret(self) -> bytes:
        return self._secret

    @property
    def reachable_at(self) -> tuple[str, int]:
        return self.advertise, self.address[1]

    def progress(self) -> tuple[int, int, int]:
        """(rows loaded, partitions heard from, partitions loaded)."""
        with self._lock:
            values = list(self._loaded.values())
        return sum(v[0] for v in values), len(values), sum(1 for v in values if v[2])

    def serve(self, conn: Connection, hello: dict) -> bool:
        """A report or a claim is the connection's introduction; nothing else is read."""
        if is_enrolment(hello):
            self._enrol(conn, hello)
            return False
        try:
            report = LoadReport.from_meta(hello)
            if report.rank >= self.num_workers:
                raise ProtocolError(f"rank {report.rank} of {self.num_workers}", "unexpected")
        except ProtocolError as exc:
            self.refuse(exc.reason, exc, "a task", conn)
            return False
        with self._lock:
            self._loaded[report.rank] = (report.rows, report.of, report.done)
            first = report.cpu_fallback is not None and report.rank not in self._fallbacks
            self._fallbacks.add(report.rank)
        if first and self._on_cpu_fallback is not None:
            self._on_cpu_fallback(report.rank, report.cpu_fallback)
        return False

    def _enrol(self, conn: Connection, hello: dict) -> None:
        """Answer a claim with the rank's key, sealed (`enrolment.seal`), or refuse it."""
        try:
            claim = Enrolment.from_meta(hello)
            if self._worker_secret is None:
                raise ProtocolError(f"the {self._name} hands out no keys", "unexpected")
            if claim.rank >= self.num_workers:
                raise ProtocolError(f"rank {claim.rank} of {self.num_workers}", "unexpected")
            with self._lock:
                holder, attempt = self._claimed.setdefault(claim.rank,
                                                           (claim.claim_id, claim.attempt))
                newer = holder != claim.claim_id and self._evict is not None \
                    and claim.attempt > attempt
                if newer:  # Spark's next attempt of this partition's task
                    holder = claim.claim_id
                    self._claimed[claim.rank] = (holder, claim.attempt)
            if newer:
                self._evict(claim.rank)
            if holder != claim.claim_id:
                raise ProtocolError(
                    f"worker {claim.rank}'s key was claimed already (this claim: attempt "
                    f"{claim.attempt}): another holder of this launch's secret may act as "
                    "that worker", "claimed")
        except ProtocolError as exc:
            self.refuse(exc.reason, exc, f"a claim for worker {hello.get('rank')!r}", conn)
            return
        key = role_key(self._worker_secret, role_of(claim.rank))
        nonce = os.urandom(32)
        with contextlib.suppress(OSError):  # gone: its retry, same claim id, is answered anew
            msg.send(conn, msg.Enrolled(nonce=nonce.hex(),
                                        sealed=seal(self._secret, claim.rank, nonce, key).hex()))
