"""Value formats: fp16, blockwise int8/int4/int2 with fp16 scales, dense bf16/fp32.

Blockwise scales (one fp16 absmax scale per block_size consecutive kept values)
keep one outlier from flattening a whole tensor to zero, which a per-tensor scale
does. Every quantizer returns the dequantized values computed exactly as the decoder
will compute them, so the sender's residual keeps the true rounding error and its
local copy is bit-identical to what receivers see.

int2 is ternary in two bits: a kept value becomes -1, 0 or +1 times its block's absmax (code 3 is
no level and is refused). The block's largest value is exact; a value under half of it is not
sent now but stays in the residual, and error feedback carries every rounding into later steps
(SparseLoCo's 2-bit values, arXiv 2508.15706). A zero level matters: without one, a block holding
an outlier would send every small value in it as a third of the outlier (measured: the residual
then grows far past the gradients and fp32 rounding loses mass).
"""

from __future__ import annotations

import numpy as np
import torch

from .errors import CodecError

F16_MAX = 65504.0
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
LEVELS = {"int8": 127, "int4": 7, "int2": 1}  # the largest |level|: scale = absmax / LEVELS
SPARSE_FORMAT = {"topk": "fp16", "topk-int8": "int8", "topk-int4": "int4", "topk-int2": "int2"}


def n_blocks(k: int, block: int) -> int:
    return (k + block - 1) // block


def value_bytes(fmt: str, k: int, block: int) -> int:
    """Bytes of the value section (scales first, so fp16 data stays 2-byte aligned)."""
    if fmt == "fp16" or fmt == "bf16":
        return 2 * k
    if fmt == "fp32":
        return 4 * k
    if fmt == "int8":
        return 2 * n_blocks(k, block) + k
    if fmt == "int4":
        return 2 * n_blocks(k, block) + (k + 1) // 2
    if fmt == "int2":
        return 2 * n_blocks(k, block) + (k + 3) // 4
    raise ValueError(f"unknown value format {fmt!r}")


def _dequant_blocks(q: np.ndarray, scales: np.ndarray, k: int, block: int) -> np.ndarray:
    """q (int, [k]) * per-block fp32 scale; shared by encoder and decoder (bit-identical)."""
    s = np.repeat(scales.astype(np.float32), block)[:k]
    return q.astype(np.float32) * s


def quantize_sparse(v: np.ndarray, fmt: str, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(value-section bytes as uint8, dequantized fp32 values) for kept values v (fp32)."""
    k = v.size
    if fmt == "fp16":
        h = np.clip(v, -F16_MAX, F16_MAX).astype(np.float16)
        return h.view(np.uint8), h.astype(np.float32)
    levels = LEVELS[fmt]
    nb = n_blocks(k, block)
    vp = np.zeros(nb * block, dtype=np.float32)
    vp[:k] = v
    blk = vp.reshape(nb, block)
    amax = np.abs(blk).max(axis=1) if nb else np.zeros(0, np.float32)
    s16 = np.minimum(amax / np.float32(levels), np.float32(F16_MAX)).astype(np.float16)
    sf = s16.astype(np.float32)
    inv = np.zeros_like(sf)
    np.divide(np.float32(1.0), sf, out=inv, where=sf > 0)
    q = np.clip(np.rint(blk * inv[:, None]), -levels, levels).astype(np.int8).reshape(-1)[:k]
    deq = _dequant_blocks(q, s16, k, block)
    if fmt == "int8":
        body = q.view(np.uint8)
    elif fmt == "int2":
        c = (q.astype(np.int16) + 1).astype(np.uint8)  # codes 0..2
        c = np.append(c, np.ones((-k) % 4, np.uint8))  # padding: the zero level
        body = c[0::4] | (c[1::4] << 2) | (c[2::4] << 4) | (c[3::4] << 6)
    else:
        u = (q.astype(np.int16) + 8).astype(np.uint8)
        if k % 2:
            u = np.append(u, np.uint8(8))
        body = u[0::2] | (u[1::2] << 4)
    return np.concatenate([s16.view(np.uint8), body]), deq


def dequantize_sparse(buf: np.ndarray, fmt: str, k: int, block: int) -> np.ndarray:
    """Inverse of quantize_sparse with validation (finite values, sane scales)."""
    if buf.size != value_bytes(fmt, k, block):
        raise CodecError(f"value section is {buf.size} bytes, expected {value_bytes(fmt, k, block)}")
    if fmt == "fp16":
        h = buf.view(np.float16)
        out = h.astype(np.float32)
        if not bool(np.isfinite(out).all()):
            raise CodecError("non-finite fp16 value in payload")
        return out
    nb = n_blocks(k, block)
    s16 = buf[:2 * nb].view(np.float16)
    sf = s16.astype(np.float32)
    if not bool(np.isfinite(sf).all()):
        raise CodecError("non-finite block scale in payload")
    if bool((sf < 0).any()):
        raise CodecError("negative block scale in payload")
    body = buf[2 * nb:]
    if fmt == "int8":
        q = body.view(np.int8)
    elif fmt == "int2":
        c = np.empty(4 * body.size, dtype=np.int8)
        for j in range(4):
            c[j::4] = ((body >> (2 * j)) & 0x03).astype(np.int8)
        if bool((c == 3).any()):
            raise CodecError("int2 code 3 is not a level")
        q = c[:k] - 1
    else:
        q = np.empty(2 * body.size, dtype=np.int8)
        q[0::2] = (body & 0x0F).astype(np.int8) - 8
        q[1::2] = (body >> 4).astype(np.int8) - 8
        q = q[:k]
    return _dequant_blocks(q, s16, k, block)


def quantize_dense(x: torch.Tensor, fmt: str) -> tuple[np.ndarray, torch.Tensor]:
    """(bytes as uint8, dequantized fp32) for a dense fp32 vector in bf16 or fp32."""
    if fmt == "fp32":
        return x.numpy().view(np.uint8), x.clone()
    b = x.clamp(-BF16_MAX, BF16_MAX).to(torch.bfloat16)
    return b.view(torch.int16).numpy().view(np.uint8), b.to(torch.float32)


def dequantize_dense(buf: np.ndarray, fmt: str, n: int) -> torch.Tensor:
    """Inverse of quantize_dense; CodecError on wrong length or non-finite values."""
    width = 4 if fmt == "fp32" else 2
    if buf.size != width * n:
        raise CodecError(f"dense section is {buf.size} bytes, expected {width * n}")
    if fmt == "fp32":
        out = torch.from_numpy(buf.view(np.float32).copy())
    else:
        out = torch.from_numpy(buf.view(np.int16).copy()).view(torch.bfloat16).to(torch.float32)
    if not np.isfinite(float(out.sum(dtype=torch.float64))) and not bool(np.isfinite(out.numpy()).all()):
        raise CodecError("non-finite dense value in payload")
    return out
