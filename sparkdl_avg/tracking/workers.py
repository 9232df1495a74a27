"""The fit's workers as the run shows them: each one's device and data cache as tags, what its
data cost as metrics (MLflow compares runs by these), its warnings in the driver's log."""

from __future__ import annotations

import logging

from sparkdl_avg._version import __version__

log = logging.getLogger("sparkdl_avg")


def log_workers(workers: list[dict], run) -> None:
    """What each worker reported (`FitResult.workers`): its warnings and version skew logged,
    its device, warning and data cache as run tags, and what its data cost as metrics."""
    for w in workers:
        if w["warning"]:
            log.warning("partition %d: %s", w["partition"], w["warning"])
        if w["version"] != __version__:
            log.warning("partition %d ran sparkdl-avg %s from %s; the driver runs %s",
                        w["partition"], w["version"], w["library"], __version__)
    run.set_tags({f"worker.{w['partition']}.device": f"{w['host']}/{w['device']}"
                  for w in workers})
    run.set_tags({f"worker.{w['partition']}.warning": w["warning"] for w in workers
                  if w["warning"]})
    run.set_tags({f"worker.{w['partition']}.data_cache": w["cache"] for w in workers})
    # what each task's data cost: memory, spill and throughput (MLflow compares runs by these)
    run.log_metrics({f"worker_{w['partition']}_{key}": w[key] for w in workers
                     for key in _WORKER_METRICS if w[key] is not None}, step=0)
    peaks = [w["peak_rss_mb"] for w in workers if w["peak_rss_mb"] is not None]
    if peaks:
        run.log_metrics({"peak_rss_mb_max": max(peaks)}, step=0)
    positions = sum(w["ragged_positions"] or 0 for w in workers)
    if positions:  # ragged inputs: the share of all their positions that were padding
        padded = sum(w["pad_positions"] or 0 for w in workers)
        run.log_metrics({"pad_fraction": padded / positions}, step=0)


_WORKER_METRICS = ("peak_rss_mb", "spilled_mb", "load_s", "load_mb_s", "read_mb_s",
                   "batch_wait_s", "pad_fraction")
