"""What every job's `main()` does around its training: Python's logging as the jobs print it,
and a Spark session that prints only what a user can act on, stopped however the job ends.

The jobs import this file as their sibling: `python jobs/<job>.py` and spark-submit's client
mode (the default) run the driver beside it. A cluster deploy mode ships only the job's file:
add `--py-files jobs/_job.py` there.

Which Python the executors run is the library's to choose (`fit` makes a local master's
executors run this driver's Python unless PYSPARK_PYTHON or spark.pyspark.python says
otherwise), so a job behaves as a user's own program does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator

LOG4J = os.path.join(os.path.dirname(os.path.abspath(__file__)), "log4j2.properties")
"""The local sessions' log4j settings: Spark's own at WARN, less what no user can act on."""
C1_JIT = "-XX:TieredStopAtLevel=1"
"""A JVM the job starts itself compiles with the JIT's first tier only: a cold JVM spends less
CPU compiling while it runs the fit's first jobs (docs/guide/cluster.md measures it), and a
job's Spark work in its own driver is small. Not for a JVM the job did not start
(spark-submit's, a notebook's)."""
JVM_NOISE = (b"WARNING: Using incubator modules",)
"""What the JVM prints on every start and no user can act on: Spark's launcher always adds the
incubator module jdk.incubator.vector (JavaModuleOptions), and no JVM option hides the line."""


def log_to_stderr() -> None:
    """The jobs' progress (the library logs each round at INFO), without py4j's chatter."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)


@contextlib.contextmanager
def session(app_name: str, master: str | None, num_workers: int) -> Iterator:
    """The job's SparkSession, stopped when the block ends. Under spark-submit, its session
    (`master` still wins when given); under plain `python`, `master` or a local session of
    `num_workers` slots on loopback with `SPARK_CONF` (its executors run this Python, which
    has sparkdl-avg, so the daemon can start with torch loaded) and no UI. A JVM this
    process starts logs through `LOG4J`, compiles as `C1_JIT` says, maps the class archive of
    Spark's classes an earlier job's JVM recorded (the first records it, written as it exits
    after the job: `sparkdl_avg._jvm_archive`) and has its `JVM_NOISE` filtered out of its
    stderr."""
    log_to_stderr()
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    from sparkdl_avg import SPARK_CONF, _jvm_archive

    submitted = "PYSPARK_GATEWAY_PORT" in os.environ  # spark-submit started the JVM already
    builder = (SparkSession.builder.appName(app_name)
               .config("spark.ui.showConsoleProgress", "false"))  # the library's own progress
    if master:
        builder = builder.master(master)
    elif not submitted:
        # one machine: loopback, where Spark would warn that the hostname resolves to it
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        builder = (builder.master(f"local[{num_workers}]").config("spark.ui.enabled", "false")
                   .config(map=SPARK_CONF))
    archive = None
    if submitted or SparkContext._gateway is not None:  # the JVM runs already
        spark = builder.getOrCreate()
    else:
        spark, archive = _jvm_archive.start_session(
            builder, f"-Dlog4j2.configurationFile={LOG4J} {C1_JIT}", _start_jvm_filtered)
    try:
        yield spark
    finally:
        spark.stop()
        if archive is not None and archive.recording:
            _jvm_archive.publish_after_stop(archive)


def _start_jvm_filtered(builder):
    """`builder.getOrCreate()`, the JVM it launches given a pipe as its stderr, every line of
    which is copied to ours but the `JVM_NOISE` ones. Our own stderr is ours again once the JVM
    has started: only the JVM (and the Python workers it starts) write into the pipe, for as
    long as it runs."""
    sys.stderr.flush()
    ours, out = os.dup(2), os.dup(2)  # ours restored below; out the copier's, for good
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)  # inheritable: the JVM, started next, writes its stderr here
    os.close(write_end)

    def copy() -> None:
        with os.fdopen(read_end, "rb") as pipe:
            for line in pipe:
                if not line.startswith(JVM_NOISE):
                    os.write(out, line)

    threading.Thread(target=copy, name="jvm-stderr", daemon=True).start()
    try:
        return builder.getOrCreate()
    finally:
        os.dup2(ours, 2)
        os.close(ours)
