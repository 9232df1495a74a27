"""overlap_averaging: each round computes while the round before is averaged, then moves onto
that average plus its own progress. Checked against an independent two-replica simulation of
the rule in float64, and by a driver slowed down that the workers no longer wait for."""

from __future__ import annotations

import time
from functools import partial

import pytest
import torch
from faulty import FaultyMLP, assert_sync_recovery, dataset, same_parameters
from test_fit_sync import frame, make_data, make_model_f64, max_param_diff

from sparkdl_avg import TrainConfig, fit
from sparkdl_avg.averaging import coordinator
from sparkdl_avg.data.order import batch_positions

pytestmark = pytest.mark.spark

ROWS, BATCH, EVERY, EPOCHS, LR, MOMENTUM = 411, 4, 4, 2, 0.05, 0.9


def reference_overlapped(x, y, *, hold: set[int], with_state: bool = False) -> torch.nn.Module:
    """Two replicas on rows g % 2, in DataFrame order (padded), `EVERY` SGD steps a round. The
    exchange of round r returns after round r + 1 computed: x <- x - S_r + A_r, A_r the
    sample-weighted average of the pushed S_r. Rounds in `hold`, and the last, are waited
    for: x <- A_r. `with_state`: x holds the momentum buffers too, after the parameters."""
    length = -(-len(x) // 2)  # a shard one row short pads its epoch with its first row
    shards = [(torch.from_numpy(x[w::2]), torch.from_numpy(y[w::2])) for w in range(2)]
    shards = [(torch.cat([xs, xs[:length - len(xs)]]), torch.cat([ys, ys[:length - len(ys)]]))
              for xs, ys in shards]
    steps_per_epoch = -(-length // BATCH)
    total = steps_per_epoch * EPOCHS
    rounds = -(-total // EVERY)
    replicas = [make_model_f64() for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM) for m in replicas]

    def tensors(w):
        params = list(replicas[w].parameters())
        state = [opts[w].state[p]["momentum_buffer"] for p in params] if with_state else []
        return params + state

    def flat(w):
        return torch.cat([t.detach().reshape(-1) for t in tensors(w)])

    def assign(w, values):
        offset = 0
        with torch.no_grad():
            for t in tensors(w):
                t.copy_(values[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    pending = None
    for r in range(rounds):
        samples = [0, 0]
        for w, (m, opt, (xs, ys)) in enumerate(zip(replicas, opts, shards, strict=True)):
            for step in range(r * EVERY, min((r + 1) * EVERY, total)):
                a, b = batch_positions(step % steps_per_epoch, BATCH, len(xs))
                opt.zero_grad()
                torch.nn.functional.cross_entropy(m(xs[a:b]), ys[a:b]).backward()
                opt.step()
                samples[w] += b - a
        if pending is not None:
            sent, average = pending
            for w in range(2):
                assign(w, flat(w) - sent[w] + average)
        sent = [flat(w) for w in range(2)]
        average = (samples[0] * sent[0] + samples[1] * sent[1]) / sum(samples)
        if r in hold or r == rounds - 1:
            for w in range(2):
                assign(w, average)
            pending = None
        else:
            pending = (sent, average)
    return replicas[0]


@pytest.mark.parametrize(("checkpoint_every", "transport", "with_state"),
                         [(0, "driver", False), (3, "driver", False), (3, "collective", False),
                          (3, "driver", True)])
@pytest.mark.exact
def test_overlapped_fit_equals_the_simulated_rule(spark, checkpoint_every, transport,
                                                  with_state):
    # 206 and 205 rows: unequal shards and partial last batches, so the weights matter;
    # checkpoint_every=3: every third round is waited for (the checkpoint takes the
    # worker's state at the average), the others overlap. Either transport; with the
    # momentum buffers averaged too (they join the buffer after the first step).
    x, y = make_data(ROWS)
    cfg = TrainConfig(num_workers=2, epochs=EPOCHS, batch_size=BATCH,
                      averaging_frequency=EVERY, optimizer="sgd", lr=LR, momentum=MOMENTUM,
                      shuffle=False, log_model=False, overlap_averaging=True,
                      checkpoint_every=checkpoint_every, transport=transport,
                      average_optimizer_state=with_state)
    result = fit(frame(spark, x, y), make_model_f64, cfg)
    rounds = len(result.history)
    hold = {r for r in range(rounds) if checkpoint_every and (r + 1) % checkpoint_every == 0}
    expected = reference_overlapped(x, y, hold=hold, with_state=with_state)
    assert max_param_diff(result.model, expected) < 1e-10
    # the rule is not plain averaging: without the overlap (every round held) it differs
    plain = reference_overlapped(x, y, hold=set(range(rounds)), with_state=with_state)
    assert max_param_diff(plain, expected) > 1e-4
    if checkpoint_every:  # ... and the held rounds are not overlapped ones
        assert max_param_diff(reference_overlapped(x, y, hold=set(), with_state=with_state),
                              expected) > 1e-4
    if with_state:  # ... and the averaged momentum changes the trajectory
        assert max_param_diff(reference_overlapped(x, y, hold=hold), expected) > 1e-4


class SlowSteps(torch.nn.Module):
    """20 ms of sleep in every forward: rounds whose compute is known."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 3)

    def forward(self, x):
        time.sleep(0.02)
        return self.linear(x)


def test_overlap_hides_a_slow_driver_behind_compute(spark, monkeypatch):
    # Each round: 2 steps of 20 ms on the workers, and 40 ms of averaging on the driver.
    # Waiting for the average costs 16 rounds x ~40 ms; overlapped, the next round's steps
    # run meanwhile.
    averaged = coordinator.average_and_diverge

    def slow_average(*args, **kwargs):
        time.sleep(0.04)
        return averaged(*args, **kwargs)

    monkeypatch.setattr(coordinator, "average_and_diverge", slow_average)
    df = frame(spark, *make_data(128))
    train_s = {}
    for overlap in (False, True):
        cfg = TrainConfig(num_workers=2, epochs=1, batch_size=2, averaging_frequency=2,
                          overlap_averaging=overlap, log_model=False, checkpoint_every=0)
        result = fit(df, SlowSteps, cfg)
        assert len(result.history) == 16
        train_s[overlap] = sum(h["time_round_s"] for h in result.history)
    # waiting: >= 16 x (40 + 40) ms; overlapped: about 16 x 40 ms
    assert train_s[False] > 1.2
    assert train_s[True] < 0.75 * train_s[False], train_s


@pytest.mark.parametrize("fault", ["raise", "kill"])
def test_overlapped_fit_recovers_from_a_fault_bit_identically(spark, fault, tmp_path):
    # The fault hits round 4's steps while round 3's exchange is in flight (round 2, a
    # checkpoint, was waited for): the worker dies, or fails and lets its exchange end first;
    # the restart from round 3 ends where the fit without the fault does.
    data = dataset(spark).cache()
    base = dict(num_workers=2, epochs=2, batch_size=15, averaging_frequency=2,
                optimizer="adam", lr=0.01, seed=5, checkpoint_every=3, log_model=False,
                overlap_averaging=True)
    reference = fit(data, FaultyMLP, TrainConfig(**base))
    result = fit(data, partial(FaultyMLP, fault=fault, marker=str(tmp_path / "fired"),
                               steps_dir=str(tmp_path)), TrainConfig(**base))
    assert (tmp_path / "fired").exists()
    assert [f["restart_at"] for f in result.failures] == ["round 3"]
    assert_sync_recovery(result, tmp_path, at_call=9, steps_per_round=2, total_steps=40)
    assert same_parameters(result.model, reference.model)
    data.unpersist()


def test_a_fault_in_the_steps_after_a_stop_does_not_fail_the_stopped_fit(spark, tmp_path):
    # on_round stops the fit at round 3 (rounds done), so the next round's average is the
    # workers' last; overlapped, they learn it only after the steps of the round after,
    # where partition 1's forward raises. Those steps were past the end: the fit finishes as
    # it does without the fault.
    data = dataset(spark).cache()
    base = dict(num_workers=2, epochs=2, batch_size=15, averaging_frequency=2,
                optimizer="adam", lr=0.01, seed=5, checkpoint_every=0, log_model=False,
                overlap_averaging=True)

    def stop_at_2(row):  # the third round: the one of index 2
        return row["round"] == 3

    reference = fit(data, FaultyMLP, TrainConfig(**base), on_round=stop_at_2)
    result = fit(data, partial(FaultyMLP, fault="raise", marker=str(tmp_path / "fired")),
                 TrainConfig(**base), on_round=stop_at_2)
    assert (tmp_path / "fired").exists()  # the fault did fire, in the dropped round
    assert result.failures == []
    assert len(result.history) == 3
    assert same_parameters(result.model, reference.model)
    data.unpersist()
