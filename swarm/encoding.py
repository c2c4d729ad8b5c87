"""zstd on the wire: bodies compressed where it pays, decompressed only within a limit.

Why: what swarm sends most (table rows in int4 / int8, their replays, quantized payloads) is
numbers whose bytes are far from uniform. zstd at level 1 takes a push or a replay to 0.71-0.73 of
its size, a per-step pull's rows to 0.82 (docs/benchmarks.md, "Bodies compressed on the wire"), in
about 0.1 ms for a 64 KB push (and 0.08 ms back). It is lossless, so every peer still decodes the
same bits.

HTTP carries it as ``Content-Encoding: zstd``: a request body so marked is decompressed by the
receiver after its signature (over the bytes on the wire) verified; a reply is compressed only for a
request that says ``Accept-Encoding: zstd``. aiohttp's own decompression is off on both sides, so
every decompression goes through ``decompress`` and its limit: a body that inflates past the
route's limit is refused (413) before it is all produced, and a frame that asks for a window over
2^WINDOW_LOG bytes is refused before any memory is taken for it.
"""

from __future__ import annotations

try:  # Python 3.14+
    from compression import zstd
except ImportError:  # pragma: no cover - the backport of the same module (a dependency before 3.14)
    from backports import zstd

ZSTD = "zstd"
LEVEL = 1  # measured: level 3 saves under 1% more here, at half the speed
WINDOW_LOG = 20  # 1 MiB: what the compressor may refer back; a frame asking more is refused
MIN_BYTES = 1024  # smaller bodies go as they are (control messages: nothing worth a frame)
WORTH = 0.97  # sent compressed only when that is at most this share of the plain size

_OPTIONS = {zstd.CompressionParameter.compression_level: LEVEL, zstd.CompressionParameter.window_log: WINDOW_LOG}
_LIMITS = {zstd.DecompressionParameter.window_log_max: WINDOW_LOG}


class EncodingError(ValueError):
    """A body that cannot be decoded as its encoding says; ``status`` is the HTTP status to answer."""

    def __init__(self, reason: str, status: int = 400):
        super().__init__(reason)
        self.reason = reason
        self.status = status


def compress(data: bytes) -> tuple[bytes, str | None]:
    """``(body, encoding)``: ``data`` as one zstd frame when that pays (at least MIN_BYTES, and at
    most WORTH of the size), else ``data`` itself and None."""
    if len(data) < MIN_BYTES:
        return data, None
    packed = zstd.compress(data, options=_OPTIONS)
    if len(packed) > WORTH * len(data):
        return data, None
    return packed, ZSTD


def decompress(data: bytes, encoding: str | None, limit: int) -> bytes:
    """The body ``data`` sent with Content-Encoding ``encoding`` (None or "identity": as it is),
    refusing (EncodingError) an unknown encoding (415), a result over ``limit`` bytes (413), and
    anything but exactly one whole zstd frame (400)."""
    enc = (encoding or "").strip().lower()
    if enc in ("", "identity"):
        return data
    if enc != ZSTD:
        raise EncodingError(f"content encoding {encoding[:40]!r} is not supported (zstd or none)", 415)
    d = zstd.ZstdDecompressor(options=_LIMITS)
    try:
        out = d.decompress(data, max_length=limit + 1)
    except zstd.ZstdError as e:
        raise EncodingError(f"bad zstd body: {e}") from None
    if len(out) > limit:
        raise EncodingError(f"zstd body inflates past this route's limit of {limit} bytes", 413)
    if not d.eof:
        raise EncodingError("bad zstd body: the frame is truncated")
    if d.unused_data:
        raise EncodingError(f"bad zstd body: {len(d.unused_data)} bytes after its frame")
    return out


def reply(data: bytes, accept: str | None, on: bool = True) -> tuple[bytes, dict[str, str]]:
    """A reply body and its headers: compressed (``compress``) when ``on`` (this peer's
    --wire-compression) and the request's ``Accept-Encoding`` header ``accept`` admits zstd."""
    if not (on and accepts(accept)):
        return data, {}
    body, enc = compress(data)
    return body, ({"Content-Encoding": enc} if enc else {})


def accepts(header: str | None) -> bool:
    """Whether an ``Accept-Encoding`` header admits zstd (a ``;q=0`` refuses it)."""
    for part in (header or "").split(","):
        name, _, params = part.strip().partition(";")
        if name.strip().lower() == ZSTD:
            q = params.strip().lower()
            return not (q.startswith("q=") and _q(q[2:]) == 0.0)
    return False


def _q(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 1.0
