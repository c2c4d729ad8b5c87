"""param_sketch: a short, seeded random projection of a replica's state, for comparing replicas.

Two replicas with the same parameters and buffers have the same sketch bit for bit; replicas that
drifted apart almost surely do not. The status page, the summary and the tests compare them.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn as nn

SKETCH_CHUNK = 1 << 16  # rows of the projection generated at a time


def _tensors(module_or_tensors) -> list[torch.Tensor]:
    if isinstance(module_or_tensors, nn.Module):
        return list(module_or_tensors.parameters())
    return [t[1] if isinstance(t, tuple) else t for t in module_or_tensors]


@torch.no_grad()
def param_sketch(module_or_tensors: nn.Module | Iterable, dim: int = 16, seed: int = 1234) -> list[float]:
    """Random projection R^n -> R^dim of the concatenated tensors (float64).

    The projection matrix is generated in chunks of 65536 rows from
    torch.Generator().manual_seed(seed) (chunk k covers elements [k*65536, (k+1)*65536)
    of the concatenation), so it never holds n*dim at once. A module contributes all its
    parameters; an iterable of tensors or (name, tensor) pairs is used as given (a replica passes
    its trainable parameters, then its buffers, in manifest order).

    Neither the float64 concatenation nor a second chunk is ever held: each chunk of the
    concatenation is copied into one reused buffer and its projection generated into another (the
    same values as a fresh tensor, from the same generator), so the sketch's transient memory is
    one chunk's (~8.9 MB at dim 16), not the model's size in float64 plus two chunks (~21 MB for the
    built-in task's 0.48M values). A peer sketches at the end of its run, when its memory is at its
    peak (docs/benchmarks.md, "Memory per peer").
    """
    flats = [t.detach().reshape(-1) for t in _tensors(module_or_tensors)]
    total = sum(f.numel() for f in flats)
    g = torch.Generator().manual_seed(seed)
    acc = torch.zeros(dim, dtype=torch.float64)
    rows = min(SKETCH_CHUNK, total)
    chunk = torch.empty(rows, dtype=torch.float64)
    proj = torch.empty(rows, dim, dtype=torch.float64)
    pieces = iter(flats)
    piece, at = None, 0  # the tensor being read, and how far
    for start in range(0, total, SKETCH_CHUNK):
        n = min(SKETCH_CHUNK, total - start)
        filled = 0
        while filled < n:
            if piece is None or at == piece.numel():
                piece, at = next(pieces), 0
                continue
            k = min(n - filled, piece.numel() - at)
            chunk[filled:filled + k].copy_(piece[at:at + k])  # to float64 (and to the CPU)
            filled, at = filled + k, at + k
        torch.randn(n, dim, generator=g, dtype=torch.float64, out=proj[:n])
        acc += chunk[:n] @ proj[:n]
    return (acc / math.sqrt(dim)).tolist()
