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
    numbered = sorted((r[INDEX], r["features"][0]) for part in parts for r in part)
    assert [i for i, _ in numbered] == list(range(103))
    assert sorted(f for _, f in numbered) == [float(i) for i in range(103)]
    if input_partitions == 1:  # numbering follows the DataFrame's own order
        assert all(i == f for i, f in numbered)
    assert data.train_sizes == [len(p) for p in parts]


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
    row's weight moves if and only if a step trained on that row."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(TRACED_ROWS, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


TRACED_ROWS = 9
"""Over 2 workers: partitions of 5 and 4 rows, 2 a batch: ceil(4 / 2) steps an epoch used to
leave the 5-row partition's last position out of every epoch."""


@pytest.mark.parametrize(("mode", "cache", "shuffle"),
                         [("sync", "memory", False), ("async", "disk", True)])
def test_a_fit_trains_on_every_row_every_epoch(spark, caplog, mode, cache, shuffle):
    import logging

    import numpy as np

    from sparkdl_avg import TrainConfig, fit

    eye = np.eye(TRACED_ROWS)
    df = spark.createDataFrame([(eye[g].tolist(), 1.0) for g in range(TRACED_ROWS)],
                               "features array<double>, label double").coalesce(1)
    config = TrainConfig(num_workers=2, epochs=1, batch_size=2, optimizer="sgd", lr=0.1,
                         mode=mode, data_cache=cache, shuffle=shuffle, seed=5,
                         log_model=False, experiment_name="every-row")
    with caplog.at_level(logging.INFO, logger="sparkdl_avg"):
        result = fit(df, RowTracer, config, loss="mse")
    untrained = [g for g, w in enumerate(result.model.weight.tolist()) if w == 0.0]
    assert untrained == []
    assert "1 partition(s) one row short repeat one row an epoch" in caplog.text
    from mlflow.tracking import MlflowClient

    assert MlflowClient().get_run(result.run_id).data.params["padded_rows"] == "1"
