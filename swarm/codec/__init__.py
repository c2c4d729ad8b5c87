"""Gradient codec: Top-K + error feedback + compact wire format (pure code, no I/O)."""

from .compressor import Compressor, Encoded
from .config import HEADER, MODES, CodecConfig
from .errors import CodecError
from .manifest import Manifest, ManifestEntry
from .payload import Decoded, decode_payload

__all__ = ["CodecError", "Manifest", "ManifestEntry", "CodecConfig", "Compressor", "Encoded",
           "Decoded", "decode_payload", "MODES", "HEADER"]
