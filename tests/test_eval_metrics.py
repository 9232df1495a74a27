"""Both drivers turn the workers' evaluation sums into eval_loss = sum(loss_sum) /
sum(loss_weight) and eval_accuracy = sum(correct) / sum(scored): over the weight and the
predictions the loss kept (weighted rows, tokens not labelled -100, labels of a multi-label
output), not over rows; and each metric's statistics (sums, auc's score tables as payload)
into its value over every worker's rows."""

from __future__ import annotations

import math
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from sparkdl_avg._eval_sums import eval_message, merge, table_of
from sparkdl_avg.averaging.coordinator import Coordinator
from sparkdl_avg.driver.asynchronous import _Intervals
from sparkdl_avg.net import auth
from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.frames import connect
from sparkdl_avg.task.evaluate import eval_metrics

# two workers' sums: rows (count) differ from the kept weight and from the predictions scored
EVALS = [dict(loss_sum=3.0, loss_weight=2.5, correct=2, scored=6, count=4),
         dict(loss_sum=1.0, loss_weight=0.5, correct=1, scored=3, count=2)]
LOSS, ACCURACY = 4.0 / 3.0, 3 / 9
# and their metrics: worker 0 scored (0.1: neg, 0.4: pos, 0.8: pos), worker 1 (0.4: neg,
# 0.9: pos); over both, 3 positives x 2 negatives, of which the tie at 0.4 counts half
SCORES = [([0.1, 0.4, 0.8], [False, True, True]), ([0.4, 0.9], [False, True])]
AUC = (2 + 1.5 + 2) / 6
PERPLEXITY = [[2.0, 4.0], [1.0, 2.0]]  # token loss sums and weights: exp(3 / 6)
METRICS = ("auc", "perplexity")


def _result(rank: int) -> dict:
    scores, positive = SCORES[rank]
    return {**EVALS[rank], "metrics": {"perplexity": PERPLEXITY[rank]},
            "tables": {"auc": table_of(np.array(scores), np.array(positive),
                                       np.ones(len(scores)))}}


def _sync_worker(address, secret, rank: int) -> None:
    conn = connect(address, timeout=5, max_payload=64)
    try:
        auth.authenticate_to_server(conn, secret, msg.WorkerHello(rank=rank, host="h"))
        msg.expect(conn, msg.Average, np.zeros(4, np.float32))
        msg.send(conn, msg.Push(round=0, samples=4, loss_sum=1.0, compute_s=0.0, setup_s=0.0,
                                dtype="float32", numel=4), np.ones(4, np.float32))
        average, _ = msg.expect(conn, msg.Average, np.zeros(4, np.float32))
        assert average.evaluate
        msg.send(conn, *eval_message(_result(rank), eval_s=0.01))
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
    logged = eval_metrics(stats.eval, METRICS)
    assert logged["eval_loss"] == pytest.approx(LOSS, abs=1e-12)
    assert logged["eval_accuracy"] == pytest.approx(ACCURACY, abs=1e-12)
    assert logged["eval_auc"] == pytest.approx(AUC, abs=1e-12)
    assert logged["eval_perplexity"] == pytest.approx(math.exp(0.5), rel=1e-12)


@pytest.mark.exact
def test_the_async_driver_logs_the_servers_summed_result_the_same_way():
    logged = []
    intervals = SimpleNamespace(run=SimpleNamespace(
        log_metrics=lambda metrics, step: logged.append((step, metrics))),
        plan=SimpleNamespace(objective=SimpleNamespace(metrics=METRICS)))
    # as the parameter server merges its workers' answers (`ps.evaluations`)
    summed = merge([{**_result(rank), "eval_s": 0.2} for rank in range(2)])
    row = {"round": 3}
    _Intervals._log_eval(intervals, row, summed)
    assert row["eval_loss"] == pytest.approx(LOSS, abs=1e-12)
    assert row["eval_accuracy"] == pytest.approx(ACCURACY, abs=1e-12)
    assert row["eval_auc"] == pytest.approx(AUC, abs=1e-12)
    assert logged == [(3, {"eval_loss": row["eval_loss"], "time_eval_s": 0.2,
                           "eval_accuracy": row["eval_accuracy"], "eval_auc": row["eval_auc"],
                           "eval_perplexity": row["eval_perplexity"]})]
    regressor = {**summed, "correct": None, "scored": None, "loss_sum": None,
                 "metrics": {"auc": None, "perplexity": None}}
    _Intervals._log_eval(intervals, row := {"round": 4}, regressor)  # diverged: NaN, no accuracy
    assert np.isnan(row["eval_loss"]) and "eval_accuracy" not in row
    assert np.isnan(row["eval_auc"]) and np.isnan(row["eval_perplexity"])
