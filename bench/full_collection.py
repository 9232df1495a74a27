"""Where the driver's full collection lands: the one a process's first fit leaves due (its
imports of MLflow, SQLAlchemy, matplotlib and torch.export), run on a thread of its own
during the next fit's validation job (`early`), or (`late`, the old way) wherever the
collector's threshold falls.

The TorchDistributor comparison's workload (MNIST-1D 20k, MLP 40-1024-1024-10, 2 workers,
5 epochs, Adam, averaging every 8 steps, evaluation after the last round), `--fits` fits in
a fresh local[2] session with `SPARK_CONF`, sessions alternating between the two kinds.
Each fit's wall time, and each full (generation 2) collection: the thread that ran it, its
duration, and when in the fit it started.

    python bench/full_collection.py [--sessions 2] [--fits 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import local_session, median, report  # noqa: E402


def one_session(kind: str, fits: int) -> list[dict]:
    import gc
    import threading

    from sparkdl_avg import SPARK_CONF, TrainConfig, fit
    from sparkdl_avg.examples import mnist1d
    from sparkdl_avg.tracking import run as run_module

    if kind == "late":
        warm_up = run_module._warm_up

        def without_the_collection(logs_model: bool) -> None:
            warm_up(logs_model)
            run_module._collection_due = False  # never armed: the collector's own timing

        run_module._warm_up = without_the_collection
    collections: list[dict] = []
    started = {"fit": 0.0, "collection": 0.0}

    def on_collection(phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        now = time.perf_counter()
        if phase == "start":
            started["collection"] = now
        else:
            collections.append({"thread": threading.current_thread().name,
                                "at_s": round(started["collection"] - started["fit"], 3),
                                "duration_s": round(now - started["collection"], 3)})

    gc.callbacks.append(on_collection)
    spark = local_session(2, **SPARK_CONF)
    try:
        train_df, test_df = mnist1d.load(spark, 20_000)
        train_df.count()
        cfg = TrainConfig(num_workers=2, epochs=5, batch_size=50, averaging_frequency=8,
                          optimizer="adam", lr=1e-3, seed=0, experiment_name="bench-gc",
                          eval_every=10**6)
        out = []
        for _ in range(fits):
            collections.clear()
            started["fit"] = time.perf_counter()
            result = fit(train_df, mnist1d.mlp((1024, 1024)), cfg, eval_df=test_df)
            out.append({"total_s": time.perf_counter() - started["fit"],
                        "timings": result.timings, "full_collections": list(collections)})
        return out
    finally:
        spark.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sessions", type=int, default=2, help="sessions of each kind")
    parser.add_argument("--fits", type=int, default=3, help="fits a session")
    parser.add_argument("--kind", choices=["early", "late"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.kind:
        print(json.dumps(one_session(args.kind, args.fits)))
        return
    store = f"sqlite:///{tempfile.mkdtemp()}/mlflow.db"
    import mlflow

    mlflow.MlflowClient(store).search_experiments()  # the store exists, as on any machine
    runs: dict[str, list] = {"early": [], "late": []}
    for _ in range(args.sessions):
        for kind in runs:
            done = subprocess.run(
                [sys.executable, __file__, "--kind", kind, "--fits", str(args.fits)],
                capture_output=True, text=True, check=True,
                env={**os.environ, "MLFLOW_TRACKING_URI": store})
            runs[kind].append(json.loads(done.stdout.strip().splitlines()[-1]))
    summary = {kind: {f"fit_{i + 1}_median_s": median([s[i]["total_s"] for s in sessions])
                      for i in range(args.fits)} for kind, sessions in runs.items()}
    report("full_collection", {"summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
