"""Row g lands on worker g % n, in one shuffle, whatever the input partitioning."""

from __future__ import annotations

import pytest
import torch
from pyspark.sql import functions as F

from sparkdl_avg.data.columns import INDEX
from sparkdl_avg.data.prepare import prepare, spark_hash_int

pytestmark = pytest.mark.spark


def test_python_hash_matches_sparks(spark):
    values = list(range(-50, 200)) + [2**31 - 1, -(2**31)]
    df = spark.createDataFrame([(v,) for v in values], "v int")
    expected = [r["h"] for r in df.select(F.hash("v").alias("h")).collect()]
    assert [spark_hash_int(v) for v in values] == expected


@pytest.mark.parametrize(("workers", "input_partitions"), [(2, 3), (3, 1), (5, 4)])
def test_rows_are_numbered_in_order_and_dealt_round_robin(spark, workers, input_partitions):
    rows = [([float(i)], i % 2) for i in range(103)]
    df = spark.createDataFrame(rows, "features array<double>, label int").coalesce(1)
    if input_partitions > 1:
        df = df.repartition(input_partitions)
    data = prepare(df, None, features_col="features", label_col="label",
                   num_workers=workers, double_precision=True)
    parts = data.frame.rdd.glom().collect()
    assert len(parts) == workers
    for w, part in enumerate(parts):
        assert part and all(r[INDEX] % workers == w for r in part)
    wire = data.schema.inputs[0].wire
    numbered = sorted((r[INDEX], r[wire][0]) for part in parts for r in part)
    assert [i for i, _ in numbered] == list(range(103))
    assert sorted(f for _, f in numbered) == [float(i) for i in range(103)]
    if input_partitions == 1:  # numbering follows the DataFrame's own order
        assert all(i == f for i, f in numbered)
    assert data.train_sizes == [len(p) for p in parts]


def test_eval_ids_wider_than_train_s_are_range_checked_with_ansi_off(ansi_off):
    """Issue 39: eval_df's bigint labels were cast to train_df's int by Spark, which with ANSI
    off wraps 2**32 + 1 into the class 1, silently; validation now sees them unnarrowed, and
    those that fit are carried narrowed, as train_df's."""
    from pyspark.sql import types as T

    from sparkdl_avg import DataError

    rows = [([float(i), 1.0], i % 3) for i in range(12)]
    train = ansi_off.createDataFrame(rows, "features array<double>, label int")
    fits = train.withColumn("label", F.col("label").cast(T.LongType()))
    wide = fits.withColumn("label", F.when(F.col("label") == 1, F.lit(2**32 + 1))
                           .otherwise(F.col("label")))
    with pytest.raises(DataError, match=r"eval_df's label \('label'\) holds 0 to 4294967297, "
                                        r"beyond the int32 train_df carries it in "
                                        r"\(-2147483648 to 2147483647\): cast train_df's"):
        prepare(train, wide, num_workers=2, double_precision=False)
    data = prepare(train, fits, num_workers=2, double_precision=False)
    label = data.schema.labels[0]
    assert label.dtype == "int32" and data.frame.schema[label.wire].dataType == T.IntegerType()
    assert sorted(r[0] for r in data.frame.select(label.wire).collect()) == \
        sorted([i % 3 for i in range(12)] * 2)


def test_the_fit_path_gives_spark_type_objects_not_type_strings(spark, monkeypatch):
    """A type or schema string goes through Spark's SQL parser, whose first use costs a cold
    session's driver about 0.35 s: the fit's casts and its jobs' schemas are type objects."""
    from pyspark.sql.types import StructType

    from sparkdl_avg.task import probe, report

    column = type(F.lit(1))
    cast, given = column.cast, []
    monkeypatch.setattr(column, "cast", lambda self, to: given.append(to) or cast(self, to))
    df = spark.createDataFrame([([1.0, 2.0], 1), ([3.0, 4.0], 0)], "features array<double>, "
                               "label int")
    prepare(df, df, features_col="features", label_col="label", num_workers=2,
            double_precision=False)
    assert given and [to for to in given if isinstance(to, str)] == []
    assert isinstance(report.struct_type(), StructType)
    assert isinstance(report.struct_type(probe.FIELDS), StructType)


class RowTracer(torch.nn.Module):
    """A linear model of one-hot features (row g's is e_g), from zero, against labels 1: a
    row's weight moves if and only if a step trained on that row. With a `marker`, its
    forward raises once, in partition 1's third step: the padded one."""

    def __init__(self, marker: str = "") -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(TRACED_ROWS, dtype=torch.float64))
        self.marker, self.calls = marker, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import os

        from pyspark import TaskContext

        ctx = TaskContext.get()
        if self.marker and ctx is not None and ctx.partitionId() == 1 and self.training:
            self.calls += 1
            if self.calls == 3 and not os.path.exists(self.marker):
                open(self.marker, "w").close()
                raise ValueError("injected failure in the padded step")
        return x @ self.weight


TRACED_ROWS, LR = 9, 0.1
"""Over 2 workers: partitions of 5 and 4 rows, 2 a batch: ceil(4 / 2) steps an epoch used to
leave the 5-row partition's last position out of every epoch."""


def padded_sgd() -> list[float]:
    """The weights after one epoch of SGD, averaged every step, over the global order the
    two workers' padded epochs make: rows 0..8, then row 1 again (worker 1's position 4 is
    its first row), 4 rows a step (2 a worker), the last step 2."""
    order = list(range(TRACED_ROWS)) + [1]
    w = [0.0] * TRACED_ROWS
    for start in range(0, len(order), 4):
        batch = order[start:start + 4]
        grad = [0.0] * TRACED_ROWS
        for g in batch:
            grad[g] += 2 * (w[g] - 1) / len(batch)
        w = [wg - LR * dg for wg, dg in zip(w, grad, strict=True)]
    return w


@pytest.mark.parametrize(("mode", "cache", "shuffle"),
                         [("sync", "memory", False), ("async", "disk", True)])
@pytest.mark.exact
def test_a_fit_trains_on_every_row_every_epoch(spark, caplog, tmp_path, mode, cache,
                                               shuffle):
    """Sync also fails in the padded step once, and restarts from the step before it."""
    import logging
    from functools import partial

    import numpy as np

    from sparkdl_avg import TrainConfig, fit

    eye = np.eye(TRACED_ROWS)
    df = spark.createDataFrame([(eye[g].tolist(), 1.0) for g in range(TRACED_ROWS)],
                               "features array<double>, label double").coalesce(1)
    rounds = {"averaging_frequency": 1, "checkpoint_every": 1} if mode == "sync" else {}
    config = TrainConfig(num_workers=2, epochs=1, batch_size=2, lr=LR, optimizer="sgd",
                         mode=mode, data_cache=cache, shuffle=shuffle, seed=5, **rounds,
                         log_model=False, experiment_name="every-row")
    marker = str(tmp_path / "fired") if mode == "sync" else ""
    with caplog.at_level(logging.INFO, logger="sparkdl_avg"):
        result = fit(df, partial(RowTracer, marker), config, loss="mse")
    weights = result.model.weight.tolist()
    assert [g for g, w in enumerate(weights) if w == 0.0] == []
    if mode == "sync":
        assert [f["restart_at"] for f in result.failures] == ["round 2"], result.failures
        assert np.allclose(weights, padded_sgd(), rtol=0, atol=1e-12)
    assert "1 partition(s) one row short repeat one row an epoch" in caplog.text
    from mlflow.tracking import MlflowClient

    assert MlflowClient().get_run(result.run_id).data.params["padded_rows"] == "1"
