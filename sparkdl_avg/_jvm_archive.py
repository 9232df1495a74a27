"""A class-data-sharing archive of Spark's classes for a JVM that this process starts itself
(a local session: the jobs', the benches'). A cold Spark JVM loads and verifies about 14,000
classes from some 260 jars, much of it in the session's start and its first jobs. The first
such JVM for a given Java and Spark records the classes it loaded as it exits
(`-XX:ArchiveClassesAtExit`, Java 13 and later); once it has exited cleanly the recording is
published under a name that says which Java, which jars and which JVM options it was recorded
with, and later JVMs of the same map it (`-XX:SharedArchiveFile`) instead of loading those
classes again: here, a session's start 2.4 s instead of 4.4 s and its first job 1.0 s instead
of 2.1 s (docs/guide/cluster.md).

A recording JVM runs slower and its exit takes seconds more while it writes the archive (150-180
MB), once. A JVM given an archive it cannot use (another JVM's, a different class path)
runs without it; one given a damaged archive does not start at all, which is why a recording
is published only after a clean exit and under a new name (`os.replace`), and why a caller
that fails to start a JVM with an archive discards it (`discard`). The folder is the user's
cache (`SPARKDL_AVG_JVM_ARCHIVES` names another, `off` turns archives off); an archive is code
the JVM runs, so a folder that others may write to is not used.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

FOLDER_ENV = "SPARKDL_AVG_JVM_ARCHIVES"
"""The folder archives are kept in; `off` turns them off. Default: the user's cache folder."""
KEEP_S = 30 * 86400
"""An archive no JVM has used for this long is removed when another is published (a pyspark
or Java upgrade leaves its predecessor's behind)."""
STALE_S = 86400
"""A recording this old was left by a process that died before publishing it; a marker this
old (a JVM that could not write its archive) is forgotten, so a later JVM tries again."""
QUIET = "-Xlog:cds*=off"
"""The JVM's notes on what it could not archive (classes of signed jars, generated ones): none
a user can act on."""


@dataclass(frozen=True)
class ClassArchive:
    """The archive for one JVM about to start: `path` is the published archive; `recording`
    is where this JVM records one as it exits (None: it maps `path`, which exists)."""

    path: str
    recording: str | None

    @property
    def java_options(self) -> str:
        """What to add to the JVM's options (`spark.driver.extraJavaOptions`)."""
        if self.recording:
            return f"-XX:ArchiveClassesAtExit={self.recording} {QUIET}"
        return f"-XX:SharedArchiveFile={self.path} {QUIET}"


def folder() -> str | None:
    """The archives' folder, created if need be; None where archives are off, where its path
    has a space or a quote (Spark's launcher splits JVM options there) or where the folder is
    not this user's alone."""
    chosen = os.environ.get(FOLDER_ENV)
    if chosen == "off":
        return None
    if not chosen:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        chosen = os.path.join(cache, "sparkdl-avg", "jvm-archives")
    if splits_in_java_options(chosen):
        log.debug("no JVM class archives: Spark splits JVM options at spaces (%r)", chosen)
        return None
    try:
        os.makedirs(chosen, mode=0o700, exist_ok=True)
        st = os.stat(chosen)
    except OSError as exc:
        log.debug("no JVM class archives: %s", exc)
        return None
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        log.warning("not using JVM class archives in %s: others may write to it (an archive is "
                    "code the JVM runs); chmod go-w it or set %s", chosen, FOLDER_ENV)
        return None
    return chosen


def splits_in_java_options(path: str) -> bool:
    """Whether Spark's launcher would cut `path` apart in a JVM option: it splits the options
    at spaces and does not honour quotes."""
    return any(c.isspace() or c in "\"'\\" for c in path)


def _java() -> str | None:
    """The java Spark's launcher runs (`spark-class`: JAVA_HOME's, else PATH's), resolved."""
    home = os.environ.get("JAVA_HOME")
    found = os.path.join(home, "bin", "java") if home else shutil.which("java")
    return os.path.realpath(found) if found and os.path.exists(found) else None


def _stamp(path: str) -> str:
    st = os.stat(path)
    return f"{path}:{st.st_size}:{st.st_mtime_ns}"


def key(java_options: str) -> str | None:
    """What an archive depends on, hashed: the java binary and its libjvm, every jar of the
    Spark the launcher would run (name, size, mtime), the JVM options given and the extra class
    path; None where Java or Spark's jars cannot be found."""
    java = _java()
    if java is None:
        return None
    libjvm = os.path.join(os.path.dirname(os.path.dirname(java)), "lib", "server", "libjvm.so")
    try:
        from pyspark.find_spark_home import _find_spark_home

        jars = os.path.join(_find_spark_home(), "jars")
        parts = [_stamp(java), _stamp(libjvm) if os.path.exists(libjvm) else ""]
        parts += sorted(_stamp(os.path.join(jars, name)) for name in os.listdir(jars))
    except (OSError, ImportError, SystemExit) as exc:  # _find_spark_home exits when it fails
        log.debug("no JVM class archive: %s", exc)
        return None
    parts += [java_options, os.environ.get("SPARK_DIST_CLASSPATH", "")]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def start_session(builder, options: str, start=None, record: bool = True):
    """`builder`'s session, its JVM (which this process starts) given `options` and the archive
    `for_new_jvm` chooses (`record`: or records where there is none); that archive too, or
    None. `start(builder)` starts it (`getOrCreate` by default). A JVM that exits as it starts
    with its archive (a damaged file) starts again, recording a new one. Where the archive is
    a recording, publish it with `publish_after_stop` once the session has stopped."""
    from pyspark.errors import PySparkRuntimeError

    start = start or (lambda b: b.getOrCreate())
    archive = for_new_jvm(options, record=record)
    if archive is not None and archive.recording is None:
        try:
            return start(builder.config("spark.driver.extraJavaOptions",
                                        f"{options} {archive.java_options}")), archive
        except PySparkRuntimeError as exc:
            if exc.getCondition() != "JAVA_GATEWAY_EXITED":  # not the JVM's start: not ours
                raise
            log.warning("the JVM did not start with its class archive %s (%s): removed, and "
                        "the JVM started again%s", archive.path, exc,
                        " to record a new one" if record else "")
            discard(archive)
            archive = for_new_jvm(options, record=record)
    extra = f" {archive.java_options}" if archive is not None else ""
    return start(builder.config("spark.driver.extraJavaOptions", options + extra)), archive


def publish_after_stop(archive: ClassArchive) -> bool:
    """End the JVM this process started, once its session has stopped, so that it writes the
    archive it recorded, and publish that (`publish`); a later session in this process starts
    a JVM of its own."""
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    SparkContext._gateway = SparkContext._jvm = None
    gateway.shutdown()
    return publish(archive, gateway.proc)


def for_new_jvm(java_options: str, record: bool = True) -> ClassArchive | None:
    """The archive a JVM about to start with `java_options` should map, or record where there is
    none yet (`record`); None where archives are off or unknowable, where there is none and
    `record` is false, or where a JVM of this kind exited cleanly without writing one in the
    last day (a marker remembers it, so later JVMs do not record in vain)."""
    where, name = folder(), key(java_options)
    if where is None or name is None:
        return None
    path = os.path.join(where, f"spark-{name}.jsa")
    _remove_older(where, (".recording", ".failed"), STALE_S)
    if os.path.exists(path + ".failed"):
        return None
    if os.path.exists(path):
        os.utime(path)  # in use: kept by `_remove_older` for KEEP_S more
        return ClassArchive(path, None)
    return ClassArchive(path, f"{path}.{os.getpid()}.recording") if record else None


def publish(archive: ClassArchive, jvm: subprocess.Popen, timeout_s: float = 180.0) -> bool:
    """End a recording JVM whose session has stopped and publish what it recorded: its stdin
    closed (Spark's gateway exits on it), its exit awaited, the recording renamed to
    `archive.path` if the JVM exited cleanly. Whatever happens, no partial recording is left.
    Whether an archive was published."""
    if archive.recording is None:
        raise ValueError(f"{archive.path}: this JVM mapped the archive; it recorded none")
    started = time.perf_counter()
    log.info("the JVM is writing its class archive for later sessions (once)")
    code = None
    try:
        jvm.stdin.close()
        code = jvm.wait(timeout_s)
    except subprocess.TimeoutExpired:
        jvm.kill()
        jvm.wait()
    finally:  # published, or removed (an interrupt included)
        written = os.path.exists(archive.recording) and os.path.getsize(archive.recording) > 0
        published = code == 0 and written
        if published:
            os.replace(archive.recording, archive.path)
        else:
            _remove(archive.recording)
    if published:
        _remove_older(os.path.dirname(archive.path), ".jsa", KEEP_S)
        log.info("JVM class archive %s written in %.1f s", archive.path,
                 time.perf_counter() - started)
        return True
    if code == 0:  # a clean exit and nothing written: this JVM cannot archive these classes
        with open(archive.path + ".failed", "w") as marker:
            marker.write("the JVM exited cleanly without writing its class archive\n")
    log.info("no JVM class archive written (the JVM's exit code: %s)", code)
    return False


def discard(archive: ClassArchive) -> None:
    """Remove an archive a JVM refused to start with."""
    _remove(archive.path)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def _remove_older(where: str, suffixes: str | tuple[str, ...], age_s: float) -> None:
    """Remove the files of `where` whose names end with one of `suffixes`, last modified over
    `age_s` ago."""
    now = time.time()
    for name in os.listdir(where):
        path = os.path.join(where, name)
        with contextlib.suppress(FileNotFoundError):  # another process removed it first
            if name.endswith(suffixes) and now - os.path.getmtime(path) > age_s:
                os.remove(path)
