"""`sparkdl_avg.local_session`: its arguments refused before any JVM starts, and, in a fresh
Python of its own, a real session that runs a job with the settings it promises and publishes
the class archive its JVM recorded as the process exits (the jobs publish theirs as each ends:
test_job)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sparkdl_avg import ConfigError, _local_session, local_session


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"slots": 0}, "slots"), ({"slots": True}, "slots"), ({"slots": "2"}, "slots"),
    ({"jit": "c2"}, "jit"), ({"conf": {"spark.sql.shuffle.partitions": 4}}, "conf"),
])
def test_a_bad_argument_is_refused_naming_it(kwargs, named):
    with pytest.raises(ConfigError, match=named):
        local_session(**kwargs)


@pytest.mark.parametrize(("env", "conf", "named"), [
    ({"SPARK_REMOTE": "sc://127.0.0.1:1"}, {}, "SPARK_REMOTE"),
    ({"SPARK_REMOTE": ""}, {}, "SPARK_REMOTE"),  # pyspark asks only whether it is there
    ({"SPARK_CONNECT_MODE_ENABLED": "1"}, {}, "SPARK_CONNECT_MODE_ENABLED"),
    ({}, {"spark.remote": "sc://127.0.0.1:1"}, "spark.remote"),
])
def test_what_would_make_a_new_session_a_connect_one_is_refused(monkeypatch, env, conf, named):
    """Where no session runs yet: the check comes before any JVM starts."""
    from pyspark import SparkContext

    monkeypatch.setattr(SparkContext, "_active_spark_context", None)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=named):
        local_session(2, conf=conf)


def test_under_spark_submit_or_a_notebooks_jvm_it_refuses_and_the_jobs_take_that_session(
        monkeypatch):
    """local_session starts Spark here, so beside spark-submit's JVM it refuses; `start_jvm`
    (the jobs' path with --master) takes that JVM's session as it is: no JVM options set, no
    class archive recorded."""
    from pyspark import SparkContext

    class Builder:
        calls: list = []

        def config(self, *args, **kwargs):
            self.calls.append(("config", args, kwargs))
            return self

        def getOrCreate(self):  # noqa: N802 - pyspark's name
            self.calls.append(("getOrCreate",))
            return "spark-submit's session"

    monkeypatch.setenv("PYSPARK_GATEWAY_PORT", "1")
    monkeypatch.setattr(SparkContext, "_gateway", None)  # connected to at the first session
    with pytest.raises(ConfigError, match="PYSPARK_GATEWAY_PORT"):
        local_session(2)
    assert _local_session.start_jvm(Builder()) == "spark-submit's session"
    assert Builder.calls == [("getOrCreate",)] and _local_session._recording is None


def test_a_forked_childs_exit_leaves_the_parents_recording_alone(monkeypatch):
    from pyspark import SparkContext

    published = []
    monkeypatch.setattr(_local_session._jvm_archive, "publish_after_stop", published.append)
    gateway = object()
    monkeypatch.setattr(SparkContext, "_gateway", gateway)
    monkeypatch.setattr(SparkContext, "_active_spark_context", None)
    monkeypatch.setattr(_local_session, "_recording", (os.getpid() + 1, gateway, "archive"))
    _local_session.end_recording()  # as a child forked from the recording process exits
    assert published == [] and _local_session._recording is None
    monkeypatch.setattr(_local_session, "_recording", (os.getpid(), gateway, "archive"))
    _local_session.end_recording()  # the process itself
    assert published == ["archive"]


# A fresh process: its session's JVM is the first, so local_session starts it. It runs a
# Python job (the executors' daemon is SPARK_CONF's) and exits without stopping the session.
SCRIPT = """
import json, sys
from sparkdl_avg import local_session
spark = local_session(2, conf={"spark.driver.extraJavaOptions": "-Dsparkdl.test=yes",
                               "spark.sql.shuffle.partitions": "3"})
sc = spark.sparkContext
runtime = sc._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean()
pid = sc._jvm.java.lang.ProcessHandle.current().pid()
with open(f"/proc/{pid}/maps") as maps:
    mapped = sorted({line.split()[-1] for line in maps if line.endswith(".jsa\\n")})
print(json.dumps({
    "options": list(runtime.getInputArguments().toArray()), "mapped": mapped,
    "master": sc.master, "daemon": sc.getConf().get("spark.python.daemon.module"),
    "ui": sc.getConf().get("spark.ui.enabled"),
    "shuffle": spark.conf.get("spark.sql.shuffle.partitions"),
    "rows": sc.parallelize(range(10), 2).map(lambda x: x * 2).sum()}))
"""


def run_script(tmp_path) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_")}
    env["SPARKDL_AVG_JVM_ARCHIVES"] = str(tmp_path / "archives")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.cluster
def test_a_new_jvms_session_is_set_up_for_fits_and_its_archive_is_published_at_exit(tmp_path):
    first, stderr = run_script(tmp_path)
    assert first["rows"] == 90 and first["master"] == "local[2]"
    assert first["daemon"] == "sparkdl_avg.task.warm_daemon" and first["ui"] == "false"
    assert first["shuffle"] == "3"  # the caller's settings reach the session
    options = first["options"]
    # the caller's JVM options after the session's own: theirs win where the two disagree
    assert options.index("-XX:TieredStopAtLevel=1") < options.index("-Dsparkdl.test=yes")
    assert any(o.startswith("-Dlog4j2.configurationFile=") for o in options), options
    assert "WARNING: Using incubator modules" not in stderr  # the JVM's stderr, filtered
    # the first JVM recorded the archive; published as the process exited, nothing half-done
    archives = os.listdir(tmp_path / "archives")
    assert len(archives) == 1 and archives[0].endswith(".jsa"), archives
    archive = str(tmp_path / "archives" / archives[0])
    assert any(o.startswith("-XX:ArchiveClassesAtExit=") for o in options), options
    second, _ = run_script(tmp_path)  # the next process's JVM maps it
    assert f"-XX:SharedArchiveFile={archive}" in second["options"], second["options"]
    assert archive in second["mapped"]
