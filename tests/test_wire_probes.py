"""Issue 33's wire faults, on the raw wire where the client library would not send such a
frame: a connection flood during the sync workers' connect, an ERROR frame instead of AUTH,
a frame whose payload its kind cannot have, and the per-role keys (a worker's key can neither
act as the driver nor as another worker, and no task receives the secret)."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import socket
import threading
import time

import cloudpickle
import numpy as np
import psutil
import pytest
from loopback import coordinator
from polling import wait_for

from sparkdl_avg import ProtocolError
from sparkdl_avg.averaging.coordinator import Coordinator
from sparkdl_avg.averaging.driver_channel import DriverChannel
from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.auth import Credential, new_secret, role_key, worker_keys
from sparkdl_avg.net.frames import HEADER, MAGIC, VERSION, Connection, Kind
from sparkdl_avg.net.server import BACKLOG
from sparkdl_avg.ps.client import PSClient
from sparkdl_avg.ps.rules import make_rule
from sparkdl_avg.ps.server import DRIVER, ParameterServer
from sparkdl_avg.ps.settings import ServerSettings
from sparkdl_avg.ps.sidecar import Sidecar

SECRET = b"r" * 32
FLOOD_PER_S = 40_000
"""Issue 33's flood: connection attempts a second, from two processes."""


def server() -> ParameterServer:
    return ParameterServer(ServerSettings(timeout=10), secret=SECRET,
                           rule=make_rule("downpour", np.zeros(4, np.float32)))


def client(ps, key: bytes | Credential, worker: int) -> PSClient:
    return PSClient(ps.address, secret=key, worker=worker, numel=4, dtype=np.float32,
                    timeout=10)


# --- fault 3: a connection flood while the sync workers connect -----------------------------

def _flood(address, stop, count, per_s: float) -> None:
    """`per_s` connection attempts a second, paced in bursts: a SYN each, then gone. At a
    lower priority than the server: a flood comes from other machines, not the driver's
    own cores (here 2, shared)."""
    os.nice(5)
    n, started = 0, time.monotonic()
    while not stop.is_set():
        for _ in range(100):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(address)
            s.close()
        n += 100
        count.value = n  # read while the flood runs: attempts before and during the connect
        ahead = n / per_s - (time.monotonic() - started)
        if ahead > 0:
            time.sleep(ahead)


def _connect_workers(coord: Coordinator, secret: bytes, workers: int) -> None:
    """The sync workers' connect (`DriverChannel.open`, as a task runs it) until each has
    its first parameters (`Coordinator.accept_workers`)."""
    errors = []

    def worker(rank: int) -> None:
        channel = DriverChannel(coord.address, Credential.of(secret, rank),
                                connect_timeout=30, reply_timeout=30)
        try:
            channel.open(msg.WorkerHello(rank=rank, host="h"))
            channel.receive_start(np.zeros(4, np.float32))
        except Exception as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)
        finally:
            channel.close()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(workers)]
    for t in threads:
        t.start()
    try:
        coord.accept_workers(np.zeros(4, np.float32), 30)
    finally:
        for t in threads:
            t.join(30)
    assert not errors, errors


def _timed_connects(flood: bool, rounds: int = 4) -> tuple[list[float], list[tuple[int, int]]]:
    """Seconds of each of `rounds` sync connects of 4 workers (each a fit's), and per round
    the flood's connection attempts before the workers came (0.3 s) and while they
    connected."""
    secret = new_secret()
    ctx = multiprocessing.get_context("fork")
    times, attempts = [], []
    for _ in range(rounds):
        with coordinator(secret, 4, timeout=30) as coord:
            stop = ctx.Event()
            counts = [ctx.Value("l", 0) for _ in range(2 if flood else 0)]
            floods = [ctx.Process(target=_flood, args=(coord.address, stop, c,
                                                       FLOOD_PER_S / len(counts)))
                      for c in counts]
            for p in floods:
                p.start()
            time.sleep(0.3 if flood else 0)  # the flood is on before the workers come
            before = sum(c.value for c in counts)
            started = time.monotonic()
            try:
                _connect_workers(coord, secret, 4)
            finally:
                times.append(time.monotonic() - started)
                during = sum(c.value for c in counts) - before
                stop.set()
                for p in floods:
                    p.join(10)
            attempts.append((before, during))
    return times, attempts


def test_a_connection_flood_adds_under_two_seconds_to_a_typical_sync_connect():
    """Coordinator level: the very path a fit's tasks take to the driver (the tasks'
    `DriverChannel.open`, the driver's `accept_workers`), without Spark around it. Each
    round is one fit's connect of 4 workers. The median round, not the worst: the flood
    shares 2 cores with the server here, so the worst round measures this machine's load
    as much as the server (it has taken up to 3.8 s; the old code's workers did not
    connect at all)."""
    quiet, _ = _timed_connects(False, rounds=3)
    flooded, attempts = _timed_connects(True, rounds=5)
    logging.getLogger("test").info("flood attempts (before, during) the connects %s: %s "
                                   "against %s quiet", attempts, flooded, quiet)
    # How many attempts a second the flood reaches depends on the machine (paced at 40k, 2
    # shared cores made 20k to 38k): what must hold is that before the workers came it had
    # made more attempts than the listen queue holds (it runs until they are in; a connect
    # may take 10 ms, too short to count what it made meanwhile, in steps of 100).
    for before, _ in attempts:
        assert before > BACKLOG, (attempts, flooded)
    assert np.median(flooded) - max(quiet) <= 2.0, (quiet, flooded, attempts)
    assert max(flooded) <= 10.0, (quiet, flooded, attempts)  # the issue saw 19 s


# --- fault 4: an ERROR frame instead of AUTH --------------------------------------------------

FORGED = json.dumps({"message": "x\nWARNING sparkdl_avg: forged line", "reason": "capacity"})


def _raw_handshake_reply(address, frame: bytes) -> msg.Message:
    """Send `frame` where the AUTH should be; the server's answer."""
    with socket.create_connection(address, timeout=5) as sock:
        conn = Connection(sock, timeout=5, max_payload=0)
        msg.expect(conn, msg.Challenge)
        sock.sendall(frame)
        return msg.receive(conn)[0]


@pytest.mark.parametrize(("payload", "reason"), [(0, "unexpected"), (1 << 40, "oversized")])
def test_an_error_frame_instead_of_auth_is_counted_by_our_reason_not_the_peers(
        payload, reason, caplog):
    body = FORGED.encode()
    with server() as ps:
        reply = _raw_handshake_reply(ps.address, HEADER.pack(
            MAGIC, VERSION, Kind.ERROR, 0, len(body), payload) + body)
        assert isinstance(reply, msg.Refusal) and reply.reason == reason, reply
        wait_for(lambda: ps.refusals() == {reason: 1})
    assert "forged line" not in caplog.text


def test_what_a_peer_chose_is_logged_escaped(caplog):
    """An authenticated worker's host (its own text) in a refusal: one log line, escaped."""
    secret = new_secret()
    with coordinator(secret, 1, timeout=5) as coord:
        channel = DriverChannel(coord.address, Credential.of(secret, 3), connect_timeout=5,
                                reply_timeout=5)
        channel.open(msg.WorkerHello(rank=3, host="h\nERROR forged line" + "x" * 3000))
        with pytest.raises(ProtocolError, match="rank 3 is unknown"):
            channel.expect(msg.Average)
        channel.close()
        wait_for(lambda: coord.refusals() == {"unexpected": 1})
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert lines and all("\n" not in line and len(line) < 1000 for line in lines), lines
    assert "h\\nERROR forged line" in lines[0]


# --- fault 6: a payload is bounded by its kind before it is read -----------------------------

def test_a_pull_with_a_payload_is_refused_before_the_payload_is_read():
    claimed = 200 << 20
    with Sidecar(ServerSettings(timeout=30), host="127.0.0.1", secret=SECRET) as sidecar:
        address = ("127.0.0.1", sidecar.port)
        process = psutil.Process(sidecar._proc.pid)
        with PSClient(address, secret=SECRET, worker=DRIVER, numel=4, dtype=np.float32,
                      timeout=10) as driver:  # the driver's connection: the largest limit
            driver.init(np.zeros(4, np.float32))
            before = process.memory_info().rss
            conn = driver._conn
            body = b"{}"

            def send() -> None:  # the whole claimed payload, unless the server hangs up
                chunk = bytes(1 << 20)
                try:
                    conn.sock.sendall(HEADER.pack(MAGIC, VERSION, Kind.PULL, 0, len(body),
                                                  claimed) + body)
                    for _ in range(claimed >> 20):
                        conn.sock.sendall(chunk)
                except OSError:
                    pass

            sender = threading.Thread(target=send)
            sender.start()
            reply, _ = msg.receive(conn)
            sender.join(30)
            grown = process.memory_info().rss - before
        assert isinstance(reply, msg.Refusal) and reply.reason == "oversized", reply
        assert "PULL carries no payload" in reply.message
        assert grown < 32 << 20, f"the server grew by {grown >> 20} MiB"
        with PSClient(address, secret=SECRET, worker=DRIVER, numel=4, dtype=np.float32,
                      timeout=10) as driver:
            assert driver.stats()["refused"] == {"oversized": 1}


# --- roles: per-role keys ----------------------------------------------------------------------

def test_a_worker_key_cannot_init_stop_or_act_as_another_worker():
    mine = Credential("worker:0", worker_keys(SECRET, 2)[0])  # task 0 claims it (enrolment)
    with server() as ps:
        with client(ps, mine, 0) as c:  # its own id: pulls and pushes
            c.pull()
            c.push(np.ones(4, np.float32))
        for worker in (DRIVER, 1):  # the driver's id (INIT, STOP, EVALUATE), another's
            with pytest.raises(ProtocolError) as info:
                client(ps, mine, worker)
            assert info.value.reason == "role", info.value
        with pytest.raises(ProtocolError) as info:  # claiming the driver's role: no key
            client(ps, Credential("driver", mine.key), DRIVER)
        assert info.value.reason == "auth"
        driver = Credential.of(SECRET, DRIVER)
        assert driver.key == role_key(SECRET, "driver")
        with client(ps, driver, DRIVER) as d:  # the driver's key does what the driver does
            d.init(np.zeros(4, np.float32), workers=2)
            assert d.stop()["stopped"]
        assert ps.applied == 0  # the INIT reset the one update worker 0 pushed
        assert ps.refusals() == {"role": 2, "auth": 1}


def test_a_worker_key_is_good_for_its_own_rank_only_at_the_coordinator():
    secret = new_secret()
    with coordinator(secret, 2, timeout=5) as coord:
        channel = DriverChannel(coord.address, Credential.of(secret, 0), connect_timeout=5,
                                reply_timeout=5)
        with pytest.raises(ProtocolError) as info:
            channel.open(msg.WorkerHello(rank=1, host="h"))
        assert info.value.reason == "role"
        wait_for(lambda: coord.refusals() == {"role": 1})


@pytest.mark.spark
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_no_key_nor_the_secret_reaches_a_task(spark, monkeypatch, mode):
    """The spec the barrier job ships to every task (pickled whole, as Spark does) holds no
    worker's key, nor the secret, nor the driver's key, as bytes or as hex: each task claims
    its own key (`task.enrolment`), and the fit's tasks train with the keys they claimed."""
    from test_fit_sync import frame, make_data, make_model_f64

    from sparkdl_avg import TrainConfig, fit
    from sparkdl_avg.driver import asynchronous, barrier, sync

    secret = new_secret()
    monkeypatch.setattr(sync if mode == "sync" else asynchronous, "new_secret",
                        lambda: secret)
    shipped = []
    training = barrier.BarrierJob.training.__func__

    def recording(cls, frame_, spec, *args, **kwargs):
        shipped.append(cloudpickle.dumps(spec))
        return training(cls, frame_, spec, *args, **kwargs)

    monkeypatch.setattr(barrier.BarrierJob, "training", classmethod(recording))
    x, y = make_data(40, seed=5)
    fit(frame(spark, x, y), make_model_f64, TrainConfig(
        mode=mode, num_workers=2, epochs=1, batch_size=10, log_model=False,
        experiment_name="roles"))
    assert len(shipped) == 1
    for key in (secret, role_key(secret, "driver"), *worker_keys(secret, 2)):
        assert key not in shipped[0]
        assert key.hex().encode() not in shipped[0]
        assert key.hex().upper().encode() not in shipped[0]
