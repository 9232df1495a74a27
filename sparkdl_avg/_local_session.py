"""`local_session`: a Spark session on this machine set up for fits, whose JVM this process
starts: the way the jobs run under plain `python`, for a user's own script or notebook.

What it sets, and why (docs/guide/cluster.md measures each):
- `SPARK_CONF`: the executors' Python daemon imports torch once (`task.warm_daemon`);
- the executors run this Python, unless PYSPARK_PYTHON or `spark.pyspark.python` says
  otherwise (`driver.session.default_executor_python`, as every fit does);
- loopback (`SPARK_LOCAL_IP`, unless set), no UI, no console progress bar (the library logs
  each round);
- log4j at WARN less what no user can act on (`LOG4J`);
- the JIT's first tier only (`jit="c1"`): a cold JVM spends less CPU compiling while it runs
  the fit's first jobs (the first step 1.2 s sooner here), and a heavy Spark job of the
  session's own runs slower (1.6x on a 300-million-row aggregation), which `jit="full"` avoids;
- a class archive of Spark's classes (`_jvm_archive`): the first such JVM records it and
  writes it as it exits, later ones map it and start in half the time;
- its stderr without `JVM_NOISE`.

A JVM that runs already (this process started a session before) keeps its options: the
session is `getOrCreate`'s, with the Spark settings that can still change.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Mapping

from sparkdl_avg import SPARK_CONF, _jvm_archive
from sparkdl_avg._errors import ConfigError
from sparkdl_avg.driver import session

LOG4J = os.path.join(os.path.dirname(os.path.abspath(__file__)), "log4j2.properties")
"""The local sessions' log4j settings: Spark's own at WARN, less what no user can act on."""
JIT = {"c1": "-XX:TieredStopAtLevel=1", "full": ""}
"""`local_session(jit=...)`: the JVM's options for each choice."""
JVM_NOISE = (b"WARNING: Using incubator modules",)
"""What the JVM prints on every start and no user can act on: Spark's launcher always adds the
incubator module jdk.incubator.vector (JavaModuleOptions), and no JVM option hides the line."""
_recording: tuple | None = None
"""(the gateway, its archive) while the JVM this process started records a class archive."""


def local_session(slots: int = 2, *, app_name: str = "sparkdl-avg", jit: str = "c1",
                  class_archive: bool = True, conf: Mapping[str, str] | None = None):
    """A Spark session on this machine with `slots` task slots (`local[slots]`: one for each
    of a fit's `num_workers`), set up for fits: `SPARK_CONF`, executors that run this Python
    (unless PYSPARK_PYTHON or `spark.pyspark.python` says otherwise), loopback, no UI, Spark's
    log at WARN less what no user can act on, and a JVM that starts and runs its first jobs sooner
    (on 2 cores, a cold fit's first step 5.7-6.0 s after `fit()` against 7.1-7.5 s with
    `SPARK_CONF` alone, and the session's start 3.6-3.8 s against 8.3-8.9 s).

    - `jit="c1"` (default): the JVM compiles with the JIT's first tier only. A heavy Spark job
      of the session's own then runs slower (1.6x here); `jit="full"` is HotSpot's default.
    - `class_archive=True` (default): the JVM maps a class archive of Spark's classes. The
      first session of a given Java, Spark and options records it, and writes it as this
      process exits (about 10 s, once; 150-180 MB in `~/.cache/sparkdl-avg/jvm-archives`;
      the environment variable `SPARKDL_AVG_JVM_ARCHIVES` names another folder, or `off`).
    - `conf`: more Spark settings; `spark.driver.extraJavaOptions` is added after the
      session's own JVM options.

    Where this process runs a JVM already (a session started before), its options stay as
    they are. Raises `ConfigError` on a bad argument, or where `SPARK_REMOTE` would make the
    session a Spark Connect one, before any JVM starts."""
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ConfigError(f"slots must be a positive int (task slots, one per worker), got "
                          f"{slots!r}")
    if jit not in JIT:
        raise ConfigError(f"jit must be one of {sorted(JIT)}, got {jit!r}")
    if os.environ.get("SPARK_REMOTE"):
        raise ConfigError("SPARK_REMOTE is set, which makes every new session a Spark Connect "
                          "one; local_session starts Spark on this machine: unset it, or "
                          "connect with SparkSession.builder.remote(...) and SPARK_CONF on "
                          "the server")
    conf = dict(conf or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in conf.items()):
        raise ConfigError(f"conf must map setting names to string values, got {conf!r}"[:300])
    from pyspark.sql import SparkSession

    # one machine: loopback, where Spark would warn that the hostname resolves to it
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    user_options = conf.pop("spark.driver.extraJavaOptions", "")
    builder = (SparkSession.builder.master(f"local[{slots}]").appName(app_name)
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config(map={**SPARK_CONF, **conf}))
    spark = start_jvm(builder, jit=jit, class_archive=class_archive, java_options=user_options)
    session.default_executor_python(spark)  # for the session's Python jobs before any fit
    return spark


def start_jvm(builder, *, jit: str = "c1", class_archive: bool = True, java_options: str = ""):
    """`builder`'s session, on a JVM this process starts as `local_session` says (`jit`, the
    class archive, `LOG4J`, `java_options` last), or on the one it runs already."""
    global _recording
    from pyspark import SparkContext

    if SparkContext._gateway is not None:  # the JVM runs already: its options are set
        return builder.getOrCreate()
    usable = os.path.exists(LOG4J) and not any(c.isspace() for c in LOG4J)  # Spark splits there
    log4j = f"-Dlog4j2.configurationFile={LOG4J}" if usable else ""
    options = " ".join(o for o in (log4j, JIT[jit], java_options) if o)
    if not class_archive:
        return _start_filtered(builder.config("spark.driver.extraJavaOptions", options))
    spark, archive = _jvm_archive.start_session(builder, options, _start_filtered)
    if archive is not None and archive.recording and SparkContext._gateway is not None:
        _recording = (SparkContext._gateway, archive)
        atexit.unregister(end_recording)  # once, however many JVMs this process starts
        atexit.register(end_recording)
    return spark


def end_recording() -> None:
    """Where the JVM `local_session` started records a class archive: stop its session, end
    the JVM and publish the archive (`_jvm_archive.publish_after_stop`). Run as this process
    exits; the jobs call it as each job ends, so that the next job's JVM maps the archive."""
    global _recording
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    if _recording is None:
        return
    gateway, archive = _recording
    _recording = None
    if SparkContext._gateway is not gateway:  # ended by someone else: nothing to publish
        return
    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()
    _jvm_archive.publish_after_stop(archive)


def _start_filtered(builder):
    """`builder.getOrCreate()`, the JVM it launches given a pipe as its stderr, every line of
    which is copied to ours but the `JVM_NOISE` ones. Our own stderr is ours again once the JVM
    has started: only the JVM (and the Python workers it starts) write into the pipe, for as
    long as it runs. Where this process has no stderr to copy to, the JVM inherits it as
    it is."""
    sys.stderr.flush()
    try:
        ours, out = os.dup(2), os.dup(2)  # ours restored below; out the copier's, for good
    except OSError:  # no file descriptor 2
        return builder.getOrCreate()
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
