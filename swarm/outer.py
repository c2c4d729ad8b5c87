"""The outer step of local steps (--sync-every H): how the shared model moves on a window's aggregate.

With local steps every peer takes H steps of the task's optimizer on its own copy, starting from
the shared (global) parameters; the window's pseudo-gradient is global minus local. The swarm
aggregates the peers' (compressed) pseudo-gradients, and every peer applies the same outer step to
the same global vector, so the global copies stay bit-identical (docs/design.md, "Local steps").

The outer step is SGD on the parameters' part, with optional (Nesterov) momentum: DiLoCo's recipe
is lr 0.7, momentum 0.9, Nesterov. With lr 1 and no momentum it is plain averaging: the new global
model is the mean of the peers' local models (up to compression). The buffers' part (BatchNorm
statistics, counters) always moves by the plain aggregate, so it averages too.

Plain, deterministic torch on flat fp32 vectors (no autograd, no torch.optim: its state layout
would tie checkpoints to its internals), so it is tested without a model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OuterConfig:
    lr: float = 1.0
    momentum: float = 0.0
    nesterov: bool = False

    def __post_init__(self) -> None:
        if not (0 < self.lr <= 10):
            raise ValueError(f"outer lr must be in (0, 10], got {self.lr}")
        if not (0 <= self.momentum < 1):
            raise ValueError(f"outer momentum must be in [0, 1), got {self.momentum}")
        if self.nesterov and self.momentum == 0:
            raise ValueError("Nesterov outer momentum needs a momentum > 0")


class OuterOptimizer:
    """SGD (momentum, Nesterov) on the first ``n_params`` entries of a flat vector; the rest (the
    buffers' entries) take the aggregate as it is."""

    def __init__(self, numel: int, n_params: int, cfg: OuterConfig):
        if not 0 <= n_params <= numel:
            raise ValueError(f"n_params {n_params} outside 0..{numel}")
        self.cfg = cfg
        self.numel = numel
        self.n_params = n_params
        # the momentum buffer is part of the shared state: a joiner downloads it (Replica.state_blob)
        self.momentum = torch.zeros(n_params if cfg.momentum else 0, dtype=torch.float32)

    @torch.no_grad()
    def step(self, flat: torch.Tensor, agg: torch.Tensor) -> None:
        """flat -= the outer update for ``agg`` (both fp32 [numel]), in place."""
        if flat.shape != (self.numel,) or agg.shape != (self.numel,):
            raise ValueError(f"outer step on {tuple(flat.shape)} / {tuple(agg.shape)}, expected ({self.numel},)")
        n, c = self.n_params, self.cfg
        g = agg[:n]
        if c.momentum:
            m = self.momentum
            m.mul_(c.momentum).add_(g)
            d = g.add(m, alpha=c.momentum) if c.nesterov else m
        else:
            d = g
        flat[:n].sub_(d, alpha=c.lr)
        flat[n:].sub_(agg[n:])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"momentum": self.momentum.clone()}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        m = sd.get("momentum")
        if not isinstance(m, torch.Tensor) or m.dtype != torch.float32 or m.shape != self.momentum.shape:
            raise ValueError(f"outer momentum must be float32 {tuple(self.momentum.shape)}, got "
                             f"{getattr(m, 'dtype', type(m).__name__)} {tuple(getattr(m, 'shape', ()))}")
        if not bool(torch.isfinite(m).all()):
            raise ValueError("outer momentum holds non-finite values")
        self.momentum = m.clone()
