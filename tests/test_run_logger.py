"""The MLflow run logger's parts that need no fit."""

from sparkdl_avg.tracking import first_use, run


def test_the_model_saving_warm_up_runs_once_a_process(monkeypatch):
    """A fit warms up MLflow's model saving while it trains; a later fit in the same process
    has nothing left to warm, and must not take CPU from its workers for it."""
    import mlflow.pytorch

    saved = []
    monkeypatch.setattr(first_use, "saved_a_model", False)
    monkeypatch.setattr(mlflow.pytorch, "save_model", lambda model, path, **_: saved.append(path))
    first_use.pay(logs_model=False)
    assert saved == []
    first_use.pay(logs_model=True)
    first_use.pay(logs_model=True)
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


def test_params_and_tags_too_long_for_mlflow_are_cut_with_a_warning(caplog, mlflow_client):
    import logging

    with caplog.at_level(logging.WARNING, logger="sparkdl_avg"), \
            run.RunLogger(experiment_name="clipped", run_name="r", tags={}) as logger:
        logger.log_params({"long": "p" * 6001, "short": 1})
        logger.set_tags({"note": "t" * 5000})
        logger.ready()
    data = mlflow_client.get_run(logger.run_id).data
    assert data.params["long"] == "p" * 6000 and data.params["short"] == "1"
    assert data.tags["note"] == "t" * 4900
    warned = [r.getMessage() for r in caplog.records if "characters long" in r.getMessage()]
    assert warned == ["the MLflow param 'long' is 6001 characters long: logged cut to its "
                      "first 6000",
                      "the MLflow tag 'note' is 5000 characters long: logged cut to its first "
                      "4900"]


def test_a_failed_fits_warm_up_and_saving_ahead_end_with_it(monkeypatch):
    """A fit that fails at once (a bad argument) returns only once its warm-up and its saving
    ahead have ended: both import modules and set torch.export's process-wide flags, which
    the caller's next lines would otherwise meet (a test after such a fit failed inside
    pytest's own bookkeeping, "dictionary changed size during iteration")."""
    import threading
    import time

    import pytest
    import torch

    from sparkdl_avg.tracking import model_ahead

    ended = []
    monkeypatch.setattr(first_use, "pay", lambda logs_model: time.sleep(1.5) or ended.append(
        "warm-up"))
    monkeypatch.setattr(model_ahead.SavedAhead, "_save", lambda self: time.sleep(1.0) or
                        ended.append("ahead"))
    logger = run.RunLogger(experiment_name="ends", run_name="r", tags={}, logs_model=True)
    with pytest.raises(ValueError, match="bad argument"), logger:
        logger.warm_up()
        logger.save_model_ahead(torch.nn.Linear(2, 1), schema=None, heads=())
        time.sleep(1.8)  # the warm-up is over, the saving ahead is under way
        raise ValueError("bad argument")
    assert ended == ["warm-up", "ahead"]
    assert not {"sparkdl-avg-warm-up", "sparkdl-avg-model-ahead"} & {
        t.name for t in threading.enumerate() if t.is_alive()}


def test_the_warm_up_draws_nothing_from_torchs_global_generator(monkeypatch):
    """The warm-up runs on a thread beside the driver's build of model_fn, which draws from
    torch's global generator under torch.manual_seed(TrainConfig.seed). A draw of the warm-up's
    own there changes the driver's initial parameters (every replica's) and its frozen
    weights, which each replica's build must match: a CI run failed so ("partition 1 built
    other frozen weights than the driver's build of model_fn", a LoRA GPT-2 built while the
    warm-up made its model)."""
    import torch

    monkeypatch.setattr(first_use, "saved_a_model", False)
    torch.manual_seed(0)
    before = torch.random.get_rng_state()
    first_use.import_and_save(logs_model=True)  # the real save, raising what fails
    assert first_use.saved_a_model
    assert torch.equal(torch.random.get_rng_state(), before)


def test_the_warm_up_saves_its_model_without_a_warning(monkeypatch):
    """The warm-up's save is a fit's first in its process, and a job prints no warning: a
    model whose parameters shared one storage had torch.export's archive warn ("No complete
    tensor found in the group")."""
    import warnings

    monkeypatch.setattr(first_use, "saved_a_model", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first_use.import_and_save(logs_model=True)
    assert first_use.saved_a_model
    assert [str(w.message) for w in caught] == []
