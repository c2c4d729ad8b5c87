"""Small, strict helpers for bytes that cross the network: bounded body reads and msgpack.

Every body is hostile until proven otherwise: sizes are checked before and while reading, msgpack is
decoded with buffer and container limits, and only plain maps come out.
"""

from __future__ import annotations

from typing import Any

import msgpack
from aiohttp import web

PROTOCOL_VERSION = 4  # 4: zstd bodies (encoding.py); 3: signed requests and member records, TLS; 2: task fingerprint
MSGPACK_TYPE = "application/msgpack"
# A body up to this size is decoded on the event loop (~0.1-0.4 ms), not on a helper thread: a
# thread hop (submit, wake, call back into the loop) costs about as much, and a step makes dozens.
INLINE_BYTES = 1 << 18


class BadRequest(Exception):
    """Input that must be answered with a 4xx; ``status`` and ``reason`` go to the client."""

    def __init__(self, reason: str, status: int = 400, code: str = ""):
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.code = code  # machine-readable, for the few refusals a sender reacts to


# request key: the body, once a middleware (authentication) has read it
BODY = web.RequestKey("swarm_body", bytes) if hasattr(web, "RequestKey") else "swarm.body"
# the body's size as it came over the wire (compressed, when it was: swarm/encoding.py)
WIRE_BYTES = web.RequestKey("swarm_wire_bytes", int) if hasattr(web, "RequestKey") else "swarm.wire_bytes"
# the authenticated sender's peer id (set by server.authenticate once a request's signature verified)
SENDER = web.RequestKey("swarm_sender", str) if hasattr(web, "RequestKey") else "swarm.sender"


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request body, refusing (413) anything over ``limit`` bytes before or while reading it.

    A body already read by a middleware (it had to hash it) is returned from ``request[BODY]``."""
    cached = request.get(BODY)
    if cached is not None:
        if len(cached) > limit:
            raise BadRequest(f"body exceeds this route's limit of {limit} bytes", 413)
        return cached
    length = request.content_length
    if length is not None and length > limit:
        raise BadRequest(f"body of {length} bytes exceeds this route's limit of {limit}", 413)
    chunks: list[bytes] = []
    got = 0
    async for chunk in request.content.iter_chunked(1 << 16):
        got += len(chunk)
        if got > limit:
            raise BadRequest(f"body exceeds this route's limit of {limit} bytes", 413)
        chunks.append(chunk)
    return b"".join(chunks)


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack_map(data: bytes, limit: int = 1 << 20) -> dict:
    """Decode one msgpack map; BadRequest for anything else (trailing bytes, wrong type, too big)."""
    if len(data) > limit:
        raise BadRequest(f"message of {len(data)} bytes exceeds {limit}", 413)
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=limit,
            max_bin_len=limit,
            max_array_len=4096,
            max_map_len=4096,
        )
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError, TypeError) as e:
        raise BadRequest(f"malformed msgpack: {e.__class__.__name__}") from None
    except Exception as e:  # msgpack raises a few odd types on truncated input
        raise BadRequest(f"malformed msgpack: {e.__class__.__name__}") from None
    if not isinstance(obj, dict):
        raise BadRequest("message must be a msgpack map")
    return obj


def msgpack_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=pack(obj), status=status, content_type=MSGPACK_TYPE)


def error_response(reason: str, status: int = 400, code: str = "") -> web.Response:
    """A 4xx with a reason in JSON, the same shape on every route."""
    return web.json_response({"error": reason, "code": code or "bad-request"}, status=status)
