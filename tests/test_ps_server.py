"""The parameter server over loopback: rules applied, bad input refused and counted, the server
up throughout, no update lost under concurrency, the staleness bound enforced."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from polling import wait_for

from sparkdl_avg import ProtocolError
from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.frames import VERSION, Connection
from sparkdl_avg.ps.client import PSClient
from sparkdl_avg.ps.rules import make_rule
from sparkdl_avg.ps.server import ParameterServer
from sparkdl_avg.ps.settings import ServerSettings
from sparkdl_avg.ps.staleness import pushes_between_fetches

SECRET = b"s" * 32


def server(n: int = 4, algorithm: str = "downpour", **kw) -> ParameterServer:
    """A server that already holds zero parameters (as if INITed)."""
    settings = ServerSettings(algorithm=algorithm, lr=0.1, timeout=10, **kw)
    rule = make_rule(algorithm, np.zeros(n, np.float32), lr=0.1)
    return ParameterServer(settings, secret=SECRET, rule=rule)


def client(ps: ParameterServer, worker: int, n: int = 4, attempt: int = 0) -> PSClient:
    return PSClient(ps.address, secret=SECRET, worker=worker, numel=n, dtype=np.float32,
                    timeout=10, attempt=attempt)


def test_pull_push_pull_applies_the_update():
    with server() as ps, client(ps, 0) as c:
        assert c.pull() == 0
        ack = c.push(np.array([1, 2, 3, 4], np.float32))
        assert ack.applied == 1 and ack.staleness == 0
        assert c.pull() == 1
        assert c.params.tolist() == [-1, -2, -3, -4]


def test_bad_input_is_refused_counted_and_the_server_stays_up():
    with server() as ps:
        with pytest.raises(ProtocolError):  # wrong secret
            PSClient(ps.address, secret=b"x" * 32, worker=0, numel=4, dtype=np.float32,
                     timeout=5)
        with client(ps, 1) as c, pytest.raises(ProtocolError, match="NaN or Inf"):
            c.pull()
            c.push(np.array([np.nan, 0, 0, 0], np.float32))
        with client(ps, 2) as c, pytest.raises(ProtocolError, match="expected"):
            c.pull()
            c.push(np.zeros(7, np.float32))  # wrong shape
        with client(ps, 3) as c:  # still serving, nothing was applied
            c.pull()
            assert c.params.tolist() == [0, 0, 0, 0]
            stats = c.stats()
        assert stats["applied"] == 0
        assert stats["refused"] == {"auth": 1, "non_finite": 1, "shape": 1}


def test_init_reports_the_settings_and_refuses_a_fit_that_needs_others():
    ps = ParameterServer(ServerSettings(algorithm="dcasgd", lr=0.1, timeout=10), secret=SECRET)
    with ps, PSClient(ps.address, secret=SECRET, worker=-1, numel=2, dtype=np.float32,
                      timeout=10) as driver:
        with pytest.raises(ProtocolError, match="algorithm: the fit has 'downpour', the "
                           "server 'dcasgd'; staleness_bound: the fit has 0") as info:
            driver.init(np.ones(2, np.float32), expect={
                "algorithm": "downpour", "lr": 0.1, "staleness_bound": 0})
        assert info.value.reason == "settings"
        assert ps.rule is None  # refused before it touched anything
        settings = driver.init(np.ones(2, np.float32), expect={
            "algorithm": "dcasgd", "lr": 0.1, "staleness_bound": None})
        assert settings["dc_lambda"] == 0.04  # the rule's default, filled in
        assert ps.stats()["refused"] == {"settings": 1}


def test_concurrent_clients_lose_no_update():
    workers, pushes = 8, 40
    with server(n=1000) as ps:
        acks = []

        def run(w: int) -> None:
            with client(ps, w, n=1000) as c:
                for _ in range(pushes):
                    c.pull()
                    acks.append(c.push(np.full(1000, 0.5, np.float32)))

        threads = [threading.Thread(target=run, args=(w,)) for w in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(acks) == workers * pushes == ps.applied
        np.testing.assert_allclose(ps.rule.params, -0.5 * workers * pushes)


def test_staleness_bound_holds_a_fast_worker_back():
    with server(staleness_bound=1) as ps, client(ps, 0) as fast, client(ps, 1) as slow:
        fast.pull()
        slow.pull()
        fast.push(np.ones(4, np.float32))  # clocks 1:0
        fast.push(np.ones(4, np.float32))  # 2:0 -> its next read must wait
        done = threading.Event()
        t = threading.Thread(target=lambda: (fast.pull(), done.set()))
        t.start()
        assert not done.wait(0.5)
        slow.push(np.ones(4, np.float32))  # 2:1 -> within the bound again
        assert done.wait(5)
        t.join()


def test_bound_zero_is_lockstep_each_read_sees_exactly_one_round():
    with server(staleness_bound=0) as ps, client(ps, 0) as a, client(ps, 1) as b:
        a.pull()
        b.pull()
        seen = {}

        def worker(c, name):
            for _ in range(5):
                c.push(np.ones(4, np.float32))
                c.pull()
                seen.setdefault(name, []).append(float(c.params[0]))

        threads = [threading.Thread(target=worker, args=(c, n)) for c, n in ((a, "a"), (b, "b"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        # after round r both workers read exactly 2*(r+1) updates of 1: never more, never less
        assert seen["a"] == seen["b"] == [-2.0 * (r + 1) for r in range(5)]


@pytest.mark.parametrize("bound", [0, 1, 2])
def test_workers_fetching_as_the_bound_allows_never_stall(bound):
    """fetch_every 8 pushes with a bound under 7 stalled both workers in a push, each
    waiting for the other's next fetch (issue 28). Fetching every
    `pushes_between_fetches` pushes, 3 workers push 12 times each under the bound."""
    every = pushes_between_fetches(1, 8, bound)
    assert every == bound + 1
    with ParameterServer(ServerSettings(timeout=5, staleness_bound=bound),
                         secret=SECRET) as ps:
        with client(ps, -1) as driver:  # all 3 count for the bound from the start
            driver.init(np.zeros(4, np.float32), workers=3)
        failures = []

        def work(worker: int) -> None:
            try:
                with client(ps, worker) as c:
                    c.pull()
                    for push in range(1, 13):
                        c.push(np.ones(4, np.float32))
                        if push % every == 0:
                            c.pull()
            except Exception as exc:  # noqa: BLE001  (reported below, not lost in a thread)
                failures.append(exc)

        threads = [threading.Thread(target=work, args=(w,)) for w in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not failures and ps.applied == 36


def test_a_disconnected_worker_no_longer_holds_the_others():
    with server(staleness_bound=0) as ps, client(ps, 0) as a:
        b = client(ps, 1)
        a.pull()
        b.pull()
        a.push(np.ones(4, np.float32))
        released = threading.Event()
        t = threading.Thread(target=lambda: (a.pull(), released.set()))
        t.start()
        assert not released.wait(0.5)
        b.close()  # b goes away: a must not wait for it forever
        assert released.wait(5)
        t.join()


def test_dcasgd_server_uses_each_workers_backup():
    """Each push is compensated against its own worker's backup: the parameters it pulled,
    moved by its own pushes since (lr 0.1, lambda 0.04, update_scale 1)."""
    u1, u2, u3 = (np.array(u, np.float32) for u in (
        [0.1, -0.2, 0.3, 0.0], [0.2, 0.1, -0.3, 0.4], [-0.3, 0.2, 0.1, 0.5]))
    with server(algorithm="dcasgd") as ps, client(ps, 0) as a, client(ps, 1) as b:
        a.pull()  # a's backup: 0
        with pytest.raises(ProtocolError, match="pushed before it pulled"):  # b never pulled
            b.push(np.ones(4, np.float32))
        a.push(u1.copy())  # w1 = -u1; a's backup -u1 (a goes on from its own parameters)
        b.pull()  # b's backup: w1
        a.push(u2.copy())  # computed at -u1 = w1: no delay, w2 = w1 - u2
        np.testing.assert_allclose(ps.rule.backups[0], -u1 - u2, rtol=1e-6)
        np.testing.assert_allclose(ps.rule.backups[1], -u1, rtol=1e-6)
        b.push(u3.copy())  # computed at w1, applied at w2: compensated by w2 - w1 = -u2
        np.testing.assert_allclose(ps.rule.backups[1], -u1 - u3, rtol=1e-6)
        g3 = u3.astype(np.float64) / 0.1
        expected = -u1 - u2 - 0.1 * (g3 + 0.04 * g3 * g3 * -u2.astype(np.float64))
        np.testing.assert_allclose(ps.rule.params, expected, rtol=1e-6)
        assert np.abs(expected - (-u1 - u2 - u3)).max() > 1e-3  # the compensation counts
        assert ps.applied == 3


def test_oversized_or_garbage_frames_do_not_stop_the_server():
    with server() as ps:
        import socket
        import struct

        with socket.create_connection(ps.address, timeout=5) as s:
            s.sendall(struct.pack("!4sBBHIQ", b"SDLA", VERSION, 2, 0, 1 << 30, 0))
        time.sleep(0.2)
        with client(ps, 0) as c:
            assert c.pull() == 0
        assert ps.stats()["refused"]["oversized"] >= 1


def test_announced_workers_hold_pushes_until_their_first_read():
    # Lockstep with a late joiner: worker 0's first push must not land before worker 1 has
    # read the initial parameters, or worker 1 would start from the wrong point.
    ps = ParameterServer(ServerSettings(timeout=10, staleness_bound=0), secret=SECRET)
    with ps:
        with PSClient(ps.address, secret=SECRET, worker=-1, numel=4, dtype=np.float32,
                      timeout=10) as driver:
            driver.init(np.zeros(4, np.float32), workers=2)
        with client(ps, 0) as early:
            early.pull()
            pushed = threading.Event()
            t = threading.Thread(target=lambda: (early.push(np.ones(4, np.float32)),
                                                 pushed.set()))
            t.start()
            assert not pushed.wait(0.5)
            with client(ps, 1) as late:
                late.pull()
                assert late.params.tolist() == [0, 0, 0, 0]
                assert pushed.wait(5)
                t.join()


def test_an_update_without_payload_is_refused_not_a_crash():
    with server() as ps, client(ps, 0) as c:
        msg.send(c._conn, msg.Update(dtype="float32", numel=4))  # first frame, no bytes
        with pytest.raises(ProtocolError, match="UPDATE without a payload"):
            msg.expect(c._conn, msg.Ack)
        c.pull()  # the connection is still served
        assert ps.stats()["refused"] == {"malformed": 1}


def test_a_restarted_server_takes_up_its_checkpoint(tmp_path):
    """The state saved every k updates comes back: parameters, counters, each worker's
    progress (where it resumes), and the announced workers of the staleness bound."""
    path = str(tmp_path / "ps.npz")
    first = ParameterServer(ServerSettings(lr=0.1, timeout=10, checkpoint_every=2),
                            secret=SECRET, checkpoint_path=path)
    with first, PSClient(first.address, secret=SECRET, worker=-1, numel=4,
                         dtype=np.float32, timeout=10) as driver:
        driver.init(np.zeros(4, np.float32), workers=2)
        with client(first, 0) as c:
            c.pull()
            for steps in (8, 16, 24):  # the third push comes after the last checkpoint
                c.push(np.ones(4, np.float32), samples=10, steps=steps)
    second = ParameterServer(ServerSettings(lr=0.1, timeout=10, staleness_bound=0),
                             secret=SECRET)
    second.restore(path)
    assert second.applied == 2 and second.samples == 20
    assert second.progress == {0: 16}
    with second, client(second, 0) as c:
        c.pull()
        assert c.progress == 16  # the worker redoes steps 17..24
        assert c.params.tolist() == [-2.0] * 4
        assert second.stats()["clocks"] == {"0": 0, "1": 0}  # worker 1 still counts


def test_the_drivers_count_of_gradients_reaches_the_rule_and_its_checkpoint(tmp_path):
    """INIT says how many leading values are parameters (the rest BatchNorm's statistics,
    which DC-ASGD applies as Downpour does: `test_async_rules`); a server restarted from its
    checkpoint keeps it."""
    path = str(tmp_path / "ps.npz")
    settings = ServerSettings(algorithm="dcasgd", lr=0.1, timeout=10, checkpoint_every=1)
    first = ParameterServer(settings, secret=SECRET, checkpoint_path=path)
    with first, PSClient(first.address, secret=SECRET, worker=-1, numel=4,
                         dtype=np.float32, timeout=10) as driver:
        driver.init(np.zeros(4, np.float32), workers=1, gradients=3)
        assert first.rule.gradients == 3
        with client(first, 0) as c:
            c.pull()
            c.push(np.array([0.0, 0.0, 0.0, -2.0], np.float32))  # a checkpoint after it
    second = ParameterServer(settings, secret=SECRET)
    second.restore(path)
    assert second.rule.gradients == 3


def test_a_push_waiting_at_the_gate_when_the_driver_stops_is_not_applied():
    """Early stopping saves the server's state at the stop: a push held by the staleness
    bound then is answered stop, at once, and not applied afterwards when the gate opens."""
    ps = ParameterServer(ServerSettings(lr=0.1, timeout=20, staleness_bound=0), secret=SECRET)
    with ps, PSClient(ps.address, secret=SECRET, worker=-1, numel=4, dtype=np.float32,
                      timeout=20) as driver:
        driver.init(np.zeros(4, np.float32), workers=2)
        with client(ps, 0) as a, client(ps, 1) as b:
            for c in (a, b):
                c.pull()
            a.push(np.ones(4, np.float32))
            b.push(np.ones(4, np.float32))
            a.pull()
            acks = []
            held = threading.Thread(target=lambda: acks.append(a.push(np.ones(4, np.float32))))
            held.start()
            wait_for(lambda: ps.applied == 2 and held.is_alive(), 10)
            time.sleep(0.3)  # a's push is read and waits for b's read at the gate
            assert driver.stop()["applied"] == 2
            held.join(10)  # answered at the stop, not at the server's timeout (20 s)
            assert acks and acks[0].stop and ps.applied == 2
        assert ps.stats()["applied"] == 2  # b gone, the gate open: still not applied


def test_a_stale_connection_ending_does_not_unregister_its_replacement():
    with server(staleness_bound=1) as ps:
        old = client(ps, 0)
        old.pull()
        new = client(ps, 0)  # the worker reconnected; the old socket lingers
        old.close()
        time.sleep(0.3)
        assert ps.stats()["clocks"] == {"0": 0}
        new.pull()
        new.push(np.ones(4, np.float32))
        new.close()


@pytest.mark.parametrize("cut_seen", ["at_once", "after_the_push"])
def test_only_a_workers_latest_task_attempt_is_served(cut_seen, monkeypatch):
    """Spark runs a worker's task again while its earlier attempt may still run (a stage
    rerun after an executor loss): the later attempt takes the worker id over, the earlier
    one's connection is cut (its push not applied), and its reconnect is refused "ended";
    reconnecting as the same attempt is still served. Without the attempt check the earlier
    attempt's reconnect would take the id back and both would push as one worker.

    The cut is a shutdown of the connection's reads, which Linux does not apply to bytes
    that arrive before the handler's next read: a handler that wakes late (a loaded machine)
    reads the earlier attempt's push and refuses it "ended" as a connection replaced. That
    order is forced here by leaving the reads open ("after_the_push"); "at_once" may take
    either, so the earlier push's refusal is not counted on, only the reconnect's."""
    if cut_seen == "after_the_push":
        monkeypatch.setattr(Connection, "end_reads", lambda self: None)
    with server() as ps, client(ps, 0, attempt=5) as earlier:
        earlier.pull()
        with client(ps, 0, attempt=9) as later:
            later.pull()
            with pytest.raises(OSError) as cut:  # its connection was cut as the later one came
                earlier.push(np.ones(4, np.float32))
            if cut_seen == "after_the_push":  # read, and refused as a replaced connection
                assert isinstance(cut.value, ProtocolError) and cut.value.reason == "ended"
            before = ps.stats()["refused"].get("ended", 0)  # counted before it was sent
            with pytest.raises(ProtocolError, match="attempt 5 of worker 0 ended: attempt 9"
                               ) as again:
                client(ps, 0, attempt=5).pull()
            assert again.value.reason == "ended"
            later.push(np.ones(4, np.float32))
        with client(ps, 0, attempt=9) as reconnected:  # the same attempt, after a lost connection
            reconnected.pull()
            assert reconnected.params.tolist() == [-1.0] * 4  # only the later push applied
        assert ps.stats()["refused"].get("ended") == before + 1


def test_the_drivers_stop_is_said_to_every_later_push_and_only_the_driver_may_stop():
    with server() as ps, client(ps, 0) as worker, client(ps, -1) as driver:
        worker.pull()
        assert not worker.push(np.ones(4, np.float32), lr=0.05).stop
        with pytest.raises(ProtocolError, match="unexpected STOP"):
            msg.send(worker._conn, msg.Stop())
            msg.expect(worker._conn, msg.Stats)
    with server() as ps, client(ps, 0) as worker, client(ps, -1) as driver:
        worker.pull()
        worker.push(np.ones(4, np.float32), lr=0.05)
        stats = driver.stop()
        assert stats["stopped"] and stats["lr"] == 0.05
        assert worker.push(np.ones(4, np.float32)).stop  # computed before it heard: dropped
        assert driver.stats()["applied"] == 1


def test_a_failed_checkpoint_save_is_reported_and_the_server_keeps_serving(tmp_path):
    """The driver learns of the save that failed (in every STATS answer, naming the file)
    while the server goes on; a new fit's INIT whose save succeeds reports none."""
    path = tmp_path / "ps.npz"
    blocker = tmp_path / "ps.npz.tmp.npz"  # a directory where the temporary file goes
    blocker.mkdir()
    settings = ServerSettings(lr=0.1, timeout=10, checkpoint_every=1)
    with ParameterServer(settings, secret=SECRET, checkpoint_path=str(path)) as ps, \
            PSClient(ps.address, secret=SECRET, worker=-1, numel=2, dtype=np.float32,
                     timeout=10) as driver, client(ps, 0, n=2) as worker:
        driver.init(np.ones(2, np.float32), workers=1)
        wait_for(lambda: driver.stats()["checkpoint_error"] is not None)
        assert driver.stats()["checkpoint_error"].startswith(
            f"could not save the server checkpoint {path}: IsADirectoryError")
        worker.pull()
        assert worker.push(np.ones(2, np.float32)).applied == 1  # still serving
        assert "IsADirectoryError" in driver.evaluate()["checkpoint_error"]
        wait_for(lambda: ps._checkpoint.errors == 2)  # INIT's save and the push's
        blocker.rmdir()
        driver.init(np.ones(2, np.float32), workers=1)
        wait_for(path.exists)
        assert driver.stats()["checkpoint_error"] is None

