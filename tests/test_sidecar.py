"""The parameter server as its own process: started and stopped by its owner, ended by its
watchdog when the owner dies, refusing to start without a secret."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from sparkdl_avg.ps.client import PSClient
from sparkdl_avg.ps.server import DRIVER
from sparkdl_avg.ps.settings import ServerSettings
from sparkdl_avg.ps.sidecar import Sidecar

SECRET = os.urandom(32)
SETTINGS = ServerSettings(algorithm="downpour", lr=0.1, update_scale=0.5, timeout=30)


def test_sidecar_serves_and_stops_with_its_block():
    with Sidecar(SETTINGS, host="127.0.0.1", secret=SECRET) as ps:
        address = ("127.0.0.1", ps.port)
        with PSClient(address, secret=SECRET, worker=DRIVER, numel=3, dtype=np.float64,
                      timeout=10) as driver:
            driver.init(np.array([1.0, 2.0, 3.0]))
            with PSClient(address, secret=SECRET, worker=0, numel=3, dtype=np.float64,
                          timeout=10) as w:
                w.pull()
                w.push(np.array([2.0, 2.0, 2.0]))  # scaled by 0.5
            driver.pull()
            assert driver.params.tolist() == [0.0, 1.0, 2.0]
        proc = ps._proc
    assert proc.poll() is not None  # stopped on leaving the block


def test_watchdog_ends_the_server_when_its_parent_dies(tmp_path):
    ready = tmp_path / "ready.json"
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    server = subprocess.Popen(
        [sys.executable, "-m", "sparkdl_avg", "ps", "serve", "--parent-pid", str(parent.pid),
         "--ready-file", str(ready)],
        env={**os.environ, "SPARKDL_AVG_PS_SECRET": SECRET.hex()},
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists()
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert server.wait(timeout=15) == 0
    finally:
        for p in (parent, server):
            if p.poll() is None:
                p.kill()


def test_serve_refuses_to_start_without_a_secret():
    env = {k: v for k, v in os.environ.items() if k != "SPARKDL_AVG_PS_SECRET"}
    proc = subprocess.run([sys.executable, "-m", "sparkdl_avg", "ps", "serve"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "need a secret" in proc.stderr


W0 = np.array([1.0, -2.0])
PUSH_A = np.array([0.2, 0.6])
PUSH_B = np.array([0.4, -0.2])


def by_hand(algorithm: str, *, lr: float, scale: float) -> np.ndarray:
    """The parameters after: A pulls W0; B pulls W0 and pushes (no delay: a plain step, but
    the adaptive rule's meansquare takes in B's gradient); A pushes one update late, so its
    compensation lambda * g*g*(w - W0) no longer vanishes."""
    g_b, g_a = scale * PUSH_B / lr, scale * PUSH_A / lr
    w = W0 - lr * g_b
    if algorithm == "downpour":
        return w - lr * g_a
    if algorithm == "dcasgd":
        lam = 0.04
    else:  # lambda0 / sqrt(meansquare + eps), meansquare updated (momentum 0.95) first
        meansquare = 0.95 * (0.05 * g_b * g_b) + 0.05 * g_a * g_a
        lam = 2.0 / np.sqrt(meansquare + 1e-7)
    return w - lr * (g_a + lam * g_a * g_a * (w - W0))


@pytest.mark.parametrize("algorithm", ["dcasgd", "dcasgd-adaptive"])
@pytest.mark.exact
def test_sidecar_runs_the_delay_compensated_rules(algorithm):
    settings = dataclasses.replace(SETTINGS, algorithm=algorithm)  # lr 0.1, scale 0.5
    with Sidecar(settings, host="127.0.0.1", secret=SECRET) as ps:
        address = ("127.0.0.1", ps.port)

        def client(worker: int) -> PSClient:
            return PSClient(address, secret=SECRET, worker=worker, numel=2, dtype=np.float64,
                            timeout=10)

        with client(DRIVER) as driver, client(0) as a, client(1) as b:
            driver.init(W0.copy())
            a.pull()
            b.pull()
            b.push(PUSH_B.copy())  # the server moves on while A computes
            a.push(PUSH_A.copy())  # stale by one update
            driver.pull()
            got = driver.params.copy()
    expected = by_hand(algorithm, lr=settings.lr, scale=settings.update_scale)
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    downpour = by_hand("downpour", lr=settings.lr, scale=settings.update_scale)
    # far enough from downpour's result that an ignored --algorithm cannot pass
    assert np.abs(got - downpour).min() > 1e-4, (got, downpour)
