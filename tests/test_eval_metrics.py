"""Both drivers turn the workers' evaluation sums into eval_loss = sum(loss_sum) /
sum(loss_weight) and eval_accuracy = sum(correct) / sum(scored): over the weight and the
predictions the loss kept (weighted rows, tokens not labelled -100, labels of a multi-label
output), not over rows."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from sparkdl_avg.averaging.coordinator import Coordinator
from sparkdl_avg.driver.asynchronous import _Intervals
from sparkdl_avg.net import auth
from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.frames import connect

# two workers' sums: rows (count) differ from the kept weight and from the predictions scored
EVALS = [dict(loss_sum=3.0, loss_weight=2.5, correct=2, scored=6, count=4),
         dict(loss_sum=1.0, loss_weight=0.5, correct=1, scored=3, count=2)]
LOSS, ACCURACY = 4.0 / 3.0, 3 / 9


def _sync_worker(address, secret, rank: int) -> None:
    conn = connect(address, timeout=5, max_payload=64)
    try:
        auth.authenticate_to_server(conn, secret, msg.WorkerHello(rank=rank, host="h"))
        msg.expect(conn, msg.Average, np.zeros(4, np.float32))
        msg.send(conn, msg.Push(round=0, samples=4, loss_sum=1.0, compute_s=0.0, setup_s=0.0,
                                dtype="float32", numel=4), np.ones(4, np.float32))
        average, _ = msg.expect(conn, msg.Average, np.zeros(4, np.float32))
        assert average.evaluate
        msg.send(conn, msg.Eval(**EVALS[rank], eval_s=0.01))
    finally:
        conn.close()


@pytest.mark.exact
def test_the_sync_driver_averages_over_the_kept_weight_and_the_scored_predictions():
    secret = auth.new_secret()
    with Coordinator(host="127.0.0.1", advertise="127.0.0.1", num_workers=2, secret=secret,
                     timeout=5, dtype=np.float32, model_numel=4,
                     check_job=lambda wait: None) as coord:
        workers = [threading.Thread(target=_sync_worker, args=(coord.address, secret, rank))
                   for rank in range(2)]
        for t in workers:
            t.start()
        coord.accept_workers(np.zeros(4, np.float32), deadline_s=20)
        stats = coord.run_round(0, model_numel=4, allow_state=False, evaluate=True)
        for t in workers:
            t.join(10)
    assert stats.eval["loss"] == pytest.approx(LOSS, abs=1e-12)
    assert stats.eval["accuracy"] == pytest.approx(ACCURACY, abs=1e-12)


@pytest.mark.exact
def test_the_async_driver_logs_the_servers_summed_result_the_same_way():
    logged = []
    intervals = SimpleNamespace(run=SimpleNamespace(
        log_metrics=lambda metrics, step: logged.append((step, metrics))))
    summed = {key: sum(e[key] for e in EVALS) for key in EVALS[0]}
    row = {"round": 3}
    _Intervals._log_eval(intervals, row, {**summed, "eval_s": 0.2})
    assert row["eval_loss"] == pytest.approx(LOSS, abs=1e-12)
    assert row["eval_accuracy"] == pytest.approx(ACCURACY, abs=1e-12)
    assert logged == [(3, {"eval_loss": row["eval_loss"], "time_eval_s": 0.2,
                           "eval_accuracy": row["eval_accuracy"]})]
    regressor = {**summed, "correct": None, "scored": None, "loss_sum": None, "eval_s": 0.2}
    _Intervals._log_eval(intervals, row := {"round": 4}, regressor)  # diverged: NaN, no accuracy
    assert np.isnan(row["eval_loss"]) and "eval_accuracy" not in row
