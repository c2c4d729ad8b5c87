"""Outgoing HTTP: one aiohttp session per peer, a timeout on every call, bounded reply sizes.

Thin on purpose: it moves bytes and counts them; what the bytes mean is decided elsewhere. Every
request is signed for its receiver (swarm/auth.py); over TLS (a swarm with a secret) the receiver's
certificate is pinned (swarm/tls.py), so its replies are authentic too.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Callable

import aiohttp
from yarl import URL

from . import auth, encoding, tls
from .auth import Signer
from .bodies import INLINE_BYTES, MSGPACK_TYPE, pack, unpack_map


class PeerUnreachable(Exception):
    """A call to another peer failed (refused, timed out, or answered with an error status)."""

    def __init__(self, addr: str, reason: str, status: int | None = None, code: str = "", foreign: bool = False):
        super().__init__(f"{addr}: {reason}")
        self.addr = addr
        self.reason = reason
        self.status = status
        self.code = code  # the peer's machine-readable refusal code, if it sent one
        # the error reply was not a swarm peer's ({"error": ...} JSON): another server answered
        self.foreign = foreign


@dataclass
class ByteCounts:
    """Body bytes as they crossed the wire (compressed where they were), by kind; and, over all
    kinds, what those bodies were before compression (``plain_*``: swarm/encoding.py)."""

    sent: dict[str, int] = field(default_factory=dict)  # by kind: "grads", "control", "state"
    received: dict[str, int] = field(default_factory=dict)
    plain_sent: int = 0
    plain_received: int = 0

    def add_sent(self, kind: str, n: int, plain: int | None = None) -> None:
        self.sent[kind] = self.sent.get(kind, 0) + n
        self.plain_sent += n if plain is None else plain

    def add_received(self, kind: str, n: int, plain: int | None = None) -> None:
        self.received[kind] = self.received.get(kind, 0) + n
        self.plain_received += n if plain is None else plain

    def wire(self) -> dict[str, int]:
        """All bodies sent and received, on the wire and before compression (the status's
        ``wire_encoding``)."""
        return {"sent": sum(self.sent.values()), "sent_plain": self.plain_sent,
                "received": sum(self.received.values()), "received_plain": self.plain_received}


class Transport:
    def __init__(self, counts: ByteCounts, headers: dict[str, str] | None = None, compress: bool = True):
        self.counts = counts
        # every reply may come zstd-compressed: this side decompresses it (within the reply's limit)
        self.headers = {"Accept-Encoding": encoding.ZSTD, **(headers or {})}
        self.compress = compress  # request bodies compressed where it pays (--wire-compression)
        self.signer: Signer | None = None  # the peer's key: every request is signed (set at start)
        self.secret: str | None = None  # checks a first contact's certificate proof (TLS)
        # peer id -> the SHA-256 fingerprint (hex) of its certificate, from its signed member record
        self.pin_of: Callable[[str], str | None] = lambda peer_id: None
        self._session: aiohttp.ClientSession | None = None
        self._pins: dict[bytes, aiohttp.Fingerprint] = {}

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=30, connect=5),
                connector=aiohttp.TCPConnector(limit=64, limit_per_host=8),
                headers=self.headers,
                cookie_jar=aiohttp.DummyCookieJar(),  # peers set no cookies; filtering them costs per request
                auto_decompress=False,  # replies are decompressed here, within their limit (encoding.py)
            )
        return self._session

    def _pinned(self, fp: bytes) -> aiohttp.Fingerprint:
        """One Fingerprint object per certificate: the connection pool is keyed by it (by identity),
        so a new object per request would make a new connection, and a TLS handshake, every time."""
        pin = self._pins.get(fp)
        if pin is None:
            if len(self._pins) >= 4096:
                self._pins.clear()
            pin = self._pins[fp] = aiohttp.Fingerprint(fp)
        return pin

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(self, method: str, url: str, *, to: str, body: bytes | None = None, timeout: float,
                      content_type: str = MSGPACK_TYPE, headers: dict[str, str] | None = None,
                      reply_limit: int = 1 << 20, kind: str = "control", reply_kind: str | None = None,
                      pin: bytes | None = None, content_encoding: str | None = None,
                      plain_bytes: int | None = None) -> bytes:
        """One call to the peer ``to`` (its id, or ``@HOST:PORT`` for a first contact: auth.address_name);
        returns the reply body (at most ``reply_limit`` bytes) or raises PeerUnreachable.

        Over https the receiver's certificate must match ``pin`` or the fingerprint its member record
        carries; a first contact without either pins what the receiver presents and requires the
        reply to prove it under the secret. The body's bytes are counted as ``kind``, the reply's as
        ``reply_kind`` (default: the same), as they cross the wire.

        The body goes zstd-compressed where that pays (``compress``: swarm/encoding.py), unless it
        already is in ``content_encoding`` (of ``plain_bytes`` before: a payload sent to several
        peers is compressed once); a compressed reply is decompressed within ``reply_limit``."""
        addr = url.split("/v1/")[0]
        hdrs = {"Content-Type": content_type, **(headers or {})} if body is not None else dict(headers or {})
        plain = 0 if body is None else len(body)
        if content_encoding is not None:
            hdrs["Content-Encoding"] = content_encoding
            plain = plain if plain_bytes is None else plain_bytes
        elif body is not None and self.compress:
            # (on the loop up to INLINE_BYTES: ~0.1 ms for 64 KB, about what a thread hop costs)
            body, enc = encoding.compress(body) if plain <= INLINE_BYTES else await asyncio.to_thread(encoding.compress, body)
            if enc is not None:
                hdrs["Content-Encoding"] = enc
        proven: str | None = None  # the fingerprint (hex) a first contact's reply must prove
        try:
            target = URL(url)
            ssl_arg: aiohttp.Fingerprint | bool = True
            if target.scheme == "https":
                fp = pin if pin is not None else (None if to.startswith("@") else _hex_pin(self.pin_of(to)))
                if fp is None:
                    if not (to.startswith("@") and self.secret):
                        raise PeerUnreachable(addr, f"no certificate is known for peer {to[:16]}", code="no-pin")
                    der = await tls.peek_certificate(target.host or "", target.port or 443, min(timeout, 5.0))
                    fp = hashlib.sha256(der).digest()
                    proven = fp.hex()
                ssl_arg = self._pinned(fp)
            if self.signer is not None:  # over the request target exactly as aiohttp sends it
                hdrs.update(self.signer.headers(method, target.raw_path_qs, body, time.time(), to))
            async with self.session.request(method, url, data=body, headers=hdrs, ssl=ssl_arg,
                                            timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                if body is not None:
                    self.counts.add_sent(kind, len(body), plain)
                if r.content_length is not None and r.content_length > reply_limit:
                    raise PeerUnreachable(addr, f"reply of {r.content_length} bytes is over {reply_limit}", r.status)
                data = bytearray()
                async for chunk in r.content.iter_chunked(1 << 16):
                    data += chunk
                    if len(data) > reply_limit:
                        raise PeerUnreachable(addr, f"reply over {reply_limit} bytes", r.status)
                wire = len(data)
                enc = r.headers.get("Content-Encoding")
                if enc is not None:
                    try:
                        data = (encoding.decompress(bytes(data), enc, reply_limit) if wire <= INLINE_BYTES
                                else await asyncio.to_thread(encoding.decompress, bytes(data), enc, reply_limit))
                    except encoding.EncodingError as e:
                        self.counts.add_received(reply_kind or kind, wire)
                        raise PeerUnreachable(addr, f"reply: {e.reason}", r.status, code="encoding") from None
                self.counts.add_received(reply_kind or kind, wire, len(data))
                if r.status >= 400:  # (an unproven refusal can only make us give up, never change state)
                    reason, code, ours = _reason(data)
                    raise PeerUnreachable(addr, reason or f"HTTP {r.status}", r.status, code, foreign=not ours)
                if proven is not None and not auth.proof_ok(self.secret, proven, hdrs[auth.NONCE],
                                                            r.headers.get(auth.PROOF)):
                    raise PeerUnreachable(addr, f"{addr} did not prove its certificate (sha256 {proven[:16]}...) under "
                                          "the swarm secret: a man in the middle, or a peer with another --secret",
                                          code="proof")
                return bytes(data)
        except aiohttp.ServerFingerprintMismatch as e:
            raise PeerUnreachable(addr, f"the certificate of {addr} has fingerprint {e.got.hex()}, not the pinned "
                                  f"{e.expected.hex()}", code="fingerprint") from None
        except tls.TLSError as e:
            raise PeerUnreachable(addr, str(e), code="tls") from None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
            # ValueError: an address no URL parser accepts (a member record is remote input)
            raise PeerUnreachable(addr, f"{e.__class__.__name__}: {e}" if str(e) else e.__class__.__name__) from None

    async def call(self, addr: str, path: str, msg: dict, *, to: str, timeout: float, kind: str = "control",
                   reply_limit: int = 1 << 20, pin: bytes | None = None) -> dict:
        """POST a msgpack map to the peer ``to`` at ``addr``, return the msgpack map of the reply (at
        most ``reply_limit`` bytes)."""
        data = await self.request("POST", addr + path, to=to, body=pack(msg), timeout=timeout, kind=kind,
                                  reply_limit=reply_limit, pin=pin)
        try:
            return unpack_map(data, reply_limit)
        except Exception as e:
            raise PeerUnreachable(addr, f"bad reply: {e}") from None


def _hex_pin(fp: str | None) -> bytes | None:
    try:
        return bytes.fromhex(fp) if fp else None
    except ValueError:
        return None


def _reason(data: bytes) -> tuple[str, str, bool]:
    """(reason, code, True) of a swarm peer's JSON error reply; the raw text's first line, no code and
    False for anything else (another server's error page)."""
    try:
        obj = json.loads(data[:4096])
    except ValueError:
        obj = None
    if not isinstance(obj, dict) or "error" not in obj:
        first = data[:200].decode("utf-8", "replace").strip().splitlines()
        return (first[0][:120] if first else ""), "", False
    return str(obj.get("error", ""))[:300], str(obj.get("code", ""))[:40], True
