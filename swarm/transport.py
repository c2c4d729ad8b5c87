"""Outgoing HTTP: one aiohttp session per peer, a timeout on every call, bounded reply sizes.

Thin on purpose: it moves bytes and counts them; what the bytes mean is decided elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp
from yarl import URL

from .auth import Signer
from .bodies import MSGPACK_TYPE, pack, unpack_map


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
    sent: dict[str, int] = field(default_factory=dict)  # by kind: "grads", "control", "state"
    received: dict[str, int] = field(default_factory=dict)

    def add_sent(self, kind: str, n: int) -> None:
        self.sent[kind] = self.sent.get(kind, 0) + n

    def add_received(self, kind: str, n: int) -> None:
        self.received[kind] = self.received.get(kind, 0) + n


class Transport:
    def __init__(self, counts: ByteCounts, headers: dict[str, str] | None = None):
        self.counts = counts
        self.headers = headers or {}
        self.signer: Signer | None = None  # set when the swarm has a --secret: every request is signed
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=30, connect=5),
                connector=aiohttp.TCPConnector(limit=64, limit_per_host=8),
                headers=self.headers,
                cookie_jar=aiohttp.DummyCookieJar(),  # peers set no cookies; filtering them costs per request
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(self, method: str, url: str, *, body: bytes | None = None, timeout: float,
                      content_type: str = MSGPACK_TYPE, headers: dict[str, str] | None = None,
                      reply_limit: int = 1 << 20, kind: str = "control", reply_kind: str | None = None) -> bytes:
        """One call; returns the reply body (at most ``reply_limit`` bytes) or raises PeerUnreachable.

        The body's bytes are counted as ``kind``, the reply's as ``reply_kind`` (default: the same)."""
        addr = url.split("/v1/")[0]
        hdrs = {"Content-Type": content_type, **(headers or {})} if body is not None else dict(headers or {})
        try:
            if self.signer is not None:  # over the request target exactly as aiohttp sends it
                hdrs.update(self.signer.headers(method, URL(url).raw_path_qs, body, time.time()))
            async with self.session.request(method, url, data=body, headers=hdrs,
                                            timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                if body is not None:
                    self.counts.add_sent(kind, len(body))
                if r.content_length is not None and r.content_length > reply_limit:
                    raise PeerUnreachable(addr, f"reply of {r.content_length} bytes is over {reply_limit}", r.status)
                data = bytearray()
                async for chunk in r.content.iter_chunked(1 << 16):
                    data += chunk
                    if len(data) > reply_limit:
                        raise PeerUnreachable(addr, f"reply over {reply_limit} bytes", r.status)
                self.counts.add_received(reply_kind or kind, len(data))
                if r.status >= 400:
                    reason, code, ours = _reason(data)
                    raise PeerUnreachable(addr, reason or f"HTTP {r.status}", r.status, code, foreign=not ours)
                return bytes(data)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
            # ValueError: an address no URL parser accepts (a member record is remote input)
            raise PeerUnreachable(addr, f"{e.__class__.__name__}: {e}" if str(e) else e.__class__.__name__) from None

    async def call(self, addr: str, path: str, msg: dict, *, timeout: float, kind: str = "control",
                   reply_limit: int = 1 << 20) -> dict:
        """POST a msgpack map, return the msgpack map of the reply (at most ``reply_limit`` bytes)."""
        data = await self.request("POST", addr + path, body=pack(msg), timeout=timeout, kind=kind,
                                  reply_limit=reply_limit)
        try:
            return unpack_map(data, reply_limit)
        except Exception as e:
            raise PeerUnreachable(addr, f"bad reply: {e}") from None


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
