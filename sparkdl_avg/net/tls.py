"""TLS material for the two servers: a server's context from its certificate and key, a
client's from the PEM text that verifies the server (a CA, or a self-signed certificate
itself). PEM travels to the executors as text: files on the driver are not on them."""

from __future__ import annotations

import ssl
from pathlib import Path

from sparkdl_avg._errors import ConfigError


def read_pem(path: str, what: str) -> str:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{what}={path!r} cannot be read: {exc}") from None
    if "-----BEGIN" not in text:
        raise ConfigError(f"{what}={path!r} holds no PEM")
    return text


def server_context(cert: str, key: str) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"tls_cert={cert!r} with tls_key={key!r} cannot be loaded: "
                          f"{exc}") from None
    return context


def client_context(pem: str) -> ssl.SSLContext:
    return ssl.create_default_context(cadata=pem)
