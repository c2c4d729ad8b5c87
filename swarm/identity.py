"""A peer's identity: an Ed25519 key pair, the peer id derived from its public key, and the
self-signed TLS certificate made from it.

Self-certifying: anyone holding a public key can check that it belongs to a peer id
(``owns``), so a peer's id cannot be claimed by another peer without its private key, and no
authority hands out ids. The certificate is a pure function of the key (Ed25519 signatures are
deterministic and every field is fixed), so a peer restarted with the same key serves the same
certificate and keeps the same fingerprint: a pinned join address stays valid.

Keys live in a file (PKCS#8 PEM, mode 0600): ``--key-file``, or ``peer.key`` in the
``--checkpoint`` directory; without either a peer makes a new key, and so a new id, every start.
No hand-rolled crypto: keys, signatures and certificates are the ``cryptography`` package's.
"""

from __future__ import annotations

import base64
import datetime
import functools
import hashlib
import os
import re
import tempfile
from dataclasses import dataclass, field

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.x509.oid import NameOID

__all__ = ["KeyFileError", "PeerKey", "peer_id_of", "owns", "verify", "b64", "unb64",
           "fingerprint_hex", "parse_fingerprint", "KEY_FILE", "ID_HEX"]

KEY_FILE = "peer.key"  # its name in a --checkpoint directory
ID_HEX = 32  # hex characters of a peer id: 128 bits of SHA-256 of the public key
PUBLIC_LEN = 32
SIGNATURE_LEN = 64
_ID_LABEL = b"swarm peer id v1\n"
_FP_RX = re.compile(r"^[0-9a-fA-F]{64}$")
_EPOCH = datetime.datetime(2000, 1, 1, tzinfo=datetime.timezone.utc)
_END = datetime.datetime(9999, 12, 31, 23, 59, 59, tzinfo=datetime.timezone.utc)


class KeyFileError(Exception):
    """A key file cannot be read, parsed or written (the message says which and why)."""


def b64(data: bytes) -> str:
    """URL-safe base64 without padding (header values, JSON)."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def unb64(text: str, length: int) -> bytes | None:
    """The bytes of ``b64`` text of exactly ``length`` bytes, or None for anything else."""
    if not isinstance(text, str) or len(text) != (4 * length + 2) // 3:
        return None
    try:
        out = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (ValueError, TypeError):
        return None
    return out if len(out) == length and b64(out) == text else None


def peer_id_of(public: bytes) -> str:
    """The peer id a public key stands for: 128 bits of SHA-256 over it, in hex."""
    return hashlib.sha256(_ID_LABEL + public).hexdigest()[:ID_HEX]


def owns(public: bytes, peer_id: str) -> bool:
    """True when ``public`` is the key of ``peer_id`` (a host group's rank ids included)."""
    if not isinstance(public, (bytes, bytearray)) or len(public) != PUBLIC_LEN or not isinstance(peer_id, str):
        return False
    head, sep, rank = peer_id.partition("~")
    if sep and not (rank.isdigit() and len(rank) <= 6 and str(int(rank)) == rank):
        return False
    return head == peer_id_of(bytes(public))


def verify(public: bytes, signature: bytes, data: bytes) -> bool:
    """An Ed25519 signature check that never raises (malformed keys and signatures are False)."""
    if not isinstance(public, (bytes, bytearray)) or len(public) != PUBLIC_LEN:
        return False
    if not isinstance(signature, (bytes, bytearray)) or len(signature) != SIGNATURE_LEN:
        return False
    try:
        _public_key(bytes(public)).verify(bytes(signature), data)
        return True
    except (InvalidSignature, ValueError):
        return False


@functools.lru_cache(maxsize=4096)
def _public_key(public: bytes) -> Ed25519PublicKey:
    """Parsed once per key: a swarm checks the same few keys over and over."""
    return Ed25519PublicKey.from_public_bytes(public)


def fingerprint_hex(cert_der: bytes) -> str:
    """A certificate's SHA-256 fingerprint, lowercase hex (the form of ``HOST:PORT#FP``)."""
    return hashlib.sha256(cert_der).hexdigest()


def parse_fingerprint(text: str) -> bytes:
    """The 32 bytes of a hex SHA-256 fingerprint (colons allowed, any case); ValueError otherwise."""
    t = text.replace(":", "").strip() if isinstance(text, str) else ""
    if not _FP_RX.match(t):
        raise ValueError(f"a certificate fingerprint is 64 hex digits (SHA-256), got {str(text)[:80]!r}")
    return bytes.fromhex(t)


@dataclass
class PeerKey:
    """One peer's key pair, and what follows from it: its id, its certificate."""

    private: Ed25519PrivateKey
    public: bytes = field(init=False)
    id: str = field(init=False)
    _cert: x509.Certificate | None = field(default=None, init=False, repr=False)
    _fingerprint: str = field(default="", init=False, repr=False)

    def __post_init__(self) -> None:
        self.public = self.private.public_key().public_bytes(serialization.Encoding.Raw,
                                                             serialization.PublicFormat.Raw)
        self.id = peer_id_of(self.public)

    def __repr__(self) -> str:  # never the private half
        return f"PeerKey(id={self.id})"

    # -- making and keeping keys ---------------------------------------------------------------
    @classmethod
    def generate(cls) -> "PeerKey":
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> "PeerKey":
        """A key from 32 bytes (tests, and a host group's ranks receiving their host's key)."""
        if len(seed) != 32:
            raise ValueError("an Ed25519 seed is 32 bytes")
        return cls(Ed25519PrivateKey.from_private_bytes(bytes(seed)))

    def seed(self) -> bytes:
        return self.private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                          serialization.NoEncryption())

    def private_pem(self) -> bytes:
        return self.private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption())

    @classmethod
    def load(cls, path: str) -> "PeerKey":
        try:
            with open(path, "rb") as f:
                data = f.read(1 << 16)
        except OSError as e:
            raise KeyFileError(f"cannot read the key file {path}: {e.strerror or e}") from None
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as e:
            raise KeyFileError(f"{path} is not an unencrypted PEM private key ({e})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise KeyFileError(f"{path} holds a {type(key).__name__.lstrip('_')}, not an Ed25519 key")
        return cls(key)

    @classmethod
    def load_or_create(cls, path: str) -> tuple["PeerKey", bool]:
        """The key in ``path``, or a new one written there (0600, atomically); (key, created)."""
        if os.path.exists(path):
            return cls.load(path), False
        key = cls.generate()
        key.save(path)
        return key, True

    def save(self, path: str) -> None:
        folder = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".peer-key-", dir=folder)
            try:
                os.fchmod(fd, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(self.private_pem())
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise
        except OSError as e:
            raise KeyFileError(f"cannot write the key file {path}: {e.strerror or e}") from None

    # -- signatures ----------------------------------------------------------------------------
    def sign(self, data: bytes) -> bytes:
        return self.private.sign(data)

    # -- the TLS certificate -------------------------------------------------------------------
    def certificate(self) -> x509.Certificate:
        """Self-signed, every field fixed: the same key always gives the same certificate."""
        if self._cert is None:
            name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"swarm peer {self.id}")])
            serial = int.from_bytes(hashlib.sha256(b"swarm cert serial v1\n" + self.public).digest()[:16], "big") >> 1
            self._cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(
                self.private.public_key()).serial_number(max(serial, 1)).not_valid_before(_EPOCH)
                .not_valid_after(_END).sign(self.private, None))
        return self._cert

    def cert_der(self) -> bytes:
        return self.certificate().public_bytes(serialization.Encoding.DER)

    def cert_pem(self) -> bytes:
        return self.certificate().public_bytes(serialization.Encoding.PEM)

    def fingerprint(self) -> str:
        """The certificate's SHA-256 fingerprint in hex: what clients pin (``HOST:PORT#FP``). Made
        once: the status document shows it every time it is built."""
        if not self._fingerprint:
            self._fingerprint = fingerprint_hex(self.cert_der())
        return self._fingerprint
