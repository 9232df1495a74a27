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


@pytest.mark.parametrize("algorithm", ["dcasgd", "dcasgd-adaptive"])
def test_sidecar_runs_the_delay_compensated_rules(algorithm):
    settings = dataclasses.replace(SETTINGS, algorithm=algorithm, update_scale=1.0)
    with Sidecar(settings, host="127.0.0.1", secret=SECRET) as ps:
        address = ("127.0.0.1", ps.port)
        with PSClient(address, secret=SECRET, worker=DRIVER, numel=2, dtype=np.float32,
                      timeout=10) as driver, PSClient(address, secret=SECRET, worker=0, numel=2,
                                                      dtype=np.float32, timeout=10) as w:
            driver.init(np.zeros(2, np.float32))
            w.pull()
            w.push(np.full(2, 0.1, np.float32))  # no delay: plain step, w = -0.1
            driver.pull()
            np.testing.assert_allclose(driver.params, [-0.1, -0.1], rtol=1e-6)
