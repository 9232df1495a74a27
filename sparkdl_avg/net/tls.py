"""TLS material for the two servers: a server's context from its certificate and key, a
client's from the PEM text that verifies the server (a CA, or a self-signed certificate
itself). PEM travels to the executors as text: files on the driver are not on them."""

from __future__ import annotations

import re
import ssl
from pathlib import Path

from sparkdl_avg._errors import ConfigError


def read_certificates(path: str, what: str) -> str:
    """The CERTIFICATE blocks of a PEM file, and nothing else: a file that also holds the
    private key must not send the key to the executors."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{what}={path!r} cannot be read: {exc}") from None
    blocks = re.findall(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", text,
                        flags=re.DOTALL)
    if not blocks:
        raise ConfigError(f"{what}={path!r} holds no PEM certificate")
    return "\n".join(blocks) + "\n"


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
