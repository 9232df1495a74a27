"""The one data order both caches follow (`data.order.EpochOrder`): pure, no Spark."""

import numpy as np
import pytest

from sparkdl_avg.data.order import (
    Cut,
    EpochOrder,
    batch_positions,
    epoch_length,
    make_cut,
    padded_rows,
    partition_sizes,
)
from sparkdl_avg.task.schedule import make_schedule


def _epoch(order: EpochOrder) -> np.ndarray:
    return np.concatenate([order.rows(k) for k in range(order.num_windows)])


@pytest.mark.parametrize("rows", [1, 7, 100, 103])
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_row_is_visited_exactly_once_per_epoch(rows, shuffle):
    order = EpochOrder(rows, epoch=2, worker=1, seed=3, shuffle=shuffle, cut=Cut(4, 3))
    visited = _epoch(order)
    assert sorted(visited.tolist()) == list(range(rows))
    if not shuffle:
        assert np.array_equal(visited, np.arange(rows))


def test_order_is_seeded_by_seed_worker_and_epoch():
    def rows(**kw):
        args = {"epoch": 0, "worker": 1, "seed": 5, "shuffle": True, "cut": Cut(4, 3)} | kw
        return _epoch(EpochOrder(103, **args))

    assert np.array_equal(rows(), rows())
    for change in ({"epoch": 1}, {"worker": 0}, {"seed": 6}):
        assert not np.array_equal(rows(), rows(**change))


def test_a_partition_within_one_window_is_fully_permuted_as_before():
    """Small partitions keep the full permutation the previous releases used."""
    order = EpochOrder(100, epoch=1, worker=2, seed=5, shuffle=True, cut=Cut(8, 16))
    assert order.num_windows == 1
    assert np.array_equal(order.rows(0), np.random.default_rng([5, 2, 1]).permutation(100))


def test_windows_hold_whole_chunks_and_mix_rows_across_the_partition():
    cut = Cut(chunk_rows=10, window_chunks=3)
    order = EpochOrder(95, epoch=0, worker=0, seed=1, shuffle=True, cut=cut)
    assert order.num_windows == 4
    for k in range(order.num_windows):
        ranges = order.ranges(k)
        assert all(a % 10 == 0 and b - a <= 10 for a, b in ranges)
        assert sorted(order.rows(k).tolist()) == sorted(
            r for a, b in ranges for r in range(a, b))
    # chunks come in a shuffled order: the first window is not simply rows 0..29
    assert sorted(order.rows(0).tolist()) != list(range(30))


def test_windows_of_splits_a_batch_across_window_boundaries():
    order = EpochOrder(95, epoch=0, worker=0, seed=1, shuffle=True, cut=Cut(10, 3))
    visited = _epoch(order)
    for start, stop in [(0, 7), (25, 35), (28, 95), (90, 95)]:
        got = np.concatenate([order.rows(k)[a:b] for k, a, b in order.windows_of(start, stop)])
        assert np.array_equal(got, visited[start:stop])


def test_cut_follows_row_size_and_shuffle_buffer():
    cut = make_cut(row_bytes=1024, shuffle_buffer_mb=64)
    assert cut.chunk_rows == 256 and cut.window_rows == 65536
    assert make_cut(row_bytes=10 << 20, shuffle_buffer_mb=1) == Cut(1, 1)


def test_batches_tile_the_epoch_and_the_last_one_is_partial():
    assert [batch_positions(s, 4, 10) for s in range(3)] == [(0, 4), (4, 8), (8, 10)]


def _epoch_batches(sizes, worker, *, batch, epoch, shuffle, cut):
    """Worker `worker`'s minibatches of one epoch, as rows, the way `TrainBatches` cuts them:
    the schedule's micro-batches per epoch, each batch's positions through `windows_of`."""
    schedule = make_schedule(epoch_length(sizes), batch, epochs=1, averaging_frequency=1)
    order = EpochOrder(sizes[worker], epoch=epoch, worker=worker, seed=4, shuffle=shuffle,
                       cut=cut)
    return [np.concatenate([order.rows(k)[a:b] for k, a, b in order.windows_of(
        *batch_positions(step, batch, epoch_length(sizes)))])
        for step in range(schedule.micro_batches_per_epoch)]


# uneven partitions whose smallest is a multiple of the batch (the case that used to leave
# the longer partitions' last row out), one that is not, and one cut in several windows
@pytest.mark.parametrize(("rows", "workers", "batch", "cut"),
                         [(403, 4, 4, Cut(8, 2)), (17, 2, 4, Cut(64, 1)),
                          (11, 3, 3, Cut(64, 1)), (1001, 2, 10, Cut(7, 3))])
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_row_of_every_worker_is_in_every_epoch(rows, workers, batch, cut, shuffle):
    sizes = partition_sizes(rows, workers)
    assert len(set(sizes)) == 2  # uneven
    for worker, size in enumerate(sizes):
        for epoch in (0, 1):
            batches = _epoch_batches(sizes, worker, batch=batch, epoch=epoch,
                                     shuffle=shuffle, cut=cut)
            seen = np.concatenate(batches)
            assert set(seen.tolist()) == set(range(size))  # every row, none beyond
            # the same batches on every worker; a short one repeats one row to fill them
            assert len(seen) == epoch_length(sizes) and [len(b) for b in batches] == \
                [len(b) for b in _epoch_batches(sizes, 0, batch=batch, epoch=epoch,
                                                shuffle=shuffle, cut=cut)]
            assert len(seen) - size == (1 if size < max(sizes) else 0)
    assert padded_rows(sizes) == workers * max(sizes) - rows


def test_padding_repeats_the_epochs_first_rows_as_distributed_sampler_does():
    """A partition within one window: the padded position is the epoch's first row, as
    DistributedSampler pads with the first indices (no extra read from the disk cache)."""
    for shuffle in (False, True):
        order = EpochOrder(5, epoch=0, worker=1, seed=2, shuffle=shuffle, cut=Cut(64, 1))
        assert order.windows_of(4, 7) == [(0, 4, 5), (0, 0, 2)]
        assert order.windows_of(5, 6) == [(0, 0, 1)]
