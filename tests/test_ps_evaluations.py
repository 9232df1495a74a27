"""Async evaluation on the parameter server: the driver asks, the server keeps a copy of its
parameters, every worker evaluates that copy and sends its sums, and only a request every
worker has answered is reported, summed. Malformed or misplaced messages are refused with a
reason, and the server keeps serving."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest

from sparkdl_avg import ProtocolError
from sparkdl_avg._eval_sums import table_of
from sparkdl_avg.net import messages as msg
from sparkdl_avg.ps.client import PSClient
from sparkdl_avg.ps.evaluations import KEEP_RESULTS, Evaluations
from sparkdl_avg.ps.server import DRIVER, ParameterServer
from sparkdl_avg.ps.settings import ServerSettings

SECRET = b"e" * 32


@contextlib.contextmanager
def started(workers: int = 2, **settings):
    """A server INITed with zeros for `workers` workers, and the driver's connection."""
    with ParameterServer(ServerSettings(timeout=10, **settings), secret=SECRET) as ps, \
            PSClient(ps.address, secret=SECRET, worker=DRIVER, numel=4, dtype=np.float32,
                     timeout=10) as driver:
        driver.init(np.zeros(4, np.float32), workers=workers)
        yield ps, driver


def client(ps: ParameterServer, worker: int) -> PSClient:
    return PSClient(ps.address, secret=SECRET, worker=worker, numel=4, dtype=np.float32,
                    timeout=10)


def result(loss_sum: float | None, correct: int | None, count: int,
           loss_weight: float | None = None, scored: int | None = None) -> dict:
    """A worker's sums; by default every row weighs 1 and is scored once."""
    return {"loss_sum": loss_sum, "correct": correct, "count": count,
            "loss_weight": float(count) if loss_weight is None else loss_weight,
            "scored": None if correct is None else (count if scored is None else scored)}


def test_a_request_is_the_copy_asked_for_summed_over_every_worker_once():
    with started() as (ps, driver), client(ps, 0) as a, client(ps, 1) as b:
        a.pull()
        b.pull()
        a.push(np.ones(4, np.float32))  # applied 1: the parameters are -1
        report = driver.evaluate()
        pending = report["evaluations"]["pending"]
        assert pending == {"request": 0, "applied": 1, "final": False, "answered": []}
        assert report["applied"] == 1  # the stats of the same moment
        ack = a.push(np.ones(4, np.float32))  # the parameters move on to -2 ...
        assert ack.evaluate == 0  # ... and the worker learns of the request
        assert a.pull_snapshot() == 0
        assert a.params.tolist() == [-1.0] * 4  # ... but the request is of -1
        assert a.answer(0, result(3.0, 2, 4, loss_weight=2.5, scored=8),
                        eval_s=0.5).evaluate is None
        a.answer(0, result(100.0, 0, 100), eval_s=9.0)  # a second answer changes nothing
        assert driver.stats()["evaluations"]["results"] == []  # not every worker answered
        assert driver.stats()["evaluations"]["pending"]["answered"] == [0]
        assert b.pull_snapshot() == 0 and b.params.tolist() == [-1.0] * 4
        b.answer(0, result(1.0, 1, 2, loss_weight=0.5, scored=3), eval_s=0.25)
        evaluations = driver.stats()["evaluations"]
        assert evaluations["pending"] is None
        assert evaluations["results"] == [{"request": 0, "applied": 1, "final": False,
                                           "loss_sum": 4.0, "loss_weight": 3.0,
                                           "correct": 3, "scored": 11, "count": 6,
                                           "eval_s": 0.5}]
        a.pull()  # the snapshot pulls changed nothing of the worker's own reads
        assert a.params.tolist() == [-2.0] * 4 and ps.applied == 2


def test_the_newest_request_replaces_a_pending_one():
    with started() as (ps, driver), client(ps, 0) as a, client(ps, 1) as b:
        a.pull()
        driver.evaluate()
        a.answer(0, result(1.0, None, 1), eval_s=0.0)  # half of request 0
        a.push(np.ones(4, np.float32))
        pending = driver.evaluate()["evaluations"]["pending"]
        assert pending["request"] == 1 and pending["answered"] == []  # 0 is dropped
        b.answer(0, result(1.0, None, 1), eval_s=0.0)  # late for 0: ignored
        assert b.pull_snapshot() == 1 and b.params.tolist() == [-1.0] * 4
        b.answer(1, result(2.0, None, 3), eval_s=0.0)
        a.answer(1, result(float("inf"), None, 3), eval_s=0.0)  # diverged: travels as None
        (done,) = driver.stats()["evaluations"]["results"]
        assert (done["request"], done["loss_sum"], done["correct"], done["count"]) == \
            (1, None, None, 6)


def test_finished_workers_get_the_final_request_and_then_leave():
    with started(staleness_bound=0) as (ps, driver), client(ps, 0) as a, client(ps, 1) as b:
        a.pull()
        b.pull()
        a.push(np.ones(4, np.float32))
        ack = a.finished(wait_s=0.2)  # b still trains: nothing yet, held for 0.2 s
        assert (ack.evaluate, ack.done) == (None, False)
        # a finished worker holds no one back: b runs on although a pushes no more
        for _ in range(3):
            b.push(np.ones(4, np.float32))
            b.pull()
        acks = {}
        waiting = threading.Thread(target=lambda: acks.setdefault("a", a.finished(10.0)))
        waiting.start()
        ack = b.finished(wait_s=10.0)  # the last to finish makes the final request
        waiting.join(5)
        assert ack.evaluate == acks["a"].evaluate == 0 and not ack.done
        assert driver.evaluate()["evaluations"]["pending"]["final"]  # no request after it
        for worker in (a, b):
            assert worker.pull_snapshot() == 0 and worker.params.tolist() == [-4.0] * 4
            worker.answer(0, result(2.0, 1, 2), eval_s=0.1)
            assert worker.finished(wait_s=10.0).done
        (final,) = driver.stats()["evaluations"]["results"]
        assert final["final"] and final["applied"] == 4 and final["count"] == 4


def test_misplaced_or_malformed_evaluation_messages_are_refused_and_counted():
    with started() as (ps, driver), client(ps, 0) as a:
        a.pull()
        msg.send(a._conn, msg.Eval(loss_sum=1.0, loss_weight=1.0, correct=None, scored=None,
                                   count=1, eval_s=0.0))
        with pytest.raises(ProtocolError, match="must name its request") as info:
            msg.expect(a._conn, msg.Ack)
        assert info.value.reason == "malformed"
        a._conn.send(msg.Kind.FINISHED, {"wait_s": 1e9})  # past the limit
        with pytest.raises(ProtocolError, match="exceeds 60") as info:
            msg.expect(a._conn, msg.Ack)
        assert info.value.reason == "malformed"
        a._conn.send(msg.Kind.EVAL, {"loss_sum": 1.0, "loss_weight": 1.0, "correct": 3,
                                     "scored": 1, "count": 1, "eval_s": 0.0, "request": 0})
        with pytest.raises(ProtocolError, match="scored 1, correct 3"):
            msg.expect(a._conn, msg.Ack)
        msg.send(a._conn, msg.Evaluate())  # only the driver asks
        with pytest.raises(ProtocolError, match="unexpected EVALUATE") as info:
            msg.expect(a._conn, msg.Stats)
        assert info.value.reason == "unexpected"
        with pytest.raises(ProtocolError, match="unexpected EVAL"):
            driver.answer(0, result(1.0, None, 1), eval_s=0.0)  # the driver evaluates nothing
        with pytest.raises(ProtocolError, match="unexpected FINISHED"):
            driver.finished(wait_s=0.1)
        a.pull()  # still served
        report = driver.stats()
        assert report["refused"] == {"malformed": 3, "unexpected": 3}
        assert report["evaluations"] == {"pending": None, "results": [], "finished": []}


def test_metrics_merge_over_workers_and_malformed_tables_are_refused():
    """auc's score tables merge by score on the server, and the result keeps only their
    Mann-Whitney sums: small JSON for STATS and the checkpoint, whatever the rows."""
    with started() as (ps, driver), client(ps, 0) as a, client(ps, 1) as b:
        a.pull()
        driver.evaluate()
        a.pull_snapshot()
        msg.send(a._conn, msg.Eval(loss_sum=1.0, loss_weight=1.0, correct=None, scored=None,
                                   count=2, eval_s=0.0, request=0, ranked={"auc": 2}),
                 np.array([0.5, 1.0, 0.0, 0.2, 0.0, 1.0]))  # scores not ascending
        with pytest.raises(ProtocolError, match="not sorted") as info:
            msg.expect(a._conn, msg.Ack)
        assert info.value.reason == "malformed"
        for worker, scores, positive in ((a, [0.2, 0.5], [False, True]),
                                         (b, [0.5, 0.7], [False, True])):
            worker.pull_snapshot()
            worker.answer(0, {**result(1.0, None, 2), "metrics": {"n": [2.0]},
                              "tables": {"auc": table_of(np.array(scores), np.array(positive),
                                                         np.ones(2))}}, eval_s=0.1)
        done = driver.stats()["evaluations"]["results"][0]
        # positives 0.5, 0.7 over negatives 0.2, 0.5: 1 + 0.5 (the tie) + 1 + 1 of 4 pairs
        assert done["metrics"] == {"n": [4.0], "auc": [3.5, 2.0, 2.0]}
        assert driver.stats()["refused"] == {"malformed": 1}


def test_the_bookkeeping_is_bounded_and_ignores_strangers():
    evaluations = Evaluations()
    params = np.zeros(3)
    assert evaluations.ask(params, 0) is None  # no workers announced: nothing to ask
    assert evaluations.done(0)  # ... and none to wait for
    evaluations.reset(2)
    for applied in range(KEEP_RESULTS + 3):
        request = evaluations.ask(params, applied)
        params += 1  # the request holds a copy
        for worker in (0, 1, 5, -1):  # strangers change nothing
            evaluations.answer(worker, request.request, {**result(1.0, 1, 1), "eval_s": 0})
        assert evaluations.pending is None
    assert [r["applied"] for r in evaluations.results] == list(range(3, KEEP_RESULTS + 3))
    assert all(r["count"] == 2 for r in evaluations.results)
    evaluations.ask(params, 50)
    evaluations.finish(0, params, 51)
    assert evaluations.pending.applied == 50 and not evaluations.pending.final
    evaluations.finish(1, params, 51)  # every worker finished: the final replaces it
    assert evaluations.pending.final and evaluations.pending.applied == 51
    assert evaluations.ask(params, 52) is None and evaluations.pending.applied == 51
    assert not evaluations.done(0)
    evaluations.answer(0, evaluations.pending.request, {**result(1.0, 1, 1), "eval_s": 0})
    assert evaluations.done(0) and not evaluations.done(1)


class _Recording:
    """A replica stand-in: records the parameters its model holds when asked to evaluate."""

    def __init__(self, model) -> None:
        self.model, self.seen = model, []

    def evaluate(self) -> dict:
        self.seen.append(self.model.weight.detach().flatten().tolist())
        return result(0.5, 1, 2)


def _worker_link(ps: ParameterServer, config):
    """A task's link to `ps` for worker 0, over a model of 4 parameters."""
    from types import SimpleNamespace

    import torch

    from sparkdl_avg.averaging.flat_buffer import FlatBuffer, averaged_tensors
    from sparkdl_avg.task.async_loop import ServerLink

    model = torch.nn.Linear(4, 1, bias=False)
    flat = FlatBuffer(averaged_tensors(model), torch.float32)
    from sparkdl_avg.net.auth import Credential

    spec = SimpleNamespace(address=ps.address, tls_ca_pem=None,
                           ps_addresses=lambda: [ps.address])
    link = ServerLink(spec, config, 0, flat, Credential.of(SECRET, 0))  # as claimed
    return link, flat, _Recording(model)


def test_a_worker_evaluates_the_requested_copy_and_goes_on_from_its_own_parameters():
    from sparkdl_avg import TrainConfig

    with started(workers=1) as (ps, driver):
        link, flat, replica = _worker_link(ps, TrainConfig(mode="async"))
        try:
            link.pull()  # the server's zeros: model and anchor
            np.copyto(flat.array, [1.0, 2.0, 3.0, 4.0])  # local steps moved the model on
            flat.scatter()
            driver.evaluate()
            link.answer(replica)
            assert replica.seen == [[0.0] * 4]  # the request's copy was evaluated ...
            assert replica.model.weight.flatten().tolist() == [1.0, 2.0, 3.0, 4.0]  # ... and
            assert link.anchor.tolist() == [0.0] * 4  # the worker's own state is untouched
            link.ps.push(link.anchor - flat.gather(), steps=8)  # its last push: -> 1..4
            np.copyto(flat.array, 9.0)  # (not what the final request is of)
            flat.scatter()
            link.finish(replica)  # the only worker: the final request is its to answer
            assert replica.seen[-1] == [1.0, 2.0, 3.0, 4.0]
            assert replica.model.weight.flatten().tolist() == [9.0] * 4
            results = driver.stats()["evaluations"]["results"]
            assert [(r["final"], r["applied"], r["count"]) for r in results] == \
                [(False, 0, 2), (True, 1, 2)]
        finally:
            link.close()


def test_a_finished_worker_stops_waiting_for_peers_that_make_no_progress():
    import time

    from sparkdl_avg import TrainConfig

    with started(workers=2) as (ps, driver):  # worker 1 never comes
        link, _, replica = _worker_link(ps, TrainConfig(mode="async", reply_timeout=1.0))
        try:
            link.pull()
            began = time.monotonic()
            link.finish(replica)  # returns: bounded, without the final evaluation
            assert 1.0 <= time.monotonic() - began < 5.0
            assert replica.seen == [] and driver.stats()["evaluations"]["finished"] == [0]
        finally:
            link.close()


def test_only_a_lost_server_counts_as_one_not_an_error_of_the_workers_own():
    from sparkdl_avg import TrainConfig
    from sparkdl_avg.task.async_loop import ServerLost

    class Failing(_Recording):
        def evaluate(self) -> dict:
            raise OSError("reading the evaluation rows failed")

    with started(workers=1) as (ps, driver):
        link, flat, replica = _worker_link(ps, TrainConfig(mode="async"))
        try:
            link.pull()
            np.copyto(flat.array, 7.0)
            flat.scatter()
            driver.evaluate()
            with pytest.raises(OSError, match="reading the evaluation rows") as info:
                link.answer(Failing(replica.model))
            assert not isinstance(info.value, ServerLost)  # fails the task, no reconnect
            assert flat.array.tolist() == [7.0] * 4  # its own parameters are back
            ps.close()  # the server goes away while the worker waits at the end
            with pytest.raises(ServerLost):
                link.finish(replica)
        finally:
            link.close()


def test_the_final_result_outlives_a_server_restart(tmp_path):
    """The workers end once they have answered the final request; a server that dies before
    the driver read the result takes it up from its checkpoint, saved when it completed."""
    path = str(tmp_path / "ps.npz")
    first = ParameterServer(ServerSettings(timeout=10), secret=SECRET, checkpoint_path=path)
    with first, PSClient(first.address, secret=SECRET, worker=DRIVER, numel=4,
                         dtype=np.float32, timeout=10) as driver:
        driver.init(np.zeros(4, np.float32), workers=1)
        with client(first, 0) as a:
            a.pull()
            a.push(np.ones(4, np.float32), steps=8)
            request = a.finished(wait_s=1.0).evaluate
            a.pull_snapshot()
            a.answer(request, result(1.5, 1, 3), eval_s=0.0)
    second = ParameterServer(ServerSettings(timeout=10), secret=SECRET)
    second.restore(path)
    with second, PSClient(second.address, secret=SECRET, worker=DRIVER, numel=4,
                          dtype=np.float32, timeout=10) as driver:
        report = driver.evaluate()
        (final,) = report["evaluations"]["results"]
        assert final["final"] and final["applied"] == report["applied"] == 1
        assert final["loss_sum"] == 1.5 and final["count"] == 3
        assert report["evaluations"]["pending"]["request"] > final["request"]  # a new id
