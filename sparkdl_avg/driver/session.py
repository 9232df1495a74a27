"""What differs between a classic SparkSession and a Spark Connect one, all in one place.

The rest of the driver uses what both kinds offer: `spark.conf`, DataFrames, barrier
`mapInArrow` and the job's own exception. Marking a thread's jobs and cancelling them differ
(`tag_jobs`, `cancel_jobs`): job tags on Connect, a job group on a classic session, where
`interruptTag` does not stop a running `collect`. A classic session also has the
SparkContext: the exact number of task slots, the status tracker and store (job
progress, each task's executor and host), and the Python the executors are told to run.
Here those are answered where there is a SparkContext, and None on Connect, where callers
fall back to a probe job and the job's exception.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import socket
import sys


def is_connect(spark) -> bool:
    """By the session object's class, not `is_remote()` (a flag for the whole process)."""
    connect_class = _connect_session_class()
    return connect_class is not None and isinstance(spark, connect_class)


@functools.cache
def _connect_session_class():
    try:
        from pyspark.sql.connect.session import SparkSession as ConnectSession
    except ImportError:  # Connect's client libraries are missing: no session is a Connect one
        return None
    return ConnectSession


def conf(spark, key: str, default: str | None = None) -> str | None:
    """A Spark setting as the session sees it (the server's, on Connect)."""
    return spark.conf.get(key, default)


SPARK_DEFAULT_PYTHON = "python3"
"""What pyspark tells the executors to run when PYSPARK_PYTHON was not set as the
SparkContext started: `python3` from each executor's PATH, whatever it has installed."""
_LOCAL_MASTER = re.compile(r"local(-cluster)?(\[.*\])?")
"""Masters whose executors run on this machine: `local`, `local[N]`, `local[N,F]`,
`local[*]`, `local-cluster[...]`."""


def python_for_executors(master: str, env_python: str | None, conf_python: str | None,
                         current: str) -> str | None:
    """The Python the executors should run instead of `current` (the SparkContext's
    `pythonExec`), or None to leave it. Left: a PYSPARK_PYTHON the user set, or anything but
    Spark's default. `spark.pyspark.python` set on a session pyspark started from a Python
    process is not applied by Spark (only spark-submit turns it into PYSPARK_PYTHON): it is
    applied here. Neither set, on a local master the executors run this driver's Python,
    which has sparkdl-avg, where PATH's `python3` is often another (a venv not activated)."""
    if env_python or current != SPARK_DEFAULT_PYTHON:
        return None
    if conf_python:
        return conf_python
    return (sys.executable or None) if _LOCAL_MASTER.fullmatch(master) else None


def default_executor_python(spark) -> None:
    """Point the session's later Python jobs at `python_for_executors`'s choice. pyspark reads
    the executable from the SparkContext as each job's Python function is made, so this holds
    for the jobs made from now on, in every executor started before or after. Nothing on
    Connect: the server's environment decides, fixed when it started."""
    if is_connect(spark):
        return
    sc = spark.sparkContext
    chosen = python_for_executors(sc.master, os.environ.get("PYSPARK_PYTHON"),
                                  conf(spark, "spark.pyspark.python", None), sc.pythonExec)
    if chosen is not None:
        sc.pythonExec = chosen


def describe_executor_python(spark) -> str:
    """Which Python the executors are told to run, and why, for an error message."""
    if is_connect(spark):
        return ("the Connect server's choice (its PYSPARK_PYTHON as it started, else "
                f"{SPARK_DEFAULT_PYTHON} from the executors' PATH)")
    python = spark.sparkContext.pythonExec
    if python == os.environ.get("PYSPARK_PYTHON"):
        return f"{python}, from PYSPARK_PYTHON"
    if python == conf(spark, "spark.pyspark.python", None):
        return f"{python}, from spark.pyspark.python"
    if python == SPARK_DEFAULT_PYTHON:
        return (f"{python} from the executors' PATH, Spark's default: neither PYSPARK_PYTHON "
                "nor spark.pyspark.python is set")
    if python == sys.executable:
        return f"{python}, this driver's own Python (a local master's default)"
    return python


def client_address(spark) -> str | None:
    """On Connect: this process's own address on the route to the Connect server, which is
    where the server's executors can best hope to reach it (the driver node's address for a
    Databricks notebook). None on a classic session."""
    if not is_connect(spark):
        return None
    server = spark.client.host.strip("[]")
    route = None
    with contextlib.suppress(OSError), socket.socket(
            socket.AF_INET6 if ":" in server else socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((server, 9))  # UDP: no packet is sent, the kernel only picks a route
        route = s.getsockname()[0]
    if route is not None and not _loopback(route):
        return route
    # The server is on this machine (a notebook beside its driver): its driver's address is
    # this machine's, as the executors see it; loopback does only for a local master.
    driver_host = conf(spark, "spark.driver.host", None)
    if driver_host and not _loopback(driver_host) and \
            not conf(spark, "spark.master", "").startswith("local"):
        return driver_host
    return route or socket.gethostname()


def _loopback(host: str) -> bool:
    return host.startswith("127.") or host in ("::1", "localhost")


def concurrent_slots(spark, profile=None) -> int | None:
    """How many tasks (of `profile`, else the default profile) the cluster runs at once;
    on Connect, only a local master's (`local[N]`) is known, else None."""
    if is_connect(spark):
        match = re.fullmatch(r"local(?:\[(\d+)(?:,\s*\d+)?\])?", conf(spark, "spark.master", ""))
        if match is None or profile is not None:
            return None
        cpus = int(conf(spark, "spark.task.cpus", "1"))
        return int(match.group(1) or 1) // cpus
    jsc = spark.sparkContext._jsc.sc()
    manager = jsc.resourceProfileManager()
    if profile is None:
        return int(jsc.maxNumConcurrentTasks(manager.defaultResourceProfile()))
    manager.addResourceProfile(profile._java_resource_profile)  # known before its stage runs
    return int(jsc.maxNumConcurrentTasks(profile._java_resource_profile))


def executors(spark) -> tuple[str, ...] | None:
    """The application's id, then its live executors' ids, sorted (none in local mode: the
    driver runs the tasks); None on Connect, which cannot list them."""
    if is_connect(spark):
        return None
    sc = spark.sparkContext
    if re.fullmatch(r"local(\[.*\])?", sc.master):
        # no executors to list; and asking Spark's local backend logs a warning a user
        # cannot act on ("Requesting executors is not supported by current scheduler")
        return (sc.applicationId,)
    ids = sc._jsc.sc().getExecutorIds()
    return (sc.applicationId, *sorted(ids.apply(i) for i in range(ids.size())))


def tag_jobs(spark, tag: str, description: str) -> None:
    """Mark the jobs this thread starts from now on, for `cancel_jobs` (and, on a classic
    session, for the status tracker): a job tag on Connect, a job group on a classic
    session, where `interruptTag` does not reach a running `collect` (seen with pyspark
    4.3: it finds no operation and the job runs on)."""
    if is_connect(spark):
        spark.addTag(tag)
    else:
        spark.sparkContext.setJobGroup(tag, description, interruptOnCancel=True)


def untag_jobs(spark, tag: str) -> None:
    """This thread's later jobs are no longer marked."""
    if is_connect(spark):
        spark.removeTag(tag)
    else:
        spark.sparkContext._jsc.clearJobGroup()  # pyspark's SparkContext has none


def cancel_jobs(spark, tag: str) -> None:
    """Stop the jobs `tag_jobs` marked, from any thread."""
    if is_connect(spark):
        spark.interruptTag(tag)
    else:
        spark.sparkContext.cancelJobGroup(tag)


def group_tasks_done(spark, group: str) -> tuple[int, int] | None:
    """(done, all) tasks of the job group's stages so far; None on Connect."""
    if is_connect(spark):
        return None
    tracker = spark.sparkContext.statusTracker()
    stages = [tracker.getStageInfo(s) for j in _jobs(tracker, group) for s in j.stageIds]
    stages = [s for s in stages if s is not None]
    return sum(s.numCompletedTasks for s in stages), sum(s.numTasks for s in stages)


def group_last_stage_tasks(spark, group: str) -> list[dict] | None:
    """The tasks of the group's last stage (a barrier job's own stage; earlier jobs and stages
    are the shuffle feeding it) as the status store knows them: partition, executor, host,
    status and the raw error. None on Connect."""
    if is_connect(spark):
        return None
    sc = spark.sparkContext
    tracker, store = sc.statusTracker(), sc._jsc.sc().statusStore()
    jobs = _jobs(tracker, group)
    if not jobs:
        return []
    stage_id = max(max(jobs, key=lambda j: j.jobId).stageIds)
    stage = tracker.getStageInfo(stage_id)
    tasks = store.taskList(stage_id, stage.currentAttemptId if stage else 0, 10_000)
    out = []
    for i in range(tasks.size()):
        t = tasks.apply(i)
        error = t.errorMessage()
        out.append({"partition": t.index(), "executor": t.executorId(), "host": t.host(),
                    "status": t.status(), "error": error.get() if error.isDefined() else None})
    return out


def _jobs(tracker, group: str) -> list:
    """The job group's jobs Spark still knows, those with stages."""
    jobs = [tracker.getJobInfo(j) for j in tracker.getJobIdsForGroup(group)]
    return [j for j in jobs if j is not None and len(j.stageIds)]
