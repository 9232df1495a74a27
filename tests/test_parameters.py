"""Public parameters checked by their effect, each by a test that fails if the parameter is
ignored: weight_decay against a hand-computed SGD step, the waits (connect_timeout,
finish_timeout, reconnect_timeout) by tasks that outlast them failing the fit with an error
naming them (and, given a longer wait, finishing), tls_ca by whom the workers trust, and
scoring's device. (AveragingEstimator's Params: test_ml.)"""

from __future__ import annotations

import datetime
import ipaddress
import threading
import time
from functools import partial

import numpy as np
import pytest
import torch
from faulty import FaultyMLP, dataset, kill_server_after_a_checkpoint
from rounding import classes_agree, forward_tolerance
from test_fit_sync import frame, make_data, make_model_f64, max_param_diff

from sparkdl_avg import ConfigError, FitResult, TrainConfig, TrainingError, fit
from sparkdl_avg._model import make_optimizer

pytestmark = pytest.mark.spark
QUICK = dict(num_workers=2, epochs=1, batch_size=10, max_failures=0, log_model=False,
             experiment_name="parameters")


@pytest.fixture(scope="module")
def data(spark):
    return dataset(spark, rows=80).cache()


@pytest.mark.exact
def test_weight_decay_is_in_the_sgd_step_as_computed_by_hand(spark):
    """Two workers, 4 rows each, one step each and one average: w - lr (g + wd w), g the
    gradient of the mean loss over all 8 rows (the workers' halves are equal)."""
    x, y = make_data(8, seed=3)
    lr, wd = 0.1, 0.5
    result = fit(frame(spark, x, y), make_model_f64, TrainConfig(
        num_workers=2, epochs=1, batch_size=4, averaging_frequency=1, optimizer="sgd",
        lr=lr, weight_decay=wd, shuffle=False, log_model=False))
    model = make_model_f64()
    torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
    with torch.no_grad():
        decayed = [p - lr * (p.grad + wd * p) for p in model.parameters()]
        plain = [p - lr * p.grad for p in model.parameters()]
    got = list(result.model.parameters())
    assert max((a - b).abs().max().item() for a, b in zip(got, decayed, strict=True)) < 1e-12
    assert max((a - b).abs().max().item() for a, b in zip(got, plain, strict=True)) > 1e-2
    adam = make_optimizer(TrainConfig(optimizer="adam", weight_decay=0.3),
                          torch.nn.Linear(2, 2).parameters())
    assert adam.param_groups[0]["weight_decay"] == 0.3


def _in_a_task() -> bool:
    from pyspark import TaskContext

    return TaskContext.get() is not None


def slow_to_build(seconds: float) -> torch.nn.Module:
    """FaultyMLP, built `seconds` late in a task (before the worker connects)."""
    if _in_a_task():
        time.sleep(seconds)
    return FaultyMLP()


def test_connect_timeout_bounds_the_wait_for_workers_to_connect(data):
    """Workers 2 s late: connect_timeout=1 fails the fit, 60 waits for them."""
    with pytest.raises(TrainingError, match=r"did not connect within 1s \(connect_timeout\)"):
        fit(data, partial(slow_to_build, 2.0), TrainConfig(**QUICK, connect_timeout=1.0))
    fit(data, partial(slow_to_build, 2.0), TrainConfig(**QUICK, connect_timeout=60.0))


class _Lingers:
    """Sleeps when collected in a task: the model dies as its task ends, after the last
    round, so the task ends that much later."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __del__(self) -> None:
        if _in_a_task():
            time.sleep(self.seconds)


class EndsLate(FaultyMLP):
    def __init__(self, seconds: float = 0.0) -> None:
        super().__init__()
        self.lingers = _Lingers(seconds)


def test_finish_timeout_bounds_the_wait_for_the_job_to_end(data):
    """Tasks ending 2 s after the last round: finish_timeout=1 fails the fit, 60 waits."""
    with pytest.raises(TrainingError, match=r"did not finish 1s after the last round "
                                            r"\(finish_timeout\)"):
        fit(data, partial(EndsLate, 2.0), TrainConfig(**QUICK, finish_timeout=1.0))
    fit(data, partial(EndsLate, 2.0), TrainConfig(**QUICK, finish_timeout=60.0))


def test_reconnect_timeout_bounds_a_workers_wait_for_a_lost_server(data, tmp_path):
    """The server is killed mid-fit and the driver, asking only every 60 s, would restart it
    far later: the workers give up after reconnect_timeout, and the fit fails then."""
    checkpoint = tmp_path / "parameter-server.npz"
    killer = threading.Thread(target=kill_server_after_a_checkpoint, args=(checkpoint,),
                              daemon=True)
    killer.start()
    config = TrainConfig(**{**QUICK, "epochs": 4}, mode="async", push_every=1,
                         eval_interval_s=60.0, ps_checkpoint_every=1,
                         checkpoint_dir=str(tmp_path), reconnect_timeout=1.0)
    with pytest.raises(TrainingError, match=r"could not connect to it within "
                                            r"reconnect_timeout=1s"):
        fit(data, partial(FaultyMLP, delay_s=0.05), config)
    killer.join(timeout=5)
    assert getattr(killer, "killed_s", None) is not None, "the server was not killed mid-fit"
    assert time.monotonic() - killer.killed_s < 15


def _certificate(name: str, key, issuer_name: str, issuer_key, *, ca: bool):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    def named(text):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])

    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(named(name))
               .issuer_name(named(issuer_name)).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=1))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem_files(folder, cert, key=None):
    from cryptography.hazmat.primitives import serialization

    folder.mkdir()
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        (folder / "key.pem").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
    return str(folder / "cert.pem"), str(folder / "key.pem")


def test_tls_ca_is_what_the_workers_trust(spark, tmp_path):
    """A certificate signed by a CA verifies against tls_ca; a self-signed one, which the
    workers would trust were tls_ca ignored, does not verify against another CA."""
    from cryptography.hazmat.primitives.asymmetric import ec

    ca_key, leaf_key, other_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    ca, _ = _pem_files(tmp_path / "ca", _certificate("test CA", ca_key, "test CA", ca_key,
                                                     ca=True))
    leaf, leaf_private = _pem_files(tmp_path / "leaf", _certificate(
        "127.0.0.1", leaf_key, "test CA", ca_key, ca=False), leaf_key)
    own, own_private = _pem_files(tmp_path / "own", _certificate(
        "127.0.0.1", other_key, "127.0.0.1", other_key, ca=True), other_key)
    x, y = make_data(40)
    df = frame(spark, x, y)
    signed = fit(df, make_model_f64, TrainConfig(**QUICK, tls_cert=leaf, tls_key=leaf_private,
                                                 tls_ca=ca))
    assert max_param_diff(signed.model, make_model_f64()) > 0
    with pytest.raises(TrainingError, match="certificate verify failed"):
        fit(df, make_model_f64, TrainConfig(**QUICK, tls_cert=own, tls_key=own_private,
                                            tls_ca=ca))


@pytest.mark.exact
def test_scoring_runs_on_the_device_asked_for(data):
    result = FitResult(model=FaultyMLP().eval(), run_id="", num_features=5, classify=True)
    with torch.no_grad():
        features = torch.from_numpy(np.stack(data.toPandas()["features"]).astype(np.float32))
        logits = result.model(features)
    scored = result.transform(data, device="cpu").toPandas()["prediction"].to_numpy()
    assert classes_agree(scored, logits, forward_tolerance(result.model, features))
    # no GPU here: device="cuda" must reach the executors and be refused there
    with pytest.raises(Exception, match=r"ClusterError: device='cuda' but Spark assigned this "
                                        r"task no GPU"):
        result.transform(data, device="cuda").collect()
    with pytest.raises(Exception, match=r"device='cuda' but Spark assigned"):
        data.select(result.predict_udf(device="cuda")("features")).collect()
    for bad in ("meta", "cuda:0"):
        with pytest.raises(ConfigError, match=f"device='{bad}' is not supported"):
            result.transform(data, device=bad)
        with pytest.raises(ConfigError, match=f"device='{bad}' is not supported"):
            result.predict_udf(device=bad)
