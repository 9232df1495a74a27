"""Async fits against a sharded parameter server (`ps_shards`): exact in lockstep, as
accurate as one server on MNIST-1D, and a shard process killed mid-fit costs no update."""

from __future__ import annotations

import threading
from functools import partial

import pytest
from faulty import FaultyMLP, dataset, kill_server_after_a_checkpoint, server_stats, steps_run
from test_fit_sync import make_model_f64, max_param_diff, sync_and_lockstep

from sparkdl_avg import TrainConfig, fit

pytestmark = pytest.mark.spark


def test_lockstep_over_three_shards_reproduces_synchronous_averaging(spark):
    """staleness_bound=0: every shard applies a round's pushes before any read, so the
    sliced server is exactly sync averaging (float64, to 1e-10): a slice in the wrong place
    or an update applied twice on one shard cannot pass."""
    sync, sharded = sync_and_lockstep(spark, rows=240, epochs=2, ps_shards=3)
    assert max_param_diff(sync, sharded) < 1e-10
    assert max_param_diff(sync, make_model_f64()) > 1e-2


@pytest.fixture(scope="module")
def mnist1d(spark):
    from sparkdl_avg.examples.mnist1d import generate

    train, test = generate(spark, num_samples=5_000)  # 4,000 / 1,000 rows, about 2 s
    return train.cache(), test.cache()


def test_two_shards_reach_the_accuracy_of_one_on_mnist1d(mnist1d, mlflow_client):
    """In lockstep (staleness_bound=0) one server and two shards follow the same trajectory
    up to float32 rounding, so this comparison does not flake; unbounded fits differ by 1-2
    points from run to run even on one server (docs/benchmarks/index.md)."""
    from sparkdl_avg.examples.mnist1d import mlp

    train, test = mnist1d
    accuracy = {}
    for shards in (1, 2):
        result = fit(train, mlp((256,)), TrainConfig(
            mode="async", ps_shards=shards, num_workers=2, epochs=6, batch_size=50,
            push_every=4, staleness_bound=0, optimizer="adam", lr=1e-2, seed=0,
            eval_interval_s=5.0, log_model=False, experiment_name="sharded"), eval_df=test)
        final = result.history[-1]
        accuracy[shards] = final["eval_accuracy"]
        # every push applied on every shard: 2 workers x 6 epochs x 40 steps / 4 a push
        assert final["updates_applied"] == 120
        stats = server_stats(mlflow_client, result.run_id)
        assert stats["progress"] == {"0": 240, "1": 240}
        if shards > 1:
            assert [s["applied"] for s in stats["shards"]] == [120, 120]
            tags = mlflow_client.get_run(result.run_id).data.tags
            assert tags["sparkdl_avg.ps.shards"] == "2"
    assert accuracy[1] > 0.5, accuracy  # logistic regression: 32%
    assert abs(accuracy[2] - accuracy[1]) <= 0.02, accuracy


BASE = dict(mode="async", num_workers=2, epochs=2, batch_size=15, push_every=2,
            optimizer="adam", lr=0.01, seed=5, eval_interval_s=0.3, log_model=False)
STEPS = 2 * 20  # 300 rows per worker, 15 a batch, 2 epochs
PUSHES = 2 * STEPS // 2


def test_a_killed_shard_is_restarted_without_a_lost_update(spark, tmp_path, mlflow_client):
    """Shard 1 of 2 is SIGKILLed after its first checkpoint past INIT's, once a worker's push
    beyond it was acknowledged. It comes back from that checkpoint without the pushes after
    it; the workers rewind to what every shard has and redo those pushes, which only shard 1
    applies: each shard ends with every worker's every push applied exactly once (shard 0
    would have the redone ones twice otherwise)."""
    checkpoint = tmp_path / "parameter-server-1-of-2.npz"
    killer = threading.Thread(target=kill_server_after_a_checkpoint, args=(checkpoint,),
                              kwargs={"steps_dir": str(tmp_path),
                                      "push_every": BASE["push_every"]}, daemon=True)
    killer.start()
    data = dataset(spark)
    result = fit(data, partial(FaultyMLP, delay_s=0.03, steps_dir=str(tmp_path)), TrainConfig(
        **BASE, ps_shards=2, ps_checkpoint_every=5, checkpoint_dir=str(tmp_path)),
        eval_df=data)
    killer.join(timeout=5)
    assert getattr(killer, "killed_at", None) is not None, "the shard was not killed mid-fit"
    stats = server_stats(mlflow_client, result.run_id)
    assert 0 < killer.killed_at < PUSHES, killer.killed_at  # not in the last round
    # every step begun since shard 1's checkpoint, an acknowledged push among them, was done
    # again
    lost = {w: killer.steps_at_kill[w] - steps for w, steps in
            killer.checkpoint_progress.items()}
    assert max(lost.values()) > BASE["push_every"]
    assert all(steps_run(tmp_path, int(w)) - STEPS >= n for w, n in lost.items()), lost
    assert mlflow_client.get_metric_history(result.run_id, "ps_restarts")[-1].value == 1
    assert result.history[-1]["updates_applied"] == PUSHES
    assert [s["applied"] for s in stats["shards"]] == [PUSHES, PUSHES]
    assert [s["progress"] for s in stats["shards"]] == [{"0": STEPS, "1": STEPS}] * 2
    assert "eval_accuracy" in result.history[-1]

