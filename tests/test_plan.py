import pytest

from sparkdl_avg.data.order import partition_sizes
from sparkdl_avg.task.schedule import make_schedule


@pytest.mark.parametrize(("rows", "workers"), [(10, 3), (9, 3), (1, 1), (1000, 7)])
def test_partitions_are_balanced_and_cover_every_row(rows, workers):
    sizes = partition_sizes(rows, workers)
    assert sum(sizes) == rows and len(sizes) == workers
    assert max(sizes) - min(sizes) <= 1
    # row g goes to worker g % workers
    assert sizes == [len(range(w, rows, workers)) for w in range(workers)]


def test_schedule_rounds_cover_all_steps_with_a_short_last_round():
    s = make_schedule(epoch_rows=205, batch_size=4, epochs=3, averaging_frequency=8)
    assert s.steps_per_epoch == 52
    assert s.total_steps == 156
    assert s.num_rounds == 20
    assert [s.steps_in_round(r) for r in range(s.num_rounds)] == [8] * 19 + [4]


def test_by_default_a_fit_evaluates_after_each_round_in_which_an_epoch_ends():
    # 10 steps an epoch, 4 a round: the epochs end inside round 2 (steps 8-11), at the end of
    # round 4 (16-19) and in the last round, 7 (28-29)
    schedule = make_schedule(40, 4, 3, 4)
    assert schedule.steps_per_epoch == 10 and schedule.num_rounds == 8
    assert [r for r in range(schedule.num_rounds)
            if schedule.evaluates_after(r, None)] == [2, 4, 7]
    # an epoch ending exactly at a round's end counts for that round, not the next
    exact = make_schedule(40, 4, 2, 5)
    assert [r for r in range(exact.num_rounds) if exact.evaluates_after(r, None)] == [1, 3]
    assert [r for r in range(8) if schedule.evaluates_after(r, 3)] == [2, 5]


@pytest.mark.parametrize(("rows", "batch", "epochs", "k", "accumulation", "warmup"), [
    (205, 4, 3, 8, 1, 0), (100, 10, 2, 3, 2, 2), (7, 10, 2, 1, 1, 0), (300, 10, 2, 3, 1, 0)])
def test_the_rows_an_absent_worker_skips_add_up_to_its_epochs(rows, batch, epochs, k,
                                                            accumulation, warmup):
    """An elastic fit's `skipped_rows`: each round's row positions, counted a batch at a time
    from the data's position (an epoch's last batch short), add up to epochs x rows, and
    any span of rounds is the sum of its rounds."""
    s = make_schedule(rows, batch, epochs, k, accumulation, warmup)
    per_round = [s.rows_in_rounds(r, r + 1) for r in range(s.num_rounds)]
    assert sum(per_round) == epochs * rows == s.rows_in_rounds(0, s.num_rounds)
    assert s.rows_in_rounds(1, s.num_rounds - 1) == sum(per_round[1:-1])
    # counted independently: every micro-batch of every round, its rows in its epoch
    expected = []
    for r in range(s.num_rounds):
        first = s.first_micro_batch(s.round_start(r))
        end = s.first_micro_batch(s.round_start(r + 1))
        expected.append(sum(min(batch, rows - (m % s.micro_batches_per_epoch) * batch)
                            for m in range(first, end)))
    assert per_round == expected
