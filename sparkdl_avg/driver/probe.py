"""One small barrier job before training answers everything the driver must know first, on
either kind of session, so a cold fit pays for one job:

- whether the cluster runs `num_workers` tasks at once (a barrier stage needs them all; on
  Connect there is no other way to ask, and Spark's own slot check would retry for about ten
  minutes, so the probe runs under a job tag interrupted at a deadline);
- whether every executor reaches the address the driver's servers will listen on (a laptop
  talking to a remote cluster must hear so in seconds, not after the connect timeout);
- whether each executor has a local directory for spill files (`data_cache="disk"`).

An executor lost under the probe (not by its doing) is replaced by the cluster: the probe
runs again, within its deadline.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
import uuid
from functools import partial

from sparkdl_avg._errors import ClusterError
from sparkdl_avg.driver import session
from sparkdl_avg.driver.load_monitor import LoadMonitor

log = logging.getLogger(__name__)


def probe_cluster(spark, config, profile, address, deadline_s: float, *,
                  too_few_slots, tasks: int | None = None) -> None:
    """Run the probe job (`task.probe`) on `tasks` (default `config.num_workers`) barrier
    tasks; raise a ClusterError naming the problem, `too_few_slots(deadline_s)` if the tasks
    did not all run within `deadline_s`."""
    from sparkdl_avg.driver.cluster import check_local_dirs
    from sparkdl_avg.task.probe import FIELDS, probe_task
    from sparkdl_avg.task.report import struct_type

    n = tasks or config.num_workers
    server = LoadMonitor(host=address.bind, advertise=address.advertise, num_workers=n,
                         port=address.port, name="probe server")
    try:
        server.start()
    except OSError as exc:
        raise ClusterError(f"cannot listen on {address.bind}:{address.port} for the "
                           f"executors: {exc}; choose another driver_address") from exc
    try:
        fn = partial(probe_task, server.reachable_at, server.secret)
        frame, schema = spark.range(n, numPartitions=n), struct_type(FIELDS)
        rows = run_past_lost_executors(
            lambda timeout: TaggedJob(spark, lambda: frame.mapInArrow(
                fn, schema, barrier=True, profile=profile).collect()).run(timeout),
            deadline_s)
    finally:
        server.close()
    if rows is None:
        raise too_few_slots(deadline_s)
    unreachable = [r for r in rows if r["unreachable"]]
    if unreachable:
        where = "; ".join(f"partition {r['partition']} on {r['host']}: {r['unreachable']}"
                          for r in unreachable[:4])
        host, port = server.reachable_at
        raise ClusterError(
            f"{len(unreachable)} of {n} executors cannot reach this process at {host}:{port} "
            f"({where}). The averaging runs here, so the executors must reach it: set "
            "TrainConfig(driver_address=...) to an address of this machine they can reach "
            "(host, or host:port for a port the firewall opens), or run this client where "
            "they can reach it (a Databricks notebook runs on the driver node; a laptop "
            "outside the cluster's network cannot host the averaging)")
    check_local_dirs({r["host"]: r["local_dirs"] for r in rows if r["local_dirs"]},
                     config.data_cache)


PROBE_ATTEMPTS = 3
"""Runs of the probe job when an executor is lost under it (none of its own doing)."""


def run_past_lost_executors(run_once, deadline_s: float, attempts: int = PROBE_ATTEMPTS):
    """`run_once(timeout)`, run again while it fails because Spark lost an executor under it
    (a machine preempted, or an executor dying as a previous fit's failed barrier stage was
    cancelled) and the deadline allows: the cluster replaces the executor, and a fit should
    not fail on what the next attempt would not meet. Any other failure is raised at once."""
    deadline, attempt = time.monotonic() + deadline_s, 1
    while True:
        try:
            return run_once(max(0.0, deadline - time.monotonic()))
        except ClusterError as exc:
            lost = "ExecutorLostFailure" in str(exc.__cause__ or exc)
            if not lost or attempt == attempts or time.monotonic() >= deadline:
                raise
            attempt += 1
            log.warning("the probe job lost an executor (%s); running it again (attempt %d "
                        "of %d)", exc, attempt, attempts)


class TaggedJob:
    """`action()` in a thread of its own whose Spark jobs carry a fresh tag, so a deadline can
    interrupt them on either kind of session (tags are per thread)."""

    def __init__(self, spark, action, what: str = "the probe job before training") -> None:
        self._spark, self._action, self._what = spark, action, what
        self._tag = f"sparkdl-avg-probe-{uuid.uuid4().hex[:12]}"
        self._rows, self._error = None, None

    def _run(self) -> None:
        try:
            session.tag_jobs(self._spark, self._tag, f"sparkdl-avg: {self._what}")
            self._rows = [row.asDict() for row in self._action()]
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
            self._error = exc
        finally:
            with contextlib.suppress(Exception):  # the thread ends anyway
                session.untag_jobs(self._spark, self._tag)

    def run(self, deadline_s: float) -> list[dict] | None:
        """The rows; None if the deadline passed first (the job is interrupted)."""
        thread = threading.Thread(target=self._run, name="sparkdl-avg-probe", daemon=True)
        thread.start()
        try:
            thread.join(deadline_s)
        finally:
            late = thread.is_alive()
            if late:  # the deadline, or Ctrl-C: stop the job either way
                # A job still waiting for its barrier slots is not registered as running, so
                # the interrupt may not reach it: Spark then resubmits it until its own slot
                # check gives up (about 10 minutes). The fit does not wait for that.
                with contextlib.suppress(Exception):
                    session.cancel_jobs(self._spark, self._tag)
                thread.join(5)
        if late:
            failed = self._failed_task_error()
            if failed is not None:  # the job failed: a slow machine aborted it after the deadline
                raise ClusterError(failure_message(self._spark, self._what, failed))
            return None
        if self._error is not None:
            raise ClusterError(failure_message(self._spark, self._what, str(self._error))) \
                from self._error
        return self._rows

    def _failed_task_error(self) -> str | None:
        """The error of a task of the job that failed. On a loaded machine a barrier stage's
        other tasks may still be starting their Python when the deadline comes, and the job
        not yet aborted (seen on a 2-core machine at load average 13 with a Python that could
        not start sparkdl-avg): the failure, not the wait, is the answer. None on Connect."""
        try:
            tasks = session.group_last_stage_tasks(self._spark, self._tag) or []
        except Exception:  # noqa: BLE001 - the status store is best effort
            return None
        return next((t["error"] for t in tasks if t["status"] == "FAILED" and t["error"]), None)


_WORKER_START = re.compile(r"Error from python worker:\s*\n\s*(\S.*)")
"""What an executor's Python printed when it could not start a worker (Spark quotes it)."""
_IMPORT = re.compile(r"\b(?:ModuleNotFoundError|ImportError)\b")


def failure_message(spark, what: str, text: str) -> str:
    """Why the first Python job of a fit failed. A worker that did not start, or a module
    that did not import, is the executors' Python lacking what the tasks need: the message
    names that Python and the two settings that choose it."""
    from sparkdl_avg import __version__
    from sparkdl_avg.driver.barrier import _spark_reason

    start = _WORKER_START.search(text)
    if start is None and not _IMPORT.search(text):
        return (f"{what} failed (is sparkdl-avg {__version__} installed in the executors' "
                f"Python?): {_spark_reason(text)}")
    reason = start.group(1).strip()[:2000] if start else _spark_reason(text)
    return (f"{what} failed: the executors' Python cannot run sparkdl-avg's tasks ({reason}). "
            f"The executors ran {session.describe_executor_python(spark)}. Install "
            f"sparkdl-avg {__version__} and its requirements (torch, numpy, pyarrow) in the "
            "Python the executors run, or point them to one that has them: PYSPARK_PYTHON "
            "(set before the session starts) or spark.pyspark.python")
