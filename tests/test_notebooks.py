"""The Databricks notebooks in notebooks/, executed cell by cell as Databricks would: in one
namespace holding `spark`, `display` and a `dbutils` stand-in. Markdown cells are checked to
be markdown; `%pip install` cells are skipped (the test environment has the package)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

pytestmark = pytest.mark.spark

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.py"))
HEADER = "# Databricks notebook source\n"
SEPARATOR = "\n# COMMAND ----------\n"


def cells(path: Path) -> list[tuple[str, str]]:
    """(kind, source) per cell: kind is "md", "pip" or "python"."""
    text = path.read_text()
    assert text.startswith(HEADER), f"{path.name} is not in Databricks source format"
    out = []
    for chunk in text[len(HEADER):].split(SEPARATOR):
        lines = [line for line in chunk.strip("\n").splitlines()]
        if lines and all(line.startswith("# MAGIC") for line in lines):
            magic = lines[0].removeprefix("# MAGIC").strip()
            kind = magic.split()[0]
            assert kind in ("%md", "%pip"), f"{path.name}: unsupported magic {magic!r}"
            out.append((kind[1:], "\n".join(line.removeprefix("# MAGIC ") for line in lines)))
        else:
            out.append(("python", "\n".join(lines)))
    return out


class _Library:
    def restartPython(self) -> None:  # noqa: N802 - Databricks' name
        pass


class DbutilsStandIn:
    library = _Library()


def display(obj) -> None:
    """Databricks renders it; here a Spark DataFrame is at least computed."""
    if hasattr(obj, "toPandas"):
        obj.toPandas()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_cell_by_cell(path, spark):
    namespace = {"spark": spark, "display": display, "dbutils": DbutilsStandIn(),
                 "__name__": "__main__"}
    kinds = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for index, (kind, source) in enumerate(cells(path)):
            kinds.append(kind)
            if kind == "python":
                exec(compile(source, f"{path.name}[cell {index}]", "exec"), namespace)
    assert not shown(caught), [f"{w.category.__name__}: {w.message}" for w in shown(caught)]
    assert kinds[0] == "md" and "pip" in kinds  # introduced, and installs like Databricks
    if path.stem == "tune":
        _check_the_pruning(namespace["study"])
    if path.stem == "recommender":
        _check_the_recommender(namespace)


def shown(caught: list) -> list:
    """The warnings a notebook would show its user: not the deprecations Python hides unless
    the notebook's own code triggers them (those are the libraries' business)."""
    hidden = (DeprecationWarning, PendingDeprecationWarning)
    return [w for w in caught if not issubclass(w.category, hidden)
            or "[cell " in w.filename]


def _check_the_pruning(study) -> None:
    """The tune notebook's claim: the trial whose lr is 100x too small (its third) is
    pruned, and its fit ends FINISHED, stopped by on_round, with the rounds so far."""
    import mlflow
    import optuna

    pruned = [t for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
    assert [t.number for t in pruned][:1] == [2], [t.state for t in study.trials]
    run = mlflow.get_run(pruned[0].user_attrs["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.tags["sparkdl_avg.stopped_by"] == "on_round"
    assert max(pruned[0].intermediate_values) < 7  # stopped before its last round (of 8)


def _check_the_recommender(ns: dict) -> None:
    """The recommender notebook's claims: MLflow's pyfunc, fed a pandas DataFrame, rates as
    `transform` does; the weighted fit finds the known structure (held-out RMSE far below
    predicting the mean, about 1.6) and beats the same fit without the weights; the run
    records the weight column."""
    import mlflow
    import numpy as np

    assert len(ns["from_spark"]) == 200
    np.testing.assert_allclose(ns["from_mlflow"], ns["from_spark"], rtol=0, atol=1e-5)
    rmse = ns["result"].history[-1]["eval_loss"] ** 0.5
    assert rmse < 0.5 < ns["baseline"], (rmse, ns["baseline"])
    assert rmse < 0.7 * ns["unweighted"].history[-1]["eval_loss"] ** 0.5
    params = mlflow.get_run(ns["result"].run_id).data.params
    assert params["weight_col"] == "weight"


def test_there_are_the_four_notebooks():
    assert [p.stem for p in NOTEBOOKS] == ["compare_modes", "quickstart", "recommender", "tune"]
