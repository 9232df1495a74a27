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

from sparkdl_avg import ConfigError, local_session


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"slots": 0}, "slots"), ({"slots": True}, "slots"), ({"slots": "2"}, "slots"),
    ({"jit": "c2"}, "jit"), ({"conf": {"spark.sql.shuffle.partitions": 4}}, "conf"),
])
def test_a_bad_argument_is_refused_naming_it(kwargs, named):
    with pytest.raises(ConfigError, match=named):
        local_session(**kwargs)


def test_a_spark_connect_environment_is_refused(monkeypatch):
    monkeypatch.setenv("SPARK_REMOTE", "sc://127.0.0.1:1")
    with pytest.raises(ConfigError, match="SPARK_REMOTE"):
        local_session(2)


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
