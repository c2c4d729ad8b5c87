"""param_sketch: a short, seeded random projection of a replica's state, for comparing replicas.

Two replicas with the same parameters and buffers have the same sketch bit for bit; replicas that
drifted apart almost surely do not. The status page, the summary and the tests compare them.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn as nn

_SKETCH_CHUNK = 1 << 16  # rows of the projection generated at a time


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
    """
    ts = _tensors(module_or_tensors)
    flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float64) for t in ts]) if ts else torch.zeros(0, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    acc = torch.zeros(dim, dtype=torch.float64)
    for start in range(0, flat.numel(), _SKETCH_CHUNK):
        chunk = flat[start:start + _SKETCH_CHUNK]
        proj = torch.randn(chunk.numel(), dim, generator=g, dtype=torch.float64)
        acc += chunk @ proj
    return (acc / math.sqrt(dim)).tolist()
