"""A binary column of about 3 GB (1.5 GB a worker, 128 KiB records) trained through
`fit(preprocess=)` with the disk cache: each task's peak resident memory, which must stay at
most 1 GB however large its partition.

The records are made by Spark (no file, nothing built on the driver): record i is i as 16
bytes followed by a constant body; a label `i % 2`; `--gb` sets the column's size and
`--record-kb` each record's. The preprocess takes each record's first 16 bytes as numbers
(a decoder that costs nothing, so what is measured is the feed); a Linear model, batch
`--batch`, sync, 2 workers; `on_round` stops after `--rounds` averaging rounds (the
partition's load into the cache and the first shuffle windows read back are done by then).
Reports each task's start and peak RSS, the bytes it spilled, and the times.

    python bench/bytes_memory.py [--gb 3.0] [--record-kb 128] [--batch 64] [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import local_session, report  # noqa: E402

WIDTH = 16


def first_bytes(batch, *, training, rng):
    import numpy as np

    rows = batch["content"]
    head = np.frombuffer(b"".join(r[:WIDTH] for r in rows), np.uint8).reshape(len(rows), WIDTH)
    return {"content": head.astype(np.float32) / 255}


def make_model():
    import torch

    return torch.nn.Linear(WIDTH, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=3.0)
    parser.add_argument("--record-kb", type=int, default=128)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{tempfile.mkdtemp()}/mlflow.db")
    from pyspark.sql import functions as F

    from sparkdl_avg import SPARK_CONF, TrainConfig, fit

    rows = int(args.gb * 2**20 / args.record_kb)
    spark = local_session(2, **SPARK_CONF, **{"spark.driver.memory": "2g"})
    try:
        body = F.lit(bytes(args.record_kb * 1024 - WIDTH))
        df = spark.range(rows, numPartitions=16).select(
            F.concat(F.unhex(F.lpad(F.hex("id"), 2 * WIDTH, "0")), body).alias("content"),
            (F.col("id") % 2).cast("int").alias("label"))
        config = TrainConfig(num_workers=2, epochs=1, batch_size=args.batch,
                             averaging_frequency=8, optimizer="adam", lr=1e-3, log_model=False,
                             checkpoint_every=0, data_cache="disk",
                             experiment_name="bench-bytes-memory")
        started = time.perf_counter()
        result = fit(df, make_model, config, features_col="content", preprocess=first_bytes,
                     on_round=lambda metrics: metrics["round"] >= args.rounds)
        total_s = time.perf_counter() - started
    finally:
        spark.stop()
    workers = [{k: w[k] for k in ("partition", "cache", "train_rows", "start_rss_mb",
                                  "peak_rss_mb", "spilled_mb", "load_s")}
               for w in result.workers]
    report("bytes_memory", {"gb": args.gb, "record_kb": args.record_kb, "rows": rows,
                            "batch": args.batch, "rounds": args.rounds, "total_s": total_s,
                            "timings": result.timings, "workers": workers,
                            "peak_rss_mb_max": max(w["peak_rss_mb"] or 0 for w in workers)})


if __name__ == "__main__":
    main()
