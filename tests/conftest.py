"""Test layers: pure tests need nothing; `spark` tests share one local[2] session (a Spark
Connect one in the process test_connect starts); tests marked `cluster` use the session's
standalone cluster or start their own processes. MLflow logs to a
throwaway sqlite store per session. The slowest subprocesses a module waits on start as soon
as collection selects its tests (`early`), beside the rest of the suite."""

from __future__ import annotations

import os
import sys

import pytest

import sparkdl_avg

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
# Executors must run this interpreter (the venv), not whatever python3 is on PATH.
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
# No test writes a JVM class archive into the user's cache: those that record one name a
# folder of their own (test_job, test_local_session, test_jvm_archive).
os.environ["SPARKDL_AVG_JVM_ARCHIVES"] = "off"


def pytest_collection_finish(session):
    import early

    if os.environ.get("SPARKDL_AVG_TEST_CONNECT") is None:  # not the Connect inner run
        early.start_selected(session.items)


def pytest_sessionfinish(session, exitstatus):
    import early

    early.stop_all()


@pytest.fixture(scope="session", autouse=True)
def mlflow_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root}/mlflow.db"
    old = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = uri
    import mlflow

    mlflow.set_tracking_uri(uri)
    yield uri
    if old is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = old


CONNECT_URL = os.environ.get("SPARKDL_AVG_TEST_CONNECT")
"""Set by test_connect for the pytest process it starts: `spark` is then a Spark Connect
session to that server, and the tests it runs (test_sessions, the quickstart notebook) run
on Connect."""


@pytest.fixture(scope="session")
def spark():
    from pyspark.sql import SparkSession

    if CONNECT_URL:
        session = SparkSession.builder.remote(CONNECT_URL).getOrCreate()
        yield session
        session.stop()
        return
    session = (
        SparkSession.builder.master("local[2]")
        .appName("sparkdl-avg-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config(map=sparkdl_avg.SPARK_CONF)
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture
def ansi_off(spark):
    """The shared session with `spark.sql.ansi.enabled` off (as many Databricks clusters
    run: a narrowing cast then wraps silently) for one test, then as it was."""
    old = spark.conf.get("spark.sql.ansi.enabled")
    spark.conf.set("spark.sql.ansi.enabled", "false")
    try:
        yield spark
    finally:
        spark.conf.set("spark.sql.ansi.enabled", old)


@pytest.fixture(scope="session")
def standalone(tmp_path_factory):
    """A Spark standalone cluster on loopback (master + two workers, one fake GPU each),
    started on first use and stopped at the end of the session, whatever happened."""
    from standalone_cluster import StandaloneCluster

    with StandaloneCluster(tmp_path_factory.mktemp("standalone"), workers=2) as cluster:
        yield cluster


@pytest.fixture
def mlflow_client(mlflow_store):
    from mlflow.tracking import MlflowClient

    return MlflowClient(mlflow_store)
