"""The driver's links to a sync fit's workers, under both transports: their connections by
rank, a call on every present worker at once (`_each`), each bounded by round_timeout, and
what a lost worker means. In an all-or-nothing fit a loss fails the round (the restart loop
takes over); in an elastic one (`averaging.membership`) the worker leaves the fit, and a
worker that connects after the start joins at the next round boundary (`_let_join`).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

from sparkdl_avg._errors import (
    TASK_ERRORS,
    PeerClosed,
    ProtocolError,
    TrainingError,
    WorkerLostError,
    from_task,
)
from sparkdl_avg.averaging.membership import Membership
from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.frames import Connection
from sparkdl_avg.net.server import Server, escaped, peer_closed

log = logging.getLogger("sparkdl_avg")
POLL_S = 0.25
"""How often a wait checks the Spark job (and the coordinator its workers)."""
_JOB_FAILURE_WAIT_S = 5.0
"""After losing a worker's socket, how long to wait for Spark to say why the task died."""


class WorkerLinks(Server):
    """Owns the workers' connections and the I/O threads; `close()` releases all."""

    def __init__(self, *, host: str, port: int, num_workers: int, secret: bytes,
                 timeout: float, check_job: Callable[[float], None],
                 tls: ssl.SSLContext | None, elastic: Membership | None, threads: int) -> None:
        # room for each rank's retry beside a connection it replaces (`serve`)
        super().__init__(secret=secret, host=host, port=port,
                         max_connections=2 * num_workers, tls=tls, name="coordinator")
        self.num_workers = num_workers
        self.elastic = elastic
        self._timeout = timeout
        self._check_job = check_job
        self._threads = threads
        self._workers: dict[int, Connection] = {}
        """The present workers' connections, by rank."""
        self._sealed = False
        """Every rank connected and accept_workers goes on: no connection is replaced."""
        self.hellos: dict[int, msg.WorkerHello] = {}
        self._io: ThreadPoolExecutor | None = None
        self.max_payload = 1 << 20
        """What a worker may send in one frame (the subclass sets it)."""
        self._at = (0, False)
        """(round index, whether its pushes are averaged): where a worker leaving leaves."""
        self._bytes_mark = 0
        self._bytes_gone = 0
        """Bytes moved on connections since dropped (`_bytes_in_round`)."""

    def start(self) -> None:
        super().start()
        self._io = ThreadPoolExecutor(self._threads, thread_name_prefix="sparkdl-avg-io")

    def close(self) -> None:
        super().close()
        if self._io is not None:
            self._io.shutdown(wait=False, cancel_futures=True)
            self._io = None

    def serve(self, conn: Connection, hello: dict) -> bool:
        """A worker connected and authenticated: keep its connection under its rank."""
        try:
            worker = msg.WorkerHello.from_meta(hello)
        except ProtocolError as exc:
            self.refuse(exc.reason, exc, hello, conn)
            return False
        conn.set_timeout(self._timeout)
        conn.max_payload = self.max_payload
        with self._lock:
            known, stale = worker.rank < self.num_workers, None
            if known and not self._sealed:
                # The same rank again, before the fit starts: a retried connect whose first
                # try the worker gave up on, or Spark's next attempt of the task. Only the
                # rank's key gets here, so the newest connection is the live one.
                stale = self._workers.get(worker.rank)
                self._workers[worker.rank] = conn
                self.hellos[worker.rank] = worker
                self._conns.discard(stale)
                self._lock.notify_all()
                sealed = False
            elif known and self.elastic is not None:
                present = self._workers.get(worker.rank)
                why = self.elastic.offer(worker.rank, conn, worker, live=present is not None
                                         and not peer_closed(present.sock))
                if why is None:  # trains from the next round boundary (`_let_join`)
                    self._lock.notify_all()
                    return True
                sealed = True
            else:
                sealed = self._sealed
        if known and not sealed:
            if stale is not None:
                log.info("worker rank %d connected again (%s): its earlier connection is "
                         "closed", worker.rank, escaped(worker.host))
                stale.close()
            return True
        # answered outside the lock, which the driver's loop polls under
        if self.elastic is not None and known:
            self.refuse("ended" if self.elastic.ended else "claimed", why, worker.host, conn)
            return False
        self.refuse("unexpected", f"worker rank {worker.rank} is "
                    f"{'taken: the fit has started' if known else 'unknown'}", worker.host,
                    conn)
        return False

    def _all(self, fn: Callable[[int, Connection], object]) -> list:
        """`_each`'s results in rank order."""
        return list(self._each(fn).values())

    def _each(self, fn: Callable[[int, Connection], object]) -> dict[int, object]:
        """Run fn for every present worker in parallel; results by rank. Fail fast (checking
        the Spark job) on errors; in an elastic fit, a worker that is lost leaves at once (its
        retried task may claim its rank meanwhile) and the others' calls go on."""
        futures = {self._io.submit(fn, rank, self._workers[rank]): rank
                   for rank in sorted(self._workers)}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=POLL_S, return_when=FIRST_EXCEPTION)
            for f in done:
                if f.exception() is not None:
                    if not self._leaves(f.exception()):
                        self._fail(f.exception())
                    self._drop(futures[f], f.exception())
            if pending:
                self._check_job(0)
        return {rank: f.result() for f, rank in sorted(futures.items(), key=lambda x: x[1])
                if f.exception() is None}

    def _leaves(self, exc: BaseException) -> bool:
        """Whether, in an elastic fit, `exc` means a worker left (lost, hung, or failed in a
        way a retry may cure) rather than a failure of the fit."""
        if self.elastic is None or isinstance(exc, TASK_ERRORS):
            return False
        return isinstance(exc, WorkerLostError) or (
            isinstance(exc, OSError) and not isinstance(exc, TrainingError))

    def _fail(self, exc: BaseException) -> None:
        if isinstance(exc, (TrainingError, *TASK_ERRORS)) \
                and not isinstance(exc, WorkerLostError):
            raise exc  # our own diagnosis (a final worker error, a NaN): final
        # A lost worker usually means its task failed: give Spark a moment to say why,
        # unless the worker told us itself.
        reported = isinstance(exc, WorkerLostError) and exc.reported is not None
        self._check_job(0 if reported else _JOB_FAILURE_WAIT_S)
        if isinstance(exc, TrainingError):
            raise exc
        raise TrainingError(str(exc)) from exc

    def evict(self, rank: int) -> None:
        """A newer attempt of rank `rank`'s task claimed its key: the older one's connection
        is shut, so it leaves the fit at its next exchange (or at the next round boundary,
        if it was waiting to join) and the newer one takes its place."""
        with self._lock:
            present = self._workers.get(rank)
            joining = self.elastic.joining.pop(rank, (None,))[0] \
                if self.elastic is not None else None
            self._conns.discard(joining)
        if present is not None or joining is not None:
            log.info("partition %d: a newer attempt of its task takes its place", rank)
        if present is not None:  # its I/O thread, or the next, sees it end and drops it
            with contextlib.suppress(OSError):
                present.sock.shutdown(socket.SHUT_RDWR)
        if joining is not None:
            joining.close()

    def _drop(self, rank: int, exc: BaseException) -> None:
        """An elastic fit's worker `rank` left (`exc`): its connection is closed, and its
        task, which Spark retries, may join again."""
        round_index, pushed = self._at
        with self._lock:
            conn = self._workers.pop(rank, None)
            if conn is not None:
                self._conns.discard(conn)
                self._bytes_gone += conn.bytes_moved
            self.elastic.lost(rank, self.hellos[rank], round_index, pushed, str(exc)[:2000])
            present = len(self._workers)
        if conn is not None:
            conn.close()
        log.warning("partition %d left the fit in round %d (%d of %d workers remain): %s",
                    rank, round_index + 1, present, self.num_workers, escaped(exc))

    def _let_join(self, round_index: int, send_start: Callable[[Connection], None]) -> None:
        """At the boundary before round `round_index`: the workers waiting to join get their
        start (`send_start`) and train from this round; while fewer than min_workers are
        present, wait for more, up to round_timeout, then fail the fit."""
        deadline = time.monotonic() + self._timeout
        while True:
            with self._lock:
                joining, self.elastic.joining = self.elastic.joining, {}
            for rank, (conn, hello) in sorted(joining.items()):
                if rank in self._workers:  # its dead predecessor, not read from since
                    self._drop(rank, PeerClosed("replaced by its retried task"))
                try:
                    send_start(conn)
                except OSError as exc:  # gone again: its task is retried once more
                    log.warning("partition %d could not join: %s", rank, escaped(exc))
                    with self._lock:
                        self._conns.discard(conn)
                    conn.close()
                    continue
                with self._lock:
                    self._workers[rank], self.hellos[rank] = conn, hello
                    self.elastic.returned(rank, hello, round_index)
                log.info("partition %d (attempt %d) joins the fit at round %d", rank,
                         hello.attempt, round_index + 1)
            with self._lock:
                present = len(self._workers)
                if present >= self.elastic.min_workers:
                    return
                if time.monotonic() > deadline:
                    raise TrainingError(
                        f"only {present} of {self.num_workers} workers were present before "
                        f"round {round_index + 1}, fewer than min_workers="
                        f"{self.elastic.min_workers}, and none came back within "
                        f"{self._timeout:g}s (round_timeout); the last checkpoint can be "
                        "taken up with resume_from")
                if not self.elastic.joining:
                    self._lock.wait(POLL_S)
            self._check_job(0)

    def _end_elastic(self) -> None:
        """The fit's last average is out: workers still waiting to join are told so."""
        with self._lock:
            self.elastic.ended = True
            joining, self.elastic.joining = self.elastic.joining, {}
        for conn, _ in joining.values():
            self.refuse("ended", "the fit has ended: its last average is out", "a late worker",
                        conn)
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _bytes_in_round(self) -> int:
        """Bytes moved with the workers since the last call."""
        total = self._bytes_gone + sum(conn.bytes_moved for conn in self._workers.values())
        moved, self._bytes_mark = total - self._bytes_mark, total
        return moved

    def _expect(self, rank: int, conn: Connection, cls: type[msg.M],
                into=None) -> tuple[msg.M, memoryview | None]:
        host = self.hellos[rank].host
        try:
            with conn.within(self._timeout):  # the whole message: a trickle holds no round
                message, payload = msg.receive(conn, into)
        except TimeoutError:
            raise WorkerLostError(
                f"partition {rank} (host {host}) sent no whole message in {self._timeout:g}s "
                "(round_timeout): the task hangs, its executor is stuck or its link is "
                "too slow",
                partition=rank, host=host) from None
        except (ProtocolError, OSError) as exc:
            raise WorkerLostError(f"lost the worker of partition {rank} (host {host}): {exc}",
                                  partition=rank, host=host) from exc
        if isinstance(message, msg.WorkerFailed):
            if message.final:
                raise from_task(f"partition {rank}", message.message)
            raise WorkerLostError(f"partition {rank} failed: {message.message}",
                                  partition=rank, reported=message.message, host=host)
        if not isinstance(message, cls):
            raise TrainingError(f"worker {rank} sent {message.KIND.name}, expected "
                                f"{cls.KIND.name}")
        return message, payload
