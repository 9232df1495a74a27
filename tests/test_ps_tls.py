"""TLS on the parameter server: a client that trusts the certificate talks; one that does not
is refused before any byte of the protocol."""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import time

import numpy as np
import pytest

from sparkdl_avg.ps.client import PSClient
from sparkdl_avg.ps.server import DRIVER, ParameterServer
from sparkdl_avg.ps.settings import ServerSettings

SECRET = os.urandom(32)


def self_signed(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    (tmp_path / "cert.pem").write_bytes(cert_pem)
    (tmp_path / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return tmp_path / "cert.pem", tmp_path / "key.pem", cert_pem.decode()


def test_tls_server_serves_trusting_clients_and_refuses_others(tmp_path):
    cert, key, pem = self_signed(tmp_path)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    server = ParameterServer(ServerSettings(timeout=10), secret=SECRET, tls=tls)
    with server:
        with PSClient(server.address, secret=SECRET, worker=DRIVER, numel=2,
                      dtype=np.float32, timeout=10, tls_ca_pem=pem) as driver:
            driver.init(np.array([1.0, 2.0], np.float32))
            driver.pull()
            assert driver.params.tolist() == [1.0, 2.0]
        with pytest.raises(ssl.SSLError):  # does not trust the certificate
            PSClient(server.address, secret=SECRET, worker=0, numel=2, dtype=np.float32,
                     timeout=10, tls_ca_pem=_other_ca(tmp_path))
        with pytest.raises(OSError):  # speaks plain TCP to a TLS server
            PSClient(server.address, secret=SECRET, worker=0, numel=2, dtype=np.float32,
                     timeout=3)
        deadline = time.monotonic() + 5  # the server counts on its own threads
        while server.stats()["refused"].get("auth", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.stats()["refused"]["auth"] == 2


def _other_ca(tmp_path) -> str:
    other = tmp_path / "other"
    other.mkdir()
    return self_signed(other)[2]
