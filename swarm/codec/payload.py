"""Wire format: one safetensors blob per step, and its hostile-input decoder.

The blob holds ONE uint8 tensor "p" (sections concatenated; their sizes follow from
n, k, format and block size) plus a few short metadata strings, so the header stays
~200 bytes whatever the model. See docs/protocol.md for the byte layout.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass

import numpy as np
import safetensors
import safetensors.numpy
import torch

from . import indexcode, quant
from .config import HEADER, MAX_BLOCK, MODES, k_cap
from .errors import CodecError
from .manifest import Manifest

VERSION = "1"
TENSOR = "p"
MAX_HEADER = 4096          # our headers are ~200 bytes; anything larger is hostile
MAX_SENDER = 256
DENSE_FORMATS = ("bf16", "fp32")
_INT_RE = re.compile(r"0|[1-9][0-9]{0,18}")
_BASE_KEYS = frozenset({"v", "h", "n", "k", "m", "f", "t", "s"})
# optional: "w" the samples behind the payload (its weight in the round), "x" the next round the
# sender will contribute to (docs/design.md, "Uneven peers and large swarms")
_OPTIONAL_KEYS = frozenset({"w", "x"})
MAX_SAMPLES = 1 << 40


@dataclass
class Decoded:
    """A decoded payload: sparse (sorted indices + values) or dense (values only)."""

    step: int
    sender: str
    n: int
    mode: str
    indices: torch.Tensor | None
    values: torch.Tensor
    samples: int | None = None  # the samples behind it (None: unsaid, the round weighs it as the others)
    next: int | None = None  # the next round its sender contributes to (None: unsaid, the one after)

    @property
    def k(self) -> int:
        """Entries carried (n for dense)."""
        return self.n if self.indices is None else int(self.indices.numel())

    def add_to(self, out: torch.Tensor, weight: float = 1.0) -> None:
        """out += weight * self; out must be fp32 [n] (indices are validated unique, in range)."""
        if out.dtype != torch.float32 or tuple(out.shape) != (self.n,):
            raise ValueError(f"out must be float32 [{self.n}], got {out.dtype} {tuple(out.shape)}")
        if self.indices is None:
            out.add_(self.values, alpha=weight)
        elif self.indices.numel():
            out.index_add_(0, self.indices, self.values, alpha=weight)

    def to_dense(self) -> torch.Tensor:
        out = torch.zeros(self.n, dtype=torch.float32)
        self.add_to(out)
        return out


def value_format(mode: str, dense_dtype: str) -> str:
    return dense_dtype if mode == "none" else quant.SPARSE_FORMAT[mode]


def body_size(n: int, k: int, fmt: str, block: int) -> int:
    """Bytes of tensor "p" (values section + index section; dense has no index)."""
    if fmt in DENSE_FORMATS:
        return quant.value_bytes(fmt, n, block)
    return quant.value_bytes(fmt, k, block) + indexcode.encoded_size(n, k)


def pack(body: np.ndarray, *, manifest_hash: str, n: int, k: int, mode: str, fmt: str,
         block: int, step: int, sender: str, samples: int | None = None, next_round: int | None = None) -> bytes:
    """Serialize one payload as safetensors bytes."""
    meta = {"v": VERSION, "h": manifest_hash, "n": str(n), "k": str(k), "m": mode, "f": fmt,
            "t": str(step), "s": sender}
    if fmt in quant.LEVELS:
        meta["b"] = str(block)
    if samples is not None:
        meta["w"] = str(samples)
    if next_round is not None:
        meta["x"] = str(next_round)
    return safetensors.numpy.save({TENSOR: np.ascontiguousarray(body, dtype=np.uint8)}, metadata=meta)


def _int(meta: dict, key: str, what: str) -> int:
    s = meta[key]
    if not _INT_RE.fullmatch(s):
        raise CodecError(f"metadata {key!r} ({what}) is not a non-negative decimal integer: {s[:40]!r}")
    return int(s)


def _no_dupes(pairs: list) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        raise CodecError("duplicate key in safetensors header")
    return d


def _read_header(blob: bytes) -> dict:
    if len(blob) < 8:
        raise CodecError(f"truncated payload: {len(blob)} bytes, no safetensors header")
    (hlen,) = struct.unpack_from("<Q", blob, 0)
    if hlen > MAX_HEADER:
        raise CodecError(f"safetensors header of {hlen} bytes exceeds {MAX_HEADER}")
    if 8 + hlen > len(blob):
        raise CodecError("truncated payload: header runs past the end")
    try:
        header = json.loads(blob[8:8 + hlen].decode("utf-8"), object_pairs_hook=_no_dupes)
    except CodecError:
        raise
    except Exception as e:  # UnicodeDecodeError, JSONDecodeError, RecursionError, ...
        raise CodecError(f"malformed safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise CodecError("malformed safetensors header: not a JSON object")
    if set(header) != {"__metadata__", TENSOR}:
        raise CodecError(f"payload must hold exactly metadata and tensor {TENSOR!r}, "
                         f"got keys {sorted(header)[:8]}")
    meta = header["__metadata__"]
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CodecError("malformed metadata: must map strings to strings")
    return meta


def decode_payload(blob: bytes, manifest: Manifest, *, header_mode: str | None = None,
                   max_ratio: float = 1.0, max_bytes: int | None = None) -> Decoded:
    """Decode and fully validate an untrusted payload; raises only CodecError.

    header_mode is the X-Compression header and must match the blob's own mode;
    a sparse payload may carry at most ceil(max_ratio * n) entries (pass the ratio
    the swarm agreed on, including warm-up); max_bytes bounds the blob size.
    """
    try:
        return _decode(blob, manifest, header_mode, max_ratio, max_bytes)
    except CodecError:
        raise
    except Exception as e:  # anything numpy/safetensors/torch might raise on hostile bytes
        raise CodecError(f"malformed payload: {type(e).__name__}: {e}") from e


def _decode(blob: bytes, manifest: Manifest, header_mode: str | None, max_ratio: float,
            max_bytes: int | None) -> Decoded:
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise CodecError(f"payload must be bytes, got {type(blob).__name__}")
    blob = bytes(blob)
    n = manifest.numel
    hard_cap = 8 + MAX_HEADER + 8 * n + 64
    if max_bytes is not None and len(blob) > max_bytes:
        raise CodecError(f"payload of {len(blob)} bytes exceeds the limit of {max_bytes}")
    if len(blob) > hard_cap:
        raise CodecError(f"payload of {len(blob)} bytes is larger than any valid payload for n={n}")
    if not (isinstance(max_ratio, (int, float)) and 0.0 < max_ratio <= 1.0):
        raise CodecError(f"max_ratio must be in (0, 1], got {max_ratio!r}")
    meta = _read_header(blob)

    if meta.get("v") != VERSION:
        raise CodecError(f"unsupported format version {str(meta.get('v'))[:20]!r}, expected {VERSION!r}")
    mode = meta.get("m")
    if mode not in MODES:
        raise CodecError(f"unknown mode {str(mode)[:20]!r}; expected one of {MODES}")
    if header_mode is not None and header_mode != mode:
        raise CodecError(f"{HEADER} header says {header_mode[:20]!r} but payload mode is {mode!r}")
    fmt = meta.get("f")
    allowed = DENSE_FORMATS if mode == "none" else (quant.SPARSE_FORMAT[mode],)
    if fmt not in allowed:
        raise CodecError(f"value format {str(fmt)[:20]!r} does not fit mode {mode!r} (expected {allowed})")
    want = _BASE_KEYS | ({"b"} if fmt in quant.LEVELS else set())
    if set(meta) - _OPTIONAL_KEYS != want:
        missing, extra = sorted(want - set(meta)), sorted(set(meta) - want - _OPTIONAL_KEYS)
        raise CodecError(f"metadata keys wrong: missing {missing}, extra {extra[:8]}")
    manifest.check_hash(meta["h"])
    pn = _int(meta, "n", "entries")
    if pn != n:
        raise CodecError(f"payload n={pn} but manifest has n={n}")
    k = _int(meta, "k", "kept entries")
    step = _int(meta, "t", "step")
    sender = meta["s"]
    if len(sender) > MAX_SENDER:
        raise CodecError(f"sender name longer than {MAX_SENDER} chars")
    samples = _int(meta, "w", "samples") if "w" in meta else None
    if samples is not None and not 1 <= samples <= MAX_SAMPLES:
        raise CodecError(f"samples {samples} outside [1, {MAX_SAMPLES}]")
    nxt = _int(meta, "x", "next round") if "x" in meta else None
    if nxt is not None and not step < nxt <= step + (1 << 20):
        raise CodecError(f"next round {nxt} must follow round {step} (by at most 2^20)")
    block = 1
    if fmt in quant.LEVELS:
        block = _int(meta, "b", "block size")
        if not 1 <= block <= MAX_BLOCK:
            raise CodecError(f"block size {block} outside [1, {MAX_BLOCK}]")
    if mode == "none":
        if k != n:
            raise CodecError(f"dense payload must have k == n ({n}), got {k}")
    else:
        cap = k_cap(n, max_ratio)
        if k > cap:
            raise CodecError(f"k={k} exceeds the cap {cap} allowed by max_ratio={max_ratio} at n={n}")
    size = body_size(n, k, fmt, block)

    try:
        tensors = safetensors.deserialize(blob)
    except Exception as e:
        raise CodecError(f"malformed safetensors payload: {e}") from e
    if len(tensors) != 1 or tensors[0][0] != TENSOR:
        raise CodecError(f"payload must hold exactly one tensor {TENSOR!r}")
    info = tensors[0][1]
    if info.get("dtype") != "U8":
        raise CodecError(f"tensor {TENSOR!r} must be U8, got {str(info.get('dtype'))[:20]}")
    if list(info.get("shape", [])) != [size]:
        raise CodecError(f"tensor {TENSOR!r} has shape {info.get('shape')}, expected [{size}] "
                         f"for n={n}, k={k}, format {fmt}")
    body = np.frombuffer(info["data"], dtype=np.uint8)
    if body.size != size:
        raise CodecError(f"truncated data: {body.size} of {size} bytes")

    if mode == "none":
        values = quant.dequantize_dense(body, fmt, n)
        return Decoded(step, sender, n, mode, None, values, samples, nxt)
    vsize = quant.value_bytes(fmt, k, block)
    vals = quant.dequantize_sparse(body[:vsize], fmt, k, block)
    idx = indexcode.decode(body[vsize:], n, k)
    return Decoded(step, sender, n, mode, torch.from_numpy(idx), torch.from_numpy(vals), samples, nxt)


def subset_bound_bits(n: int, k: int) -> float:
    """log2 C(n, k): information bound, in bits, for a k-subset of n."""
    if k <= 0 or k >= n:
        return 0.0
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)
