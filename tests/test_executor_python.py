"""Which Python the executors run: a local master's run the driver's unless PYSPARK_PYTHON or
spark.pyspark.python says otherwise, and an executors' Python without sparkdl-avg is named,
with the two settings, when the fit's first Python job fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_docs import readme_example

from sparkdl_avg.driver.session import python_for_executors

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("master", "env", "conf", "current", "chosen"), [
    ("local[2]", None, None, "python3", sys.executable),  # the README's session
    ("local", None, None, "python3", sys.executable),
    ("local[2,3]", None, None, "python3", sys.executable),
    ("local-cluster[2,1,1024]", None, None, "python3", sys.executable),  # executors here too
    ("spark://host:7077", None, None, "python3", None),  # another machine: PATH's python3
    ("yarn", None, None, "python3", None),
    ("local[2]", "/env/python", None, "/env/python", None),  # the user's PYSPARK_PYTHON
    ("local[2]", "python3", None, "python3", None),  # even when it names PATH's
    # a builder's spark.pyspark.python, which Spark applies only under spark-submit
    ("local[2]", None, "/conf/python", "python3", "/conf/python"),
    ("spark://host:7077", None, "./environment/bin/python", "python3",
     "./environment/bin/python"),
    ("local[2]", None, None, "/set/by/hand", None),  # not Spark's default: someone chose it
])
def test_the_executors_python_is_chosen_by_the_users_settings_else_the_master(
        master, env, conf, current, chosen):
    assert python_for_executors(master, env, conf, current) == chosen


@pytest.fixture(scope="module")
def python_without_the_package(tmp_path_factory) -> Path:
    """A `python3` that cannot import sparkdl-avg: the interpreter this venv was made from, in
    isolated mode (neither PYTHONPATH nor the working directory on its path), as a system
    Python beside a venv that was not activated is."""
    folder = tmp_path_factory.mktemp("bin")
    python3 = folder / "python3"
    python3.write_text(f'#!/bin/sh\nexec "{sys._base_executable}" -I "$@"\n')
    python3.chmod(0o755)
    lacks = subprocess.run([str(python3), "-c", "import sparkdl_avg"], capture_output=True)
    if lacks.returncode == 0:
        pytest.skip(f"{sys._base_executable} has sparkdl-avg installed")
    return python3


@pytest.mark.cluster
def test_the_readme_example_runs_with_the_venvs_python_not_activated(
        python_without_the_package, tmp_path, mlflow_store):
    """The README's example run by the venv's Python given by its path, with PATH's `python3`
    one that lacks sparkdl-avg and no PYSPARK_PYTHON: the executors run the driver's Python
    (without the default they run PATH's, and the probe job fails)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_")}
    env.update(PATH=f"{python_without_the_package.parent}{os.pathsep}{env['PATH']}",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
               SPARK_LOCAL_IP="127.0.0.1", MLFLOW_TRACKING_URI=mlflow_store)
    proc = subprocess.run([sys.executable, "-c", readme_example()], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "test accuracy" in proc.stdout


@pytest.mark.spark
def test_an_executors_python_without_the_package_is_named_with_pyspark_python(
        spark, python_without_the_package, monkeypatch):
    """PYSPARK_PYTHON set to a Python without sparkdl-avg: the fit fails at its probe job with
    a ClusterError that says the executors' Python cannot run the tasks, names that Python and
    where it came from, and the two settings that choose it."""
    import torch

    from sparkdl_avg import ClusterError, TrainConfig, fit
    from sparkdl_avg.driver import cluster

    bad = str(python_without_the_package)
    # as a SparkContext started with it reads PYSPARK_PYTHON
    monkeypatch.setenv("PYSPARK_PYTHON", bad)
    monkeypatch.setattr(spark.sparkContext, "pythonExec", bad)
    monkeypatch.setattr(cluster, "_PROBED", set())  # the shared session's probe: run again
    monkeypatch.setattr(cluster, "PROBE_S", 120.0)  # a loaded machine starts Pythons slowly
    df = spark.createDataFrame([([0.0, 1.0], 0), ([1.0, 0.0], 1)] * 4, ["features", "label"])
    with pytest.raises(ClusterError) as failed:
        fit(df, lambda: torch.nn.Linear(2, 2), TrainConfig(num_workers=2, epochs=1))
    message = str(failed.value)
    assert "the executors' Python cannot run sparkdl-avg's tasks" in message
    assert "No module named 'sparkdl_avg'" in message
    assert f"{bad}, from PYSPARK_PYTHON" in message
    assert "spark.pyspark.python" in message


@pytest.mark.spark
def test_a_job_failed_before_its_deadline_is_reported_as_its_failure(spark, monkeypatch):
    """A probe job whose task failed while the job is still running at the deadline (a
    barrier stage whose other task is still starting its Python, on a loaded machine) raises
    that task's error, not the deadline's None (which the fit reports as slots that never
    came)."""
    import threading

    import pyarrow as pa

    from sparkdl_avg import ClusterError
    from sparkdl_avg.driver import probe, session

    def fail(batches):
        raise ModuleNotFoundError("No module named 'torch'")
        yield pa.RecordBatch.from_pylist([])

    cancelled = threading.Event()  # the job's thread ends once the deadline cancels it
    cancel = session.cancel_jobs
    monkeypatch.setattr(session, "cancel_jobs", lambda *a: (cancel(*a), cancelled.set()))

    def failed_then_still_running():
        with pytest.raises(Exception, match="No module named"):
            spark.range(1, numPartitions=1).mapInArrow(fail, "id long").collect()
        cancelled.wait(30)
        return []

    spark.range(1).mapInArrow(lambda b: b, "id long").collect()  # a warm worker: fails at once
    with pytest.raises(ClusterError, match="cannot run sparkdl-avg's tasks .*'torch'"):
        probe.TaggedJob(spark, failed_then_still_running).run(deadline_s=5.0)
