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
  session's own runs slower (1.9x on a 300-million-row aggregation, `bench/c1_heavy_job.py`),
  which `jit="full"` avoids;
- a class archive of Spark's classes (`_jvm_archive`): the first such JVM records it and
  writes it as it exits, later ones map it and start in half the time;
- its stderr without `JVM_NOISE`.

A JVM that runs already (this process started a session before) keeps its options: the
session is `getOrCreate`'s, with the Spark settings that can still change.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
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
"""(this process's id, the gateway, its archive) while the JVM this process started records a
class archive."""
_lock = threading.Lock()
"""One JVM's start, or its end, at a time: both swap file descriptor 2 or `_recording`."""
log = logging.getLogger(__name__)


def local_session(slots: int = 2, *, app_name: str = "sparkdl-avg", jit: str = "c1",
                  class_archive: bool = True, conf: Mapping[str, str] | None = None):
    """A Spark session on this machine with `slots` task slots (`local[slots]`: one for each
    of a fit's `num_workers`), set up for fits: `SPARK_CONF`, executors that run this Python
    (unless PYSPARK_PYTHON or `spark.pyspark.python` says otherwise), loopback, no UI, Spark's
    log at WARN less what no user can act on, and a JVM that starts and runs its first jobs sooner
    (on 2 cores, a cold fit's first step 6.0 s after `fit()` against 7.5 s with `SPARK_CONF`
    alone, and the session's start 3.8 s against 8.9 s: docs/benchmarks).

    - `jit="c1"` (default): the JVM compiles with the JIT's first tier only. A heavy Spark job
      of the session's own then runs slower (1.9x here); `jit="full"` is HotSpot's default.
    - `class_archive=True` (default): the JVM maps a class archive of Spark's classes. The
      first session of a given Java, Spark and options records it, and writes it as this
      process exits (about 10 s, once; 150-180 MB in `~/.cache/sparkdl-avg/jvm-archives`;
      the environment variable `SPARKDL_AVG_JVM_ARCHIVES` names another folder, or `off`).
    - `conf`: more Spark settings; `spark.driver.extraJavaOptions` is added after the
      session's own JVM options.

    Where this process runs a JVM already (a session started before), its options stay as
    they are, and so does a running session (a warning says so where its master differs).
    In an interactive kernel (Jupyter's, which may be killed while the JVM writes) the JVM
    maps an archive a script recorded but records none.

    Raises `ConfigError`, before any JVM starts, on a bad argument, under spark-submit or in
    a notebook whose JVM runs already (use its session), and where pyspark would make the
    session a Spark Connect one."""
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ConfigError(f"slots must be a positive int (task slots, one per worker), got "
                          f"{slots!r}")
    if jit not in JIT:
        raise ConfigError(f"jit must be one of {sorted(JIT)}, got {jit!r}")
    conf = dict(conf or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in conf.items()):
        raise ConfigError(f"conf must map setting names to string values, got {conf!r}"[:300])
    if "PYSPARK_GATEWAY_PORT" in os.environ:
        raise ConfigError("this Python runs beside a JVM that spark-submit or a notebook "
                          "started (PYSPARK_GATEWAY_PORT is set): use its session "
                          "(SparkSession.builder.getOrCreate(), with SPARK_CONF given to "
                          "spark-submit --conf or the cluster); local_session starts one")
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    running = SparkContext._active_spark_context
    why = None if running is not None else _connect_reason(conf)
    if why is not None:
        raise ConfigError(f"{why}, which makes a new session a Spark Connect one; "
                          "local_session starts Spark on this machine: leave that out, or "
                          "connect with SparkSession.builder.remote(...) (SPARK_CONF on the "
                          "server)")
    if running is not None and running.master != f"local[{slots}]":
        log.warning("local_session(%d): this process's Spark session runs already, on %s; it "
                    "is returned as it is (stop it first for a new one)", slots, running.master)
    if SparkContext._gateway is None:  # one machine: loopback, where Spark would warn that
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # the hostname resolves to it
    user_options = conf.pop("spark.driver.extraJavaOptions", "")
    builder = (SparkSession.builder.master(f"local[{slots}]").appName(app_name)
               .config("spark.api.mode", "classic")  # whatever SPARK_API_MODE says
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config(map={**SPARK_CONF, **conf}))
    spark = start_jvm(builder, jit=jit, class_archive=class_archive, java_options=user_options)
    session.default_executor_python(spark)  # for the session's Python jobs before any fit
    return spark


def _connect_reason(conf: Mapping[str, str]) -> str | None:
    """Why pyspark would make a new session a Spark Connect one, or None."""
    if "spark.remote" in conf:
        return "conf sets spark.remote"
    for name in ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED"):  # the second: an earlier
        if name in os.environ:  # Connect session of this process set it
            return f"the environment variable {name} is set"
    from pyspark.util import is_remote_only

    return "this pyspark is Spark Connect's client only" if is_remote_only() else None


def start_jvm(builder, *, jit: str = "c1", class_archive: bool = True, java_options: str = ""):
    """`builder`'s session, on a JVM this process starts as `local_session` says (`jit`, the
    class archive, `LOG4J`, `java_options` last), or on the one it runs already (this
    process's, or spark-submit's or a notebook's: PYSPARK_GATEWAY_PORT)."""
    global _recording
    from pyspark import SparkContext

    with _lock:
        if SparkContext._gateway is not None or "PYSPARK_GATEWAY_PORT" in os.environ:
            return builder.getOrCreate()  # the JVM runs already: its options are set
        usable = os.path.exists(LOG4J) and not _jvm_archive.splits_in_java_options(LOG4J)
        log4j = f"-Dlog4j2.configurationFile={LOG4J}" if usable else ""
        options = " ".join(o for o in (log4j, JIT[jit], java_options) if o)
        if not class_archive:
            return _start_filtered(builder.config("spark.driver.extraJavaOptions", options))
        spark, archive = _jvm_archive.start_session(builder, options, _start_filtered,
                                                    record="ipykernel" not in sys.modules)
        if archive is not None and archive.recording:
            _recording = (os.getpid(), SparkContext._gateway, archive)
            atexit.unregister(end_recording)  # once, however many JVMs this process starts
            atexit.register(end_recording)
        return spark


def end_recording() -> None:
    """Where the JVM `local_session` started records a class archive: stop its session, end
    the JVM and publish the archive (`_jvm_archive.publish_after_stop`). Run as this process
    exits; the jobs call it as each job ends, so that the next job's JVM maps the archive."""
    global _recording
    from pyspark import SparkContext

    with _lock:
        if _recording is None:
            return
        pid, gateway, archive = _recording
        _recording = None
        if pid != os.getpid() or SparkContext._gateway is not gateway:
            return  # a forked child's exit, or the JVM ended by someone else: not ours
        running = SparkContext._active_spark_context  # whichever thread started it
        if running is not None:
            try:
                running.stop()
            except Exception as exc:  # noqa: BLE001 - a JVM already gone: publish decides
                log.info("stopping the Spark session before writing the archive: %s", exc)
        _jvm_archive.publish_after_stop(archive)


def _start_filtered(builder):
    """`builder.getOrCreate()`, the JVM it launches given a pipe as its stderr, every line of
    which is copied to ours but the `JVM_NOISE` ones. Our own stderr is ours again once the JVM
    has started: only the JVM (and the Python workers it starts) write into the pipe, for as
    long as it runs. Where this process has no stderr to copy to, the JVM inherits it as
    it is."""
    if sys.stderr is not None:
        sys.stderr.flush()
    try:
        ours, out = os.dup(2), os.dup(2)  # ours restored below; out the copier's
    except OSError:  # no file descriptor 2
        return builder.getOrCreate()
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)  # inheritable: the JVM, started next, writes its stderr here
    os.close(write_end)

    def copy() -> None:  # until the JVM (and its Python workers) have all exited
        with os.fdopen(read_end, "rb") as pipe:
            for line in pipe:
                if not line.startswith(JVM_NOISE):
                    with contextlib.suppress(OSError):  # our stderr gone: drain, so no
                        os.write(out, line)  # writer into the pipe ever blocks or fails
        os.close(out)

    threading.Thread(target=copy, name="jvm-stderr", daemon=True).start()
    try:
        return builder.getOrCreate()
    finally:
        os.dup2(ours, 2)
        os.close(ours)
