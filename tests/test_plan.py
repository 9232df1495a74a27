import numpy as np
import pytest

from sparkdl_avg.data.order import batch_slice, epoch_order, partition_sizes
from sparkdl_avg.task.schedule import make_schedule


@pytest.mark.parametrize(("rows", "workers"), [(10, 3), (9, 3), (1, 1), (1000, 7)])
def test_partitions_are_balanced_and_cover_every_row(rows, workers):
    sizes = partition_sizes(rows, workers)
    assert sum(sizes) == rows and len(sizes) == workers
    assert max(sizes) - min(sizes) <= 1
    # row g goes to worker g % workers
    assert sizes == [len(range(w, rows, workers)) for w in range(workers)]


def test_schedule_rounds_cover_all_steps_with_a_short_last_round():
    s = make_schedule(smallest_partition=205, batch_size=4, epochs=3, averaging_frequency=8)
    assert s.steps_per_epoch == 52
    assert s.total_steps == 156
    assert s.num_rounds == 20
    assert [s.steps_in_round(r) for r in range(s.num_rounds)] == [8] * 19 + [4]


def test_epoch_order_is_a_seeded_permutation():
    a = epoch_order(100, epoch=0, worker=1, seed=5, shuffle=True)
    assert sorted(a.tolist()) == list(range(100))
    assert np.array_equal(a, epoch_order(100, epoch=0, worker=1, seed=5, shuffle=True))
    assert not np.array_equal(a, epoch_order(100, epoch=1, worker=1, seed=5, shuffle=True))
    assert not np.array_equal(a, epoch_order(100, epoch=0, worker=0, seed=5, shuffle=True))
    assert np.array_equal(epoch_order(5, epoch=3, worker=0, seed=5, shuffle=False), np.arange(5))


def test_batches_tile_the_epoch_and_the_last_one_is_partial():
    slices = [batch_slice(s, 4, 10) for s in range(3)]
    assert [(s.start, s.stop) for s in slices] == [(0, 4), (4, 8), (8, 10)]
