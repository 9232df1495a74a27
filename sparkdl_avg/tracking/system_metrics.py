"""MLflow's system metrics for a fit's run, which the fit creates without `mlflow.start_run`
(that would make it the process's active run)."""

from __future__ import annotations

import logging

log = logging.getLogger("sparkdl_avg")


def start_system_metrics(run_id: str, tracking_uri: str):
    """MLflow's system metrics (CPU, memory, disk, network; GPU with pynvml) for the run, as
    `mlflow.start_run` would do, when `mlflow.enable_system_metrics_logging()` (or
    MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING) asks and psutil (the `metrics` extra) is there."""
    import importlib.util

    from mlflow.environment_variables import MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING

    if not MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING.get():
        return None
    if importlib.util.find_spec("psutil") is None:
        log.warning("system metrics logging is enabled but psutil is missing: "
                    "pip install 'sparkdl-avg[metrics]'")
        return None
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(run_id, tracking_uri=tracking_uri)
    monitor.start()
    return monitor
