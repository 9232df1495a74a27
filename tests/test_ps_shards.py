"""A sharded parameter server without Spark: the slices, the settings' checks, K in-process
shards answering like one server, and a shard restarted from an older checkpoint losing and
doubling nothing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sparkdl_avg import ConfigError, TrainConfig
from sparkdl_avg.ps.client import PSClient
from sparkdl_avg.ps.server import DRIVER, ParameterServer
from sparkdl_avg.ps.settings import ServerSettings
from sparkdl_avg.ps.sharded_client import ShardedClient, connect
from sparkdl_avg.ps.shards import bounds, merge_reports, parse_addresses

SECRET = b"s" * 32


@pytest.mark.parametrize("numel", [1, 2, 3, 7, 10, 1001])
@pytest.mark.parametrize("shards", [1, 2, 3, 4])
def test_slices_are_contiguous_cover_everything_and_differ_by_at_most_one(numel, shards):
    if numel < shards:
        with pytest.raises(ConfigError, match=f"ps_shards={shards} needs a model of at least"):
            bounds(numel, shards)
        return
    got = bounds(numel, shards)
    assert got[0][0] == 0 and got[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(got[:-1], got[1:], strict=True))
    sizes = [hi - lo for lo, hi in got]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_addresses_are_parsed_in_order_and_each_once():
    assert parse_addresses("a:1, b:2,c:3") == [("a", 1), ("b", 2), ("c", 3)]
    for bad in ("a", "a:", "a:0", "a:70000", "a:1,", "a:1,a:1"):
        with pytest.raises(ConfigError, match="ps_address="):
            parse_addresses(bad)


def test_ps_shards_is_checked_before_anything_runs():
    assert TrainConfig().ps_shards == 1
    with pytest.raises(ConfigError, match="ps_shards=2 applies to mode='async' only"):
        TrainConfig(ps_shards=2)
    for bad in (0, -1, 1.5, True, 65):
        with pytest.raises(ConfigError, match="ps_shards"):
            TrainConfig(mode="async", ps_shards=bad)
    with pytest.raises(ConfigError, match="ps_address names 2 server.* and ps_shards=3"):
        TrainConfig(mode="async", ps_shards=3, ps_address="h:1,h:2", ps_secret_file="s")
    with pytest.raises(ConfigError, match="ps_address names 2 server.* and ps_shards=1"):
        TrainConfig(mode="async", ps_address="h:1,h:2", ps_secret_file="s")
    config = TrainConfig(mode="async", ps_shards=2, ps_address="h:1,h:2", ps_secret_file="s")
    assert config.to_dict()["ps_shards"] == "2"


class Shards:
    """K in-process servers (checkpointing every `every` updates when `folder` is given)."""

    def __init__(self, k: int, algorithm: str = "downpour", folder=None, every: int = 0):
        self.settings = ServerSettings(algorithm=algorithm, lr=0.1, timeout=10,
                                       checkpoint_every=every)
        self.paths = [folder and str(folder / f"shard-{i}.npz") for i in range(k)]
        self.servers = [self.start(i) for i in range(k)]

    def start(self, i: int, port: int = 0, resume: bool = False) -> ParameterServer:
        server = ParameterServer(self.settings, secret=SECRET, port=port,
                                 checkpoint_path=self.paths[i])
        if resume:
            server.restore(self.paths[i])
        return server.__enter__()

    def restart(self, i: int) -> None:
        """Shard i dies and comes back on its port from its last checkpoint."""
        port = self.servers[i].address[1]
        self.servers[i].close()
        self.servers[i] = self.start(i, port, resume=True)

    def client(self, worker: int, numel: int):
        return connect([s.address for s in self.servers], secret=SECRET, worker=worker,
                       numel=numel, dtype=np.float64, timeout=10)

    def close(self) -> None:
        for s in self.servers:
            s.close()


# Both workers pull before either pushes, and each pushes again before it pulls again, so
# every DC-ASGD push after the first is compensated (the other's pushes lie in between).
SCHEDULE = [(0, "pull"), (1, "pull"), (0, "push"), (1, "push"), (0, "push"), (1, "pull"),
            (0, "pull"), (1, "push"), (0, "push"), (1, "push"), (0, "push")]


def _run_schedule(k: int, algorithm: str, w0, pushes) -> tuple:
    """SCHEDULE against k shards (lr 0.1, update_scale 1): the final parameters, the stats,
    and the events for `by_hand` (each push with the point its worker computed it from)."""
    shards = Shards(k, algorithm)
    try:
        with shards.client(DRIVER, 10) as driver, shards.client(0, 10) as a, \
                shards.client(1, 10) as b:
            assert isinstance(driver, ShardedClient if k > 1 else PSClient)
            settings = driver.init(w0.copy(), workers=2)
            assert settings.get("shards", 1) == k
            own, events, updates = {}, [], iter(pushes)
            for i, (worker, what) in enumerate(SCHEDULE):
                c = (a, b)[worker]
                if what == "pull":
                    c.pull()
                    own[worker] = c.params.copy()
                    continue
                update = next(updates)
                events.append(("push", update, own[worker].copy()))
                own[worker] = own[worker] - update  # the worker goes on from its own
                ack = c.push(update.copy(), samples=5, loss_sum=1.0, steps=i + 1, lr=0.1)
                assert ack.applied == len(events)
            driver.pull()
            return driver.params.copy(), driver.stats(), events
    finally:
        shards.close()


@pytest.mark.parametrize("algorithm", ["downpour", "dcasgd", "dcasgd-adaptive"])
@pytest.mark.exact
def test_shards_answer_like_one_server(algorithm):
    """The same pushes and pulls against 1 and 3 shards give the same parameters (the rules
    are elementwise), the same counters and one report; DC-ASGD's are those computed by
    hand, and differ from Downpour's."""
    from test_async_rules import by_hand

    rng = np.random.default_rng(0)
    w0, pushes = rng.normal(size=10), rng.normal(size=(7, 10)) * 0.1
    results = {k: _run_schedule(k, algorithm, w0, pushes) for k in (1, 3)}
    np.testing.assert_allclose(results[3][0], results[1][0], rtol=0, atol=1e-15)
    one, three = results[1][1], results[3][1]
    for key in ("applied", "samples", "loss_sum", "progress", "refused", "stopped"):
        assert three[key] == one[key], key
    assert [s["applied"] for s in three["shards"]] == [7, 7, 7]
    lam = {"downpour": 0.0, "dcasgd": 0.04, "dcasgd-adaptive": 2.0}[algorithm]
    events = results[1][2]
    expected = by_hand(algorithm, w0, events, lr=0.1, scale=1.0, lam=lam)
    np.testing.assert_allclose(results[3][0], expected, rtol=1e-12, atol=1e-14)
    downpour = by_hand("downpour", w0, events, lr=0.1, scale=1.0, lam=0.0)
    if algorithm != "downpour":
        assert np.abs(results[3][0] - downpour).max() > 1e-5


def test_a_shard_restarted_from_an_older_checkpoint_loses_and_doubles_nothing(tmp_path):
    """Shard 1 comes back without the worker's last push. The worker rewinds to what every
    shard has, redoes that push, and the redone update goes to shard 1 only: each shard
    ends with every update applied exactly once."""
    shards = Shards(2, folder=tmp_path, every=2)
    try:
        with shards.client(DRIVER, 4) as driver:
            driver.init(np.zeros(4), workers=1)
        worker = shards.client(0, 4)
        worker.pull()
        for steps in (8, 16, 24):  # checkpoints after the 2nd push; the 3rd is lost on 1
            worker.push(np.ones(4), samples=1, steps=steps)
        shards.restart(1)
        with pytest.raises(OSError):
            worker.pull()
        worker.close()
        worker = shards.client(0, 4)
        worker.pull()
        assert worker.progress == 16  # shard 0 has 24, shard 1 has 16: redo 17..24
        assert worker.params.tolist() == [-3, -3, -2, -2]
        worker.push(np.ones(4), samples=1, steps=24)
        worker.push(np.ones(4), samples=1, steps=32)
        assert [s.applied for s in shards.servers] == [4, 4]
        assert [s.progress for s in shards.servers] == [{0: 32}, {0: 32}]
        worker.pull()
        assert worker.params.tolist() == [-4] * 4
        worker.close()
    finally:
        shards.close()


def test_one_report_from_k():
    def report(applied, refused, stale_mean, stale_max, progress, pending=None):
        return {"applied": applied, "refused": refused, "clocks": {"0": applied},
                "progress": progress, "samples": 10 * applied, "loss_sum": float(applied),
                "staleness": {"0": {"count": applied, "mean": stale_mean, "max": stale_max,
                                    "histogram": {}}},
                "evaluations": {"pending": pending, "results": [], "finished": []},
                "lr": 0.1, "stopped": False}
    merged = merge_reports([
        report(5, {"auth": 1}, 0.5, 1, {"0": 40}, {"request": 3, "applied": 5, "final": False}),
        report(4, {"auth": 2, "shape": 1}, 0.8, 1, {"0": 32},
               {"request": 7, "applied": 4, "final": False}),
        report(5, {}, 0.1, 3, {"0": 40}, {"request": 3, "applied": 5, "final": False})])
    assert merged["applied"] == 4 and merged["samples"] == 40 and merged["loss_sum"] == 4.0
    assert merged["refused"] == {"auth": 3, "shape": 1}
    assert merged["progress"] == {"0": 32} and merged["clocks"] == {"0": 4}
    assert merged["staleness"]["0"]["mean"] == 0.8 and merged["staleness"]["0"]["max"] == 3
    # every shard made its request at its own moment: one request, at the merged count
    assert merged["evaluations"]["pending"] == {"request": 3, "applied": 4, "final": False}
    half = merge_reports([report(5, {}, 0, 0, {}, {"request": 3, "applied": 5,
                                                    "final": False}),
                          report(5, {}, 0, 0, {}, None)])
    assert half["evaluations"]["pending"] is None  # shard 1 has none: nothing to follow
    apart = merge_reports([report(5, {}, 0, 0, {}, {"request": 3, "applied": 5,
                                                     "final": False}),
                           report(5, {}, 0, 0, {}, {"request": 3, "applied": 4,
                                                    "final": False})])
    assert apart["evaluations"]["pending"]["applied"] is None  # made at other moments


def test_the_command_line_serves_k_shards_and_restarts_a_dead_one(tmp_path):
    """`ps serve --shards 2` prints the fit's ps_address; a fit's client sees one server
    there; a shard SIGKILLed comes back from its checkpoint on its port; Ctrl-C stops all."""
    import os
    import signal
    import subprocess
    import sys
    import time

    ready = tmp_path / "ready.json"
    env = {**os.environ, "SPARKDL_AVG_PS_SECRET": SECRET.hex()}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sparkdl_avg", "ps", "serve", "--shards", "2",
         "--checkpoint-every", "1", "--checkpoint-file", str(tmp_path / "ps.npz"),
         "--ready-file", str(ready)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("ps_address="), line
        config = TrainConfig(mode="async", ps_shards=2, ps_address=line.split("=", 1)[1],
                             ps_secret_file="unused")
        addresses = parse_addresses(config.ps_address)
        assert [p for _, p in addresses] == json.loads(ready.read_text())["ports"]

        def client(worker: int) -> ShardedClient:
            return ShardedClient(addresses, secret=SECRET, worker=worker, numel=5,
                                 dtype=np.float64, timeout=10)
        with client(DRIVER) as driver:
            driver.init(np.zeros(5), workers=1)
        with client(0) as worker:
            worker.pull()
            worker.push(np.ones(5), steps=3)
        shard = tmp_path / "ps-1-of-2.npz"
        _wait_for_checkpoint(shard, applied=1)  # written after the ack, on the shard's writer
        _wait_for_checkpoint(tmp_path / "ps-0-of-2.npz", applied=1)
        os.kill(_pid_serving(str(shard)), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:  # back on its port, from its checkpoint
            try:
                with client(0) as worker:
                    worker.pull()
                    break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert worker.params.tolist() == [-1.0] * 5 and worker.progress == 3
        children = [_pid_serving(str(tmp_path / f"ps-{k}-of-2.npz")) for k in (0, 1)]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        for pid in children:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if proc.poll() is None:
            proc.kill()


def _wait_for_checkpoint(path, applied: int, timeout: float = 30.0) -> None:
    """Until the checkpoint at `path` holds `applied` updates: the server acknowledges an
    update before its background writer has saved it."""
    import time

    from sparkdl_avg.ps import state_file

    deadline = time.monotonic() + timeout
    while not (path.exists() and state_file.load(str(path))[1]["applied"] >= applied):
        assert time.monotonic() < deadline, f"{path} never held {applied} updates"
        time.sleep(0.05)


def _pid_serving(checkpoint: str) -> int:
    from pathlib import Path

    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in cmdline and checkpoint.encode() in cmdline:
            return int(entry.name)
    raise AssertionError(f"no server saving {checkpoint}")
