"""The fine-tuning job's figures for the docs: `python jobs/finetune_lm.py` as it runs by
default (LoRA on the English), then the same job with `--full-finetune --lr 1e-3` (every
weight trains on the English: what averaging everything moves). Each in a fresh process
with its own MLflow store; each side's figures are what its job logged to its run (the
held-out perplexities, the driver's megabytes a round of each fit, the fits' seconds), and
the job's wall time. The same seed pretrains the same model on both sides (a sync fit is
bit-identical from run to run), so their "before" agree.

    python bench/finetune_lm.py [any job arguments, given to both sides]
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import REPO, report  # noqa: E402

JOB = REPO / "jobs" / "finetune_lm.py"
SIDES = {"lora": [], "full": ["--full-finetune", "--lr", "1e-3"]}


def run_side(extra: list[str], folder: str) -> dict:
    """The job in a process of its own; its run's logged report and the wall time."""
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{folder}/mlflow.db"
    env = {**os.environ, "MLFLOW_TRACKING_URI": store, "PYSPARK_PYTHON": sys.executable}
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, str(JOB), *extra], capture_output=True, text=True,
                          cwd=folder, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"the job failed: {done.stderr[-3000:]}")
    run_id = re.search(r"MLflow run (\w+)", done.stdout).group(1)
    return {**MlflowClient(store).get_run(run_id).data.metrics,
            "job_wall_s": time.perf_counter() - t0}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    job_args = sys.argv[1:]
    result: dict = {"job_args": job_args}
    for side, extra in SIDES.items():
        logging.info("%s: %s", side, " ".join(job_args + extra))
        with tempfile.TemporaryDirectory(prefix="bench-finetune-lm-") as folder:
            result[side] = run_side(job_args + extra, folder)
    lora, full = result["lora"], result["full"]
    result["full_over_lora"] = {
        key: full[key] / lora[key] for key in ("driver_mb_finetune", "trainable_params",
                                                "finetune_s", "perplexity_after")}
    report("finetune_lm", result)


if __name__ == "__main__":
    main()
