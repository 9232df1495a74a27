"""Each task claims its own worker key from the driver's load monitor, one claim per rank per
launch whatever attempt it names: a second claim is refused ("claimed") and fails the fit
naming it, the same claim retried gets its key again, a claim beyond the fit or without the
launch's secret is refused, and the key never crosses the wire in clear."""

from __future__ import annotations

import socket

import pytest
from polling import eventually

from sparkdl_avg._errors import PeerRefused, ProtocolError, TrainingError, WorkerLostError
from sparkdl_avg.driver.load_monitor import LoadMonitor
from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.auth import authenticate_to_server, new_secret, role_key
from sparkdl_avg.net.frames import connect
from sparkdl_avg.task.enrolment import Enrolment, enrol, seal

WORKERS = b"w" * 32
"""The coordinator's (or parameter server's) secret the keys derive from."""


@pytest.fixture
def monitor():
    with LoadMonitor(host="127.0.0.1", advertise="127.0.0.1", num_workers=2,
                     worker_secret=WORKERS) as m:
        yield m


def claim(monitor, rank: int, attempt: int, secret: bytes | None = None) -> bytes:
    return enrol(monitor.reachable_at, secret or monitor.secret, rank, attempt,
                 limit_s=5).key


def test_each_rank_is_claimed_once_whatever_the_attempt(monitor):
    assert claim(monitor, 0, 0) == role_key(WORKERS, "worker:0")
    assert claim(monitor, 1, 0) == role_key(WORKERS, "worker:1")
    with pytest.raises(PeerRefused, match="worker 0's key was claimed already") as info:
        claim(monitor, 0, 0)  # an impostor came first: the real task is refused
    assert info.value.reason == "claimed"
    with pytest.raises(PeerRefused) as info:
        claim(monitor, 1, 1)  # a later attempt is the claimant's word: refused as well
    assert info.value.reason == "claimed"
    assert eventually(lambda: monitor.refusals() == {"claimed": 2})


def raw_claim(monitor, rank: int, claim_id: str) -> msg.Enrolled:
    """One claim as an eavesdropper sees it: the monitor's reply, unopened."""
    conn = connect(monitor.reachable_at, timeout=5, max_payload=0)
    try:
        authenticate_to_server(conn, monitor.secret, Enrolment(rank, 0, claim_id))
        reply, payload = msg.expect(conn, msg.Enrolled)
    finally:
        conn.close()
    assert isinstance(reply, msg.Enrolled) and payload is None
    return reply


def test_the_same_claim_retried_gets_its_key_again_and_no_other_claim_does(monitor):
    """A task whose reply was lost retries with its claim id: answered anew, not refused."""
    first = raw_claim(monitor, 1, "ab" * 16)
    again = raw_claim(monitor, 1, "ab" * 16)
    assert {seal(monitor.secret, 1, bytes.fromhex(r.nonce), bytes.fromhex(r.sealed))
            for r in (first, again)} == {role_key(WORKERS, "worker:1")}
    with pytest.raises(PeerRefused) as info:
        raw_claim(monitor, 1, "cd" * 16)
    assert info.value.reason == "claimed"


def test_a_claim_beyond_the_fit_or_without_the_launch_secret_is_refused(monitor):
    with pytest.raises(PeerRefused, match="rank 2 of 2") as info:
        claim(monitor, 2, 0)
    assert info.value.reason == "unexpected"
    with pytest.raises(PeerRefused) as info:
        claim(monitor, 1, 0, secret=new_secret())  # a stranger: not this launch's secret
    assert info.value.reason == "auth"
    assert eventually(lambda: monitor.refusals() == {"unexpected": 1, "auth": 1})
    assert claim(monitor, 1, 0) == role_key(WORKERS, "worker:1")  # neither used rank 1 up
    with LoadMonitor(host="127.0.0.1", advertise="127.0.0.1", num_workers=2) as probe, \
            pytest.raises(PeerRefused, match="hands out no keys"):  # the probe job's
        claim(probe, 0, 0)


class _Lost:
    """A connection whose reply never leaves: the monitor has recorded the claim by then."""

    def send(self, *args, **kwargs) -> None:
        raise OSError("the reply was lost")  # the server closes the connection


def test_a_task_whose_reply_was_lost_claims_again_and_trains():
    lost = []

    class Lossy(LoadMonitor):
        def _enrol(self, conn, hello) -> None:
            # noted before the reply goes: once the task holds its key, both claims are in
            # `lost` (noted after, the retry's could still be on its way on a loaded machine)
            lost.append(hello["claim_id"])
            super()._enrol(conn if len(lost) > 1 else _Lost(), hello)

    with Lossy(host="127.0.0.1", advertise="127.0.0.1", num_workers=2,
               worker_secret=WORKERS) as monitor:
        assert claim(monitor, 0, 0) == role_key(WORKERS, "worker:0")
        assert len(lost) == 2 and lost[0] == lost[1]  # the retry was the same claim
        assert "claimed" not in monitor.refusals()


def test_the_key_crosses_the_wire_sealed_under_the_launch_secret(monitor):
    """What an eavesdropper sees of a claim (raw frames) does not hold the key."""
    key = role_key(WORKERS, "worker:1")
    replies = [raw_claim(monitor, 1, "ab" * 16) for _ in range(2)]
    for reply in replies:
        sealed, nonce = bytes.fromhex(reply.sealed), bytes.fromhex(reply.nonce)
        assert sealed != key and key.hex() not in repr(reply.to_meta())
        assert seal(monitor.secret, 1, nonce, sealed) == key
    # a fresh nonce each time: the same key never seals the same twice
    assert replies[0].nonce != replies[1].nonce and replies[0].sealed != replies[1].sealed


def test_a_task_that_cannot_reach_the_monitor_fails_retryably():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = s.getsockname()
    with pytest.raises(WorkerLostError, match="partition 0 could not claim its worker key"):
        enrol(address, new_secret(), 0, 0, limit_s=0.5)


@pytest.mark.spark
def test_a_rank_claimed_before_its_task_fails_the_fit_naming_it(spark, monkeypatch,
                                                                mlflow_client):
    """An impostor holding the launch secret claims worker 0's key first: the real task's
    claim is refused, and the fit fails at once, saying so, with the refusal counted and a
    FAILED run."""
    from test_fit_sync import frame, make_data, make_model_f64

    from sparkdl_avg import TrainConfig, fit
    from sparkdl_avg.driver import barrier

    monitors = []

    class Impostor(LoadMonitor):
        def start(self) -> None:
            super().start()
            monitors.append(self)
            claim(self, 0, 0)

    monkeypatch.setattr(barrier, "LoadMonitor", Impostor)
    x, y = make_data(40, seed=5)
    with pytest.raises(TrainingError, match="worker 0's key was claimed already"):
        fit(frame(spark, x, y), make_model_f64, TrainConfig(
            num_workers=2, epochs=1, batch_size=10, log_model=False, max_failures=3,
            experiment_name="enrolment"))
    assert len(monitors) == 1  # final: no restart made a launch the impostor missed
    # the claim refused once; the other task, cancelled as the fit fails, may have its load
    # report cut mid-handshake ("closed")
    refused = monitors[0].refusals()
    assert refused.get("claimed") == 1 and set(refused) <= {"claimed", "closed"}, refused
    experiment = mlflow_client.get_experiment_by_name("enrolment").experiment_id
    run = mlflow_client.search_runs([experiment], order_by=["attributes.start_time DESC"],
                                    max_results=1)[0]
    assert run.info.status == "FAILED"


@pytest.mark.parametrize("claim_id, error", [
    ("ab" * 8, "a claim id of 8 bytes"), ("zz" * 16, "claim_id is not hex"),
    (None, "claim_id")])
def test_a_claim_needs_a_claim_id_of_16_random_bytes(claim_id, error):
    meta = {"rank": 0, "attempt": 0} | ({} if claim_id is None else {"claim_id": claim_id})
    with pytest.raises(ProtocolError, match=error):
        Enrolment.from_meta(meta)
