"""The run a fit nests under. MLflow's active run is per thread, and pyspark fits a
CrossValidator's folds on threads of a pool, over the estimator or over a Pipeline holding it:
`parent_run` names the parent on a thread of one's own, and the Spark ML estimator carries the
caller's run to those threads itself (`callers_run` when it is copied, `inherited` when it
fits)."""

from __future__ import annotations

import contextlib
import sys
import threading

_PARENT = threading.local()


@contextlib.contextmanager
def parent_run(run_id: str | None):
    """Fits started in this block, on this thread, become children of `run_id` (as of an
    active run). MLflow's active run is per thread, so a fit on a pool thread (CrossValidator
    fits its folds there) would not see the caller's."""
    previous = getattr(_PARENT, "run_id", None)
    _PARENT.run_id = run_id
    try:
        yield
    finally:
        _PARENT.run_id = previous


def named_parent() -> str | None:
    """The run `parent_run` names on this thread, if any."""
    return getattr(_PARENT, "run_id", None)


def callers_run() -> str | None:
    """The run a fit started on this thread would nest under: the one `parent_run` names,
    else MLflow's active run (none where mlflow was never imported)."""
    named = named_parent()
    if named:
        return named
    fluent = sys.modules.get("mlflow")
    active = fluent.active_run() if fluent is not None else None
    return active.info.run_id if active is not None else None


@contextlib.contextmanager
def inherited(run_id: str | None):
    """Fits in this block, on this thread, nest under `run_id` (a `callers_run` captured on
    another thread) when this thread has no run of its own and `run_id` is still running: one
    that ended since it was captured is no parent for a later fit."""
    if run_id is None or callers_run() is not None:
        yield
        return
    from mlflow.tracking import MlflowClient

    running = MlflowClient().get_run(run_id).info.status == "RUNNING"
    with parent_run(run_id if running else None):
        yield
