"""What one peer does for the sharded tables, as a synchronous core: the current ownership map,
the slots it holds, and the answers to pull, push, replica and hand-off requests.

No sockets and no clock of its own: the node's HTTP shell (swarm/tables/http.py) decodes a
request, calls one method here on the peer's table thread, and sends what it returns. Every
method either completes or raises one of the errors below before changing anything.

Rules (docs/tables.md):
- Fencing: a pull or push carries the sender's view (a digest of the member set the map was
  built from). An owner whose view differs answers 409 with its own view: nobody reads or writes
  a slot through a map the owner does not share.
- One writer: only a slot's primary in the current view applies pushed gradients; it then hands
  back the replica updates for the shell to forward. A push for a slot this peer is not the
  primary of is refused.
- Exactly once: a push is keyed by (sender:step, table); a repeated key is acknowledged and not
  applied again.
- Hand-off: on a new map every slot this peer newly owns is fetched from an old owner that is
  still a member (Move.sources); slots nobody can supply start as zero rows (counted as lost
  when they had owners before). Slots it no longer owns are kept `release_after` seconds so the
  new owners can fetch them, then dropped.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
import torch

from .ownership import Move, OwnershipMap, TableSpec, moves
from .shard import RowOptConfig, ShardError, TableShard
from .wire import PullRequest, PushRequest, decode_slot, encode_slot


class Fenced(Exception):
    """The request was made under another view of the membership (HTTP 409)."""

    def __init__(self, reason: str, view: str):
        super().__init__(reason)
        self.view = view


class Moving(Exception):
    """A slot this peer owns is still being handed over to it (HTTP 503: retry shortly)."""


class NotPrimary(Exception):
    """A push reached a peer that is not the slot's primary in its view (HTTP 409)."""


@dataclass
class TableStats:
    rows_served: int = 0
    pulls_served: int = 0
    pushes_applied: int = 0
    rows_updated: int = 0
    duplicate_pushes: int = 0
    replica_updates: int = 0
    slots_fetched: int = 0
    slots_created: int = 0
    slots_lost: int = 0  # slots that had owners, none of whom could hand them over: restarted from zeros
    slots_released: int = 0
    view_changes: int = 0


@dataclass
class TableService:
    self_id: str
    specs: list[TableSpec]
    replicas: int = 2
    slots: int = 4096
    opt: RowOptConfig = field(default_factory=RowOptConfig)
    release_after: float = 30.0
    applied_keys_kept: int = 4096

    def __post_init__(self) -> None:
        self.by_name = {s.name: s for s in self.specs}
        self.shards = {s.name: TableShard(s, min(self.slots, s.rows), self.opt) for s in self.specs}
        self.map: OwnershipMap | None = None
        self.epoch = 0  # local count of view changes, for the status page
        self.moving: dict[tuple[str, int], Move] = {}  # slots we own but do not hold yet
        self.releasing: dict[tuple[str, int], float] = {}  # slots we hold but no longer own -> drop time
        self.applied: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        self.stats = TableStats()

    # -- the map ------------------------------------------------------------------------------
    @property
    def view(self) -> str:
        return self.map.view if self.map is not None else ""

    def set_members(self, members: Iterable[str], now: float) -> list[Move]:
        """Adopt the map of ``members``; returns the hand-offs this peer must fetch (to == self).

        Slots that nobody can supply are created here as zero rows. Unchanged members: no-op."""
        members = sorted(set(members))
        if self.map is not None and tuple(members) == self.map.members:
            return []
        old = self.map
        new = OwnershipMap(self.specs, members, replicas=self.replicas, slots=self.slots)
        self.map = new
        self.epoch += 1
        self.stats.view_changes += 1
        fetch: list[Move] = []
        fresh: dict[str, list[int]] = {name: [] for name in self.shards}
        self.moving = {k: m for k, m in self.moving.items() if self.self_id in new.owners(*k)}
        for mv in moves(old, new):
            if mv.to != self.self_id:
                continue
            key = (mv.table, mv.slot)
            self.releasing.pop(key, None)
            if self.shards[mv.table].has_slot(mv.slot):
                continue  # we still hold it from an earlier map
            sources = tuple(s for s in mv.sources if s != self.self_id)
            if sources:
                self.moving[key] = Move(mv.table, mv.slot, mv.to, sources)
                fetch.append(self.moving[key])
            else:
                if old is not None:
                    self.stats.slots_lost += 1
                fresh[mv.table].append(mv.slot)
                self.stats.slots_created += 1
        for name, slots in fresh.items():
            self.shards[name].create_slots(slots)
        for name, shard in self.shards.items():
            for slot in shard.slots():
                if self.self_id not in new.owners(name, slot) and (name, slot) not in self.releasing:
                    self.releasing[(name, slot)] = now + self.release_after
        return fetch

    def release(self, now: float) -> int:
        """Drop held slots whose grace period after losing ownership has passed."""
        done = [k for k, t in self.releasing.items() if t <= now]
        for name, slot in done:
            del self.releasing[(name, slot)]
            if self.map is None or self.self_id not in self.map.owners(name, slot):
                self.shards[name].drop_slot(slot)
                self.stats.slots_released += 1
        return len(done)

    def _fence(self, view: str) -> None:
        if self.map is None:
            raise Moving("this peer has no ownership map yet")
        if view != self.map.view:
            raise Fenced(f"view {view} differs from this owner's view {self.map.view}", self.map.view)

    def _held(self, table: str, ids: np.ndarray) -> None:
        shard = self.shards[table]
        for slot in np.unique(self.map.slot_of(table, ids)).tolist():
            if not shard.has_slot(slot):
                if (table, slot) in self.moving:
                    raise Moving(f"slot {slot} of {table!r} is being handed over to this peer")
                raise NotPrimary(f"this peer does not hold slot {slot} of {table!r}")

    # -- serving ------------------------------------------------------------------------------
    def serve_pull(self, req: PullRequest) -> list[tuple[str, torch.Tensor]]:
        """Rows asked of us, per table in request order. Any holder may serve (primary or replica)."""
        self._fence(req.view)
        for table, ids in req.ids.items():
            self._held(table, ids)
        out = [(table, self.shards[table].read(ids)) for table, ids in req.ids.items()]
        self.stats.pulls_served += 1
        self.stats.rows_served += sum(len(ids) for ids in req.ids.values())
        return out

    def read_local(self, table: str, ids: np.ndarray) -> torch.Tensor:
        """Our own rows, for our own batch (no fencing: it is our own map)."""
        self._held(table, ids)
        self.stats.rows_served += len(ids)
        return self.shards[table].read(ids)

    def apply_push(self, req: PushRequest) -> dict[str, list[tuple[str, dict[str, torch.Tensor]]]]:
        """Apply pushed row gradients as the primary; returns {replica peer: [(table, update)]}."""
        self._fence(req.view)
        todo = []
        for table, ids in req.ids.items():
            if (req.key, table) in self.applied:
                self.stats.duplicate_pushes += 1
                continue
            slots = self.map.slot_of(table, ids)
            om = self.map.owner_matrix(table)
            me = self.map.index[self.self_id] if self.self_id in self.map.index else -1
            if not bool(np.all(om[slots, 0] == me)):
                raise NotPrimary(f"this peer is not the primary of every slot of {table!r} in this push")
            self._held(table, ids)
            todo.append(table)
        forward: dict[str, list[tuple[str, dict[str, torch.Tensor]]]] = {}
        for table in todo:
            ids = req.ids[table]
            update = self.shards[table].apply_grads(ids, req.grads[table])
            self._remember((req.key, table))
            self.stats.pushes_applied += 1
            self.stats.rows_updated += len(ids)
            self._fan_out(table, ids, update, forward)
        return forward

    def _fan_out(self, table: str, ids: np.ndarray, update: dict[str, torch.Tensor], forward: dict) -> None:
        """Cut a primary's update by replica: each replica gets the rows of the slots it holds."""
        if self.map.replicas < 2:
            return
        slots = self.map.slot_of(table, ids)
        om = self.map.owner_matrix(table)[slots, 1:]
        for r in range(om.shape[1]):
            for member_idx in np.unique(om[:, r]).tolist():
                sel = np.flatnonzero(om[:, r] == member_idx)
                part = {k: v[torch.from_numpy(sel)] for k, v in update.items()}
                forward.setdefault(self.map.members[member_idx], []).append((table, part))

    def apply_replica(self, table: str, update: dict[str, torch.Tensor], view: str, key: str) -> bool:
        """A primary's update for rows we replicate. False (ignored) when it is a repeat."""
        self._fence(view)
        if (key, "replica:" + table) in self.applied:
            return False
        ids = update["ids"].numpy()
        self._held(table, ids)
        self.shards[table].apply_replica_update(update)
        self._remember((key, "replica:" + table))
        self.stats.replica_updates += 1
        return True

    def _remember(self, key: tuple[str, str]) -> None:
        self.applied[key] = None
        while len(self.applied) > self.applied_keys_kept:
            self.applied.popitem(last=False)

    # -- hand-off -----------------------------------------------------------------------------
    def export_slot(self, table: str, slot: int) -> bytes:
        """A held slot, rows and optimizer state, for a new owner (not fenced: reading is harmless)."""
        if table not in self.shards:
            raise NotPrimary(f"unknown table {table!r}")
        shard = self.shards[table]
        if not shard.has_slot(slot):
            raise NotPrimary(f"this peer does not hold slot {slot} of {table!r}")
        return encode_slot(table, slot, shard.export_slot(slot), self.view or "0" * 16)

    def import_slot(self, move: Move, blob: bytes) -> bool:
        """Install a fetched slot if we still await it; False if it is no longer wanted."""
        table, slot, tensors, _ = decode_slot(blob, self.by_name, self._slot_rows)
        if (table, slot) != (move.table, move.slot):
            raise ShardError(f"asked for slot {move.slot} of {move.table!r}, got {slot} of {table!r}")
        if self.moving.get((table, slot)) is None:
            return False
        self.shards[table].import_slot(slot, tensors)
        del self.moving[(table, slot)]
        self.stats.slots_fetched += 1
        return True

    def give_up(self, move: Move) -> None:
        """No source could hand the slot over: start it from zeros (its rows are lost)."""
        if self.moving.pop((move.table, move.slot), None) is not None:
            self.shards[move.table].create_slot(move.slot)
            self.stats.slots_lost += 1
            self.stats.slots_created += 1

    def _slot_rows(self, table: str, slot: int) -> tuple[int, int]:
        spec = self.by_name[table]
        n = min(self.slots, spec.rows)
        if not 0 <= slot < n:
            raise ValueError(f"slot {slot} out of range for {table!r}")
        return slot * spec.rows // n, (slot + 1) * spec.rows // n

    # -- reporting ----------------------------------------------------------------------------
    def status(self) -> dict:
        m = self.map
        by_peer: dict[str, dict[str, int]] = {}
        if m is not None:
            for name in m.tables:
                om = m.owner_matrix(name)
                for col, role in ((0, "primary"), *((c, "replica") for c in range(1, om.shape[1]))):
                    counts = np.bincount(om[:, col], minlength=len(m.members))
                    for i, c in enumerate(counts.tolist()):
                        d = by_peer.setdefault(m.members[i], {"primary": 0, "replica": 0})
                        d[role] += c
        window = 256  # the page draws the owners of the first `window` slots of each table
        ranges = [r for r in (m.ranges() if m else []) if r["first_slot"] < window]
        for r in ranges:
            r["last_slot"] = min(r["last_slot"], window - 1)
        return {
            "view": self.view,
            "epoch": self.epoch,
            "replicas": m.replicas if m else 0,
            "slots": min(self.slots, min(s.rows for s in self.specs)),
            "window": window,
            "by_peer": by_peer,  # slots (all tables) each member is primary or replica of
            "owners": ranges,  # consecutive slots with the same owners, within the window
            "held_slots": {name: len(sh.slots()) for name, sh in self.shards.items()},
            "held_rows": {name: sh.rows_held() for name, sh in self.shards.items()},
            "handoffs": [{"table": t, "first_slot": s, "last_slot": s, "from": mv.sources[0] if mv.sources else "",
                          "to": self.self_id} for (t, s), mv in list(self.moving.items())[:50]],
            "handoffs_pending": len(self.moving),
            "releasing": len(self.releasing),
            "stats": vars(self.stats).copy(),
        }
