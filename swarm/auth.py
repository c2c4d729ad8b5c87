"""Request authentication: an HMAC-SHA256 over each peer-to-peer request, and its verification.

Sans-I/O like the membership core: nothing here reads the clock, opens a socket or touches aiohttp;
callers pass ``now`` (wall-clock Unix seconds: the signer's and the verifier's clocks must agree
within ``skew`` seconds) and the bytes or their hash. See docs/security.md for the threat model.

A signed request carries three headers:

  X-Swarm-Timestamp  decimal Unix seconds (up to 3 decimals) when the request was signed
  X-Swarm-Nonce      16..64 characters of [A-Za-z0-9_-], fresh per request
  X-Swarm-Signature  lowercase hex HMAC-SHA256(key, canonical) where canonical is the UTF-8 of
                     "swarm-v1\\n" METHOD "\\n" PATH "\\n" TIMESTAMP "\\n" NONCE "\\n" sha256hex(body)

PATH is the request target as sent (path and query string, percent-encoded as on the wire). The
key is not the secret itself but HMAC-SHA256(secret, "swarm request key v1"); the status token
(``status_token``) is derived the same way under another label, so a leaked status URL does not
give the right to sign requests.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import re
import secrets
from typing import Mapping

TIMESTAMP = "X-Swarm-Timestamp"
NONCE = "X-Swarm-Nonce"
SIGNATURE = "X-Swarm-Signature"
HEADERS = (TIMESTAMP, NONCE, SIGNATURE)

DEFAULT_SKEW = 30.0  # seconds a timestamp may be off (either way) from the verifier's clock
DEFAULT_MAX_NONCES = 1 << 17  # replay cache bound; ~1000 requests/s sustained with the default skew

_TS_RX = re.compile(r"^[0-9]{1,12}(\.[0-9]{1,3})?$")
_NONCE_RX = re.compile(r"^[A-Za-z0-9_-]{16,64}$")
_SIG_RX = re.compile(r"^[0-9a-f]{64}$")
_HASH_RX = _SIG_RX


def _derive(secret: str, label: bytes) -> bytes:
    if not isinstance(secret, str) or not secret:
        raise ValueError("the secret must be a non-empty string")
    return hmac.new(secret.encode("utf-8"), label, hashlib.sha256).digest()


def request_key(secret: str) -> bytes:
    return _derive(secret, b"swarm request key v1")


def status_token(secret: str) -> str:
    """The token that opens the status routes (``?token=``, ``Authorization: Bearer``, cookie)."""
    return _derive(secret, b"swarm status token v1").hex()[:40]


def generate_secret() -> str:
    return secrets.token_urlsafe(32)


def new_nonce() -> str:
    return secrets.token_urlsafe(18)  # 24 characters, 144 bits


def body_hash(body: bytes | None) -> str:
    return hashlib.sha256(body or b"").hexdigest()


def format_timestamp(now: float) -> str:
    return f"{now:.3f}"


def canonical(method: str, path: str, body_sha256: str, timestamp: str, nonce: str) -> bytes:
    return "\n".join(("swarm-v1", method.upper(), path, timestamp, nonce, body_sha256)).encode("utf-8")


def _mac(key: bytes, method: str, path: str, body_sha256: str, timestamp: str, nonce: str) -> str:
    return hmac.new(key, canonical(method, path, body_sha256, timestamp, nonce), hashlib.sha256).hexdigest()


def sign(secret: str | bytes, method: str, path: str, body_sha256: str, timestamp: str, nonce: str) -> dict[str, str]:
    """The three header values for one request. ``secret`` is the swarm secret, or (bytes) a key
    from ``request_key``; ``timestamp`` from ``format_timestamp``; ``nonce`` from ``new_nonce``."""
    key = secret if isinstance(secret, bytes) else request_key(secret)
    return {TIMESTAMP: timestamp, NONCE: nonce, SIGNATURE: _mac(key, method, path, body_sha256, timestamp, nonce)}


class Signer:
    """Client side: holds the derived key, makes a fresh nonce per request."""

    def __init__(self, secret: str):
        self._key = request_key(secret)

    def headers(self, method: str, path: str, body: bytes | None, now: float) -> dict[str, str]:
        return sign(self._key, method, path, body_hash(body), format_timestamp(now), new_nonce())


class Verifier:
    """Server side: checks a request's signature in constant time, refuses timestamps more than
    ``skew`` seconds from ``now`` and nonces seen before.

    The replay cache holds each accepted nonce until its timestamp goes stale (timestamp + skew):
    after that a replay is refused as stale anyway, so the nonce can be forgotten. It never holds
    more than ``max_nonces`` entries; when full (more than max_nonces signed requests within one
    window, which only a secret holder can cause) new requests are refused: it fails closed.
    Only requests whose signature verified are recorded, so a stranger cannot fill it.
    """

    def __init__(self, secret: str, *, skew: float = DEFAULT_SKEW, max_nonces: int = DEFAULT_MAX_NONCES):
        if skew <= 0 or max_nonces < 1:
            raise ValueError("skew must be > 0 and max_nonces >= 1")
        self._key = request_key(secret)
        self.skew = float(skew)
        self.max_nonces = int(max_nonces)
        self._seen: dict[str, float] = {}  # nonce -> when it may be forgotten
        self._expiry: list[tuple[float, str]] = []  # heap of the same
        self.refused = 0
        self.accepted = 0

    def __len__(self) -> int:
        return len(self._seen)

    def check_headers(self, headers: Mapping[str, str], now: float) -> bool:
        """Cheap checks that need no body: all three headers well-formed, timestamp fresh, nonce new.
        A request failing these can be refused before its body is read."""
        self._forget(now)
        ts, nonce, sig = (headers.get(h) for h in HEADERS)
        if not (isinstance(ts, str) and isinstance(nonce, str) and isinstance(sig, str)):
            return False
        if not (_TS_RX.match(ts) and _NONCE_RX.match(nonce) and _SIG_RX.match(sig)):
            return False
        if abs(now - float(ts)) > self.skew:
            return False
        return nonce not in self._seen

    def verify(self, method: str, path: str, body_sha256: str, headers: Mapping[str, str], now: float) -> bool:
        """True (and the nonce is recorded) when the request is authentic, fresh and new."""
        ok = self._verify(method, path, body_sha256, headers, now)
        if ok:
            self.accepted += 1
        else:
            self.refused += 1
        return ok

    def _verify(self, method: str, path: str, body_sha256: str, headers: Mapping[str, str], now: float) -> bool:
        if not self.check_headers(headers, now) or not _HASH_RX.match(body_sha256 or ""):
            return False
        ts, nonce, sig = (headers[h] for h in HEADERS)
        want = _mac(self._key, method, path, body_sha256, ts, nonce)
        if not hmac.compare_digest(want.encode("ascii"), sig.encode("ascii")):
            return False
        if len(self._seen) >= self.max_nonces:
            return False  # fail closed rather than forget a nonce that could still be replayed
        expires = float(ts) + self.skew
        self._seen[nonce] = expires
        heapq.heappush(self._expiry, (expires, nonce))
        return True

    def _forget(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] < now:
            _, nonce = heapq.heappop(self._expiry)
            self._seen.pop(nonce, None)


def token_ok(token: str | None, secret_token: str) -> bool:
    """Constant-time comparison of a presented status token."""
    if not isinstance(token, str) or not token or len(token) > 256:
        return False
    return hmac.compare_digest(token.encode("utf-8", "replace"), secret_token.encode("ascii"))
