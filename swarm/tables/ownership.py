"""Who owns which rows of the sharded embedding tables (sans-I/O, deterministic).

Each table's rows are cut into ``n_slots = min(slots, rows)`` contiguous slots; slot ``s`` covers rows
``[s*rows//n_slots, (s+1)*rows//n_slots)``. Each slot gets ``R = min(replicas, len(members))`` owners by
rendezvous (highest-random-weight) hashing over the members: the R members with the highest score,
primary first, ties broken by peer id (ascending). The score is bit-exact uint64 arithmetic:

    peer_hash(p)   = big-endian uint64 of sha256(utf8(p))[:8]
    table_key(t)   = big-endian uint64 of sha256(b"swarm-table\\0" + utf8(t))[:8]
    slot_key(t, s) = hash_symbols(table_key(t), [s])         # swarm.hashing: mix64(mix64(tk) ^ ((s+1)*GOLDEN))
    score(t, s, p) = mix64(slot_key(t, s) ^ peer_hash(p))    # mix64 = splitmix64 finalizer, swarm.hashing

A join or leave changes the top-R of a slot only where the joiner/leaver is (or was) in it: about
R/(N+1) of the slots gain the joiner as an owner, 1/(N+1) as primary. See docs/tables.md.

Hosts: a member id ``"<host>~<rank>"`` (the ranks of a torchrun host group, swarm/group) names the
host it runs on; any other id is a host of its own. A slot's owners are then the top-scoring members
on distinct hosts (walking down the score order), so a host that dies takes no slot with it while
another host is a member; only when fewer hosts than R are members do owners share a host. The
primary is always the top-scoring member, so primaries move exactly as above.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Collection, Iterable, Sequence

import numpy as np

from swarm.hashing import hash_symbols, mix64

__all__ = ["TableSpec", "OwnershipMap", "slot_bounds", "Move", "moves", "view_id", "peer_hash", "table_key", "scores", "host_of"]

HOST_SEP = "~"  # "<host>~<rank>": the ranks of one host group


def host_of(member: str) -> str:
    """The host a member runs on: the part of its id before "~", else the whole id."""
    return member.split(HOST_SEP, 1)[0]

MAX_ROWS = 2**31 - 1  # ids travel as int32 in pushes / replica updates


@dataclass(frozen=True)
class TableSpec:
    name: str
    rows: int
    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or not self.name.isprintable() or "." in self.name:
            raise ValueError(f"table name must be a non-empty printable string without '.': {self.name!r}")
        for what, v, hi in (("rows", self.rows, MAX_ROWS), ("dim", self.dim, 1 << 16)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= int(v) <= hi:
                raise ValueError(f"table {self.name!r}: {what} must be an int in [1, {hi}], got {v!r}")


def _digest64(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


def peer_hash(peer: str) -> int:
    return _digest64(peer.encode("utf-8"))


def table_key(name: str) -> int:
    return _digest64(b"swarm-table\0" + name.encode("utf-8"))


def view_id(members: Iterable[str]) -> str:
    """16 hex chars: sha256 over the sorted, de-duplicated member ids (each length-prefixed)."""
    h = hashlib.sha256(b"swarm-view-v1\0")
    for m in sorted(set(members)):
        b = m.encode("utf-8")
        h.update(len(b).to_bytes(4, "little"))
        h.update(b)
    return h.hexdigest()[:16]


def slot_bounds(rows: int, slots: int) -> np.ndarray:
    """int64 [n + 1], n = min(slots, rows): slot s of a table of ``rows`` rows covers rows
    [b[s], b[s+1]) (the map's layout, and the ranges a slot's initial rows are drawn for)."""
    n = min(slots, rows)
    if rows < 1 or n < 1:
        raise ValueError(f"a table needs rows >= 1 and slots >= 1, got {rows} and {slots}")
    return np.arange(n + 1, dtype=np.int64) * rows // n


def scores(table: str, slots: np.ndarray, members: Sequence[str]) -> np.ndarray:
    """uint64 [len(slots), len(members)] rendezvous scores."""
    sk = hash_symbols(table_key(table), [np.asarray(slots, dtype=np.uint64)]).reshape(-1, 1)
    ph = np.array([peer_hash(m) for m in members], dtype=np.uint64).reshape(1, -1)
    return mix64(sk ^ ph)


@dataclass(frozen=True)
class Move:
    """`to` newly owns (table, slot); ask `sources` (old owners still alive, primary first) for the rows.
    Empty sources: nobody holds them, create the slot fresh (zero rows, zero state)."""
    table: str
    slot: int
    to: str
    sources: tuple[str, ...]


class OwnershipMap:
    def __init__(self, tables: Sequence[TableSpec], members: Iterable[str], replicas: int = 2,
                 slots: int = 4096):
        mem = sorted(set(members))
        if not mem:
            raise ValueError("an ownership map needs at least one member")
        for m in mem:
            if not isinstance(m, str) or not m:
                raise ValueError(f"member ids must be non-empty strings, got {m!r}")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {slots!r}")
        self.tables: dict[str, TableSpec] = {}
        for t in tables:
            if not isinstance(t, TableSpec):
                raise ValueError(f"tables must be TableSpec, got {type(t).__name__}")
            if t.name in self.tables:
                raise ValueError(f"duplicate table {t.name!r}")
            self.tables[t.name] = t
        self.members: tuple[str, ...] = tuple(mem)
        self.index: dict[str, int] = {m: i for i, m in enumerate(mem)}
        self.view: str = view_id(mem)
        self.replicas: int = min(replicas, len(mem))
        self.requested_replicas = replicas
        self.slots = slots
        self._bounds: dict[str, np.ndarray] = {}
        self._owners: dict[str, np.ndarray] = {}

    # --- layout ---------------------------------------------------------------------------

    def spec(self, table: str) -> TableSpec:
        try:
            return self.tables[table]
        except KeyError:
            raise ValueError(f"unknown table {table!r}") from None

    def n_slots(self, table: str) -> int:
        return min(self.slots, self.spec(table).rows)

    def bounds(self, table: str) -> np.ndarray:
        """int64 [n_slots + 1]: slot s covers rows [bounds[s], bounds[s+1])."""
        b = self._bounds.get(table)
        if b is None:
            b = slot_bounds(self.spec(table).rows, self.slots)
            b.flags.writeable = False
            self._bounds[table] = b
        return b

    def slot_of(self, table: str, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids)
        rows = self.spec(table).rows
        if ids.size and (ids.dtype.kind not in "iu" or int(ids.min()) < 0 or int(ids.max()) >= rows):
            raise ValueError(f"table {table!r}: ids must be integers in [0, {rows})")
        return np.searchsorted(self.bounds(table), ids.astype(np.int64, copy=False), side="right") - 1

    def slot_rows(self, table: str, slot: int) -> tuple[int, int]:
        n = self.n_slots(table)
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or not 0 <= int(slot) < n:
            raise ValueError(f"table {table!r}: slot must be an int in [0, {n}), got {slot!r}")
        b = self.bounds(table)
        return int(b[slot]), int(b[slot + 1])

    # --- owners ---------------------------------------------------------------------------

    def owner_matrix(self, table: str) -> np.ndarray:
        """int64 [n_slots, replicas]: indices into self.members, primary first (cached, read-only)."""
        om = self._owners.get(table)
        if om is None:
            sc = scores(table, np.arange(self.n_slots(table)), self.members)
            # members are sorted by id and the sort is stable: equal scores fall back to peer id order.
            order = np.argsort(~sc, axis=1, kind="stable")
            om = np.ascontiguousarray(self._spread(order)).astype(np.int64)
            om.flags.writeable = False
            self._owners[table] = om
        return om

    def _spread(self, order: np.ndarray) -> np.ndarray:
        """The first R members of each slot's score order on distinct hosts; when there are fewer
        hosts than R, the best of the rest fill in (in score order)."""
        hosts = [host_of(m) for m in self.members]
        if len(set(hosts)) == len(hosts) or self.replicas == 1:
            return order[:, :self.replicas]  # every member its own host: plain top-R
        host_idx = np.unique(np.asarray(hosts), return_inverse=True)[1].astype(np.int64)
        h = host_idx[order]                                   # [n_slots, N] host of each candidate
        n_slots, n = order.shape
        taken = np.zeros((n_slots, n), dtype=bool)            # candidate already chosen
        seen = np.zeros((n_slots, int(host_idx.max()) + 1), dtype=bool)
        out = np.empty((n_slots, self.replicas), dtype=np.int64)
        rows = np.arange(n_slots)
        for r in range(self.replicas):
            fresh = ~taken & ~seen[rows[:, None], h]          # not chosen, on a host not used yet
            any_fresh = fresh.any(axis=1)
            pick = np.where(any_fresh, np.argmax(fresh, axis=1), np.argmax(~taken, axis=1))
            out[:, r] = order[rows, pick]
            taken[rows, pick] = True
            seen[rows, h[rows, pick]] = True
        return out

    def owners(self, table: str, slot: int) -> tuple[str, ...]:
        self.slot_rows(table, slot)  # validates
        return tuple(self.members[i] for i in self.owner_matrix(table)[int(slot)])

    def plan(self, table: str, ids: np.ndarray, down: Collection[str] = ()) -> dict[str, np.ndarray]:
        """Cut sorted-unique ids by owner: each id goes to the first owner of its slot not in `down`;
        ids of slots whose owners are all down go under "". Values are sorted int64 sub-arrays, only
        non-empty ones. Unsorted or repeated ids are sorted and de-duplicated first."""
        ids = np.asarray(ids)
        if ids.ndim != 1:
            raise ValueError("ids must be 1-D")
        if ids.size > 1 and not bool(np.all(ids[1:] > ids[:-1])):
            ids = np.unique(ids)
        ids = ids.astype(np.int64, copy=False)
        return {peer: ids[pos] for peer, pos in self.cut(table, ids, down).items()}

    def cut(self, table: str, ids: np.ndarray, down: Collection[str] = ()) -> dict[str, np.ndarray]:
        """plan() as positions: {owner: int64 positions into ``ids`` (1-D, any order), ascending}.
        A caller that holds values beside its ids gathers them with these directly."""
        ids = np.asarray(ids)
        if ids.ndim != 1:
            raise ValueError("ids must be 1-D")
        if ids.size == 0:
            return {}
        slots = self.slot_of(table, ids)
        om = self.owner_matrix(table)
        down_mask = np.zeros(len(self.members) + 1, dtype=bool)
        for d in down:
            i = self.index.get(d)
            if i is not None:
                down_mask[i] = True
        if down_mask.any():
            ok = ~down_mask[om]                                   # [n_slots, R]
            first = np.argmax(ok, axis=1)
            choice = np.where(ok.any(axis=1), om[np.arange(om.shape[0]), first], len(self.members))
        else:
            choice = om[:, 0]                                     # nobody down: the primaries
        owner = choice[slots]                                     # per id; len(members) = nobody
        order = np.argsort(owner, kind="stable")                  # stable: each group stays ascending
        owner_sorted = owner[order]
        uniq, starts = np.unique(owner_sorted, return_index=True)
        ends = np.append(starts[1:], owner_sorted.size)
        return {"" if o == len(self.members) else self.members[o]: order[a:b]
                for o, a, b in zip(uniq.tolist(), starts.tolist(), ends.tolist())}

    def owned_mask(self, peer: str, table: str, ids: np.ndarray, primary: bool = False) -> np.ndarray:
        """bool per id: ``peer`` owns the id's slot (as primary or replica; ``primary``: as primary)."""
        if not len(ids) or peer not in self.index:
            return np.zeros(len(ids), dtype=bool)
        om = self.owner_matrix(table)
        mine = om[:, 0] == self.index[peer] if primary else (om == self.index[peer]).any(axis=1)
        return mine[self.slot_of(table, ids)]

    def owned_slots(self, peer: str, table: str) -> tuple[np.ndarray, np.ndarray]:
        om = self.owner_matrix(table)
        i = self.index.get(peer)
        if i is None:
            e = np.zeros(0, dtype=np.int64)
            return e, e.copy()
        return (np.flatnonzero(om[:, 0] == i).astype(np.int64),
                np.flatnonzero((om[:, 1:] == i).any(axis=1)).astype(np.int64))

    def ranges(self) -> list[dict]:
        out = []
        for table in self.tables:
            om = self.owner_matrix(table)
            change = np.flatnonzero((om[1:] != om[:-1]).any(axis=1)) + 1
            starts = np.concatenate([[0], change]).tolist()
            ends = (np.concatenate([change, [om.shape[0]]]) - 1).tolist()
            for a, b in zip(starts, ends):
                row = [self.members[i] for i in om[a]]
                out.append({"table": table, "first_slot": a, "last_slot": b,
                            "primary": row[0], "replicas": row[1:]})
        return out

    def __repr__(self) -> str:
        return (f"OwnershipMap(view={self.view}, members={len(self.members)}, replicas={self.replicas}, "
                f"tables={list(self.tables)})")


def moves(old: OwnershipMap | None, new: OwnershipMap) -> list[Move]:
    """The (table, slot, new owner) pairs of `new` that `old` did not have, sorted by (table, slot, to),
    with the old owners that are still members as sources (old order: primary first)."""
    out: list[Move] = []
    for table, spec in new.tables.items():
        om_new = new.owner_matrix(table)
        if old is None or table not in old.tables:
            for s in range(om_new.shape[0]):
                for i in sorted(om_new[s].tolist(), key=lambda i: new.members[i]):
                    out.append(Move(table, s, new.members[i], ()))
            continue
        if old.tables[table] != spec or old.n_slots(table) != new.n_slots(table):
            raise ValueError(f"table {table!r} changed shape or slot count between the maps")
        om_old = old.owner_matrix(table)
        # old owner indices translated to new-member indices; -1 for members that are gone.
        to_new = np.array([new.index.get(m, -1) for m in old.members], dtype=np.int64)
        old_in_new = to_new[om_old]                                       # [n_slots, R_old]
        is_new = ~(om_new[:, :, None] == old_in_new[:, None, :]).any(axis=2)  # [n_slots, R_new]
        for s in np.flatnonzero(is_new.any(axis=1)).tolist():
            src = tuple(new.members[i] for i in old_in_new[s].tolist() if i >= 0)
            for j in sorted(np.flatnonzero(is_new[s]).tolist(), key=lambda j: new.members[om_new[s, j]]):
                out.append(Move(table, s, new.members[om_new[s, j]], src))
    return out
