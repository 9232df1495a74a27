"""Strangers on the cluster network during real fits: slow connections that never
authenticate do not delay a sync fit measurably, and a connection flood leaves the parameter
server as small as it was and still serving."""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import psutil
import pytest
from test_fit_sync import frame, make_data, make_model_f64

from sparkdl_avg import TrainConfig, fit
from sparkdl_avg.averaging.coordinator import Coordinator

pytestmark = pytest.mark.spark


class SlowStrangers:
    """`count` connections that each send one byte every `every_s` and never authenticate;
    a dropped one connects again."""

    def __init__(self, count: int = 30, every_s: float = 3.0) -> None:
        self.count, self.every_s = count, every_s
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def start(self, address: tuple[str, int]) -> None:
        for _ in range(self.count):
            t = threading.Thread(target=self._drip, args=(address,), daemon=True)
            t.start()
            self.threads.append(t)

    def _drip(self, address) -> None:
        while not self.stop.is_set():
            try:
                with socket.create_connection(address, timeout=5) as sock:
                    while not self.stop.wait(self.every_s * np.random.rand()):
                        sock.sendall(b"S")
            except OSError:
                if self.stop.wait(0.1):
                    return

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)


def test_slow_strangers_do_not_delay_a_sync_fit(spark, monkeypatch):
    x, y = make_data(400, seed=11)
    df = frame(spark, x, y).cache()
    cfg = TrainConfig(num_workers=2, epochs=2, batch_size=10, averaging_frequency=2,
                      log_model=False, experiment_name="strangers")
    fit(df, make_model_f64, cfg)  # warm: the timings below are of warm fits
    started = time.monotonic()
    quiet = fit(df, make_model_f64, cfg)
    normal_s = time.monotonic() - started

    strangers = SlowStrangers()
    accept_workers = Coordinator.accept_workers

    def with_strangers(self, *args, **kwargs):
        strangers.start(self.address)  # they arrive before the workers do
        time.sleep(0.5)
        return accept_workers(self, *args, **kwargs)

    monkeypatch.setattr(Coordinator, "accept_workers", with_strangers)
    started = time.monotonic()
    try:
        crowded = fit(df, make_model_f64, cfg)
    finally:
        strangers.join()
    crowded_s = time.monotonic() - started
    assert crowded_s <= 2 * normal_s + 15, (normal_s, crowded_s)
    for a, b in zip(quiet.model.parameters(), crowded.model.parameters(), strict=True):
        assert np.array_equal(a.detach().numpy(), b.detach().numpy())
    refused = crowded.history[-1]
    assert sum(v for k, v in refused.items() if k.startswith("refused_")) >= 1  # in MLflow


def test_a_connection_flood_leaves_the_parameter_server_as_it_was(spark, tmp_path):
    from sparkdl_avg.ps.settings import ServerSettings
    from sparkdl_avg.ps.sidecar import Sidecar

    secret = os.urandom(32)
    (tmp_path / "secret").write_text(secret.hex())
    settings = ServerSettings(lr=0.05, update_scale=0.5, timeout=60)
    with Sidecar(settings, host="127.0.0.1", secret=secret) as server:
        address = ("127.0.0.1", server.port)
        process = psutil.Process(server._proc.pid)
        for _ in range(200):  # warm up: handler threads exist, allocator settled
            socket.create_connection(address, timeout=5).close()
        time.sleep(1)
        before = process.memory_info().rss
        for _ in range(6000):
            socket.create_connection(address, timeout=5).close()
        idle = [socket.create_connection(address, timeout=5) for _ in range(100)]
        for sock in idle:
            sock.close()
        deadline = time.monotonic() + 15
        while process.memory_info().rss > before + (4 << 20) and time.monotonic() < deadline:
            time.sleep(0.5)
        grown = process.memory_info().rss - before
        assert grown <= 4 << 20, f"resident memory grew by {grown / 2**20:.1f} MiB"
        x, y = make_data(400, seed=3)  # and it still serves a fit
        result = fit(frame(spark, x, y), make_model_f64, TrainConfig(
            mode="async", num_workers=2, epochs=2, batch_size=8, push_every=2, lr=0.05,
            ps_address=f"127.0.0.1:{server.port}", ps_secret_file=str(tmp_path / "secret"),
            log_model=False))
        assert result.history[-1]["updates_applied"] == 2 * (2 * 25) // 2
