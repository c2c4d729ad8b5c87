"""The sender side: clip, accumulate with error feedback, select, quantize, encode.

Error feedback loses nothing: after each step the residual holds every unsent value
plus the quantization error (value - dequantized value) of every sent one, so
sum(decoded payloads) + residual == sum(gradients) up to fp32 rounding. With
``ef_decay`` < 1 (SparseLoCo's error feedback as outer momentum) the residual is
multiplied by it before each payload's values are added: old unsent mass fades on purpose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from . import indexcode, payload, quant
from .config import MAX_SPARSE_RATIO, CodecConfig, k_cap, k_for
from .errors import CodecError
from .manifest import Manifest
from .select import select_chunked, select_topk
from .payload import Decoded


def _all_finite(t: torch.Tensor) -> bool:
    return bool(np.isfinite(t.numpy()).all())


@dataclass
class Encoded:
    """One step's payload: send ``blob`` with header X-Compression: ``mode``."""

    blob: bytes
    mode: str
    step: int
    n: int
    k: int
    skipped: bool
    decoded: Decoded

    @property
    def wire_bytes(self) -> int:
        return len(self.blob)

    @property
    def dense_bytes(self) -> int:
        return 4 * self.n


class Compressor:
    """Stateful per-peer compressor (owns the error-feedback residual)."""

    def __init__(self, manifest: Manifest, config: CodecConfig, sender: str, *, seed: int = 0) -> None:
        config.validate()
        if not isinstance(sender, str) or len(sender) > payload.MAX_SENDER:
            raise ValueError(f"sender must be a str of at most {payload.MAX_SENDER} chars")
        self.manifest = manifest
        self.config = config
        self.sender = sender
        self.n = manifest.numel
        self.residual = torch.zeros(self.n, dtype=torch.float32)
        self.skipped_steps = 0
        self.fallback_steps = 0   # steps sent dense because sparse would be larger
        # The sample only steers the threshold; the selected set is exact either way.
        self._rng = np.random.default_rng(seed)
        self.k_floor = self._k_for_bytes(config.min_bytes)
        self._floors = {1: self.k_floor}  # share -> the entries that fill min_bytes / share

    def _k_for_bytes(self, nbytes: int) -> int:
        """The fewest entries whose sparse body is at least ``nbytes`` (0 when there is no floor;
        n when even all entries are smaller)."""
        mode = self.config.mode
        if nbytes <= 0 or mode == "none" or self.n == 0:
            return 0
        lo, hi = 1, self.n  # body size grows with k: bisect
        while lo < hi:
            mid = (lo + hi) // 2
            if self._sparse_cost(mid, mode) >= nbytes:
                hi = mid
            else:
                lo = mid + 1
        return lo

    # -- helpers -------------------------------------------------------------
    def _pack(self, body: np.ndarray, k: int, mode: str, fmt: str, step: int, tag: tuple[int | None, int | None]
              ) -> bytes:
        samples, nxt = tag  # the header's samples and next round (compress)
        return payload.pack(body, manifest_hash=self.manifest.hash, n=self.n, k=k, mode=mode, fmt=fmt,
                            block=self.config.block_size, step=step, sender=self.sender, samples=samples,
                            next_round=nxt)

    def _sparse_cost(self, k: int, mode: str) -> int:
        """Body bytes plus the metadata bytes that differ from a dense payload."""
        fmt = quant.SPARSE_FORMAT[mode]
        extra = len(str(k)) + (len(',"b":""') + len(str(self.config.block_size)) if fmt in quant.LEVELS else 0)
        return payload.body_size(self.n, k, fmt, self.config.block_size) + extra

    def _dense_cost(self) -> int:
        return quant.value_bytes(self.config.dense_dtype, self.n, 1) + len(str(self.n))

    def _skip(self, step: int, tag: tuple[int | None, int | None]) -> Encoded:
        self.skipped_steps += 1
        mode = self.config.mode if self.config.mode != "none" else "topk"
        fmt = quant.SPARSE_FORMAT[mode]
        body = np.zeros(payload.body_size(self.n, 0, fmt, self.config.block_size), np.uint8)
        blob = self._pack(body, 0, mode, fmt, step, tag)
        dec = Decoded(step, self.sender, self.n, mode, torch.empty(0, dtype=torch.int64),
                      torch.empty(0, dtype=torch.float32))
        return Encoded(blob, mode, step, self.n, 0, True, dec)

    # -- main entry ------------------------------------------------------------
    def compress(self, flat_grad: torch.Tensor, step: int, *, samples: int | None = None,
                 next_round: int | None = None, share: int = 1) -> Encoded:
        """Compress one step's flat gradient; non-finite input yields a skipped k=0 payload.
        ``samples`` and ``next_round`` travel in the header when given (the payload's weight in
        its round, and the round its sender contributes to next). ``share`` > 1 sends 1/share of
        the entries the ratio and the byte floor ask for (a sparse mode only; the rest stays in
        the residual): a window's payload when more peers contribute than the cap
        (swarm/local_steps.py)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        if isinstance(share, bool) or not isinstance(share, int) or share < 1:
            raise ValueError(f"share must be an int >= 1, got {share!r}")
        enc = self._compress(flat_grad, step, (samples, next_round), share)
        enc.decoded.samples, enc.decoded.next = samples, next_round
        return enc

    def _floor(self, share: int) -> int:
        """The fewest entries whose body fills min_bytes / ``share`` (cached per share)."""
        if share not in self._floors:
            self._floors[share] = self._k_for_bytes(-(-self.config.min_bytes // share))
        return self._floors[share]

    def _compress(self, flat_grad: torch.Tensor, step: int, tag: tuple[int | None, int | None],
                  share: int = 1) -> Encoded:
        g = flat_grad.detach()
        if g.numel() != self.n:
            raise ValueError(f"gradient has {g.numel()} entries, manifest has {self.n}")
        g = g.reshape(-1).to(device="cpu", dtype=torch.float32)
        cfg = self.config

        # Non-finite check: a NaN/Inf anywhere makes the fp32 sum (or norm) non-finite; only
        # when it is (possibly plain overflow) do we pay for the exact elementwise check.
        if cfg.clip_norm is not None:
            norm = float(torch.linalg.vector_norm(g))
            if not math.isfinite(norm):
                if not _all_finite(g):
                    return self._skip(step, tag)
                norm = float(torch.linalg.vector_norm(g, dtype=torch.float64))
            if norm > cfg.clip_norm:
                g = g * (cfg.clip_norm / norm)
        elif not math.isfinite(float(g.sum())) and not _all_finite(g):
            return self._skip(step, tag)

        acc = self.residual
        if cfg.ef_decay != 1.0:
            acc.mul_(cfg.ef_decay)
        acc.add_(g)                       # acc = residual + grad, in place
        k = max(k_for(self.n, cfg.ratio_at(step) / share), self._floor(share))
        mode = cfg.mode
        if mode != "none" and (k > k_cap(self.n, MAX_SPARSE_RATIO) or self._sparse_cost(k, mode) >= self._dense_cost()):
            mode = "none"
            self.fallback_steps += 1

        if mode == "none":
            fmt = cfg.dense_dtype
            body, deq = quant.quantize_dense(acc, fmt)
            blob = self._pack(body, self.n, mode, fmt, step, tag)
            acc.sub_(deq)
            dec = Decoded(step, self.sender, self.n, mode, None, deq)
            return Encoded(blob, mode, step, self.n, self.n, False, dec)

        fmt = quant.SPARSE_FORMAT[mode]
        a = acc.numpy()
        idx = (select_chunked(a, k, cfg.chunk) if cfg.chunk
               else select_topk(a, k, exact=cfg.exact, rng=self._rng))
        v = a[idx]
        vbody, deq = quant.quantize_sparse(v, fmt, cfg.block_size)
        a[idx] = v - deq                  # residual keeps unsent values + quantization error
        ibody = np.frombuffer(indexcode.encode(idx, self.n), dtype=np.uint8)
        kk = int(idx.size)
        blob = self._pack(np.concatenate([vbody, ibody]), kk, mode, fmt, step, tag)
        dec = Decoded(step, self.sender, self.n, mode, torch.from_numpy(idx), torch.from_numpy(deq))
        return Encoded(blob, mode, step, self.n, kk, False, dec)

    # -- checkpoints -------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            "residual": self.residual.clone(),
            "skipped_steps": torch.tensor(self.skipped_steps, dtype=torch.int64),
            "fallback_steps": torch.tensor(self.fallback_steps, dtype=torch.int64),
        }

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        r = sd["residual"]
        if r.dtype != torch.float32 or tuple(r.shape) != (self.n,):
            raise CodecError(f"residual must be float32 [{self.n}], got {r.dtype} {tuple(r.shape)}")
        if not bool(torch.isfinite(r).all()):
            raise CodecError("residual in checkpoint is not finite")
        self.residual = r.detach().to("cpu").clone()
        self.skipped_steps = int(sd.get("skipped_steps", torch.tensor(0)))
        self.fallback_steps = int(sd.get("fallback_steps", torch.tensor(0)))
