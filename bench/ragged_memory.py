"""A ragged int32 token column of about 2 GB (1 GB a worker) trained with the disk cache: each
task's peak resident memory, which must stay under 0.8 GB however large its partition.

The rows are made by Spark (no file): row i holds `1 + i % 511` token ids (mean 256, int32,
ragged), a label `i % 2`; `--gb` sets the column's size. One epoch of a bag-of-tokens model
(EmbeddingBag -> Linear), batch 2048, sync, 2 workers; `on_round` stops after `--rounds`
averaging rounds, since the memory that matters is the partition's load into the cache and
the first windows read back. Reports each task's start and peak RSS, the bytes it spilled, and
the times.

    python bench/ragged_memory.py [--gb 2.0] [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import local_session, report  # noqa: E402

MEAN_TOKENS, VOCAB = 256, 512


def make_model():
    import torch

    class Bag(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bag = torch.nn.EmbeddingBag(VOCAB, 16, mode="mean", padding_idx=0)
            self.out = torch.nn.Linear(16, 2)

        def forward(self, tokens):
            return self.out(self.bag(tokens))

    return Bag()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{tempfile.mkdtemp()}/mlflow.db")
    from pyspark.sql import functions as F

    from sparkdl_avg import SPARK_CONF, TrainConfig, fit

    rows = int(args.gb * 2**30 / 4 / MEAN_TOKENS)
    spark = local_session(2, **SPARK_CONF, **{"spark.driver.memory": "2g"})
    try:
        ids = F.sequence(F.lit(1), (F.col("id") % (2 * MEAN_TOKENS - 1) + 1).cast("int"))
        df = spark.range(rows, numPartitions=16).select(
            F.transform(ids, lambda t: (t % (VOCAB - 1) + 1).cast("int")).alias("tokens"),
            (F.col("id") % 2).cast("int").alias("label"))
        config = TrainConfig(num_workers=2, epochs=1, batch_size=2048, averaging_frequency=8,
                             optimizer="adam", lr=1e-3, log_model=False, checkpoint_every=0,
                             data_cache="disk", experiment_name="bench-ragged-memory")
        started = time.perf_counter()
        result = fit(df, make_model, config, features_col="tokens",
                     on_round=lambda metrics: metrics["round"] >= args.rounds)
        total_s = time.perf_counter() - started
    finally:
        spark.stop()
    workers = [{k: w[k] for k in ("partition", "cache", "train_rows", "start_rss_mb",
                                  "peak_rss_mb", "spilled_mb", "load_s", "pad_fraction")}
               for w in result.workers]
    report("ragged_memory", {"gb": args.gb, "rows": rows, "rounds": args.rounds,
                             "total_s": total_s, "timings": result.timings,
                             "workers": workers,
                             "peak_rss_mb_max": max(w["peak_rss_mb"] or 0 for w in workers)})


if __name__ == "__main__":
    main()
