"""A local-step window's table rows (--sync-every H): each row pulled at most once per window, a
working copy the inner steps update, one push per row per window (sans-I/O, training thread).

Within a window a peer trains on its own copy of the rows it has pulled: every inner step's row
gradients update that copy with the row optimizer's rule (Adam, its state fresh each window and
only here), so later inner steps see the rows move, as the dense parameters do. What goes to each
row's primary at the end of the window is a **gradient**: the sum of the row's gradients over the
window's inner steps (one push, its key the window). A primary applies it like any push: one step
of its row optimizer, combined with the other peers' pushes of the same row that reach it within
its push window (tables/service.py sums them); Adam's normalisation makes that step's size
independent of how many inner steps touched the row. Rows the owners could not serve (zeros were
used) get no push, as in per-step training.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .shard import RowOptConfig


@dataclass
class _Rows:
    """One table's rows of this window, sorted by id."""
    dim: int
    ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    rows: torch.Tensor = None  # type: ignore[assignment]
    m: torch.Tensor = None  # type: ignore[assignment]
    v: torch.Tensor = None  # type: ignore[assignment]
    t: torch.Tensor = None  # type: ignore[assignment]  # per-row local step count (Adam's bias correction)
    gsum: torch.Tensor = None  # type: ignore[assignment]
    absent: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # never served: no push

    def __post_init__(self) -> None:
        z = torch.zeros(0, self.dim)
        self.rows, self.m, self.v, self.gsum = z, z.clone(), z.clone(), z.clone()
        self.t = torch.zeros(0, dtype=torch.int64)

    def positions(self, ids: np.ndarray) -> np.ndarray:
        pos = np.searchsorted(self.ids, ids)
        if ids.size and (pos.max() >= self.ids.size or not np.array_equal(self.ids[pos], ids)):
            raise KeyError("rows asked for that this window never pulled")
        return pos


class WindowRows:
    """The working copy of one window's rows, for every table."""

    def __init__(self, dims: dict[str, int], opt: RowOptConfig):
        self.dims = dict(dims)
        self.opt = opt
        self.tables = {t: _Rows(d) for t, d in self.dims.items()}
        self.pulled = 0  # rows pulled this window (each once)

    def missing(self, want: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The ids of ``want`` (sorted-unique per table) not pulled yet this window."""
        out = {}
        for t, ids in want.items():
            have = self.tables[t].ids
            out[t] = ids[~np.isin(ids, have, assume_unique=True)] if have.size else ids
        return out

    def add(self, ids: dict[str, np.ndarray], rows: dict[str, torch.Tensor], absent: dict[str, np.ndarray]) -> None:
        """Rows just pulled (fp32 in ``ids`` order; ids not in the window yet); ``absent``: the ids
        the owners could not serve (their rows are zeros: used, never pushed)."""
        for t, new in ids.items():
            if not len(new):
                continue
            r = self.tables[t]
            if np.isin(new, r.ids, assume_unique=True).any():
                raise ValueError(f"table {t}: rows pulled twice in one window")
            gone = np.isin(new, absent.get(t, new[:0]), assume_unique=True)
            all_ids = np.concatenate([r.ids, new])
            order = np.argsort(all_ids, kind="stable")
            idx = torch.from_numpy(order)
            zeros = torch.zeros(len(new), r.dim)
            r.ids = all_ids[order]
            r.rows = torch.cat([r.rows, rows[t].to(torch.float32)]).index_select(0, idx)
            r.m = torch.cat([r.m, zeros]).index_select(0, idx)
            r.v = torch.cat([r.v, zeros]).index_select(0, idx)
            r.gsum = torch.cat([r.gsum, zeros]).index_select(0, idx)
            r.t = torch.cat([r.t, torch.zeros(len(new), dtype=torch.int64)]).index_select(0, idx)
            r.absent = np.concatenate([r.absent, gone])[order]
            self.pulled += len(new)

    def rows(self, want: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """The working copy of ``want``'s rows (fp32, in ids order)."""
        return {t: r.rows.index_select(0, torch.from_numpy(r.positions(want[t]))) for t, r in self.tables.items()
                if t in want}

    @torch.no_grad()
    def update(self, row_grads: dict[str, tuple[np.ndarray, torch.Tensor]]) -> None:
        """An inner step's row gradients: added to the window's sums, and one step of the row
        optimizer on the working copy (rows that were never served stay zeros)."""
        b1, b2 = self.opt.betas
        for t, (ids, g) in row_grads.items():
            if not len(ids):
                continue
            r = self.tables[t]
            pos = r.positions(ids)
            idx = torch.from_numpy(pos)
            g = g.to(torch.float32)
            r.gsum.index_add_(0, idx, g)
            served = torch.from_numpy(~r.absent[pos]).unsqueeze(1)
            step = r.t.index_select(0, idx) + 1
            r.t.index_copy_(0, idx, step)
            if self.opt.kind == "adam":
                m = r.m.index_select(0, idx).mul_(b1).add_(g, alpha=1 - b1)
                v = r.v.index_select(0, idx).mul_(b2).addcmul_(g, g, value=1 - b2)
                r.m.index_copy_(0, idx, m)
                r.v.index_copy_(0, idx, v)
                tt = step.to(torch.float64).unsqueeze(1)
                bc1 = (1 - b1 ** tt).to(torch.float32)
                bc2 = (1 - b2 ** tt).to(torch.float32)
                delta = (m / bc1) / ((v / bc2).sqrt() + self.opt.eps) * self.opt.lr
            else:  # adagrad
                acc = r.v.index_select(0, idx).addcmul_(g, g)
                r.v.index_copy_(0, idx, acc)
                delta = self.opt.lr * g / (acc.sqrt() + self.opt.eps)
            r.rows.index_add_(0, idx, -(delta * served))

    def pushes(self) -> dict[str, tuple[np.ndarray, torch.Tensor]]:
        """The window's push: {table: (ids, summed gradients)} of the served rows it touched."""
        out = {}
        for t, r in self.tables.items():
            keep = (r.t > 0).numpy() & ~r.absent
            out[t] = (r.ids[keep], r.gsum[torch.from_numpy(keep)])
        return out

    def clear(self) -> None:
        """A new window: nothing pulled yet."""
        self.tables = {t: _Rows(d) for t, d in self.dims.items()}
        self.pulled = 0
