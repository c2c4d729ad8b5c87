"""Elias-Fano coding of strictly increasing indices, vectorised with numpy.

With l = floor(log2(n/k)) low bits per index stored verbatim and the high parts in
unary (one set bit per index in a k + ((n-1) >> l)-bit array), the cost is at most
about 2 + log2(n/k) bits per index: ~8.6 bits at k = n/100 against the bound
log2 C(n,k)/k ~ 8.1. Sizes depend only on (n, k), so the decoder knows exactly how
many bytes to expect.
"""

from __future__ import annotations

import numpy as np

from .errors import CodecError

MAX_N = 1 << 48   # keeps low parts <= 48 bits so the 8-byte gather in _unpack_fixed suffices


def low_bits(n: int, k: int) -> int:
    """Low-part width l = floor(log2(n // k)) (0 when k >= n or k == 0)."""
    if k <= 0 or n <= k:
        return 0
    return (n // k).bit_length() - 1


def high_len(n: int, k: int) -> int:
    """Bits in the unary high part: one 1 per index plus ((n-1) >> l) zeros at most."""
    if k <= 0:
        return 0
    return k + ((n - 1) >> low_bits(n, k))


def sizes(n: int, k: int) -> tuple[int, int]:
    """(high bytes, low bytes) for k indices below n."""
    if k <= 0:
        return 0, 0
    return (high_len(n, k) + 7) // 8, (k * low_bits(n, k) + 7) // 8


def encoded_size(n: int, k: int) -> int:
    h, lo = sizes(n, k)
    return h + lo


def _pack_fixed(v: np.ndarray, w: int) -> np.ndarray:
    """Pack non-negative int64 values into w bits each, little-endian bit order."""
    if w == 0 or v.size == 0:
        return np.empty(0, dtype=np.uint8)
    nb = (w + 7) // 8
    by = v.astype("<u8", copy=False).view(np.uint8).reshape(-1, 8)[:, :nb]
    bits = np.unpackbits(by, axis=1, bitorder="little")[:, :w]
    return np.packbits(bits.reshape(-1), bitorder="little")


def _unpack_fixed(buf: np.ndarray, k: int, w: int) -> np.ndarray:
    """Read k w-bit fields: gather the <= 8 bytes spanning each field, shift, mask."""
    if w == 0 or k == 0:
        return np.zeros(k, dtype=np.int64)
    pos = np.arange(k, dtype=np.int64) * w
    byte = pos >> 3
    shift = (pos & 7).astype(np.uint64)
    padded = np.concatenate([buf, np.zeros(8, dtype=np.uint8)])
    acc = padded[byte].astype(np.uint64)
    for j in range(1, (w + 7 + 7) // 8):
        acc |= padded[byte + j].astype(np.uint64) << np.uint64(8 * j)
    return ((acc >> shift) & np.uint64((1 << w) - 1)).astype(np.int64)


def encode(idx: np.ndarray, n: int) -> bytes:
    """Elias-Fano bytes (high part, then low part) of sorted, strictly increasing idx < n."""
    k = int(idx.size)
    if k == 0:
        return b""
    if n > MAX_N:
        raise ValueError(f"n={n} above the supported {MAX_N}")
    idx = idx.astype(np.int64, copy=False)
    ell = low_bits(n, k)
    hb = np.zeros(high_len(n, k), dtype=bool)
    hb[(idx >> ell) + np.arange(k, dtype=np.int64)] = True
    high = np.packbits(hb, bitorder="little")
    low = _pack_fixed(idx & ((1 << ell) - 1), ell)
    return high.tobytes() + low.tobytes()


def decode(buf: np.ndarray, n: int, k: int) -> np.ndarray:
    """Inverse of encode; CodecError unless buf holds exactly k strictly increasing indices < n."""
    hbytes, lbytes = sizes(n, k)
    if buf.dtype != np.uint8 or buf.ndim != 1 or buf.size != hbytes + lbytes:
        raise CodecError(f"index section is {buf.size} bytes, expected {hbytes + lbytes} for n={n}, k={k}")
    if k == 0:
        return np.empty(0, dtype=np.int64)
    if n > MAX_N:
        raise CodecError(f"n={n} above the supported {MAX_N}")
    ell = low_bits(n, k)
    ones = np.flatnonzero(np.unpackbits(buf[:hbytes], bitorder="little"))
    if ones.size != k:
        raise CodecError(f"index high bits hold {ones.size} entries, expected k={k}")
    if int(ones[-1]) >= high_len(n, k):
        raise CodecError("index high bits: set bit in the padding")
    high = ones - np.arange(k, dtype=np.int64)
    idx = (high << ell) | _unpack_fixed(buf[hbytes:], k, ell)
    if int(idx[-1]) >= n:
        raise CodecError(f"index {int(idx[-1])} out of range for n={n}")
    if k > 1 and not bool(np.all(idx[1:] > idx[:-1])):
        raise CodecError("indices are not strictly increasing")
    return idx
