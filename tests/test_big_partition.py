"""Partitions larger than the cache budget (issue 11): about 60 MB a partition against an
8 MB budget. The disk cache keeps a task's resident memory from growing with its partition,
gives bit-identical parameters to the memory cache with and without shuffle, and recovers
bit-identically from a fault injected mid-epoch."""

from __future__ import annotations

import logging
import os
import re
from functools import partial

import pytest
from faulty import FaultyMLP, assert_sync_recovery, same_parameters

from sparkdl_avg import TrainConfig, fit

pytestmark = pytest.mark.spark

FEATURES, ROWS = 128, 240_000  # 2 partitions of 120k rows x 520 bytes: 62 MB each
PARTITION_MB = ROWS // 2 * (FEATURES * 4 + 8) / 2**20
GROWTH_BOUND_MB = 30
"""A disk-cached task's peak resident memory may exceed its start by this much, whatever its
partition's size (measured: 15 MB): Arrow batches in flight while loading (Spark's 10,000
rows, about 5 MB here, and a sorted copy), the 2 MB shuffle window, the prefetched
minibatches, and allocator slack. That is in a Python worker that has trained before: a
process's first task also pays once for torch's code pages (about 90 MB) and Arrow's
memory pool (about 45 MB), the same for any partition size (see docs/guide/large-data.md, "How much
memory a worker needs")."""
DRIVER_LOG: list[str] = []
"""The driver's log lines during the disk fit."""
BASE = dict(num_workers=2, epochs=1, batch_size=256, averaging_frequency=8, optimizer="adam",
            lr=0.003, seed=11, cache_budget_mb=8, shuffle_buffer_mb=2, log_model=False,
            checkpoint_every=10, experiment_name="big-partitions")


@pytest.fixture(scope="module")
def big(spark, tmp_path_factory):
    from pyspark.sql import functions as F

    frame = spark.range(ROWS, numPartitions=4).select(
        F.array(*[F.rand(seed=i).cast("float") for i in range(FEATURES)]).alias("features"),
        (F.col("id") % 3).cast("int").alias("label")).cache()
    frame.count()
    yield frame
    frame.unpersist()


def _fit(data, cache: str, model_fn=None, **overrides):
    model_fn = model_fn or partial(FaultyMLP, n_features=FEATURES)
    return fit(data, model_fn, TrainConfig(**{**BASE, **overrides, "data_cache": cache}))


@pytest.fixture(scope="module")
def small_pair(big):
    """Disk and memory without shuffle on 20,000 rows; also warms the Python workers."""
    small = big.limit(20_000)
    return (_fit(small, "disk", shuffle=False, averaging_frequency=16),
            _fit(small, "auto", shuffle=False, averaging_frequency=16, cache_budget_mb=512))


@pytest.fixture(scope="module")
def on_disk(big, small_pair):
    """The disk fit, with the driver's log lines (progress polled every 0.1 s)."""
    from sparkdl_avg.driver import barrier

    lines = DRIVER_LOG
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger, every = logging.getLogger("sparkdl_avg"), barrier.LOAD_LOG_S
    logger.addHandler(handler)
    level, barrier.LOAD_LOG_S = logger.level, 0.1
    logger.setLevel(logging.INFO)
    try:
        result = _fit(big, "disk")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        barrier.LOAD_LOG_S = every
    return result


def test_the_driver_shows_the_load_phase(on_disk):
    loading = [line for line in DRIVER_LOG if line.startswith("loading partitions")]
    assert loading, DRIVER_LOG
    rows = [int(re.match(r"loading partitions: ([\d,]+) of 240,000 rows", line).group(1)
                .replace(",", "")) for line in loading]
    assert rows == sorted(rows) and 0 < rows[-1] <= ROWS


def test_without_shuffle_the_caches_also_agree(small_pair):
    on_disk, in_memory = small_pair
    assert {w["cache"] for w in on_disk.workers} == {"disk"}
    assert {w["cache"] for w in in_memory.workers} == {"memory"}
    assert same_parameters(on_disk.model, in_memory.model)


def test_a_disk_cached_task_does_not_grow_with_its_partition(on_disk, small_pair):
    assert PARTITION_MB > 55  # MiB: 62 MB
    # the same Python workers as the warm-up fits (Spark reuses them): see GROWTH_BOUND_MB
    assert {w["pid"] for w in on_disk.workers} <= {w["pid"] for w in small_pair[1].workers}
    for worker in on_disk.workers:
        assert worker["cache"] == "disk"
        assert worker["spilled_mb"] == pytest.approx(PARTITION_MB, rel=0.01)
        growth = worker["peak_rss_mb"] - worker["start_rss_mb"]
        assert growth < GROWTH_BOUND_MB, (worker, small_pair)
        assert worker["load_mb_s"] > 0 and worker["read_mb_s"] > 0


def test_memory_and_disk_caches_train_bit_identical_parameters(big, on_disk):
    in_memory = _fit(big, "memory")
    assert same_parameters(in_memory.model, on_disk.model)
    # the memory bound above can fail: holding the partition grows a task past it
    for worker in in_memory.workers:
        assert worker["cache"] == "memory" and worker["spilled_mb"] == 0
        assert worker["peak_rss_mb"] - worker["start_rss_mb"] > PARTITION_MB


def test_a_fault_mid_epoch_in_disk_mode_recovers_bit_identically(spark, big, on_disk,
                                                                  tmp_path):
    """Partition 1's Python worker is killed at its 100th step of 469 (past 6 of its 30
    shuffle windows), after the checkpoint at step 80, which the restart reads from. The
    killed task's spill folder is left behind; the restarted tasks remove it (checked by the
    next test)."""
    marker = tmp_path / "fired"
    model_fn = partial(FaultyMLP, n_features=FEATURES, fault="kill", marker=str(marker),
                       at_call=100, steps_dir=str(tmp_path))
    result = _fit(big, "disk", model_fn=model_fn)
    assert marker.exists() and len(result.failures) == 1
    assert result.failures[0]["restart_at"] == "round 10"
    assert_sync_recovery(result, tmp_path, at_call=100, steps_per_round=8,
                         total_steps=-(-ROWS // 2 // 256))
    assert same_parameters(result.model, on_disk.model)
    roots = _spill_roots(spark)
    assert any(os.path.isdir(r) for r in roots)  # the tasks spilled there
    assert _leftovers(roots) == []  # the killed worker's folder too: the restart removed it


def _spill_roots(spark) -> list[str]:
    """The spill roots under Spark's local directories (local mode: the driver's executor)."""
    dirs = spark.sparkContext.parallelize([0], 1).map(
        lambda _: os.environ["SPARK_LOCAL_DIRS"]).collect()[0].split(",")
    return [os.path.join(d, "sparkdl-avg-spill") for d in dirs]


def _leftovers(roots: list[str]) -> list[str]:
    return [name for r in roots if os.path.isdir(r) for name in os.listdir(r)]


def test_spill_files_went_to_sparks_local_dirs_and_are_gone(on_disk, spark):
    roots = _spill_roots(spark)
    assert any(os.path.isdir(r) for r in roots)  # the tasks spilled there
    assert _leftovers(roots) == []
