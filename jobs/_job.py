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
from collections.abc import Iterator


def log_to_stderr() -> None:
    """The jobs' progress (the library logs each round at INFO), without py4j's chatter."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)


@contextlib.contextmanager
def session(app_name: str, master: str | None, num_workers: int) -> Iterator:
    """The job's SparkSession, stopped when the block ends. Under spark-submit, its session
    (`master` still wins when given); under plain `python`, `sparkdl_avg.local_session` with
    `num_workers` slots, or a session of `master` on a JVM started the same way (its log4j,
    the JIT's first tier, the class archive of Spark's classes, its stderr filtered). A JVM
    that records the class archive writes it as the job ends, so the next job's JVM maps it."""
    log_to_stderr()
    from pyspark.sql import SparkSession

    from sparkdl_avg import _local_session, local_session

    submitted = "PYSPARK_GATEWAY_PORT" in os.environ  # spark-submit started the JVM already
    if master is None and not submitted:
        spark = local_session(num_workers, app_name=app_name)
    else:
        builder = (SparkSession.builder.appName(app_name)
                   .config("spark.ui.showConsoleProgress", "false"))  # the library's own
        if master:
            builder = builder.master(master)
        spark = _local_session.start_jvm(builder)  # spark-submit's JVM: its session as is
    try:
        yield spark
    finally:
        spark.stop()
        _local_session.end_recording()
