"""TLS for peer-to-peer links, without a certificate authority: each peer serves the self-signed
certificate of its own key (swarm/identity.py) and clients pin the certificate of the peer they call.

Where a pin comes from (docs/security.md): the receiver's signed member record (``tls``), the join
address (``HOST:PORT#FP``), or, for a first contact without one, the certificate the receiver
presents, accepted only once its reply proves it under the swarm secret (``auth.proof``).
"""

from __future__ import annotations

import asyncio
import os
import ssl
import tempfile

from . import identity

__all__ = ["server_context", "peek_certificate", "TLSError"]


class TLSError(Exception):
    """The TLS set-up failed (the message says why)."""


def server_context(key: identity.PeerKey) -> ssl.SSLContext:
    """A TLS 1.3 server context serving ``key``'s certificate (Ed25519)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    # ssl loads a certificate chain from files only: a private temporary directory, removed at once
    with tempfile.TemporaryDirectory(prefix="swarm-tls-") as d:
        os.chmod(d, 0o700)
        cert, pkey = os.path.join(d, "cert.pem"), os.path.join(d, "key.pem")
        fd = os.open(pkey, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key.private_pem())
        with open(cert, "wb") as f:
            f.write(key.cert_pem())
        try:
            ctx.load_cert_chain(cert, pkey)
        except ssl.SSLError as e:
            raise TLSError(f"this Python's OpenSSL cannot serve an Ed25519 certificate: {e}") from None
    return ctx


def _unverified() -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # what it presents is checked by the caller (pin or proof)
    return ctx


async def peek_certificate(host: str, port: int, timeout: float) -> bytes:
    """The DER certificate ``host:port`` presents (a TLS handshake, nothing sent). The caller then
    pins it for the real request and checks the reply's proof: a man in the middle could present
    its own certificate here, but could not prove it under the secret."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port, ssl=_unverified()), timeout)
    except ssl.SSLError as e:
        raise TLSError(f"TLS handshake with {host}:{port} failed ({e.reason or e}): does it run with the same --secret?") from None
    try:
        so = writer.get_extra_info("ssl_object")
        der = so.getpeercert(binary_form=True) if so is not None else None
    finally:
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), 1.0)
        except (OSError, asyncio.TimeoutError, ssl.SSLError):
            pass
    if not der:
        raise TLSError(f"{host}:{port} presented no certificate")
    return der
