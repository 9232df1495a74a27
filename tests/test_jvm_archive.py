"""The class archive of Spark's classes a JVM started here maps (`sparkdl_avg._jvm_archive`):
which archive a JVM gets, and how a recording is published, without a JVM: a stand-in Java
and Spark, and stand-in JVM processes that do what a recording JVM does when its stdin closes.
A real JVM records and maps one in test_job (the jobs' JVMs)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest

from sparkdl_avg import _jvm_archive


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A stand-in Java (JAVA_HOME/bin/java, lib/server/libjvm.so) and Spark (SPARK_HOME/jars),
    and an empty archive folder; the folder."""
    java_home, spark_home, folder = tmp_path / "jdk", tmp_path / "spark", tmp_path / "archives"
    (java_home / "bin").mkdir(parents=True)
    (java_home / "lib" / "server").mkdir(parents=True)
    (java_home / "bin" / "java").write_text("java")
    (java_home / "lib" / "server" / "libjvm.so").write_text("jvm")
    (spark_home / "jars").mkdir(parents=True)
    for name in ("spark-core.jar", "scala-library.jar"):
        (spark_home / "jars" / name).write_text(name)
    monkeypatch.setenv("JAVA_HOME", str(java_home))
    monkeypatch.setenv("SPARK_HOME", str(spark_home))
    monkeypatch.setenv(_jvm_archive.FOLDER_ENV, str(folder))
    monkeypatch.delenv("SPARK_DIST_CLASSPATH", raising=False)
    return folder


def jvm(recording: str | None, *, writes: bool = True, code: int = 0, hangs: bool = False):
    """A stand-in for a recording JVM: when its stdin closes it writes `recording` (as the JVM
    writes its archive as it exits) and exits with `code`; `hangs`: it never exits."""
    lines = ["import sys, time", "sys.stdin.read()"]
    if hangs:
        lines.append("time.sleep(60)")
    if writes:
        lines.append(f"open({recording!r}, 'wb').write(bytes(1000))")
    script = "\n".join([*lines, f"sys.exit({code})"])
    return subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE)


def test_a_first_jvm_records_and_a_later_one_maps_what_it_published(machine):
    first = _jvm_archive.for_new_jvm("-XX:TieredStopAtLevel=1")
    assert first.recording and not os.path.exists(first.path)
    assert f"-XX:ArchiveClassesAtExit={first.recording}" in first.java_options.split()
    assert _jvm_archive.publish(first, jvm(first.recording))
    assert os.listdir(machine) == [os.path.basename(first.path)]  # no recording left behind
    later = _jvm_archive.for_new_jvm("-XX:TieredStopAtLevel=1")
    assert later == _jvm_archive.ClassArchive(first.path, None)
    assert f"-XX:SharedArchiveFile={first.path}" in later.java_options.split()
    assert _jvm_archive.QUIET in later.java_options.split()
    with pytest.raises(ValueError, match="recorded none"):  # a mapping JVM has none to publish
        _jvm_archive.publish(later, jvm(None, writes=False))


def test_the_archive_follows_java_the_jars_the_options_and_the_class_path(machine, tmp_path,
                                                                            monkeypatch):
    """An archive recorded with one Java, one set of jars or other JVM options is never given
    to another: a JVM refuses a mismatched archive (and runs without it), or fails to start on
    a damaged one."""
    key = _jvm_archive.key("-Xa")
    assert key == _jvm_archive.key("-Xa")
    assert _jvm_archive.key("-Xb") != key
    jar = tmp_path / "spark" / "jars" / "spark-core.jar"
    jar.write_text("spark-core, upgraded")
    upgraded = _jvm_archive.key("-Xa")
    assert upgraded != key
    (tmp_path / "spark" / "jars" / "more.jar").write_text("more")
    assert _jvm_archive.key("-Xa") != upgraded
    more = _jvm_archive.key("-Xa")
    (tmp_path / "jdk" / "lib" / "server" / "libjvm.so").write_text("another JVM build")
    assert _jvm_archive.key("-Xa") != more
    rebuilt = _jvm_archive.key("-Xa")
    monkeypatch.setenv("SPARK_DIST_CLASSPATH", "/opt/hadoop/*")
    assert _jvm_archive.key("-Xa") != rebuilt
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "no-such-jdk"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no java on it either
    assert _jvm_archive.key("-Xa") is None
    assert _jvm_archive.for_new_jvm("-Xa") is None


def test_a_jvm_that_fails_leaves_neither_a_recording_nor_an_archive(machine):
    archive = _jvm_archive.for_new_jvm("")
    assert not _jvm_archive.publish(archive, jvm(archive.recording, code=1))
    assert os.listdir(machine) == []
    assert _jvm_archive.for_new_jvm("").recording  # the next JVM records again


def test_a_jvm_that_does_not_exit_is_killed_and_its_recording_removed(machine):
    archive = _jvm_archive.for_new_jvm("")
    process = jvm(archive.recording, hangs=True)
    with open(archive.recording, "wb") as part:  # what it had written so far
        part.write(bytes(10))
    started = time.monotonic()
    assert not _jvm_archive.publish(archive, process, timeout_s=1.0)
    assert time.monotonic() - started < 30
    assert process.returncode is not None
    assert os.listdir(machine) == []


def test_a_clean_exit_without_an_archive_stops_recordings_for_a_day(machine):
    """A JVM that cannot archive these classes (it exits 0 and writes nothing) is remembered:
    later JVMs do not pay for recording in vain, until the marker is a day old."""
    archive = _jvm_archive.for_new_jvm("")
    assert not _jvm_archive.publish(archive, jvm(archive.recording, writes=False))
    assert os.listdir(machine) == [os.path.basename(archive.path) + ".failed"]
    assert _jvm_archive.for_new_jvm("") is None
    day_ago = time.time() - _jvm_archive.STALE_S - 60
    os.utime(archive.path + ".failed", (day_ago, day_ago))
    assert _jvm_archive.for_new_jvm("").recording


def test_unused_archives_and_dead_processes_recordings_are_removed(machine):
    machine.mkdir(mode=0o700)
    month_ago = time.time() - _jvm_archive.KEEP_S - 60
    day_ago = time.time() - _jvm_archive.STALE_S - 60
    for name, when in (("spark-old.jsa", month_ago), ("spark-recent.jsa", time.time()),
                       ("spark-x.jsa.1.recording", day_ago),
                       ("spark-y.jsa.2.recording", time.time())):
        (machine / name).write_bytes(b"x")
        os.utime(machine / name, (when, when))
    archive = _jvm_archive.for_new_jvm("")
    assert sorted(os.listdir(machine)) == ["spark-old.jsa", "spark-recent.jsa",
                                           "spark-y.jsa.2.recording"]
    assert _jvm_archive.publish(archive, jvm(archive.recording))
    assert sorted(os.listdir(machine)) == sorted(["spark-recent.jsa", "spark-y.jsa.2.recording",
                                                  os.path.basename(archive.path)])
    # mapping an archive keeps it: its time is renewed
    os.utime(archive.path, (month_ago, month_ago))
    assert _jvm_archive.for_new_jvm("").recording is None
    assert time.time() - os.path.getmtime(archive.path) < 60


def test_archives_are_off_on_request_in_a_folder_others_may_write_or_with_spaces(
        machine, monkeypatch, caplog):
    monkeypatch.setenv(_jvm_archive.FOLDER_ENV, "off")
    assert _jvm_archive.for_new_jvm("") is None
    monkeypatch.setenv(_jvm_archive.FOLDER_ENV, str(machine))
    machine.mkdir(mode=0o700)
    os.chmod(machine, 0o777)  # an archive is code the JVM runs
    with caplog.at_level(logging.WARNING, logger=_jvm_archive.__name__):
        assert _jvm_archive.for_new_jvm("") is None
    assert "others may write to it" in caplog.text and _jvm_archive.FOLDER_ENV in caplog.text
    spaced = machine.parent / "my archives"  # Spark's launcher splits JVM options at spaces
    monkeypatch.setenv(_jvm_archive.FOLDER_ENV, str(spaced))
    assert _jvm_archive.for_new_jvm("") is None
    monkeypatch.delenv(_jvm_archive.FOLDER_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(machine.parent / "cache"))
    default = _jvm_archive.folder()  # the user's cache, made private
    assert default == str(machine.parent / "cache" / "sparkdl-avg" / "jvm-archives")
    assert os.stat(default).st_mode & 0o777 == 0o700


class Builder:
    """A stand-in for a session builder: the JVM options each start was given."""

    current = ""

    def config(self, key, value):
        assert key == "spark.driver.extraJavaOptions"
        self.current = value
        return self


def test_a_jvm_that_does_not_start_with_its_archive_starts_again_recording(machine, caplog):
    """A damaged archive stops a JVM from starting (a truncated one did, with Java 17): it is
    removed, and the JVM starts again recording a new one."""
    from pyspark.errors import PySparkRuntimeError

    first = _jvm_archive.for_new_jvm("-Xa")
    assert _jvm_archive.publish(first, jvm(first.recording))
    builder, starts = Builder(), []

    def start(b):
        starts.append(b.current)
        if "SharedArchiveFile" in b.current:
            raise PySparkRuntimeError(errorClass="JAVA_GATEWAY_EXITED", messageParameters={})
        return "session"

    with caplog.at_level(logging.WARNING, logger=_jvm_archive.__name__):
        session, archive = _jvm_archive.start_session(builder, "-Xa", start)
    assert session == "session"
    assert [s.split()[1].split("=")[0] for s in starts] == ["-XX:SharedArchiveFile",
                                                            "-XX:ArchiveClassesAtExit"]
    assert all(s.startswith("-Xa ") for s in starts)
    assert archive.recording and not os.path.exists(first.path)
    assert "did not start with its class archive" in caplog.text
    # a JVM that starts with its archive is started once
    assert _jvm_archive.publish(archive, jvm(archive.recording))
    starts.clear()
    session, mapped = _jvm_archive.start_session(builder, "-Xa", lambda b: starts.append(b))
    assert mapped.recording is None and len(starts) == 1


def test_an_error_other_than_the_jvms_exit_keeps_the_archive(machine):
    """Only a JVM that exits as it starts condemns its archive: an error of another kind (a
    Connect URL missing) is raised as it is, and the archive stays."""
    from pyspark.errors import PySparkRuntimeError

    first = _jvm_archive.for_new_jvm("-Xa")
    assert _jvm_archive.publish(first, jvm(first.recording))

    def start(b):
        raise PySparkRuntimeError(errorClass="CONNECT_URL_NOT_SET", messageParameters={})

    with pytest.raises(PySparkRuntimeError, match="CONNECT_URL_NOT_SET"):
        _jvm_archive.start_session(Builder(), "-Xa", start)
    assert os.path.exists(first.path)


def test_without_recording_a_jvm_maps_an_archive_or_has_none(machine):
    """`record=False` (an interactive kernel, which may be killed while its JVM writes): no
    recording where there is no archive, the archive where there is one."""
    assert _jvm_archive.for_new_jvm("-Xa", record=False) is None
    assert not os.listdir(machine)
    first = _jvm_archive.for_new_jvm("-Xa")
    assert _jvm_archive.publish(first, jvm(first.recording))
    assert _jvm_archive.for_new_jvm("-Xa", record=False) == _jvm_archive.ClassArchive(
        first.path, None)
