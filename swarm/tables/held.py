"""The rows a peer pulled from other owners in its last local-step window, with their tags, so that
the next window's pulls ask an owner to leave out the rows that have not changed (sans-I/O).

With local steps (--sync-every H) a peer pulls each row once a window, and most of a window's rows
recur in the next one; a row that no peer pushed a delta for in between is still the row it
pulled. The pull then carries, per id, the tag (formats.row_tags) of the row held here, and the
owner sends only the rows whose tag moved. Tags hash the wire encoding, so they need no version
counters at the owners, hold across ownership moves and replicas, and a row is reused exactly
when its owner would have sent the same bytes (docs/tables.md, "Conditional pulls"). Per-step
rounds do not use it: a row a peer pulled for a step is in its batch, so its own gradient has
moved the row by the next pull.
"""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["HeldRows"]


class HeldRows:
    """Rows pulled in the window that ended (what the next pulls may reuse) and in the current one
    (what the window after it may), per table: sorted ids, fp32 rows as decoded, their tags. Rows
    of the wire dtype ``dtype`` only; at most ``cap`` rows are kept (the rest are pulled whole)."""

    def __init__(self, dims: dict[str, int], dtype: str, cap: int):
        if cap < 0:
            raise ValueError(f"cap must be >= 0 rows, got {cap}")
        self.dims, self.dtype, self.cap = dict(dims), dtype, cap
        self._last: dict[str, tuple[np.ndarray, torch.Tensor, np.ndarray]] = {}
        self._now: dict[str, list[tuple[np.ndarray, torch.Tensor, np.ndarray]]] = {}

    def rows(self) -> int:
        """Rows held for the next window's pulls."""
        return sum(len(ids) for ids, _, _ in self._last.values())

    def lookup(self, table: str, ids: np.ndarray, dtype: str) -> tuple[np.ndarray, torch.Tensor] | None:
        """(tags, rows) of sorted ``ids`` held from the last window (tag 0 and a zero row where none
        is held), or None when none is (or the pull is in another dtype)."""
        last = self._last.get(table)
        if dtype != self.dtype or last is None or not len(ids):
            return None
        hid, hrows, htags = last
        pos = np.minimum(np.searchsorted(hid, ids), len(hid) - 1)
        hit = hid[pos] == ids
        if not hit.any():
            return None
        tags = np.where(hit, htags[pos], 0).astype(np.uint32)
        rows = torch.zeros(len(ids), self.dims[table])
        rows[torch.from_numpy(np.flatnonzero(hit))] = hrows.index_select(0, torch.from_numpy(pos[hit]))
        return tags, rows

    def remember(self, table: str, ids: np.ndarray, rows: torch.Tensor, tags: np.ndarray, dtype: str) -> None:
        """Rows a pull of this window brought (in ``dtype`` on the wire), for the next window."""
        if dtype == self.dtype and len(ids) and self.cap:
            self._now.setdefault(table, []).append((np.asarray(ids, np.int64), rows.to(torch.float32), tags))

    def next_window(self) -> None:
        """A window begins: the one that ended is what its pulls may reuse; older rows are dropped
        (a row not pulled for a whole window is likely to have moved)."""
        last, left = {}, self.cap
        for table, parts in self._now.items():
            ids = np.concatenate([p[0] for p in parts])
            # sorted unique ids, each its latest pull's (a row is pulled once a window, but a pull
            # retried after a timeout may have landed twice)
            _, back = np.unique(ids[::-1], return_index=True)
            order = (len(ids) - 1 - back)[:left]
            left -= len(order)
            if not len(order):
                continue
            idx = torch.from_numpy(order)
            last[table] = (ids[order], torch.cat([p[1] for p in parts]).index_select(0, idx),
                           np.concatenate([p[2] for p in parts])[order])
        self._last, self._now = last, {}

    def clear(self) -> None:
        """Forget every row (a re-sync: the model restarts from a checkpoint's rows)."""
        self._last, self._now = {}, {}
