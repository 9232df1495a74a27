"""A binary column of 3 GB (1.5 GB a worker, 128 KiB records) trains through
`fit(preprocess=)` from the disk cache with each task's peak resident memory at most 1 GB
(issue 31). Spark makes the records (no file, nothing in Python on the driver); the
preprocess is trivial (the first bytes of each record as numbers), so what is measured is the
feed: the partition's load into the cache, the shuffle windows read back, and the raw batches
in flight on the preprocess pool. The fit stops at averaging round 4 (`on_round`), by when
all of those have happened. `bench/bytes_memory.py` is the same run by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pyspark.sql import functions as F
from pyspark.sql import types as T

from sparkdl_avg import TrainConfig, fit

pytestmark = pytest.mark.spark

GB, RECORD_KB, WIDTH = 3.0, 128, 16
PEAK_MB = 1024


def _first_bytes(batch, *, training, rng):
    """Each record's first WIDTH bytes as numbers: a decoder that costs nothing."""
    rows = batch["content"]
    head = np.frombuffer(b"".join(r[:WIDTH] for r in rows), np.uint8).reshape(len(rows), WIDTH)
    return {"content": head.astype(np.float32) / 255}


class Head(torch.nn.Linear):
    def __init__(self) -> None:
        super().__init__(WIDTH, 2)


def test_1_5_gb_of_bytes_a_worker_trains_under_1_gb_a_task(spark):
    rows = int(GB * 2**20 / RECORD_KB)
    # 128 KiB a record: the row's id as 16 bytes (records differ) + a constant body; a
    # binary literal costs Spark a copy a row, where unhex of a long string parses it
    body = F.lit(bytes(RECORD_KB * 1024 - WIDTH))
    df = spark.range(rows, numPartitions=16).select(
        F.concat(F.unhex(F.lpad(F.hex("id"), 2 * WIDTH, "0")), body).alias("content"),
        (F.col("id") % 2).cast(T.IntegerType()).alias("label"))
    config = TrainConfig(num_workers=2, epochs=1, batch_size=64, averaging_frequency=8,
                         optimizer="adam", lr=1e-3, log_model=False, data_cache="disk",
                         experiment_name="bytes-memory")
    result = fit(df, Head, config, features_col="content", preprocess=_first_bytes,
                 on_round=lambda metrics: metrics["round"] >= 5)
    assert len(result.history) == 5  # rounds 1 to 5
    for worker in result.workers:
        assert worker["cache"] == "disk" and worker["train_rows"] == rows // 2
        assert worker["spilled_mb"] > 1400  # the partition is on disk: 1.5 GB of records
        assert worker["peak_rss_mb"] <= PEAK_MB, worker
