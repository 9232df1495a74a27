"""Checkpoints on disk and in an MLflow run: complete or absent, the newest readable one wins,
damage is caught."""

from __future__ import annotations

import numpy as np
import pytest

from sparkdl_avg import ClusterError, ConfigError
from sparkdl_avg.driver.checkpoints import Checkpoint, DirStore, MlflowStore
from sparkdl_avg.driver.resume_checks import check_devices, check_resumable
from sparkdl_avg.task.schedule import Schedule

FINGERPRINT = {"averaging_frequency": 2, "lr": 0.1}


def steps(total: int) -> Schedule:
    """A schedule of `total` steps averaged every 2 (the fingerprint's)."""
    return Schedule(micro_batches_per_epoch=total, epochs=1, averaging_frequency=2)


def checkpoint(round_index: int) -> Checkpoint:
    states = [([[0, "momentum_buffer", "tensor", "float32", [3], 0, 12]],
               np.arange(12, dtype=np.uint8))]
    return Checkpoint(round=round_index, steps=2 * round_index,
                      params=np.full(3, round_index, np.float32), states=states,
                      fingerprint=FINGERPRINT, history=[{"round": 0, "train_loss": 1.5}])


def damage(params_file) -> None:
    with open(params_file, "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\x00\x00\x80\x7f")  # a flipped value: the SHA-256 no longer matches


def test_the_newest_two_are_kept_and_the_newest_is_loaded(tmp_path):
    store = DirStore(str(tmp_path))
    for r in (9, 10, 11):  # 10 and 11 sort numerically, not as text
        store.save(checkpoint(r))
    assert [p.name for p in store.complete()] == ["round-000010", "round-000011"]
    loaded = store.load_latest()
    assert loaded.round == 11 and loaded.params.tolist() == [11.0] * 3
    assert loaded.states[0][1].tolist() == list(range(12))
    assert loaded.history == [{"round": 0, "train_loss": 1.5}]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no leftovers


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path):
    store = DirStore(str(tmp_path))
    store.save(checkpoint(4))
    store.save(checkpoint(6))
    damage(tmp_path / "round-000006" / "params.npy")
    assert store.load_latest().round == 4
    (tmp_path / "round-000004" / "state-0.npy").unlink()
    with pytest.raises(ConfigError, match="cannot read the checkpoint"):
        store.load_latest()


def test_a_damaged_newest_mlflow_checkpoint_falls_back_to_the_previous(
        tmp_path, mlflow_store, mlflow_client, caplog):
    # the run's artifacts in a folder of the test's own, to damage one in place
    experiment = mlflow_client.create_experiment(f"checkpoints-{tmp_path.name}",
                                                 artifact_location=str(tmp_path / "artifacts"))
    run_id = mlflow_client.create_run(experiment).info.run_id
    store = MlflowStore(mlflow_store, run_id)
    store.save(checkpoint(4))
    store.save(checkpoint(6))
    assert store.load_latest().round == 6
    damage(tmp_path / "artifacts" / run_id / "artifacts" / "checkpoints" / "round-000006"
           / "params.npy")
    loaded = store.load_latest()
    assert loaded.round == 4 and loaded.params.tolist() == [4.0] * 3
    assert "checkpoints/round-000006" in caplog.text and "SHA-256" in caplog.text
    damage(tmp_path / "artifacts" / run_id / "artifacts" / "checkpoints" / "round-000004"
           / "params.npy")
    # none reads: the newest one's error
    with pytest.raises(ConfigError, match=r"checkpoints/round-000006 of MLflow run .*SHA-256"):
        store.load_latest()


def test_resume_checks_name_each_difference():
    with pytest.raises(ConfigError, match=r"lr: checkpoint 0.1, this fit 0.2"):
        check_resumable(checkpoint(3), {**FINGERPRINT, "lr": 0.2}, schedule=steps(100),
                        source="x")
    with pytest.raises(ConfigError, match="raise epochs"):
        check_resumable(checkpoint(3), FINGERPRINT, schedule=steps(6), source="x")
    check_resumable(checkpoint(3), FINGERPRINT, schedule=steps(100), source="x")


def test_a_checkpoint_from_before_padding_is_refused_only_where_padding_changes_the_order():
    """Before padding, an epoch left a longer partition's extra row out: with uneven
    partitions the order differs, with even ones it does not."""
    old = Checkpoint(round=1, steps=2, params=np.zeros(3, np.float32), states=None,
                     fingerprint=FINGERPRINT)
    check_resumable(old, {**FINGERPRINT, "padded_rows": 0}, schedule=steps(10), source="x")
    with pytest.raises(ConfigError, match="padded_rows: checkpoint 0, this fit 1"):
        check_resumable(old, {**FINGERPRINT, "padded_rows": 1}, schedule=steps(10), source="x")


def test_a_deterministic_restart_on_other_devices_is_refused_naming_them():
    point = checkpoint(3)
    point.fingerprint = {**FINGERPRINT, "devices": ["cuda/NVIDIA A100", "cuda/NVIDIA A100"]}
    with pytest.raises(ClusterError, match=r"partition 1: cuda/NVIDIA A100 then, cpu now"):
        check_devices(point, ["cuda/NVIDIA A100", "cpu"], deterministic=True)
    with pytest.raises(ClusterError, match=r"partition 0: .*H100 now; partition 1"):
        check_devices(point, ["cuda/NVIDIA H100", "cuda/NVIDIA H100"], deterministic=True)
    check_devices(point, ["cuda/NVIDIA A100", "cuda/NVIDIA A100"], deterministic=True)
    check_devices(point, ["cpu", "cpu"], deterministic=False)  # not asked to be bit-identical
    check_devices(checkpoint(3), ["cpu", "cpu"], deterministic=True)  # nothing recorded


@pytest.mark.parametrize("every, rounds, expected", [
    # None: by training time, CHECKPOINT_INTERVAL_S (30 s) apart, and after the last round
    (None, [(0, 10.0), (1, 29.9), (2, 30.0), (3, 45.0), (4, 59.9), (5, 60.1), (6, 61.0)],
     [2, 5, 6]),
    (3, [(0, 0.0), (1, 40.0), (2, 80.0), (3, 81.0), (4, 82.0), (5, 83.0), (6, 84.0)],
     [2, 5, 6]),
    (0, [(r, 100.0 * r) for r in range(7)], []),
])
def test_checkpoints_come_every_k_rounds_or_by_training_time(monkeypatch, every, rounds,
                                                             expected):
    """Rounds start at the given seconds of training (7 rounds, the last is 6)."""
    from types import SimpleNamespace

    from sparkdl_avg.driver import sync

    clock = {"now": 0.0}
    monkeypatch.setattr(sync.time, "perf_counter", lambda: clock["now"])
    attempt = SimpleNamespace(plan=SimpleNamespace(config=SimpleNamespace(
        checkpoint_every=every)), checkpointed_at=0.0)
    taken = []
    for r, at in rounds:
        clock["now"] = at
        if sync._Attempt._checkpoints_after(attempt, r, last=r == 6):
            taken.append(r)
    assert taken == expected


def _only_run(client, experiment: str):
    [run] = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return run


@pytest.mark.spark
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_unwritable_checkpoint_dir_is_refused_before_any_spark_job(
        spark, tmp_path, monkeypatch, mlflow_client, mode):
    """A path under a regular file: no one can create it, root included (CI runs as root,
    where a read-only mode would not stop a write)."""
    from faulty import FaultyMLP, dataset

    from sparkdl_avg import TrainConfig, fit
    from sparkdl_avg.driver import plan

    def no_job(*_, **__):
        raise AssertionError("a Spark job ran before the checkpoint_dir check")

    monkeypatch.setattr(plan, "check_cluster", no_job)  # the fit's first Spark job
    (tmp_path / "a-file").write_text("")
    folder = str(tmp_path / "a-file" / "checkpoints")
    config = TrainConfig(num_workers=2, mode=mode, checkpoint_dir=folder, log_model=False,
                         experiment_name=f"unwritable-{mode}")
    with pytest.raises(ConfigError, match=rf"checkpoint_dir='{folder}' is not a directory "
                                          "this driver can write"):
        fit(dataset(spark, rows=40), FaultyMLP, config)
    assert _only_run(mlflow_client, f"unwritable-{mode}").info.status == "FAILED"


@pytest.mark.spark
@pytest.mark.parametrize("failing", ["first", "last"])
def test_a_checkpoint_that_cannot_be_saved_fails_the_fit(spark, tmp_path, monkeypatch,
                                                         mlflow_client, failing):
    """The save itself fails (a full disk): the fit fails, promptly when the first save
    fails, and at the end when only the last one does, never FINISHED without its
    checkpoint."""
    from faulty import FaultyMLP, dataset

    from sparkdl_avg import TrainConfig, TrainingError, fit

    rounds, saved, seen = 20, [], []
    save = DirStore.save

    def full_disk(store, point):
        # a disk that fills stays full; failing round 1's save alone could pass unnoticed,
        # as the newest-wins writer skips a save a later round's supersedes before it starts
        if point.round >= 1 if failing == "first" else point.round == rounds:
            raise OSError(28, "No space left on device")
        saved.append(point.round)
        save(store, point)

    monkeypatch.setattr(DirStore, "save", full_disk)
    config = TrainConfig(num_workers=2, epochs=1, batch_size=15, averaging_frequency=1,
                         checkpoint_every=1, checkpoint_dir=str(tmp_path / "ckpt"),
                         log_model=False, experiment_name=f"full-disk-{failing}")
    with pytest.raises(TrainingError, match=r"could not save a checkpoint to .*ckpt: "
                                            r".*No space left on device"):
        fit(dataset(spark), FaultyMLP, config, on_round=lambda m: seen.append(m["round"]))
    run = _only_run(mlflow_client, f"full-disk-{failing}")
    assert run.info.status == "FAILED" and "No space left" in run.data.tags["error"]
    if failing == "first":  # stopped within a few rounds of the failed save
        assert len(seen) < rounds // 2, seen
    else:
        assert seen == list(range(1, rounds + 1)) and rounds not in saved


@pytest.mark.spark
def test_a_server_checkpoint_that_cannot_be_saved_fails_the_async_fit(spark, tmp_path,
                                                                      mlflow_client):
    """Shard 1 of 2 cannot write its checkpoint (a directory where its temporary file goes:
    unwritable for root too; checkpoint_dir itself passes the check before the fit): the
    server keeps serving, the driver hears of it in the server's report and fails the fit,
    naming the file, at the first interval's report rather than after training, instead of
    ending FINISHED with a server that could not be restarted."""
    from faulty import FaultyMLP, dataset

    from sparkdl_avg import TrainConfig, TrainingError, fit

    folder = tmp_path / "ckpt"
    (folder / "parameter-server-1-of-2.npz.tmp.npz").mkdir(parents=True)
    pushes, applied = 2 * 40 * 4, []  # 2 workers, 40 epochs of 4 steps, a push each
    config = TrainConfig(mode="async", num_workers=2, ps_shards=2, epochs=40, batch_size=10,
                         push_every=1, checkpoint_dir=str(folder), eval_interval_s=0.2,
                         log_model=False, experiment_name="server-cannot-save")
    with pytest.raises(TrainingError, match=r"could not save the server checkpoint "
                       r".*ckpt/parameter-server-1-of-2\.npz: IsADirectoryError.*free space "
                       r"or fix where it writes"):
        fit(dataset(spark, rows=80), FaultyMLP, config,
            on_round=lambda m: applied.append(m["updates_applied"]))
    assert max(applied, default=0) < pushes // 2, applied  # stopped early, not at the end
    run = _only_run(mlflow_client, "server-cannot-save")
    assert run.info.status == "FAILED" and "parameter-server-1-of-2.npz" in run.data.tags["error"]
    assert (folder / "parameter-server-0-of-2.npz").exists()  # shard 0 saved as usual
