"""Request authentication: every peer-to-peer request is signed by its sender's key (Ed25519,
swarm/identity.py) and, when the swarm has a secret, MACed under it; the signature names the
receiver, so a captured request cannot be replayed to another member.

Sans-I/O like the membership core: nothing here reads the clock, opens a socket or touches aiohttp;
callers pass ``now`` (wall-clock Unix seconds: the signer's and the verifier's clocks must agree
within ``skew`` seconds) and the bytes or their hash. See docs/security.md for the threat model.

A signed request carries these headers:

  X-Swarm-Timestamp  decimal Unix seconds (up to 3 decimals) when the request was signed
  X-Swarm-Nonce      16..64 characters of [A-Za-z0-9_-], fresh per request
  X-Swarm-From       the sender's peer id (derived from its key: ``identity.owns``)
  X-Swarm-Key        the sender's Ed25519 public key, URL-safe base64 (43 characters)
  X-Swarm-To         the receiver's peer id, or ``@HOST:PORT`` (the address dialled) for a first
                     contact (GET /v1/swarm, POST /v1/join), before the receiver's id is known
  X-Swarm-Signature  URL-safe base64 of Ed25519(key, canonical) (86 characters)
  X-Swarm-Mac        with a --secret only: lowercase hex HMAC-SHA256(K, canonical)

where canonical is the UTF-8 of "swarm-v2\n" METHOD "\n" PATH "\n" TIMESTAMP "\n" NONCE "\n"
FROM "\n" TO "\n" sha256hex(body). PATH is the request target as sent (path and query string,
percent-encoded as on the wire). K is not the secret itself but HMAC-SHA256(secret, "swarm request
key v1"); the status token (``status_token``) and the TLS proof key (``proof``) are derived the
same way under other labels, so a leaked status URL does not give the right to sign requests.
The MAC (cheap) is checked before the signature (about 160 us): an outsider without the secret
costs one HMAC.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import re
import secrets
import socket
import string
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from . import identity

TIMESTAMP = "X-Swarm-Timestamp"
NONCE = "X-Swarm-Nonce"
FROM = "X-Swarm-From"
KEY = "X-Swarm-Key"
TO = "X-Swarm-To"
SIGNATURE = "X-Swarm-Signature"
MAC = "X-Swarm-Mac"
PROOF = "X-Swarm-Proof"  # a first contact's reply: the receiver's certificate, proven under the secret
HEADERS = (TIMESTAMP, NONCE, FROM, KEY, TO, SIGNATURE)  # every signed request's (MAC: with a secret)

DEFAULT_SKEW = 30.0  # seconds a timestamp may be off (either way) from the verifier's clock
DEFAULT_MAX_NONCES = 1 << 17  # replay cache bound; ~1000 requests/s sustained with the default skew

_TS_RX = re.compile(r"^[0-9]{1,12}(\.[0-9]{1,3})?$")
_NONCE_RX = re.compile(r"^[A-Za-z0-9_-]{16,64}$")
_HEX64_RX = re.compile(r"^[0-9a-f]{64}$")
_ID_RX = re.compile(r"^[0-9a-f]{%d}(~[0-9]{1,6})?$" % identity.ID_HEX)
_TO_RX = re.compile(r"^(@[A-Za-z0-9.:\[\]_-]{1,260}|[0-9a-f]{%d}(~[0-9]{1,6})?)$" % identity.ID_HEX)


def _derive(secret: str, label: bytes) -> bytes:
    if not isinstance(secret, str) or not secret:
        raise ValueError("the secret must be a non-empty string")
    return hmac.new(secret.encode("utf-8"), label, hashlib.sha256).digest()


def request_key(secret: str) -> bytes:
    return _derive(secret, b"swarm request key v1")


def status_token(secret: str) -> str:
    """The token that opens the status routes (``?token=``, ``Authorization: Bearer``, cookie)."""
    return _derive(secret, b"swarm status token v1").hex()[:40]


def proof(secret: str, fingerprint: str, nonce: str) -> str:
    """What a first contact's reply carries (``X-Swarm-Proof``) when the joiner did not pin the
    receiver's certificate: a MAC under the secret over the certificate's fingerprint (hex) and the
    request's nonce. A man in the middle without the secret cannot make it for its own certificate;
    the nonce stops it replaying one it saw."""
    key = _derive(secret, b"swarm tls proof key v1")
    return hmac.new(key, f"swarm tls proof v1\n{fingerprint}\n{nonce}".encode("utf-8"), hashlib.sha256).hexdigest()


def proof_ok(secret: str, fingerprint: str, nonce: str, presented: str | None) -> bool:
    if not isinstance(presented, str) or not _HEX64_RX.match(presented):
        return False
    return hmac.compare_digest(proof(secret, fingerprint, nonce).encode("ascii"), presented.encode("ascii"))


_SECRET_ALPHABET = string.ascii_letters + string.digits


def generate_secret() -> str:
    """43 letters and digits (256 bits). No "-" or "_": a URL-safe token starts with "-" one time in
    64, and ``--secret -x...`` in the printed join command would read as a flag."""
    return "".join(secrets.choice(_SECRET_ALPHABET) for _ in range(43))


def new_nonce() -> str:
    return secrets.token_urlsafe(18)  # 24 characters, 144 bits


def body_hash(body: bytes | None) -> str:
    return hashlib.sha256(body or b"").hexdigest()


def format_timestamp(now: float) -> str:
    return f"{now:.3f}"


def address_name(host: str, port: int) -> str:
    """The ``X-Swarm-To`` of a first contact: the address as dialled (IPv6 in brackets)."""
    h = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"@{h.lower()}:{int(port)}"


def canonical(method: str, path: str, body_sha256: str, timestamp: str, nonce: str, sender: str,
              receiver: str) -> bytes:
    return "\n".join(("swarm-v2", method.upper(), path, timestamp, nonce, sender, receiver,
                      body_sha256)).encode("utf-8")


def _mac(key: bytes, text: bytes) -> str:
    return hmac.new(key, text, hashlib.sha256).hexdigest()


@dataclass
class Names:
    """How requests may name this peer (``X-Swarm-To``), and what proves its certificate.

    Every route wants our id. The first-contact routes (a joiner does not know our id yet) also take
    an address we know as ours: the advertised one, the one we listen on, and, when we listen on a
    wildcard or loopback address, the loopback names and this machine's name. A request signed for
    another member's address is refused, so it cannot be replayed to us."""

    peer_id: str
    tls: bool = False
    fingerprint: str = ""  # our certificate's SHA-256, hex
    proof_secret: str | None = None  # with TLS: the secret a first contact's reply proof is made with
    own: frozenset[str] = field(init=False)
    first_contact: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        self.own = self.first_contact = frozenset([self.peer_id])

    def set_addresses(self, bind_host: str, port: int, adv_host: str, adv_port: int) -> None:
        names = {address_name(adv_host, adv_port), address_name(bind_host or "0.0.0.0", port)}
        if bind_host in ("", "0.0.0.0", "::") or bind_host.startswith("127.") or bind_host in ("localhost", "::1"):
            hosts = {"127.0.0.1", "localhost", "::1"}
            if bind_host in ("", "0.0.0.0", "::"):
                try:
                    hosts.add(socket.gethostname())
                    hosts.update(a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None))
                except OSError:
                    pass
            names.update(address_name(h, port) for h in hosts)
        self.first_contact = frozenset([self.peer_id, *names])


class Signer:
    """Client side: the peer's key and id, and the swarm's derived MAC key if it has a secret."""

    def __init__(self, key: identity.PeerKey, peer_id: str | None = None, secret: str | None = None):
        self.key = key
        self.peer_id = peer_id or key.id
        if not identity.owns(key.public, self.peer_id):
            raise ValueError(f"peer id {self.peer_id!r} is not this key's")
        self._public = identity.b64(key.public)
        self._mac_key = request_key(secret) if secret else None

    def headers(self, method: str, path: str, body: bytes | None, now: float, to: str) -> dict[str, str]:
        ts, nonce = format_timestamp(now), new_nonce()
        text = canonical(method, path, body_hash(body), ts, nonce, self.peer_id, to)
        out = {TIMESTAMP: ts, NONCE: nonce, FROM: self.peer_id, KEY: self._public, TO: to,
               SIGNATURE: identity.b64(self.key.sign(text))}
        if self._mac_key is not None:
            out[MAC] = _mac(self._mac_key, text)
        return out


class Verifier:
    """Server side: checks a request's MAC (with a secret; constant time), its sender's signature
    and key, that it names this peer as its receiver, refuses timestamps more than ``skew`` seconds
    from ``now`` and nonces seen before.

    The replay cache holds each accepted nonce until its timestamp goes stale (timestamp + skew):
    after that a replay is refused as stale anyway, so the nonce can be forgotten. It never holds
    more than ``max_nonces`` entries; when full new requests are refused: it fails closed. Only
    requests whose signature verified are recorded, so a stranger cannot fill it.
    """

    def __init__(self, secret: str | None, *, skew: float = DEFAULT_SKEW, max_nonces: int = DEFAULT_MAX_NONCES):
        if skew <= 0 or max_nonces < 1:
            raise ValueError("skew must be > 0 and max_nonces >= 1")
        self._mac_key = request_key(secret) if secret else None
        self.skew = float(skew)
        self.max_nonces = int(max_nonces)
        self._seen: dict[str, float] = {}  # nonce -> when it may be forgotten
        self._expiry: list[tuple[float, str]] = []  # heap of the same
        self.refused = 0
        self.accepted = 0

    def __len__(self) -> int:
        return len(self._seen)

    def check_headers(self, headers: Mapping[str, str], now: float, receivers: Iterable[str]) -> bool:
        """Cheap checks that need no body: every header well-formed, the timestamp fresh, the nonce
        new, the receiver one of ``receivers`` (this peer's names). A request failing these can be
        refused before its body is read (and counts as refused)."""
        ok = self._check_headers(headers, now, receivers)
        if not ok:
            self.refused += 1
        return ok

    def _check_headers(self, headers: Mapping[str, str], now: float, receivers: Iterable[str]) -> bool:
        self._forget(now)
        values = [headers.get(h) for h in HEADERS]
        if not all(isinstance(v, str) for v in values):
            return False
        ts, nonce, sender, key, to, sig = values
        if not (_TS_RX.match(ts) and _NONCE_RX.match(nonce) and _ID_RX.match(sender) and _TO_RX.match(to)):
            return False
        if len(key) != 43 or len(sig) != 86:
            return False
        if self._mac_key is not None and not (isinstance(headers.get(MAC), str) and _HEX64_RX.match(headers[MAC])):
            return False
        if abs(now - float(ts)) > self.skew or to not in receivers:
            return False
        return nonce not in self._seen

    def verify(self, method: str, path: str, body_sha256: str, headers: Mapping[str, str], now: float,
               receivers: Iterable[str]) -> str | None:
        """The sender's peer id (and the nonce is recorded) when the request is authentic, fresh,
        new and meant for us; None otherwise."""
        sender = self._verify(method, path, body_sha256, headers, now, receivers)
        if sender is not None:
            self.accepted += 1
        else:
            self.refused += 1
        return sender

    def _verify(self, method: str, path: str, body_sha256: str, headers: Mapping[str, str], now: float,
                receivers: Iterable[str]) -> str | None:
        if not self._check_headers(headers, now, receivers) or not _HEX64_RX.match(body_sha256 or ""):
            return None
        ts, nonce, sender, key, to, sig = (headers[h] for h in HEADERS)
        text = canonical(method, path, body_sha256, ts, nonce, sender, to)
        if self._mac_key is not None and not hmac.compare_digest(_mac(self._mac_key, text).encode("ascii"),
                                                                 headers[MAC].encode("ascii")):
            return None
        public, signature = identity.unb64(key, identity.PUBLIC_LEN), identity.unb64(sig, identity.SIGNATURE_LEN)
        if public is None or signature is None or not identity.owns(public, sender):
            return None
        if not identity.verify(public, signature, text):
            return None
        if len(self._seen) >= self.max_nonces:
            return None  # fail closed rather than forget a nonce that could still be replayed
        expires = float(ts) + self.skew
        self._seen[nonce] = expires
        heapq.heappush(self._expiry, (expires, nonce))
        return sender

    def _forget(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] < now:
            _, nonce = heapq.heappop(self._expiry)
            self._seen.pop(nonce, None)


def token_ok(token: str | None, secret_token: str) -> bool:
    """Constant-time comparison of a presented status token."""
    if not isinstance(token, str) or not token or len(token) > 256:
        return False
    return hmac.compare_digest(token.encode("utf-8", "replace"), secret_token.encode("ascii"))
