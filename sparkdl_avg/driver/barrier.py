"""The barrier job that runs the training tasks, in a background thread the driver owns; what
Spark says about its tasks (which failed, where, why); and which failures are final."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable
from functools import partial

from pyspark.sql import DataFrame
from pyspark.sql.types import StructType

from sparkdl_avg._errors import TrainingError, WorkerLostError, from_task
from sparkdl_avg.driver import session
from sparkdl_avg.driver.load_monitor import LoadMonitor

log = logging.getLogger("sparkdl_avg")
LOAD_LOG_S = 5.0
"""While the tasks load their partitions, the driver logs their progress this often."""
SILENT_TASKS_S = 60.0
"""With only the training tasks left and none of them reporting for this long, the driver
stops logging the load phase (reports are progress only)."""
_TASKS_END_S = 60.0
"""After a failure, how long the driver waits for the aborted job's tasks to leave their slots."""


def report_cpu_fallback(run, rank: int, why: str) -> None:
    """A task Spark gave a GPU trains on the CPU: said before training (a log line, and the
    MLflow tag `sparkdl_avg.cpu_fallback.<partition>` when there is a `run`), not after it,
    so a user watching a slow fit knows why."""
    log.warning("partition %d trains on the CPU: %s", rank, why)
    if run is not None:
        run.set_tags({f"sparkdl_avg.cpu_fallback.{rank}": why})


class BarrierJob:
    """Runs `frame.mapInArrow(fn, schema, barrier=True).collect()` in a thread it owns.

    `check(wait_s)` raises the job's error if it failed (waiting up to wait_s for it to end):
    a `WorkerLostError` for a failure a restart may cure, a `TrainingError` for one it cannot.
    Use as a context manager: leaving cancels and joins; leaving on a `WorkerLostError` also
    fills in which task failed, where and why (`explain`)."""

    @classmethod
    def training(cls, frame: DataFrame, spec, description: str, config,
                 run=None, *, secret: bytes,
                 evict: Callable[[int], None] | None = None) -> BarrierJob:
        """The job of a fit's training tasks (`task.entry.run_task` on every partition),
        with a `LoadMonitor` the tasks report their loading to and claim their worker keys
        from (derived from `secret`, the coordinator's or the parameter server's, which
        never enters `spec`); a task's CPU fallback is reported (`report_cpu_fallback`, to
        the fit's MLflow `run`) as it loads. An elastic fit (`min_workers`) and an async fit
        run them as a normal stage, whose failed task Spark retries alone; `evict(rank)` is
        called when a newer attempt claims its rank (an elastic fit ends the older one's
        place; the parameter server serves a worker id's latest attempt only)."""
        from sparkdl_avg.driver.cluster import driver_address, training_resources
        from sparkdl_avg.task import report
        from sparkdl_avg.task.entry import run_task

        spark = frame.sparkSession
        address = driver_address(spark, config)
        profile, gpus = training_resources(spark, config.device)
        monitor = LoadMonitor(host=address.bind, advertise=address.advertise,
                              num_workers=len(spec.train_rows), worker_secret=secret,
                              on_cpu_fallback=partial(report_cpu_fallback, run),
                              evict=evict)
        monitor.start()  # here: the tasks need its port; the job closes it
        try:
            spec = dataclasses.replace(spec, load_monitor=monitor.reachable_at,
                                       load_secret=monitor.secret,
                                       gpu_tasks=gpus > 0)
            job = cls(frame, partial(run_task, spec), report.struct_type(), description,
                      rows=sum(spec.train_rows) + sum(spec.eval_rows), monitor=monitor,
                      barrier=config.mode == "sync" and config.min_workers is None)
            job.profile = profile
            return job
        except BaseException:
            monitor.close()
            raise

    def __init__(self, frame: DataFrame, fn: Callable, schema: StructType, description: str,
                 rows: int = 0, monitor: LoadMonitor | None = None,
                 barrier: bool = True) -> None:
        """`rows`: the rows the tasks load; while they load, progress (from `monitor`, which
        the job closes) is logged every LOAD_LOG_S. `barrier`: a barrier stage (all tasks
        start together, and one failure fails them all)."""
        self._barrier = barrier
        self._frame, self._fn, self._schema, self._rows = frame, fn, schema, rows
        self._monitor = monitor
        self.profile = None
        """A stage-level resource profile for the job's stage (`cluster.training_profile`)."""
        self._description = description
        self._group = f"sparkdl-avg-{uuid.uuid4().hex[:12]}"
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self.rows: list = []
        self.error: BaseException | None = None

    def __enter__(self) -> BarrierJob:
        self._thread = threading.Thread(target=self._run, name="sparkdl-avg-job", daemon=True)
        self._thread.start()
        if self._monitor is not None:
            threading.Thread(target=self._log_load, name="sparkdl-avg-load", daemon=True).start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if isinstance(exc, WorkerLostError):
            self.explain(exc)
        if not self._done.is_set():
            self.cancel()
        if self._thread is not None:
            self._thread.join(timeout=60)
        if self._monitor is not None:
            self._monitor.close()

    def _run(self) -> None:
        spark = self._frame.sparkSession
        try:
            session.tag_jobs(spark, self._group, self._description)  # this thread runs it
            self.rows = self._frame.mapInArrow(self._fn, self._schema, barrier=self._barrier,
                                               profile=self.profile).collect()
        except BaseException as exc:  # reported to the driver loop through check()
            self.error = exc
        finally:
            with contextlib.suppress(Exception):
                session.untag_jobs(spark, self._group)
            self._done.set()

    def check(self, wait_s: float = 0) -> None:
        if wait_s > 0:
            self._done.wait(wait_s)
        if self.error is not None:
            text = str(self.error)
            if _NOT_RETRYABLE.search(text):  # cancelled by a person, or Spark shut down
                raise TrainingError(f"the training job was stopped: {_spark_reason(text)}") \
                    from self.error
            match = _FAILED_TASK.search(text)
            final = _FINAL_TASK.search(text)
            if final:  # the task's own check failed: a restart would fail the same way
                failed = self.failed_tasks() if match is None else []
                partition = _partition(match) if match else \
                    (failed[0]["partition"] if failed else None)
                where = "a training task" if partition is None else f"partition {partition}"
                raise from_task(where, final.group(1)[:2000]) from self.error
            raise WorkerLostError(f"the training tasks failed: {_spark_reason(text)}",
                                  partition=_partition(match)) \
                from self.error

    def failed_tasks(self, partition: int | None = None) -> list[dict]:
        """The failed training tasks (of `partition`, if given) as the status store knows
        them, oldest first; none where it cannot say (Connect, or a store that fails)."""
        try:
            tasks = self.tasks() or []
        except Exception:  # noqa: BLE001 - the status store is best effort
            return []
        return [t for t in tasks if t["status"] == "FAILED"
                and partition in (None, t["partition"])]

    def _log_load(self) -> None:
        """Until every task has loaded its partition: Spark preparing the data (reading it,
        the shuffle that partitions it), then the rows the tasks report loaded. Once only
        the training tasks are left, SILENT_TASKS_S without a new report ends it."""
        started = last_change = time.monotonic()
        last = None
        while not self._done.wait(LOAD_LOG_S):
            now = time.monotonic()
            rows, heard, loaded = self._monitor.progress()
            if loaded == self._monitor.num_workers:
                return
            try:
                done, total = session.group_tasks_done(self._frame.sparkSession,
                                                       self._group) or (None, None)
            except Exception:  # noqa: BLE001 - progress only; the job reports real errors
                return
            if heard or (total is not None and total - done <= self._monitor.num_workers):
                if (rows, heard, loaded) != last:
                    last, last_change = (rows, heard, loaded), now
                elif now - last_change > SILENT_TASKS_S:
                    log.info("no load progress from the training tasks for %.0fs (is the "
                             "driver reachable from the executors?); they train all the "
                             "same", now - last_change)
                    return
            if heard:
                log.info("loading partitions: %s of %s rows (%.0f%%), %d of %d tasks loaded, "
                         "%.0fs", f"{rows:,}", f"{self._rows:,}",
                         100 * rows / max(1, self._rows), loaded, self._monitor.num_workers,
                         now - started)
            elif total is not None:
                log.info("preparing the data: %d of %d Spark tasks done, %.0fs", done, total,
                         now - started)
            else:  # Connect: no status tracker
                log.info("preparing the data, %.0fs", now - started)

    def tasks(self) -> list[dict] | None:
        """The training tasks as the driver's status store knows them: partition, executor,
        host, status and error; None on Connect, which has no status store."""
        tasks = session.group_last_stage_tasks(self._frame.sparkSession, self._group)
        if tasks is None:
            return None
        return [dict(t, error=_spark_reason(t["error"]) if t["error"] else None)
                for t in tasks]

    def explain(self, exc: WorkerLostError) -> None:
        """After a failure: stop the job, wait for its tasks to leave their slots, and fill
        `exc.details` with the partition, executor, host and original error."""
        self.cancel()
        if not self.wait_tasks_ended(_TASKS_END_S):
            log.warning("tasks of the failed job still run after %.0fs", _TASKS_END_S)
        try:
            tasks = self.tasks()
        except Exception:  # noqa: BLE001 - the status store is best effort
            tasks = []
        if tasks is None:  # Connect: what the job's exception says
            tasks = _tasks_from_error(str(self.error or ""))
        failed = [t for t in tasks if t["status"] == "FAILED"]
        partition = exc.partition if exc.partition is not None else \
            (failed[0]["partition"] if failed else None)
        task = next((t for t in failed if t["partition"] == partition), None) or \
            next((t for t in tasks if t["partition"] == partition), None)
        error = exc.reported or str(exc)
        if task is not None and task["status"] == "FAILED" and task["error"] \
                and not exc.reported:
            error = task["error"]  # Spark knows the root cause (a crash, a lost executor)
        exc.details = {"partition": partition, "executor": task["executor"] if task else None,
                       "host": task["host"] if task and task["host"] else exc.host,
                       "error": error}

    def wait_tasks_ended(self, timeout: float) -> bool:
        """After a failure: wait until no task of this job still runs (its slots are free)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                tasks = self.tasks()
                if tasks is None:  # Connect: the next job waits for the slots instead
                    return self._done.wait(max(0.0, deadline - time.monotonic()))
                if not any(t["status"] == "RUNNING" for t in tasks):
                    return True
            except Exception:  # noqa: BLE001 - the status store is best effort
                return False
            time.sleep(0.2)
        return False

    def done(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the job to end; raise if it failed."""
        finished = self._done.wait(timeout)
        self.check()
        return finished

    def wait(self, timeout: float) -> list:
        if not self._done.wait(timeout):
            raise TrainingError(f"the training job did not finish {timeout:g}s after the last "
                                "round (finish_timeout)")
        self.check()
        return self.rows

    def cancel(self) -> None:
        session.cancel_jobs(self._frame.sparkSession, self._group)


_NOT_RETRYABLE = re.compile(r"cancelled job group|Job \d+ cancelled|SparkContext was shut down|"
                            r"killed via the Web UI|OPERATION_CANCELED")
_FAILED_TASK = re.compile(r"barrier task ResultTask\(\d+, (\d+)\)|"
                          r"Task (\d+) in stage [\d.]+ failed \d+ times|"
                          r"sparkdl-avg: the training task of partition (\d+)")
_PYTHON_ERROR = re.compile(  # a Python error, module-qualified or not; no JVM class
    r"^(?!(?:org|java|javax|scala|py4j)\.)(?:[a-z_]\w*\.)*[A-Z]\w*"
    r"(Error|Exception|Exit|Interrupt)(: .*)?$")
_FINAL_TASK = re.compile(r"FinalTaskError: (.*)")
_LOST_TASK = re.compile(r"Lost task [\d.]+ in stage [\d.]+ \(TID \d+\) \((\S+) executor (\S+?)\)")
_JVM_ERROR = re.compile(r"^:?\s*(?:org\.apache|java)\.[\w.$]*(?:Exception|Error): (.*)$")


def _spark_reason(text: str) -> str:
    """The useful line of a Spark task or job failure: the Python error raised in the task,
    else the first JVM error that is not the job abort itself."""
    lines = [line.strip() for line in text.splitlines()]
    python = [line for line in lines if _PYTHON_ERROR.match(line)]
    if python:
        return python[-1][:2000]
    for line in lines:
        match = _JVM_ERROR.match(line)
        if match and not match.group(1).startswith("Job aborted"):
            return match.group(1)[:2000]
    return text.strip()[:2000]


def _tasks_from_error(text: str) -> list[dict]:
    """The failed task as a job's exception names it (Connect has no status store): its
    partition, and its host and executor where Spark's message says."""
    failed = _FAILED_TASK.search(text)
    if failed is None:
        return []
    lost = _LOST_TASK.search(text)
    return [{"partition": _partition(failed), "status": "FAILED",
             "host": lost.group(1) if lost else None,
             "executor": lost.group(2) if lost else None, "error": _spark_reason(text)}]


def _partition(match: re.Match | None) -> int | None:
    """The failed task's partition in a `_FAILED_TASK` match (a barrier or a normal stage, or
    the note `task.entry` adds to a training task's error)."""
    if match is None:
        return None
    return int(next(g for g in match.groups() if g is not None))
