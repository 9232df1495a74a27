"""The MLflow run logger's parts that need no fit."""

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
