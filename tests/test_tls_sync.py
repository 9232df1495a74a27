"""TLS on the sync averaging channel: the driver serves its certificate, the executors verify
it from PEM text shipped with the task, the result is the same as over plain TCP, and a peer
speaking plain TCP or trusting another CA gets nowhere."""

from __future__ import annotations

import ssl

import numpy as np
import pytest
from loopback import coordinator
from test_fit_sync import frame, make_data, make_model_f64, max_param_diff
from test_ps_tls import _other_ca, self_signed

from sparkdl_avg import ConfigError, TrainConfig, fit
from sparkdl_avg.averaging.coordinator import Coordinator
from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.auth import authenticate_to_server, new_secret
from sparkdl_avg.net.frames import connect
from sparkdl_avg.net.tls import client_context, server_context

pytestmark = pytest.mark.spark


def test_a_sync_fit_over_tls_equals_one_over_plain_tcp(spark, tmp_path, monkeypatch):
    cert, key, _ = self_signed(tmp_path)
    served = []  # whether each fit's coordinator really spoke TLS
    accept_workers = Coordinator.accept_workers

    def spy(self, *args, **kwargs):
        served.append(self._tls is not None)
        return accept_workers(self, *args, **kwargs)

    monkeypatch.setattr(Coordinator, "accept_workers", spy)
    x, y = make_data(300, seed=8)
    df = frame(spark, x, y).cache()
    cfg = dict(num_workers=2, epochs=2, batch_size=10, averaging_frequency=3,
               optimizer="adam", lr=0.01, log_model=False)
    plain = fit(df, make_model_f64, TrainConfig(**cfg))
    secure = fit(df, make_model_f64, TrainConfig(**cfg, tls_cert=str(cert),
                                                 tls_key=str(key)))
    assert served == [False, True]  # and the workers, whom a TLS server only lets in TLS
    assert max_param_diff(plain.model, secure.model) == 0
    assert max_param_diff(plain.model, make_model_f64()) > 1e-3


def test_the_tls_coordinator_refuses_plain_tcp_and_untrusting_peers(tmp_path):
    cert, key, pem = self_signed(tmp_path)
    secret = new_secret()
    with coordinator(secret, timeout=5, numel=2,
                     tls=server_context(str(cert), str(key))) as coord:
        hello = msg.WorkerHello(rank=0, host="h")
        with pytest.raises(OSError):  # plain TCP: no CHALLENGE ever comes
            plain = connect(coord.address, timeout=2, max_payload=64)
            authenticate_to_server(plain, secret, hello)
        with pytest.raises(ssl.SSLError):  # another CA: the driver is not trusted
            connect(coord.address, timeout=5, max_payload=64,
                    tls=client_context(_other_ca(tmp_path)))
        good = connect(coord.address, timeout=5, max_payload=64, tls=client_context(pem))
        authenticate_to_server(good, secret, hello)  # the real worker gets in
        coord.accept_workers(np.zeros(2, np.float32), deadline_s=10)
        assert msg.expect(good, msg.Average, np.zeros(2, np.float32))[0].round == -1
        good.close()


def test_tls_settings_are_checked_before_any_task(spark, tmp_path):
    with pytest.raises(ConfigError, match="tls_cert and tls_key together"):
        TrainConfig(tls_cert="cert.pem")
    with pytest.raises(ConfigError, match="applies to mode='sync' only"):
        TrainConfig(mode="async", tls_cert="c", tls_key="k")
    x, y = make_data(100)
    with pytest.raises(ConfigError, match="tls_cert=.* cannot be loaded"):
        fit(frame(spark, x, y), make_model_f64, TrainConfig(
            tls_cert=str(tmp_path / "missing.pem"), tls_key=str(tmp_path / "key.pem"),
            log_model=False))


def test_a_worker_that_does_not_trust_the_driver_fails_at_once(tmp_path):
    """A wrong tls_ca is no busy server: the connect is not retried for connect_timeout."""
    import time

    from sparkdl_avg.averaging.driver_channel import DriverChannel
    from sparkdl_avg.net.auth import Credential

    cert, key, _ = self_signed(tmp_path)
    secret = new_secret()
    with coordinator(secret, timeout=5, numel=2,
                     tls=server_context(str(cert), str(key))) as coord:
        channel = DriverChannel(coord.address, Credential.of(secret, 0), connect_timeout=20,
                                reply_timeout=5, tls_ca_pem=_other_ca(tmp_path))
        started = time.monotonic()
        with pytest.raises(ssl.SSLCertVerificationError):
            channel.open(msg.WorkerHello(rank=0, host="h"))
        assert time.monotonic() - started < 2


def test_a_slow_tls_handshake_gets_the_handshake_s_time_not_the_tcp_connect_s(tmp_path):
    """The driver takes 1.5 s to start TLS (a loaded driver): the worker's TLS handshake is
    held to the handshake's deadline, not to the TCP connect's limit (0.2 to 1 s), which
    no retry would ever have outlasted."""
    import time

    from sparkdl_avg.averaging.driver_channel import DriverChannel
    from sparkdl_avg.net.auth import Credential

    class SlowTLS:
        def __init__(self, context: ssl.SSLContext) -> None:
            self.context = context

        def wrap_socket(self, sock, **kwargs):
            time.sleep(1.5)
            return self.context.wrap_socket(sock, **kwargs)

    cert, key, pem = self_signed(tmp_path)
    secret = new_secret()
    with coordinator(secret, timeout=5, numel=2,
                     tls=SlowTLS(server_context(str(cert), str(key)))) as coord:
        channel = DriverChannel(coord.address, Credential.of(secret, 0), connect_timeout=8,
                                reply_timeout=5, tls_ca_pem=pem)
        try:
            channel.open(msg.WorkerHello(rank=0, host="h"))
            coord.accept_workers(np.zeros(2, np.float32), deadline_s=5)
            assert channel.receive_start(np.zeros(2, np.float32)).round == 0
        finally:
            channel.close()
