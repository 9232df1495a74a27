"""The MLflow run logger's parts that need no fit, and the driver's collector around its imports."""

import time

from sparkdl_avg.tracking import run


def test_the_model_saving_warm_up_runs_once_a_process(monkeypatch):
    """A fit warms up MLflow's model saving while it trains; a later fit in the same process
    has nothing left to warm, and must not take CPU from its workers for it."""
    import mlflow.pytorch

    saved = []
    monkeypatch.setattr(run, "_saved_a_model", False)
    monkeypatch.setattr(mlflow.pytorch, "save_model", lambda model, path, **_: saved.append(path))
    run._warm_up(logs_model=False)
    assert saved == []
    run._warm_up(logs_model=True)
    run._warm_up(logs_model=True)
    assert len(saved) == 1


def test_the_run_imports_pyspark_ml_before_it_writes_params(tmp_path):
    """MLflow's Param reads `pyspark.ml.param` once "pyspark.ml" is in sys.modules: had the
    caller's thread been halfway through importing it (the dataset schema does), the write
    failed and the fit with it ("cannot access submodule 'ml'", seen in a test run). The run's
    writer imports it whole before it writes anything."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, pyspark\n"
        "from sparkdl_avg.tracking.run import RunLogger\n"
        "assert 'pyspark.ml' not in sys.modules\n"
        "with RunLogger(experiment_name='imports', run_name='r', tags={}) as run:\n"
        "    run.log_params({'a': 1})\n"
        "    run.ready()\n"
        "    assert hasattr(pyspark, 'ml') and hasattr(pyspark.ml, 'param')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path,
                          env={**os.environ,
                               "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/m.db"})
    assert proc.returncode == 0, proc.stderr[-3000:]



def test_a_first_fits_warm_up_leaves_the_full_collection_due_and_a_later_ones_does_not(
        monkeypatch):
    """The imports and the first model save leave the collector a full collection to do,
    which the next fit runs (`RunLogger.warm_up` arms it); a later warm-up imports nothing."""
    import mlflow.pytorch

    monkeypatch.setattr(run, "_saved_a_model", False)
    monkeypatch.setattr(run, "_collection_due", False)
    monkeypatch.setattr(mlflow.pytorch, "save_model", lambda model, path, **_: None)
    run._warm_up(logs_model=True)
    assert run._collection_due
    run._warm_up(logs_model=True)
    assert not run._collection_due


def test_an_armed_full_collection_runs_once_on_a_thread_of_its_own(monkeypatch):
    """Beside a wait on the JVM, where the waiting thread needs no GIL: the collection holds
    it for 0.4-0.5 s after a first fit's imports."""
    import gc
    import threading

    from sparkdl_avg import _gc_pause

    full = []

    def on_collection(phase, info):
        if phase == "start" and info["generation"] == 2:
            full.append(threading.current_thread().name)

    monkeypatch.setattr(_gc_pause, "_armed", False)
    was_enabled = gc.isenabled()
    gc.disable()  # only the armed collection is counted
    gc.callbacks.append(on_collection)
    try:
        with _gc_pause.full_collection_beside():
            time.sleep(0.2)
        assert full == []
        _gc_pause.arm_full_collection()
        with _gc_pause.full_collection_beside():
            time.sleep(0.5)
        assert full == ["sparkdl-avg-collect"]
        with _gc_pause.full_collection_beside():
            time.sleep(0.2)
        assert full == ["sparkdl-avg-collect"]
    finally:
        gc.callbacks.remove(on_collection)
        if was_enabled:
            gc.enable()
