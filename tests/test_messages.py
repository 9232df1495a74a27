"""Every message kind validates itself: what a peer sends is checked once, when decoded, and a
frame that does not fit is refused with reason "malformed" before anyone acts on it."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import numpy as np
import pytest

from sparkdl_avg import ProtocolError
from sparkdl_avg._errors import PeerRefused, Unacceptable
from sparkdl_avg._eval_sums import payload_target, split_tables
from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.frames import Connection, Kind

VALID = {
    msg.Challenge: {"nonce": "ab" * 32},
    msg.Auth: {"nonce": "ab" * 32, "mac": "cd" * 32, "role": "worker:0", "hello": {"worker": 0}},
    msg.Welcome: {"mac": "cd" * 32},
    msg.Refusal: {"message": "no", "reason": "shape"},
    msg.Push: {"round": 0, "samples": 8, "loss_sum": 1.5, "compute_s": 0.1, "setup_s": 0.0,
               "dtype": "float32", "numel": 10, "lr": 0.01},
    msg.Average: {"round": -1, "state_follows": True, "dtype": "float64", "numel": 10,
                  "stop": False},
    msg.State: {"layout": []},
    msg.Eval: {"loss_sum": 3.0, "loss_weight": 2.5, "correct": 2, "scored": 6, "count": 4,
               "eval_s": 0.01, "request": 7, "metrics": {"perplexity": [2.5, 4.0], "f": None},
               "ranked": {"auc": 3}},
    msg.Done: {"layout": []},
    msg.WorkerFailed: {"message": "ValueError: boom", "final": False},
    msg.Init: {"dtype": "float32", "numel": 4, "workers": 2, "expect": {"lr": 0.1}},
    msg.Settings: {"settings": {"algorithm": "downpour"}},
    msg.Pull: {"evaluate": True},
    msg.Params: {"version": 3, "progress": 16, "dtype": "float32", "numel": 4, "evaluate": 2},
    msg.Update: {"samples": 8, "loss_sum": None, "steps": 16, "dtype": "float32", "numel": 4,
                 "lr": 0.005},
    msg.Ack: {"applied": 4, "staleness": 1, "evaluate": 0, "done": False, "stop": True},
    msg.Stats: {"report": {"applied": 4},
                "checkpoint_error": "could not save the server checkpoint /x.npz: OSError(28)"},
    msg.Evaluate: {},
    msg.Finished: {"wait_s": 2.0},
    msg.Stop: {},
    msg.Report: {"round": 2, "samples": 8, "loss_sum": None, "compute_s": 0.1, "setup_s": 0.0,
                 "reduce_s": 0.01, "distance": 0.5, "replica_finite": True,
                 "average_finite": True, "lr": 0.01},
    msg.Orders: {"round": 2, "evaluate": True, "checkpoint": False, "stop": False,
                 "send_average": True},
    msg.Averaged: {"round": 2, "dtype": "float32", "numel": 10},
    msg.Enrolled: {"nonce": "ab" * 32, "sealed": "cd" * 32},
}

INVALID = [
    (msg.Push, {"samples": 0}, "samples >= 1"),
    (msg.Push, {"loss_sum": float("inf")}, "Push.loss_sum must be float or null"),
    (msg.Push, {"numel": 0}, "a payload of 0 'float32' values"),
    (msg.Push, {"dtype": "int32"}, "a payload of 10 'int32' values"),
    (msg.Update, {"samples": 10 ** 17}, "Update.samples must be int"),
    (msg.Init, {"workers": 10 ** 6}, "workers 1000000"),
    (msg.Init, {"gradients": 5}, "gradients 5 of 4 values"),
    (msg.ServerHello, {"worker": 2 ** 80}, "ServerHello.worker must be int"),
    (msg.ServerHello, {"worker": True}, "ServerHello.worker must be int"),
    (msg.Push, {"round": True}, "Push.round must be int"),
    (msg.Push, {"numel": "10"}, "Push.numel must be int"),
    (msg.Push, {"compute_s": float("nan")}, "Push.compute_s must be float, got nan"),
    (msg.Push, {"setup_s": -1.0}, "setup_s=-1.0 is no duration"),
    (msg.Average, {"round": -2}, "round -2"),
    (msg.Eval, {"correct": 7}, "scored 6, correct 7"),
    (msg.Eval, {"correct": -1}, "scored 6, correct -1"),
    (msg.Eval, {"scored": None}, "scored None, correct 2"),
    (msg.Eval, {"correct": None}, "scored 6, correct None"),
    (msg.Eval, {"loss_weight": -0.5}, "loss_weight -0.5"),
    (msg.Eval, {"loss_weight": float("inf")}, "Eval.loss_weight must be float, got inf"),
    (msg.Eval, {"count": -1}, "count -1"),
    (msg.Init, {"dtype": "int8"}, "4 'int8' values"),
    (msg.Update, {"steps": -1}, "steps -1"),
    (msg.Eval, {"loss_sum": float("nan")}, "Eval.loss_sum must be float or null"),
    (msg.Refusal, {"reason": "because"}, "unknown reason 'because'"),
    (msg.Challenge, {"nonce": "zz"}, "nonce is not hex"),
    (msg.Auth, {"hello": []}, "Auth.hello must be dict"),
    (msg.Auth, {"role": "worker:01"}, "role .worker:01."),
    (msg.Ack, {"extra": 1}, r"Ack has no fields \['extra'\]"),
    (msg.Stats, {"checkpoint_error": "x" * 2001}, "checkpoint_error of 2001 characters"),
    (msg.Stats, {"checkpoint_error": ""}, "checkpoint_error of 0 characters"),
    (msg.Stats, {"checkpoint_error": 7}, "Stats.checkpoint_error must be str or null"),
    # async evaluation: request ids, the finished worker's wait, and no evaluating driver
    (msg.Eval, {"request": -1}, "evaluation request -1"),
    (msg.Eval, {"request": 1.5}, "Eval.request must be int or null"),
    (msg.Ack, {"evaluate": -3}, "evaluation request -3"),
    (msg.Ack, {"done": 1}, "Ack.done must be bool"),
    (msg.Params, {"evaluate": "0"}, "Params.evaluate must be int or null"),
    (msg.Pull, {"evaluate": 1}, "Pull.evaluate must be bool"),
    (msg.Finished, {"wait_s": -1.0}, "wait_s=-1.0 is no duration"),
    (msg.Finished, {"wait_s": 3600.0}, "wait_s=3600.0 exceeds 60"),
    (msg.Evaluate, {"request": 1}, r"Evaluate has no fields \['request'\]"),
    # the training controls: a push's learning rate, and stopping
    (msg.Update, {"lr": -0.1}, "lr -0.1"),
    (msg.Update, {"lr": float("inf")}, "Update.lr must be float or null"),
    (msg.Push, {"lr": "0.1"}, "Push.lr must be float or null"),
    (msg.Average, {"stop": 1}, "Average.stop must be bool"),
    (msg.Stop, {"now": True}, r"Stop has no fields \['now'\]"),
    # the collective transport's control plane
    (msg.Report, {"samples": 0}, "samples >= 1"),
    (msg.Report, {"reduce_s": -1.0}, "reduce_s=-1.0 is no duration"),
    (msg.Report, {"distance": -0.5}, "distance -0.5"),
    (msg.Report, {"replica_finite": 1}, "Report.replica_finite must be bool"),
    (msg.Orders, {"round": -1}, "round -1"),
    (msg.Orders, {"send_average": "yes"}, "Orders.send_average must be bool"),
    (msg.Averaged, {"numel": 0}, "a payload of 0 'float32' values"),
    # a task's claimed key: 32 bytes, sealed, with a 32-byte nonce
    (msg.Enrolled, {"sealed": "cd" * 31}, "a sealed key of 31 bytes"),
    (msg.Enrolled, {"nonce": "ab" * 8}, "a nonce of 8"),
    (msg.Enrolled, {"sealed": "zz" * 32}, "sealed is not hex"),
    # evaluation metrics: named as they are logged, bounded, finite, and tables of rows
    (msg.Eval, {"metrics": []}, "Eval.metrics must be dict or null"),
    (msg.Eval, {"metrics": {"eval loss": [1.0]}}, "a metric named 'eval loss'"),
    (msg.Eval, {"metrics": {"f": [1.0] * 65}}, "list of at most 64 finite numbers"),
    (msg.Eval, {"metrics": {"f": [float("nan")]}}, "list of at most 64 finite numbers"),
    (msg.Eval, {"metrics": {"f": ["1"]}}, "list of at most 64 finite numbers"),
    (msg.Eval, {"metrics": {"f": 1.0}}, "list of at most 64 finite numbers"),
    (msg.Eval, {"metrics": {f"m{k}": [] for k in range(17)}}, "17 metrics .at most 16."),
    (msg.Eval, {"ranked": {"auc": -1}}, "ranked must give 0 to 4194304"),
    (msg.Eval, {"ranked": {"auc": 1 << 22, "b": 1}}, "ranked must give 0 to 4194304"),
    (msg.Eval, {"ranked": {"auc": 1.5}}, "ranked must give 0 to 4194304"),
]


VALID[msg.ServerHello] = {"worker": 1}


def test_every_kind_has_one_message():
    assert set(msg.MESSAGES) == set(Kind)
    assert set(VALID) - {msg.ServerHello} == set(msg.MESSAGES.values())


@pytest.mark.parametrize("cls", list(VALID), ids=lambda c: c.__name__)
def test_valid_messages_round_trip(cls):
    message = cls.from_meta(VALID[cls])
    assert cls.from_meta(message.to_meta()) == message


@pytest.mark.parametrize(("cls", "change", "match"), INVALID)
def test_invalid_fields_are_refused_naming_the_field(cls, change, match):
    with pytest.raises(ProtocolError, match=match) as info:
        cls.from_meta({**VALID[cls], **change})
    assert info.value.reason == "malformed"


def test_a_missing_field_is_refused():
    meta = dict(VALID[msg.Push])
    del meta["numel"]
    with pytest.raises(ProtocolError, match="numel"):
        msg.Push.from_meta(meta)


def test_hellos_validate_what_the_servers_act_on():
    with pytest.raises(ProtocolError, match="worker id -2"):
        msg.ServerHello.from_meta({"worker": -2})
    with pytest.raises(ProtocolError, match="WorkerHello.rank must be int"):
        msg.WorkerHello.from_meta({"rank": "0", "host": "h"})


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    ca, cb = Connection(a, timeout=5, max_payload=1024), Connection(b, timeout=5,
                                                                    max_payload=1024)
    yield ca, cb
    ca.close()
    cb.close()


def test_a_message_is_validated_before_its_payload_is_read(pair):
    a, b = pair
    bad = {**VALID[msg.Push], "samples": 0}  # its 10 float32 values follow
    a.send(Kind.PUSH, bad, np.zeros(10, np.float32))
    target_called = []
    with pytest.raises(ProtocolError, match="samples >= 1"):
        msg.receive(b, into=lambda m: target_called.append(m))
    assert target_called == []


def test_payload_presence_is_checked_and_the_stream_stays_in_step(pair):
    a, b = pair
    msg.send(a, msg.Params(version=1, progress=0, dtype="float32", numel=1))  # no payload
    msg.send(a, msg.Ack(applied=1))
    with pytest.raises(Unacceptable, match="PARAMS without a payload"):
        msg.receive(b)
    assert msg.receive(b)[0] == msg.Ack(applied=1)  # the next frame reads fine


def test_a_refusal_raises_with_its_reason(pair):
    a, b = pair
    msg.send(a, msg.Refusal(message="update holds NaN", reason="non_finite"))
    with pytest.raises(PeerRefused, match="update holds NaN") as info:
        msg.expect(b, msg.Ack)
    assert info.value.reason == "non_finite"


def test_an_evaluations_payload_is_its_tables_exactly_or_refused_unread(pair):
    a, b = pair
    tables = np.array([0.1, 0.0, 1.0, 0.5, 1.0, 0.0, 0.9, 2.0, 0.0])
    meta = {**VALID[msg.Eval], "ranked": {"auc": 3}}
    a.send(Kind.EVAL, meta, tables)
    message, payload = msg.receive(b, into=payload_target)
    assert split_tables(message.ranked, payload)["auc"].tolist() == \
        tables.reshape(3, 3).tolist()
    a.send(Kind.EVAL, {**meta, "ranked": {"auc": 2}}, tables)  # claims fewer rows than sent
    with pytest.raises(ProtocolError, match="payload of 72 bytes where 48") as info:
        msg.receive(b, into=payload_target)
    assert info.value.reason == "shape"


def test_an_unexpected_kind_is_named(pair):
    a, b = pair
    msg.send(a, msg.Done(layout=[]))
    with pytest.raises(ProtocolError, match="expected ACK, got DONE") as info:
        msg.expect(b, msg.Ack)
    assert info.value.reason == "unexpected"


def test_a_message_trickled_a_byte_at_a_time_is_bounded_by_one_wait(pair):
    """`within`: the whole frame within the wait, not each byte; after it the connection's
    own per-read timeout is back. Each byte comes sooner than the wait, so only a deadline
    for the whole message can end the read."""
    a, b = pair
    frame = bytearray()
    fake = socket.socketpair()  # a sender that writes the frame's bytes one at a time
    Connection(fake[0], timeout=5, max_payload=1024).send(Kind.PUSH, VALID[msg.Push],
                                                          np.zeros(10, np.float32))
    fake[0].close()
    while chunk := fake[1].recv(4096):
        frame += chunk
    fake[1].close()
    stop = threading.Event()

    def trickle():
        for byte in frame:
            if stop.wait(0.05):
                return
            with contextlib.suppress(OSError):
                a.sock.sendall(bytes([byte]))

    sender = threading.Thread(target=trickle, daemon=True)
    sender.start()
    start = time.monotonic()
    with pytest.raises(TimeoutError), b.within(0.5):
        msg.receive(b)
    took = time.monotonic() - start
    stop.set()
    sender.join(5)
    assert took < 0.05 * len(frame) / 2  # the frame needs 10 s at this rate
    assert b.deadline is None and b.sock.gettimeout() == 5
