"""Codec modes and configuration (ratio, value format, warm-up, clipping)."""

from __future__ import annotations

import math
from dataclasses import dataclass

HEADER = "X-Compression"
MODES = ("none", "topk", "topk-int8", "topk-int4", "topk-int2")
SPARSE_MODES = MODES[1:]
DENSE_DTYPES = ("bf16", "fp32")
MAX_BLOCK = 1 << 16
MIN_CHUNK, MAX_CHUNK = 64, 1 << 24  # chunk-wise selection: entries per chunk


@dataclass
class CodecConfig:
    """How a peer compresses its gradients.

    ratio is the steady-state fraction of entries sent; during warm-up the ratio decays
    exponentially from warmup_start_ratio to ratio (as in Deep Gradient Compression), so
    early, fast-changing gradients are sent denser.

    chunk > 0 selects chunk-wise: each run of ``chunk`` consecutive entries keeps its own share of
    the k entries (0: the k largest of the whole vector).

    min_bytes is a floor on the payload body: a step sends at least as many entries as fill it
    (for a small model, more than ``ratio`` asks). Below a few tens of kilobytes a payload's time
    on a link is less than one round trip, so sparsifying further saves no wall time and only
    slows convergence; a large model's payloads are far above the floor and are not affected.
    """

    mode: str = "topk-int8"
    ratio: float = 0.01
    block_size: int = 64
    dense_dtype: str = "bf16"
    warmup_steps: int = 0
    warmup_start_ratio: float = 0.25
    ef_decay: float = 1.0  # residual *= ef_decay before each payload's values are added (1: exact)
    clip_norm: float | None = None
    exact: bool = False
    min_bytes: int = 0
    chunk: int = 0

    def ratio_at(self, step: int) -> float:
        """Ratio in effect at ``step``: exponential decay over warm-up, then the target."""
        if self.warmup_steps <= 0 or step >= self.warmup_steps:
            return self.ratio
        frac = max(step, 0) / self.warmup_steps
        r = self.warmup_start_ratio * (self.ratio / self.warmup_start_ratio) ** frac
        return min(1.0, max(self.ratio, r))

    def validate(self) -> None:
        """Raise ValueError with a clear message for any out-of-range setting."""
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; expected one of {MODES}")
        if not isinstance(self.ratio, (int, float)) or not (0.0 < self.ratio <= 1.0):
            raise ValueError(f"ratio must be in (0, 1], got {self.ratio!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) \
                or not (1 <= self.block_size <= MAX_BLOCK):
            raise ValueError(f"block_size must be an int in [1, {MAX_BLOCK}], got {self.block_size!r}")
        if self.dense_dtype not in DENSE_DTYPES:
            raise ValueError(f"dense_dtype must be one of {DENSE_DTYPES}, got {self.dense_dtype!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) \
                or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if isinstance(self.ef_decay, bool) or not isinstance(self.ef_decay, (int, float)) \
                or not (0.0 < self.ef_decay <= 1.0):
            raise ValueError(f"ef_decay must be in (0, 1], got {self.ef_decay!r}")
        if not isinstance(self.warmup_start_ratio, (int, float)) \
                or not (0.0 < self.warmup_start_ratio <= 1.0):
            raise ValueError(f"warmup_start_ratio must be in (0, 1], got {self.warmup_start_ratio!r}")
        if self.warmup_steps > 0 and self.warmup_start_ratio < self.ratio:
            raise ValueError(f"warmup_start_ratio ({self.warmup_start_ratio}) must be >= ratio "
                             f"({self.ratio}): warm-up starts denser")
        if self.clip_norm is not None and (
                not isinstance(self.clip_norm, (int, float)) or not math.isfinite(self.clip_norm)
                or self.clip_norm <= 0):
            raise ValueError(f"clip_norm must be None or a finite number > 0, got {self.clip_norm!r}")
        if isinstance(self.min_bytes, bool) or not isinstance(self.min_bytes, int) or self.min_bytes < 0:
            raise ValueError(f"min_bytes must be an int >= 0, got {self.min_bytes!r}")
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or not (
                self.chunk == 0 or MIN_CHUNK <= self.chunk <= MAX_CHUNK):
            raise ValueError(f"chunk must be 0 or an int in [{MIN_CHUNK}, {MAX_CHUNK}], got {self.chunk!r}")
        if not isinstance(self.exact, bool):
            raise ValueError(f"exact must be a bool, got {self.exact!r}")


def k_for(n: int, ratio: float) -> int:
    """Entries kept at ``ratio``: round(ratio*n) clamped to [1, n]; always <= ceil(ratio*n)."""
    if n <= 0:
        return 0
    return max(1, min(n, int(round(ratio * n))))


# A sparse payload keeps at most this fraction of the entries: receivers refuse denser ones (an index
# per entry costs more than it saves there), and a sender that would select more sends dense instead.
MAX_SPARSE_RATIO = 0.5


def k_cap(n: int, max_ratio: float) -> int:
    """Largest k a receiver accepts for a sparse payload at ``max_ratio``."""
    return min(n, math.ceil(max_ratio * n))
