"""Replica rows a primary owes a catch-up (sans-I/O).

A primary answers a push once its flush's replays reached the replicas, or failed to (a replica
that timed out, was unreachable, or was on another view for a moment). A replay that did not land
leaves the replica's copy of those rows behind the primary's, and before this record nothing ever
brought it back unless a later push touched the same rows (the replay then finds them stale) or a
training peer's audit came by. Had the primary crashed meanwhile, the replica promoted in its
place served and updated the old rows: the updates were lost, although two copies were asked for.

So the primary remembers, per replica and table, the rows whose last replay did not land, and
sends them their full state (rows, optimizer state, counters) until a replica acknowledges it
(TableClient's catch-up; the replica takes it only for rows that have had fewer updates than it
carries, so a catch-up that arrives after a later replay cannot roll it back). What is owed is kept only while it
is still owed: this peer is the rows' primary and the replica still holds their slot in the
current map (a new map hands the slot to its new owners, who fetch it).

Each record carries a generation: a catch-up settles only what was owed when it read the rows, so
a replay that failed while the catch-up was in flight stays owed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .ownership import OwnershipMap

__all__ = ["Debt", "OwedRows"]


@dataclass(frozen=True)
class Debt:
    """Rows of ``table`` that ``peer`` (a replica) is owed, as of generation ``gen``."""
    peer: str
    table: str
    ids: np.ndarray  # int64, sorted, unique
    gen: int


class OwedRows:
    """Per replica and table: the rows owed and the generation each was last owed at."""

    def __init__(self) -> None:
        self._owed: dict[tuple[str, str], tuple[np.ndarray, np.ndarray]] = {}  # -> (ids, gens)
        self._gen = 0
        self.dropped = 0  # rows no longer owed because the map moved them (or their replica) on

    def __len__(self) -> int:
        """Rows owed, over all replicas and tables."""
        return sum(len(ids) for ids, _ in self._owed.values())

    def add(self, peer: str, table: str, ids: np.ndarray) -> None:
        """``peer``'s copy of these rows of ``table`` missed an update (a replay that did not land)."""
        ids = np.asarray(ids, dtype=np.int64)
        if not ids.size:
            return
        self._gen += 1
        old_ids, old_gens = self._owed.get((peer, table), (np.zeros(0, np.int64), np.zeros(0, np.int64)))
        all_ids = np.concatenate([old_ids, ids])
        gens = np.concatenate([old_gens, np.full(ids.size, self._gen, dtype=np.int64)])
        order = np.lexsort((-gens, all_ids))  # by id, newest generation first
        uniq, first = np.unique(all_ids[order], return_index=True)
        self._owed[(peer, table)] = (uniq, gens[order][first])

    def due(self, omap: OwnershipMap | None, self_id: str) -> list[Debt]:
        """What is still owed under ``omap``, each as of now: rows whose slot has ``self_id`` as its
        primary and the peer among its replicas. The rest is forgotten (counted in ``dropped``)."""
        out = []
        for (peer, table), (ids, gens) in list(self._owed.items()):
            keep = self._still_owed(omap, self_id, peer, table, ids)
            if not keep.all():
                self.dropped += int((~keep).sum())
                if not keep.any():
                    del self._owed[(peer, table)]
                    continue
                ids, gens = ids[keep], gens[keep]
                self._owed[(peer, table)] = (ids, gens)
            out.append(Debt(peer, table, ids, int(gens.max())))
        return out

    @staticmethod
    def _still_owed(omap: OwnershipMap | None, self_id: str, peer: str, table: str, ids: np.ndarray) -> np.ndarray:
        if omap is None or self_id not in omap.index or peer not in omap.index or table not in omap.tables:
            return np.zeros(len(ids), dtype=bool)
        om = omap.owner_matrix(table)[omap.slot_of(table, ids)]  # [n, replicas], primary first
        return (om[:, 0] == omap.index[self_id]) & (om[:, 1:] == omap.index[peer]).any(axis=1)

    def settle(self, peer: str, table: str, ids: np.ndarray, gen: int) -> int:
        """``peer`` acknowledged the full state of ``ids`` read when generation ``gen`` was the
        newest: those rows are no longer owed, unless owed again since. Returns the rows settled."""
        cur = self._owed.get((peer, table))
        if cur is None:
            return 0
        have, gens = cur
        done = np.isin(have, np.asarray(ids, dtype=np.int64)) & (gens <= gen)
        n = int(done.sum())
        if n == len(have):
            del self._owed[(peer, table)]
        elif n:
            self._owed[(peer, table)] = (have[~done], gens[~done])
        return n

    def by_peer(self) -> dict[str, int]:
        """Rows owed to each replica (for the status page)."""
        out: dict[str, int] = {}
        for (peer, _), (ids, _) in self._owed.items():
            out[peer] = out.get(peer, 0) + len(ids)
        return out
