"""Bit-exact 64-bit hashing shared by the table ownership map and tasks that hash ids.

Everything is uint64 arithmetic that wraps mod 2**64 (numpy uint64 arrays wrap silently and
identically on every platform). Spec, with & MASK64 after every + and *:

  mix64(z):  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
             z = (z ^ (z >> 27)) * 0x94D049BB133111EB
             return z ^ (z >> 31)                       (splitmix64 finalizer)
  hash_symbols(tag, s_1..s_k):
             h = mix64(tag)
             for s in s_1..s_k:  h = mix64(h ^ ((s + 1) * 0x9E3779B97F4A7C15))
             return h
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

MASK64 = (1 << 64) - 1
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_S30, _S27, _S31, _ONE = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(1)


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer on a uint64 array (wrapping)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> _S30)) * _M1
        z = (z ^ (z >> _S27)) * _M2
        return z ^ (z >> _S31)


def hash_symbols(tag: int, symbols: Sequence[np.ndarray]) -> np.ndarray:
    """Hash aligned integer arrays (values >= 0), oldest symbol first; returns uint64."""
    shape = np.broadcast_shapes(*(np.shape(s) for s in symbols)) if symbols else ()
    h = mix64(np.full(shape, tag & MASK64, dtype=np.uint64).reshape(shape or (1,)))
    with np.errstate(over="ignore"):
        for s in symbols:
            s = np.asarray(s).astype(np.uint64).reshape(shape or (1,))
            h = mix64(h ^ ((s + _ONE) * _GOLDEN))
    return h.reshape(shape)
