"""The representative tests, run on both kinds of session: here on the classic local[2] one,
and by test_connect in a pytest process of its own whose `spark` is a Spark Connect session
(conftest). A sync fit on Connect must give the classic one's parameters bit for bit: the
classic result comes in SPARKDL_AVG_TEST_REFERENCE."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from functools import partial

import numpy as np
import pytest
import torch
from faulty import (
    FaultyMLP,
    assert_sync_recovery,
    dataset,
    latest_run,
    same_parameters,
    steps_run,
)
from rounding import classes_agree, forward_tolerance

from sparkdl_avg import ClusterError, DataError, TrainConfig, fit
from sparkdl_avg.driver import session as session_kind

pytestmark = pytest.mark.spark
SYNC = TrainConfig(num_workers=2, epochs=2, batch_size=15, averaging_frequency=2,
                   optimizer="adam", lr=0.01, seed=5, log_model=False,
                   experiment_name="sessions")
REFERENCE = os.environ.get("SPARKDL_AVG_TEST_REFERENCE")


@pytest.fixture(scope="module")
def data(spark):
    return dataset(spark).cache()


def sync_fit(data, **kwargs):
    return fit(data, FaultyMLP, SYNC, eval_df=data, **kwargs)


def parameters(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in model.state_dict().items()}


def test_the_session_kind_is_told_by_the_session_object(spark):
    assert session_kind.is_connect(spark) == bool(os.environ.get("SPARKDL_AVG_TEST_CONNECT"))


@pytest.mark.core
def test_the_session_runs_the_spark_line_of_the_clients_pyspark(spark):
    """CI's 4.0 run (and its Connect server, inner run) must run 4.0 on the Spark side too,
    not a mix of two lines."""
    import pyspark

    assert spark.version == pyspark.__version__


def test_python_workers_are_forked_from_the_warm_daemon_with_torch_loaded(spark):
    """The session has `SPARK_CONF` (conftest, and the Connect server's settings): its Python
    workers come from `task.warm_daemon`, which imported torch and the task's modules, and
    pyspark from the installed package (compiled), not from Spark's copy of it in
    pyspark.zip (compiled afresh by every process). Nor do they have an archive finder off
    their path, or a jar with no Python on it, for Spark's `invalidate_caches` to read again
    in each worker's first task."""
    import pyspark

    def forked_from(batches):  # nested: pickled by value, as test modules are not on workers
        import os
        import sys
        import zipimport

        import pyarrow as pa
        import pyspark

        for _ in batches:
            pass
        daemon = sys.modules["__main__"]  # the daemon runs as `python -m <module>`
        archives = [f.archive for f in sys.path_importer_cache.values()
                    if isinstance(f, zipimport.zipimporter)]
        yield pa.RecordBatch.from_pydict({
            "daemon": [getattr(daemon.__spec__, "name", None)],
            "preloaded": [bool(getattr(daemon, "preloaded", False))],
            # torch's objects, frozen before the fork: collections skip them
            "frozen": [getattr(daemon, "frozen", 0) > 100_000],
            "pyspark": [os.path.realpath(pyspark.__file__)],
            "archives_off_path": [sum(a not in sys.path for a in archives)],
            "jars": [sum(e.endswith(".jar") for e in sys.path)]})

    rows = spark.range(2, numPartitions=2).mapInArrow(
        forked_from, "daemon string, preloaded boolean, frozen boolean, pyspark string, "
        "archives_off_path long, jars long").collect()
    installed = os.path.realpath(pyspark.__file__)  # the same install on this machine
    assert [tuple(r) for r in rows] == [("sparkdl_avg.task.warm_daemon", True, True,
                                         installed, 0, 0)] * 2


@pytest.fixture(scope="module")
def synced(data):
    return sync_fit(data)


@pytest.mark.core
def test_a_sync_fit_with_eval_df_learns_and_matches_the_classic_one_bit_for_bit(synced):
    assert synced.history[-1]["eval_accuracy"] > 0.6
    assert [w["partition"] for w in synced.workers] == [0, 1]
    if REFERENCE:
        with np.load(REFERENCE) as reference:
            mine = parameters(synced.model)
            assert sorted(reference.files) == sorted(mine)
            for name, value in mine.items():
                assert np.array_equal(reference[name], value), name


@pytest.mark.core
def test_an_async_fit_trains_and_returns_the_servers_model(data):
    result = fit(data, FaultyMLP, TrainConfig(mode="async", num_workers=2, epochs=2,
                                              batch_size=15, lr=0.05, log_model=False,
                                              experiment_name="sessions"), eval_df=data)
    assert result.history and result.history[-1]["eval_accuracy"] > 0.5
    assert not same_parameters(result.model, FaultyMLP())  # it trained


@pytest.mark.core
def test_transform_and_predict_udf_score_as_the_model_does(synced, data):
    local = data.toPandas()
    with torch.no_grad():
        features = torch.tensor(np.stack(local["features"]), dtype=torch.float32)
        logits = synced.model(features)
    apart = forward_tolerance(synced.model, features)  # Spark's chunks round otherwise
    scored = synced.transform(data).toPandas()
    assert classes_agree(scored["prediction"].to_numpy(), logits, apart)
    column = data.select(synced.predict_udf(batch_size=7)("features").alias("p")).toPandas()
    assert classes_agree(column["p"].to_numpy(), logits, apart)


class Typed(torch.nn.Module):
    """Int ids, a ragged bag of pairs of ids ([B, L, 2]) and an image ([B, 1, 2, 2])."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ids = torch.nn.Embedding(8, 3)
        self.pairs = torch.nn.Embedding(8, 3)
        self.image = torch.nn.Linear(4, 3)

    def forward(self, ids, pairs, image):
        return self.ids(ids) + self.pairs(pairs).sum((1, 2)) + self.image(image.flatten(1))


def test_typed_inputs_by_name_train_and_score(data):
    """Typed inputs on either session kind: the validation's nested-array sizes (a lambda),
    ragged rows, keyword binding, weights, and transform's probabilities."""
    from pyspark.sql import functions as F

    typed = data.select(
        (F.abs(F.hash("features")) % 8).alias("id"), "label",
        F.slice(F.array(*[F.array(F.lit(i % 8), F.lit((i + 3) % 8)) for i in range(4)]),
                1, F.abs(F.hash("label", "features")) % 4 + 1).alias("pairs"),
        F.array(F.slice("features", 1, 2), F.slice("features", 3, 2)).alias("image"),
        (F.col("label") + 1).cast("double").alias("w"))
    typed = typed.select("id", "label", "pairs", F.array("image").alias("image"), "w")
    result = fit(typed, Typed, replace(SYNC, epochs=1),
                 inputs={"ids": "id", "pairs": "pairs", "image": "image"}, weight_col="w")
    assert [f.shape for f in result.schema.inputs] == [(), (-1, 2), (1, 2, 2)]
    assert all(0 < w["pad_fraction"] < 1 for w in result.workers)
    scored = result.transform(typed, output="probability").toPandas()
    assert np.allclose([sum(p) for p in scored["prediction"]], 1.0, atol=1e-5)


def test_bad_input_is_refused_before_training_with_a_failed_run(data, mlflow_client):
    with pytest.raises(DataError, match=r"no column 'feature'.*did you mean 'features'"):
        fit(data, FaultyMLP, SYNC, features_col="feature")
    assert latest_run(mlflow_client, "sessions").info.status == "FAILED"
    started = time.monotonic()
    with pytest.raises(ClusterError, match=r"num_workers=3 but the cluster"):
        fit(data, FaultyMLP, TrainConfig(num_workers=3, batch_size=15, log_model=False,
                                         experiment_name="sessions"))
    assert time.monotonic() - started < 30


@pytest.mark.core
def test_a_task_failure_is_restarted_to_the_same_parameters(synced, data, tmp_path):
    result = fit(data, partial(FaultyMLP, fault="raise", marker=str(tmp_path / "fired"),
                               steps_dir=str(tmp_path)),
                 replace(SYNC, checkpoint_every=3), eval_df=data)
    [failure] = result.failures
    assert failure["partition"] == 1 and failure["host"]
    assert "ValueError: injected failure in forward" in failure["error"]
    assert_sync_recovery(result, tmp_path, at_call=9, steps_per_round=2, total_steps=40)
    assert same_parameters(result.model, synced.model)


def test_resume_from_a_directory_continues_to_the_same_parameters(synced, data, tmp_path):
    folder = str(tmp_path / "ckpt")
    fit(data, FaultyMLP, replace(SYNC, epochs=1, checkpoint_dir=folder), eval_df=data)
    resumed = fit(data, FaultyMLP, replace(SYNC, checkpoint_dir=folder),
                  eval_df=data, resume_from=folder)
    assert same_parameters(resumed.model, synced.model)


def test_the_end_of_fit_warm_up_runs_beside_the_first_spark_job(data, monkeypatch):
    """What a fit logs at its end (matplotlib, MLflow's model saving) is warmed up while its
    first Spark job runs, where a cold session's executors import torch and the driver idles,
    not while the workers train, where it takes their CPU; only once the run is open, so that
    one thread at a time imports MLflow; and training does not wait for it (a warm cluster's
    probe is over long before a fresh driver's warm-up)."""
    import threading

    from sparkdl_avg import _fit
    from sparkdl_avg.driver import plan
    from sparkdl_avg.tracking import first_use, run

    warmed, training, opened = threading.Event(), threading.Event(), []
    open_run, check_cluster = run.RunLogger._open_run, plan.check_cluster
    train = _fit._TRAIN["sync"]

    def slow_open(self, *args):
        time.sleep(0.5)
        open_run(self, *args)
        opened.append(time.monotonic())

    def warm_up(logs_model):
        assert opened, "the warm-up started before the run was open"
        warmed.set()
        training.wait(20)  # a warm-up that outlasts the probe

    def train_sync(spark, fit_plan, fit_run):
        training.set()
        return train(spark, fit_plan, fit_run)

    def first_job(spark, config):
        assert warmed.wait(20), "the warm-up did not run beside the first Spark job"
        check_cluster(spark, config)

    monkeypatch.setattr(run.RunLogger, "_open_run", slow_open)
    monkeypatch.setattr(first_use, "pay", warm_up)
    monkeypatch.setattr(plan, "check_cluster", first_job)
    monkeypatch.setitem(_fit._TRAIN, "sync", train_sync)
    started = time.monotonic()
    assert sync_fit(data).history
    assert time.monotonic() - started < 15, "training waited for the warm-up"


def test_executors_that_cannot_reach_the_client_are_named_in_seconds(data, mlflow_client):
    started = time.monotonic()
    with pytest.raises(ClusterError, match=r"2 of 2 executors cannot reach this process at "
                                           r"nowhere\.invalid:\d+ .*driver_address"):
        fit(data, FaultyMLP, replace(SYNC, driver_address="nowhere.invalid"))
    assert time.monotonic() - started < 20
    assert latest_run(mlflow_client, "sessions").info.status == "FAILED"


def test_a_probe_job_without_its_slots_is_interrupted_at_its_deadline(spark):
    """Spark's own barrier slot check would retry for about ten minutes."""
    from sparkdl_avg.driver.cluster import driver_address
    from sparkdl_avg.driver.probe import probe_cluster

    config = TrainConfig(num_workers=3)
    started = time.monotonic()
    with pytest.raises(ClusterError, match="too few"):
        probe_cluster(spark, config, None, driver_address(spark, config), 3.0,
                      too_few_slots=lambda s: ClusterError(f"too few after {s}s"))
    assert time.monotonic() - started < 20
    assert spark.range(4).count() == 4  # the interrupted job left the session usable


def test_a_probe_job_that_loses_an_executor_runs_again_and_nothing_else_does():
    """An executor lost under the probe (the CI run that lost one as the previous fit's
    failed barrier stage was cancelled) is no reason to fail the fit: the cluster replaces it.
    A failure of the probe's own doing is raised at once; the attempts are bounded."""
    from sparkdl_avg.driver.probe import run_past_lost_executors

    lost = RuntimeError("Job aborted due to stage failure: ... ExecutorLostFailure (executor 0 "
                        "exited unrelated to the running tasks) Reason: Command exited with "
                        "code 50")
    calls = []

    def flaky(failures, cause):
        def run_once(timeout):
            calls.append(timeout)
            if len(calls) <= failures:
                raise ClusterError("the probe job before training failed") from cause
            return ["rows"]
        return run_once

    assert run_past_lost_executors(flaky(1, lost), 30.0) == ["rows"]
    assert len(calls) == 2 and 0 < calls[1] <= calls[0] <= 30.0
    calls.clear()
    with pytest.raises(ClusterError):
        run_past_lost_executors(flaky(1, RuntimeError("ModuleNotFoundError: sparkdl_avg")), 30)
    assert len(calls) == 1
    calls.clear()
    with pytest.raises(ClusterError):
        run_past_lost_executors(flaky(5, lost), 30.0, attempts=3)
    assert len(calls) == 3


def test_a_probe_runs_again_only_when_what_it_checked_changed(spark, monkeypatch):
    """A warm session's next fit skips the probe job its executors already passed; other
    executors, another worker count or a port the user gave (the probe finds it taken) run
    it again. On Connect, which cannot list executors, it runs every time."""
    import socket

    from sparkdl_avg.driver import cluster, probe, session

    ran = []
    real = probe.probe_cluster
    monkeypatch.setattr(probe, "probe_cluster", lambda *a, **k: ran.append(1) or real(*a, **k))
    monkeypatch.setattr(cluster, "_PROBED", set())
    config = TrainConfig(num_workers=2)
    cluster.check_cluster(spark, config)
    cluster.check_cluster(spark, config)
    if session.is_connect(spark):
        assert len(ran) == 2
        return
    assert len(ran) == 1
    cluster.check_cluster(spark, replace(config, num_workers=1))
    assert len(ran) == 2
    with socket.create_server(("127.0.0.1", 0)) as free:
        port = free.getsockname()[1]
    given = replace(config, driver_address=f"127.0.0.1:{port}")
    cluster.check_cluster(spark, given)
    cluster.check_cluster(spark, given)
    assert len(ran) == 4
    listed = session.executors(spark)
    monkeypatch.setattr(session, "executors", lambda s: (*listed, "a new executor"))
    cluster.check_cluster(spark, config)
    assert len(ran) == 5
    monkeypatch.setattr(session, "executors", lambda s: None)  # as on Connect
    cluster.check_cluster(spark, config)
    cluster.check_cluster(spark, config)
    assert len(ran) == 7


def test_the_driver_address_is_chosen_for_the_session_kind_or_given(spark):
    from sparkdl_avg.driver.cluster import driver_address

    chosen = driver_address(spark, TrainConfig())
    # classic: spark.driver.host; Connect: this process's address towards the server, which
    # is loopback here
    assert (chosen.bind, chosen.advertise, chosen.port) == ("127.0.0.1", "127.0.0.1", 0)
    given = driver_address(spark, TrainConfig(driver_address="127.0.0.1:7123"))
    assert (given.bind, given.advertise, given.port) == ("127.0.0.1", "127.0.0.1", 7123)
    elsewhere = driver_address(spark, TrainConfig(driver_address="nowhere.invalid"))
    assert (elsewhere.bind, elsewhere.advertise) == ("0.0.0.0", "nowhere.invalid")


def test_a_fit_listens_on_the_port_it_is_given(data):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        config = replace(SYNC, epochs=1, driver_address=f"127.0.0.1:{port}")
        with pytest.raises(ClusterError, match=f"cannot listen on 127.0.0.1:{port}"):
            fit(data, FaultyMLP, config)
    result = fit(data, FaultyMLP, config)  # the probe server, then the coordinator, on it
    assert result.history


def test_an_async_fit_on_a_given_port_restarts_after_a_task_failure(data, tmp_path):
    """The parameter server holds the port while the restart checks the cluster again."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as free:
        port = free.getsockname()[1]
    # the fault is in step 12 of 40, a push (8 steps) applied: steps 9 to 12 run twice
    result = fit(data, partial(FaultyMLP, fault="raise", marker=str(tmp_path / "fired"),
                               at_call=12, steps_dir=str(tmp_path)),
                 TrainConfig(mode="async", num_workers=2, epochs=2, batch_size=15,
                             driver_address=f"127.0.0.1:{port}", log_model=False,
                             experiment_name="sessions"))
    [failure] = result.failures
    assert failure["partition"] == 1
    assert steps_run(tmp_path, 1) == 40 + 4


def test_cancelling_a_fits_jobs_stops_a_running_barrier_job(spark, tmp_path):
    """What a failed or abandoned fit relies on to free the task slots."""
    import threading

    from sparkdl_avg.driver import session as sessions

    ended = threading.Event()
    folder = str(tmp_path)

    def sleeps(batches):  # nested: it travels by value (executors cannot import this file)
        import os
        import time

        from pyspark import TaskContext

        open(os.path.join(folder, str(TaskContext.get().partitionId())), "w").close()
        for batch in batches:
            time.sleep(60)
            yield batch

    def run():
        sessions.tag_jobs(spark, "sparkdl-avg-cancel-test", "a test job")
        try:
            spark.range(2, numPartitions=2).mapInArrow(sleeps, "id long",
                                                       barrier=True).collect()
        except Exception:  # noqa: BLE001 - cancelled, as meant
            pass
        finally:
            sessions.untag_jobs(spark, "sparkdl-avg-cancel-test")
            ended.set()

    threading.Thread(target=run, daemon=True).start()
    deadline = time.monotonic() + 60
    while len(list(tmp_path.iterdir())) < 2:  # both tasks are running
        assert time.monotonic() < deadline
        time.sleep(0.2)
    started = time.monotonic()
    sessions.cancel_jobs(spark, "sparkdl-avg-cancel-test")
    assert ended.wait(20), "the job ran on after it was cancelled"
    assert time.monotonic() - started < 20


def test_a_slow_python_worker_start_is_waited_for_where_the_slots_are_known(spark,
                                                                           monkeypatch):
    """Where the session counts its slots and they suffice, the probe job waits for the
    Python workers as long as the fit waits for its workers to connect (connect_timeout),
    not the 40 s that stand for "no slots" where nothing says how many there are (Connect):
    a busy machine starts them slowly. Simulated by a probe job that outlasts a 0.5 s
    PROBE_S."""
    from sparkdl_avg.driver import cluster, probe, session

    start = probe.TaggedJob.__init__

    def slow_job(self, spark, action, *args, **kwargs):  # the Python workers take 2 s
        start(self, spark, lambda: time.sleep(2) or action(), *args, **kwargs)

    monkeypatch.setattr(probe.TaggedJob, "__init__", slow_job)
    monkeypatch.setattr(cluster, "_PROBED", set())
    monkeypatch.setattr(cluster, "PROBE_S", 0.5)
    config = TrainConfig(num_workers=2, connect_timeout=60)
    if session.concurrent_slots(spark) is None:  # no slot count: the short deadline stands
        with pytest.raises(ClusterError, match="did not run 2 tasks at once within"):
            cluster.check_cluster(spark, config, wait_s=0)
        return
    cluster.check_cluster(spark, config, wait_s=0)
