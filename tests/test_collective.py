"""The collective transport: the tasks all-reduce among themselves, the driver keeps the
control plane. Checked against independent computations (large-batch SGD) and against the
driver transport, which it must match bit for bit with two workers (the same weighted sum in
the same order), through restarts, the disk cache and the training controls."""

from __future__ import annotations

import threading
from functools import partial

import psutil
import pytest
import torch
import torch.distributed as dist
from faulty import (
    FaultyMLP,
    assert_sync_recovery,
    dataset,
    diverges,
    latest_run,
    same_parameters,
)
from test_fit_sync import (
    frame,
    make_data,
    make_model_f64,
    max_param_diff,
    reference_large_batch_sgd,
)
from test_training_controls import overfitting_data, wide

from sparkdl_avg import ConfigError, EarlyStopping, TrainConfig, TrainingError, fit
from sparkdl_avg.averaging.process_group import TaskGroup

BASE = dict(num_workers=2, epochs=2, batch_size=15, averaging_frequency=2, optimizer="adam",
            lr=0.01, seed=5, checkpoint_every=3, log_model=False, experiment_name="collective")


@pytest.fixture(scope="module")
def data(spark):
    return dataset(spark).cache()


@pytest.fixture(scope="module")
def by_the_driver(data):
    """The same fit with the driver transport."""
    return fit(data, FaultyMLP, TrainConfig(**BASE))


@pytest.mark.spark
def test_collective_averaging_equals_large_batch_sgd_and_keeps_parameters_off_the_driver(
        spark):
    # 411 rows: unequal shards (the short one padded) and a partial last batch;
    # momentum with its buffers averaged too (the optimizer state rides the all-reduce)
    x, y = make_data(411)
    cfg = TrainConfig(num_workers=2, epochs=4, batch_size=4, averaging_frequency=1,
                      optimizer="sgd", lr=0.05, momentum=0.9, shuffle=False,
                      average_optimizer_state=True, checkpoint_every=50, log_model=False,
                      transport="collective")
    result = fit(frame(spark, x, y), make_model_f64, cfg)
    reference = reference_large_batch_sgd(x, y, 8, 4, 0.05, 0.9, workers=2)
    assert max_param_diff(result.model, reference) < 1e-10
    assert max_param_diff(result.model, make_model_f64()) > 1e-2  # it did train
    model_bytes = sum(p.numel() * 8 for p in make_model_f64().parameters())
    moved = {h["round"]: h["driver_mb"] * 1e6 for h in result.history}
    checkpoints = {r for r in moved if r % 50 == 0} | {max(moved)}  # rounds done
    # the parameters reach the driver at checkpoints and the end only: two workers' round
    # numbers and orders are less than one copy of this small model
    assert all(moved[r] < model_bytes for r in moved if r not in checkpoints)
    assert all(moved[r] > model_bytes for r in checkpoints)
    assert all(h["replica_divergence"] > 0 for h in result.history)


@pytest.mark.spark
def test_collective_fit_restarts_after_a_killed_task_as_the_driver_transport_trains(
        data, by_the_driver, tmp_path):
    # partition 1 kills its own process in round 4, after the checkpoint of round 3: its
    # peer's all-reduce fails, the barrier job is restarted from the checkpoint, and the
    # process group of the new attempt forms in reused Python workers
    model_fn = partial(FaultyMLP, fault="kill", marker=str(tmp_path / "fired"),
                       steps_dir=str(tmp_path))
    result = fit(data, model_fn, TrainConfig(**BASE, transport="collective"))
    assert (tmp_path / "fired").exists()
    assert len(result.failures) == 1
    assert result.failures[0]["restart_at"] == "round 3"
    assert_sync_recovery(result, tmp_path, at_call=9, steps_per_round=2, total_steps=40)
    assert same_parameters(result.model, by_the_driver.model)
    assert [h["round"] for h in result.history] == \
        list(range(1, len(by_the_driver.history) + 1))


@pytest.mark.spark
def test_a_collective_fit_resumes_from_its_checkpoints_as_an_unbroken_fit(data, tmp_path):
    folder = str(tmp_path / "ckpt")
    fit(data, FaultyMLP, TrainConfig(**{**BASE, "epochs": 1}, checkpoint_dir=folder,
                                     transport="collective"))
    resumed = fit(data, FaultyMLP, TrainConfig(**{**BASE, "epochs": 3}, checkpoint_dir=folder,
                                               transport="collective"), resume_from=folder)
    straight = fit(data, FaultyMLP, TrainConfig(**{**BASE, "epochs": 3}))
    assert same_parameters(resumed.model, straight.model)
    assert len(resumed.history) == len(straight.history)


@pytest.mark.spark
@pytest.mark.exact
def test_collective_fit_on_the_disk_cache_trains_as_the_driver_transport(data, by_the_driver):
    result = fit(data, FaultyMLP, TrainConfig(**BASE, transport="collective",
                                              data_cache="disk"))
    assert {w["cache"] for w in result.workers} == {"disk"}
    assert same_parameters(result.model, by_the_driver.model)
    for ours, theirs in zip(result.history, by_the_driver.history, strict=True):
        assert ours["train_loss"] == theirs["train_loss"]
        assert ours["replica_divergence"] == pytest.approx(theirs["replica_divergence"],
                                                           rel=1e-5)


@pytest.mark.spark
def test_collective_early_stopping_and_on_round_keep_what_the_driver_transport_keeps(spark):
    # restore_best needs the best evaluation's average, on_round's stop the stopping round's:
    # worker 0 sends them to the driver only then
    train, test = overfitting_data(spark, 40, 1), overfitting_data(spark, 200, 2)
    seen: list[int] = []

    def stop_at_round_30(row: dict) -> bool:
        seen.append(row["round"])
        return row["round"] == 30

    for early in (EarlyStopping(patience=2), None):
        results = [fit(train, wide, TrainConfig(
            num_workers=2, epochs=60, batch_size=10, averaging_frequency=2, optimizer="adam",
            lr=0.01, log_model=False, experiment_name="collective", eval_every=2,
            early_stopping=early, transport=transport), eval_df=test,
            on_round=None if early else stop_at_round_30)
            for transport in ("driver", "collective")]
        driver, collective = results
        assert len(collective.history) == len(driver.history) < 60
        assert same_parameters(collective.model, driver.model)
    assert seen.count(30) == 2


def test_task_groups_bind_the_given_address_sum_and_leave_nothing_behind():
    world, found, results = 2, [], {}
    gathered = threading.Barrier(world)

    def all_gather(message: str) -> list[str]:
        found.append(message)
        gathered.wait(timeout=30)
        return list(found)

    def task(rank: int) -> None:
        group = TaskGroup.form(rank=rank, world=world, address="127.0.0.1",
                               device=torch.device("cpu"), all_gather=all_gather,
                               connect_timeout_s=30, op_timeout_s=30)
        try:
            values = torch.full((5,), float(rank + 1), dtype=torch.float64)
            group.all_reduce_sum(values)
            results[rank] = values
            gathered.wait(timeout=30)  # both hold their sockets here
            results[f"listening{rank}"] = [
                c.laddr for c in psutil.Process().net_connections("tcp")
                if c.status == psutil.CONN_LISTEN]
        finally:
            group.close()

    threads = [threading.Thread(target=task, args=(rank,)) for rank in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert torch.equal(results[0], torch.full((5,), 3.0, dtype=torch.float64))
    assert torch.equal(results[1], results[0])
    listening = results["listening0"]
    assert listening and all(addr.ip == "127.0.0.1" for addr in listening)
    assert not dist.is_initialized()  # no global default group for a reused worker to trip on


def test_a_group_that_fails_to_form_leaves_no_listening_socket():
    """The barrier's all-gather fails (a peer's task failed, the stage was cancelled): rank
    0's listening socket is closed, not left in the Python worker Spark reuses."""
    def listening() -> int:
        return sum(c.status == psutil.CONN_LISTEN for c in psutil.Process().net_connections("tcp"))

    def all_gather(message: str) -> list[str]:
        raise RuntimeError("the barrier's all-gather failed")

    before = listening()
    for _ in range(3):
        with pytest.raises(RuntimeError, match="all-gather failed"):
            TaskGroup.form(rank=0, world=2, address="127.0.0.1", device=torch.device("cpu"),
                           all_gather=all_gather, connect_timeout_s=1, op_timeout_s=1)
    assert listening() == before


@pytest.mark.parametrize(("fields", "match"), [
    ({"transport": "ring"}, r"transport='ring' is not supported"),
    ({"transport": "collective", "mode": "async"}, r"transport='collective' applies to "
                                                   r"mode='sync' only"),
    ({"transport": "collective", "tls_cert": "c.pem", "tls_key": "k.pem"},
     r"travel between the tasks unencrypted"),
])
def test_bad_transport_settings_are_config_errors(fields, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig(**fields)


@pytest.mark.spark
def test_a_collective_fit_that_diverges_fails_naming_the_workers(data, mlflow_client):
    with pytest.raises(TrainingError, match=r"worker\(s\) \[0, 1\] pushed NaN/Inf parameters "
                                            r"in round 0"):
        fit(data, diverges, TrainConfig(**BASE, transport="collective"))
    assert latest_run(mlflow_client, "collective").info.status == "FAILED"


def test_the_group_forms_only_after_the_driver_sends_the_start(monkeypatch):
    """The driver sends the start once every task has loaded its data and joined: forming the
    group (the barrier's all-gather) only then, no task waits in the gather for a peer that
    may still fail loading (a task killed there takes its executor down with it)."""
    import numpy as np

    from sparkdl_avg.averaging import collective

    events = []

    class Control:
        local_address = "127.0.0.1"

        def open(self, hello):
            events.append("open")

        def receive_start(self, params):
            events.append("start")
            return "start point"

    monkeypatch.setattr(collective.TaskGroup, "form",
                        classmethod(lambda cls, **kw: events.append("form") or "group"))
    channel = collective.CollectiveChannel(
        Control(), rank=0, world=2, device=torch.device("cpu"), all_gather=None,
        connect_timeout_s=1, round_timeout_s=1)
    from sparkdl_avg import TrainConfig

    channel.configure(TrainConfig(), trainable=[(3,)], warmup_rounds=0)  # as a task does
    channel.open(hello=None)
    assert events == ["open"]
    assert channel.receive_start(np.zeros(3, dtype=np.float32)) == "start point"
    assert events == ["open", "start", "form"]


def test_a_bfloat16_replica_is_averaged_in_float32_as_the_driver_averages_it():
    """Scaled and summed in bfloat16, the collective average rounded at every step; the
    driver transport averages the same replicas in float32 (its wire dtype) and rounds
    once, when the worker takes the average in."""
    import numpy as np

    from sparkdl_avg.averaging import collective
    from sparkdl_avg.averaging.arithmetic import weighted_average
    from sparkdl_avg.averaging.flat_buffer import FlatBuffer
    from sparkdl_avg.averaging.transport import RoundReport
    from sparkdl_avg.net import messages as msg

    world, samples, found, results = 2, [3, 7], [], {}
    gathered = threading.Barrier(world)
    generator = torch.Generator().manual_seed(0)
    replicas = [torch.randn(4096, generator=generator).bfloat16() for _ in range(world)]

    def all_gather(message: str) -> list[str]:
        found.append(message)
        gathered.wait(timeout=30)
        return list(found)

    class Control:
        def send(self, message, payload=None):
            pass

        def expect(self, kind):
            return msg.Orders(round=0)

    def task(rank: int) -> None:
        channel = collective.CollectiveChannel(
            Control(), rank=rank, world=world, device=torch.device("cpu"),
            all_gather=all_gather, connect_timeout_s=30, round_timeout_s=30)
        channel._model_numel = replicas[rank].numel()
        channel._group = collective.TaskGroup.form(
            rank=rank, world=world, address="127.0.0.1", device=torch.device("cpu"),
            all_gather=all_gather, connect_timeout_s=30, op_timeout_s=30)
        try:
            flat = FlatBuffer([replicas[rank].clone()], torch.float32)
            channel.exchange(RoundReport(round=0, samples=samples[rank], loss_sum=0.0,
                                         compute_s=0.0, setup_s=0.0, lr=None), flat)
            results[rank] = flat.flat
        finally:
            channel._group.close()

    threads = [threading.Thread(target=task, args=(rank,)) for rank in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    by_the_driver = np.empty(4096, np.float32)
    weighted_average([r.float().numpy() for r in replicas], samples, by_the_driver)
    expected = torch.from_numpy(by_the_driver).bfloat16()
    assert results[0].dtype == torch.bfloat16
    assert torch.equal(results[0], expected) and torch.equal(results[1], expected)
