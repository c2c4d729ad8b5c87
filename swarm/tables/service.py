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
  still a member (Move.sources); slots nobody can supply start from their initial rows (counted as lost
  when they had owners before). Slots it no longer owns are kept `release_after` seconds so the
  new owners can fetch them, then dropped.
"""

from __future__ import annotations

import collections
import secrets
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
import torch

from .audit import Digest
from .ownership import Move, OwnershipMap, TableSpec, moves, slot_bounds
from .shard import RowOptConfig, ShardError, TableShard
from .formats import PullRequest, PushRequest, Replay, decode_slot, encode_slot, roundtrip
from .robust_rows import Levels, Part, combine

MAX_GRAD = 1e15  # |row gradient| above this is refused: Adam squares it, and a flush sums a few


FRESH = 0  # a hand-off offer meaning "this slot was never updated: create it from its initial rows"


class Fenced(Exception):
    """The request was made under another view of the membership (HTTP 409)."""

    def __init__(self, reason: str, view: str):
        super().__init__(reason)
        self.view = view


class Moving(Exception):
    """A slot this peer owns is still being handed over to it (HTTP 503: retry shortly)."""


class NotPrimary(Exception):
    """A push reached a peer that is not the slot's primary in its view (HTTP 409)."""


@dataclass(frozen=True)
class ReplayOutcome:
    """What a replica did with one replay message: ``applied`` False for a repeat (nothing done);
    ``stale`` the rows (per table) that were not at the primary's update count, left as they are
    for the primary to send in full state. Every other row took the replayed step."""

    applied: bool
    stale: dict[str, np.ndarray]


@dataclass(frozen=True)
class RowVerdict:
    """One sender's part of a flush, as the robust combine saw it (all tables): the shell scores it."""

    sender: str
    rows: int  # rows it pushed
    clipped: int  # ... of which were scaled down to the bar
    outlier: bool  # its rows' level exceeded OUTLIER_FACTOR x the reference, or it disagreed (some table)
    shared: int = 0  # rows it pushed that other senders of the flush pushed too (all tables)
    agreement: float | None = None  # its lowest agreement over the tables it was judged in (robust_rows)
    disagreed: bool = False  # its rows pointed against the others' (in some table): left out of the flush
    ratio: float = 0.0  # its largest level over the flush's reference (the tables whose levels were judged)


def sender_of(req: PushRequest) -> str:
    """The sender a push names: its key's peer part ("peer:step"). Only as good as the request's
    authentication; the HTTP shell passes the id it trusts (tables/http.py push_sender)."""
    return req.key.rsplit(":", 1)[0]


@dataclass
class TableStats:
    rows_served: int = 0
    pulls_served: int = 0
    pushes_applied: int = 0
    rows_updated: int = 0  # row updates applied as a primary (one per row per flush)
    rows_combined: int = 0  # pushed rows that shared an update with another push of the same flush
    rows_clipped: int = 0  # pushed (sender, row) gradients the robust combine scaled down (--row-clip)
    outlier_pushes: int = 0  # (flush, sender) pairs whose rows were outliers (robust_rows.combine)
    disagreeing_pushes: int = 0  # ... of which its rows pointed against the others' (left out of the flush)
    flushes: int = 0
    duplicate_pushes: int = 0
    replica_updates: int = 0  # full-state replica updates applied
    replica_rows_newer: int = 0  # catch-up rows left alone: ours had as many updates or more (a replay overtook it)
    replays_applied: int = 0  # replica steps replayed from the primary's gradients
    replays_diverged: int = 0  # replay messages with some rows not at the primary's count (healed in full state)
    rows_stale: int = 0  # ... those rows, in all: the rest of each message was applied
    slots_fetched: int = 0
    slots_created: int = 0
    slots_lost: int = 0  # slots that had owners, none of whom could hand them over: restarted from initial rows
    slots_kept: int = 0  # ... and that we went on with the (possibly older) copy we held
    slots_released: int = 0
    view_changes: int = 0
    replicas_repaired: int = 0  # replica slots the audit found unlike their primary's, replaced by its copy


@dataclass
class TableService:
    self_id: str
    specs: list[TableSpec]
    replicas: int = 2
    slots: int = 4096
    opt: RowOptConfig = field(default_factory=RowOptConfig)
    release_after: float = 30.0
    applied_keys_kept: int = 4096
    # table -> (lo, hi) -> initial fp32 rows: where a fresh slot starts (the task's init); absent = zeros
    inits: dict = field(default_factory=dict)
    # a flush clips each pushed row to row_clip x the flush's reference row norm (robust_rows.py,
    # --row-clip); 0 = the plain sum
    row_clip: float = 2.0

    def __post_init__(self) -> None:
        self.by_name = {s.name: s for s in self.specs}
        self._bounds = {s.name: slot_bounds(s.rows, self.slots) for s in self.specs}  # the map's layout
        self.shards = {s.name: TableShard(s, min(self.slots, s.rows), self.opt, self.inits.get(s.name))
                       for s in self.specs}
        self.map: OwnershipMap | None = None
        self.epoch = 0  # local count of view changes, for the status page
        self.moving: dict[tuple[str, int], Move] = {}  # slots we own but do not hold yet
        self.releasing: dict[tuple[str, int], float] = {}  # slots we hold but no longer own -> drop time
        self.applied: collections.OrderedDict[tuple[str, str], None] = collections.OrderedDict()
        # pushes accepted and not yet applied (flush), by ticket (with their sender), and their (key, table) pairs
        self.pending: dict[int, tuple[PushRequest, list[str], str]] = {}
        self._pending_keys: set[tuple[str, str]] = set()
        self._tickets = 0
        # names this incarnation's replays (a restarted primary must not reuse a replica's remembered key)
        self.nonce = secrets.token_hex(4)
        self.stats = TableStats()
        self.levels = Levels()  # recent senders' row-norm levels, per table (robust_rows.py)
        self.verdicts: list[RowVerdict] = []  # what the last flush's combine saw, per sender

    # -- the map ------------------------------------------------------------------------------
    @property
    def view(self) -> str:
        return self.map.view if self.map is not None else ""

    def set_members(self, members: Iterable[str], now: float) -> list[Move]:
        """Adopt the map of ``members``; returns the hand-offs this peer must fetch (to == self).

        Slots that nobody can supply are created here from their initial rows. Unchanged members: no-op."""
        members = sorted(set(members))
        if self.map is not None and tuple(members) == self.map.members:
            return []
        old = self.map
        others = [m for m in members if m != self.self_id]
        if old is None and others:
            # We are joining a swarm that already holds the tables: hand-offs come from the owners
            # of the map it had before us (if it has only just started, those hold zero rows too).
            old = OwnershipMap(self.specs, others, replicas=self.replicas, slots=self.slots)
        new = OwnershipMap(self.specs, members, replicas=self.replicas, slots=self.slots)
        fetch: list[Move] = []
        fresh: dict[str, list[int]] = {name: [] for name in self.shards}
        moving = {k: m for k, m in self.moving.items() if self.self_id in new.owners(*k)}
        for mv in moves(old, new):
            if mv.to != self.self_id:
                continue
            key = (mv.table, mv.slot)
            self.releasing.pop(key, None)
            # A copy we still hold from an earlier map (waiting to be released) is stale: we were
            # not an owner in `old`, so updates went elsewhere. Fetch it again.
            sources = tuple(s for s in mv.sources if s != self.self_id)
            if not sources and old is not None:
                # Every old owner has left our map. One may only have been declared dead by mistake
                # (an overloaded peer that will refute): keep asking the old owners for a while
                # (TableClient.fetch's deadline) before the slot restarts from zero rows (give_up).
                sources = tuple(o for o in old.owners(mv.table, mv.slot) if o != self.self_id)
            if sources:
                moving[key] = Move(mv.table, mv.slot, mv.to, sources)
                fetch.append(moving[key])
            else:  # a new swarm's slot: nobody ever had it
                fresh[mv.table].append(mv.slot)
                self.stats.slots_created += 1
        for name, slots in fresh.items():
            self.shards[name].create_slots(slots)
        for name, shard in self.shards.items():
            for slot in shard.slots():
                if self.self_id not in new.owners(name, slot) and (name, slot) not in self.releasing:
                    self.releasing[(name, slot)] = now + self.release_after
        # Published last, moves first: this runs on the table thread while the event loop (the
        # status page, a test's "settled") reads map and moving without it. Whoever sees the new
        # map must also see the slots it still awaits, never a map whose slots look held.
        self.moving = moving
        self.map = new
        self.epoch += 1
        self.stats.view_changes += 1
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

    def _moving_slots(self, table: str) -> np.ndarray:
        """int64 slots of ``table`` this peer owns but is still fetching."""
        return np.asarray([s for (t, s) in self.moving if t == table], dtype=np.int64)

    def _held(self, table: str, ids: np.ndarray) -> None:
        """Raise Moving / NotPrimary unless every id's slot is held here and not being handed over.
        Vectorised (one gather of a per-slot mask): a pull touches hundreds of slots, and this runs
        for every request served."""
        if not len(ids):
            return
        slots = self.map.slot_of(table, ids)
        if self.moving:
            hit = np.intersect1d(slots, self._moving_slots(table))
            if hit.size:
                raise Moving(f"slot {int(hit[0])} of {table!r} is being handed over to this peer")
        ok = self.shards[table].held_mask(self.map.n_slots(table))[slots]
        if not bool(ok.all()):
            raise NotPrimary(f"this peer does not hold slot {int(slots[~ok].min())} of {table!r}")

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

    def read_held(self, table: str, ids: np.ndarray, view: str) -> tuple[torch.Tensor, np.ndarray]:
        """Rows for a rank of our host group (swarm/group/rows.py): every id whose slot is held here
        and not being handed over, zeros elsewhere, and the mask of the ids served. The asker falls
        back to HTTP for the rest; an asker under another view gets nothing (fencing, as over HTTP)."""
        ok = np.zeros(len(ids), dtype=bool)
        if self.map is None or view != self.map.view or not len(ids):
            return torch.zeros(len(ids), self.by_name[table].dim), ok
        slots = self.map.slot_of(table, ids)
        ok = self.shards[table].held_mask(self.map.n_slots(table))[slots] & ~np.isin(slots, self._moving_slots(table))
        rows = torch.zeros(len(ids), self.by_name[table].dim)
        if ok.any():
            rows[torch.from_numpy(ok)] = self.shards[table].read(ids[ok])
        self.stats.rows_served += int(ok.sum())
        return rows, ok

    def _push_tables(self, req: PushRequest) -> list[str]:
        """The tables of ``req`` to apply (a repeated key's are acknowledged, not applied again);
        raises Fenced / NotPrimary / Moving / ShardError unless we may apply all of them now."""
        self._fence(req.view)
        todo = []
        for table, ids in req.ids.items():
            if (req.key, table) in self.applied or (req.key, table) in self._pending_keys:
                self.stats.duplicate_pushes += 1
                continue
            slots = self.map.slot_of(table, ids)
            om = self.map.owner_matrix(table)
            me = self.map.index[self.self_id] if self.self_id in self.map.index else -1
            if not bool(np.all(om[slots, 0] == me)):
                raise NotPrimary(f"this peer is not the primary of every slot of {table!r} in this push")
            self._held(table, ids)
            g = req.grads[table]
            if g.numel() and float(g.abs().max()) > MAX_GRAD:
                raise ShardError(f"row gradients of {table!r} exceed {MAX_GRAD:g} in magnitude")
            todo.append(table)
        return todo

    def accept_push(self, req: PushRequest, sender: str | None = None) -> int | None:
        """Check a push as its primary and queue it for the next flush(); returns its ticket, or
        None when it is a repeat (acknowledge it, apply nothing). Raises like apply_push.
        ``sender``: who the robust combine charges the rows to (default: the key's peer part)."""
        todo = self._push_tables(req)
        if not todo:
            return None
        self._tickets += 1
        self.pending[self._tickets] = (req, todo, sender if sender is not None else sender_of(req))
        self._pending_keys.update((req.key, t) for t in todo)
        return self._tickets

    def pending_senders(self) -> set[str]:
        """Who the pushes queued for the next flush are from (PushBatcher: a flush may go early)."""
        return {sender for _, _, sender in self.pending.values()}

    def flush(self, dtype: str | None = None) -> tuple[dict[str, list[Replay]], dict[int, Exception | None]]:
        """Apply every queued push together: ONE optimizer step per row on the sum of the gradients
        the pushes brought for it (DDP's one step on the reduced gradient; a row four peers touched
        is updated, and replayed to its replicas, once instead of four times). The gradients are
        rounded to ``dtype`` (this primary's push wire dtype) before they are applied, so the
        replicas replay exactly these bits in that dtype. Returns the replays to forward and each ticket's
        outcome: None (applied) or why it was refused (the map changed since it was accepted)."""
        pending, self.pending = self.pending, {}
        self._pending_keys.clear()
        outcome: dict[int, Exception | None] = {}
        batch: list[tuple[PushRequest, list[str], str]] = []
        self.verdicts = []
        for ticket, (req, tables, sender) in pending.items():
            # accept_push checked the push under this view; within one view the map, its primaries
            # and the slots held and not moving do not change (set_members makes a new view), so
            # only the view needs checking again
            try:
                self._fence(req.view)
            except (Fenced, Moving) as e:
                outcome[ticket] = e
                continue
            outcome[ticket] = None
            batch.append((req, tables, sender))
        try:
            forward = self._apply_batch(batch, dtype, f"{self.self_id}.{self.nonce}/flush:{self.stats.flushes}",
                                        self.row_clip)
        except ShardError as e:  # nothing was applied
            return {}, {t: (e if o is None else o) for t, o in outcome.items()}
        self.stats.flushes += 1
        return forward, outcome

    def apply_push(self, req: PushRequest) -> dict[str, list[Replay]]:
        """Apply one push now, alone, as the primary (a host group's owner applies each rank's part
        this way); returns {replica peer: [Replay]} to forward."""
        todo = self._push_tables(req)
        # one push is split across primaries, each replaying its part to the same replicas: the
        # replica's exactly-once key names the primary too
        # (not clipped: a host group's ranks are one user's processes, trusted; docs/security.md)
        return self._apply_batch([(req, todo, sender_of(req))], None, f"{self.self_id}/{req.key}", 0.0)

    def _apply_batch(self, batch: list[tuple[PushRequest, list[str], str]], dtype: str | None,
                     replay_key: str, clip: float) -> dict[str, list[Replay]]:
        """One optimizer step per row over the pushes of ``batch``: rows combined across pushes by
        robust_rows.combine (``clip`` 0: summed); transactional per call: on ShardError no row has
        changed (and no sender's level is remembered)."""
        by_table: dict[str, list[Part]] = {}
        for req, tables, sender in batch:
            for t in tables:
                by_table.setdefault(t, []).append(Part(sender, req.ids[t], req.grads[t]))
        combined = {}
        seen: dict[str, list] = {}  # sender -> [rows, clipped, outlier, shared, agreement, disagreed, ratio]
        levels = {}
        for table, parts in by_table.items():
            c = combine(parts, clip, self.levels.others(table, self.stats.flushes, {p.sender for p in parts})
                        if clip > 0 else ())
            ids, grads = c.ids, c.grads
            levels[table] = c.levels
            for s in c.rows:
                v = seen.setdefault(s, [0, 0, False, 0, None, False, 0.0])
                v[0] += c.rows[s]
                v[1] += c.clipped[s]
                v[2] |= s in c.outliers
                v[3] += c.shared.get(s, 0)
                if s in c.agreement:
                    v[4] = c.agreement[s] if v[4] is None else min(v[4], c.agreement[s])
                v[5] |= s in c.disagreeing
                v[6] = max(v[6], c.ratios.get(s, 0.0))
            if dtype is not None:  # (a no-op on one push that came in ``dtype``)
                grads = roundtrip(grads, dtype)
            combined[table] = (ids, grads, sum(len(p.ids) for p in parts) - len(ids))
        # check every table before changing any (apply_checked itself is transactional per table)
        checked = {table: self.shards[table].check_grads(ids, grads) for table, (ids, grads, _) in combined.items()}
        forward: dict[str, list[Replay]] = {}
        for table, (ids, grads, merged) in combined.items():
            update = self.shards[table].apply_checked(checked[table])
            self.stats.rows_updated += len(ids)
            self.stats.rows_combined += merged
            self._fan_out(Replay(table, self.map.view, replay_key, ids, grads, update["step"] - 1, dtype), forward)
        for table, lv in levels.items():
            self.levels.remember(table, lv, self.stats.flushes)
        self.verdicts = [RowVerdict(s, rows, clipped, bool(out), sh, agr, bool(dis), ratio)
                         for s, (rows, clipped, out, sh, agr, dis, ratio) in seen.items()]
        self.stats.rows_clipped += sum(v.clipped for v in self.verdicts)
        self.stats.outlier_pushes += sum(v.outlier for v in self.verdicts)
        self.stats.disagreeing_pushes += sum(v.disagreed for v in self.verdicts)
        for req, tables, _ in batch:
            for t in tables:
                self._remember((req.key, t))
            self.stats.pushes_applied += len(tables)
        return forward

    def _fan_out(self, rp: Replay, forward: dict) -> None:
        """Cut an applied push by replica: each replica replays the rows of the slots it holds."""
        if self.map.replicas < 2:
            return
        slots = self.map.slot_of(rp.table, rp.ids)
        om = self.map.owner_matrix(rp.table)[slots, 1:]
        for r in range(om.shape[1]):
            for member_idx in np.unique(om[:, r]).tolist():
                sel = np.flatnonzero(om[:, r] == member_idx)
                t = torch.from_numpy(sel)
                part = Replay(rp.table, rp.view, rp.key, rp.ids[sel], rp.grads[t], rp.pre_step[t], rp.dtype)
                forward.setdefault(self.map.members[member_idx], []).append(part)

    def apply_replays(self, rps: list[Replay]) -> ReplayOutcome:
        """Replay a primary's optimizer step on our replica rows (one message: every table of one
        flush): the same gradients on rows at the same update count give the same bits. Row by
        row: a row whose counter is not the primary's pre-step one (it missed or reordered an
        update) is left alone and named in ``stale``, for the primary to heal with its full state;
        the other rows take the step (each row's step depends on that row alone). Every table is
        checked before any is changed. ``applied`` False (nothing done) when it is a repeat."""
        todo, stale = [], {}
        for rp in rps:
            self._fence(rp.view)
            if (rp.key, "replica:" + rp.table) in self.applied:
                continue
            self._held(rp.table, rp.ids)
            shard = self.shards[rp.table]
            match = torch.eq(shard.steps(rp.ids), rp.pre_step)
            if not bool(match.all()):
                keep = match.numpy()
                stale[rp.table] = rp.ids[~keep]
                ids, grads = rp.ids[keep], rp.grads[match]
            else:
                ids, grads = rp.ids, rp.grads
            todo.append((rp, shard.check_grads(ids, grads) if ids.size else None))
        for rp, checked in todo:
            if checked is not None:
                self.shards[rp.table].apply_checked(checked)
            self._remember((rp.key, "replica:" + rp.table))
            self.stats.replays_applied += 1
        if stale:
            self.stats.replays_diverged += 1
            self.stats.rows_stale += sum(len(v) for v in stale.values())
        return ReplayOutcome(bool(todo), stale)

    def full_state(self, table: str, ids: np.ndarray) -> dict[str, torch.Tensor]:
        """Current rows and optimizer state, for a replica that diverged (a full-state update)."""
        self._held(table, ids)
        return self.shards[table].read_state(ids)

    def apply_replica(self, table: str, update: dict[str, torch.Tensor], view: str, key: str,
                      mode: str = "heal") -> bool:
        """A primary's full-state update of rows we replicate. A heal overwrites: the primary saw
        our counters and answers with its rows. A catch-up (swarm/tables/owed.py) is taken only by
        rows that have had fewer updates here than in it: a newer replay may have overtaken it
        (it would roll them back), and at an equal count the row already has that update (a
        replay whose answer was lost) or another one, which is the audit's to judge, not a
        catch-up's to overwrite."""
        self._fence(view)
        ids = update["ids"].numpy()
        self._held(table, ids)
        if mode == "catch-up":
            newer = self.shards[table].steps(ids) >= update["step"]
            if bool(newer.any()):
                self.stats.replica_rows_newer += int(newer.sum())
                keep = ~newer
                update = {k: v[keep] for k, v in update.items()}
                if not len(update["ids"]):
                    return True
        self.shards[table].apply_replica_update(update)
        self.stats.replica_updates += 1
        return True

    def _remember(self, key: tuple[str, str]) -> None:
        self.applied[key] = None
        while len(self.applied) > self.applied_keys_kept:
            self.applied.popitem(last=False)

    # -- replica audit (swarm/tables/audit.py) -------------------------------------------------
    def replica_slots(self) -> dict[str, dict[str, list[int]]]:
        """{primary: {table: [slot, ...]}} of the slots this peer holds as a replica in the current
        map (not those it is still fetching): what an audit compares, by whom to ask."""
        out: dict[str, dict[str, list[int]]] = {}
        m = self.map
        if m is None or self.self_id not in m.index or m.replicas < 2:
            return out
        me = m.index[self.self_id]
        for name in m.tables:
            om = m.owner_matrix(name)
            mine = np.flatnonzero((om[:, 1:] == me).any(axis=1))
            held = self.shards[name].held_mask(m.n_slots(name))
            moving = self._moving_slots(name)
            mine = mine[held[mine] & ~np.isin(mine, moving)]
            for prim in np.unique(om[mine, 0]).tolist():
                slots = mine[om[mine, 0] == prim]
                out.setdefault(m.members[prim], {})[name] = slots.tolist()
        return out

    def digests(self, table: str, slots: list[int]) -> list[Digest | None]:
        """The digest of each slot held here and not being handed over (None for the others)."""
        if table not in self.shards:
            raise ShardError(f"unknown table {table!r}")
        shard, out = self.shards[table], []
        for s in slots:
            if (table, s) in self.moving or not shard.has_slot(s):
                out.append(None)
            else:
                out.append(Digest(*shard.digest(s)))
        return out

    def digests_under(self, view: str, table: str, slots: list[int]) -> list[Digest | None]:
        """digests() for a replica that asks under ``view`` (Fenced when it is not ours): digests
        taken under different maps are not comparable."""
        self._fence(view)
        return self.digests(table, slots)

    def repair(self, table: str, slot: int, blob: bytes | int, view: str) -> bool:
        """Replace our replica copy of ``slot`` with its primary's (an audit found them apart), a
        slot blob or FRESH (never updated: its initial rows). False, changing nothing, when the map
        changed since (``view``), we no longer replicate it, or the copy is older than ours (a
        replay reached us after it was taken); raises WireError / ShardError for a copy that does
        not decode as that slot."""
        m = self.map
        if m is None or m.view != view or (table, slot) in self.moving or not self.shards[table].has_slot(slot):
            return False
        if self.self_id not in m.owners(table, slot)[1:]:
            return False
        shard = self.shards[table]
        ours = shard.digest(slot)[0]
        if blob == FRESH:
            if ours:  # replays reached us since the primary's copy was taken: it is older than ours
                return False
            shard.create_slot(slot)
        else:
            name, got, tensors, _ = decode_slot(blob, self.by_name, self._slot_rows, self.opt.kind)
            if (name, got) != (table, slot):
                raise ShardError(f"asked for slot {slot} of {table!r}, got slot {got} of {name!r}")
            if int(tensors["step"].sum()) < ours:
                # a replay landed here after the copy was taken: installing it would drop that update;
                # the next audit compares again
                return False
            shard.import_slot(slot, tensors)
        self.stats.replicas_repaired += 1
        return True

    # -- hand-off -----------------------------------------------------------------------------
    def export_slot_or_fresh(self, table: str, slot: int) -> bytes | int:
        """export_slot, or FRESH (0) for a slot no update has touched: the new owner creates its
        zero rows itself instead of receiving them (a swarm's first joins move no row bytes)."""
        if (table in self.shards and (table, slot) not in self.moving and self.shards[table].has_slot(slot)
                and self.shards[table].untouched(slot)):
            return FRESH
        return self.export_slot(table, slot)

    def export_slot(self, table: str, slot: int) -> bytes:
        """A held slot, rows and optimizer state, for a new owner (not fenced: reading is harmless).

        A copy kept for release, or one we hold while fetching the slot ourselves (a checkpoint's),
        may be older than the owners': the asker keeps the newest of all the copies it is offered
        (import_best). Offering it matters when peers restart from checkpoints at the same time:
        each is fetching the slots the other holds, and neither would ever be answered."""
        if table not in self.shards:
            raise NotPrimary(f"unknown table {table!r}")
        shard = self.shards[table]
        if not shard.has_slot(slot):
            raise NotPrimary(f"this peer does not hold slot {slot} of {table!r}")
        return encode_slot(table, slot, shard.export_slot(slot), self.view or "0" * 16)

    def import_best(self, move: Move, blobs: list[bytes]) -> bool:
        """Install the newest of the offered copies of a slot we await; False if none is usable or
        the slot is no longer wanted. Row update counters only grow, so the copy with the most
        updates applied is the current one (a copy kept for release by a former owner may be older).
        A stale copy this peer still holds counts as an offer too."""
        if self.moving.get((move.table, move.slot)) is not move:
            return False
        best, best_version = None, -1
        for blob in blobs:
            if blob == FRESH:
                if best_version < 0:
                    best, best_version = FRESH, 0
                continue
            try:
                table, slot, tensors, _ = decode_slot(blob, self.by_name, self._slot_rows, self.opt.kind)
            except ValueError:  # (also a copy of another optimizer's state: --row-state is the swarm's)
                continue
            if (table, slot) != (move.table, move.slot):
                continue
            version = int(tensors["step"].sum())
            if version > best_version:
                best, best_version = tensors, version
        if best is None:
            return False
        shard = self.shards[move.table]
        if not (shard.has_slot(move.slot) and int(shard.export_slot(move.slot)["step"].sum()) > best_version):
            if best is FRESH:
                shard.create_slot(move.slot)
            else:
                shard.import_slot(move.slot, best)
        del self.moving[(move.table, move.slot)]
        self.stats.slots_fetched += 1
        return True

    def give_up(self, move: Move) -> None:
        """No source could hand the slot over: keep the copy we hold (a checkpoint's, or an older
        one), else start it from zeros (its rows are lost). Only the very move awaited, as in
        import_best: a newer view's move of the same slot is another fetch's, still under way."""
        key = (move.table, move.slot)
        if self.moving.get(key) is move:
            del self.moving[key]
            if self.shards[move.table].has_slot(move.slot):
                self.stats.slots_kept += 1
                return
            self.shards[move.table].create_slot(move.slot)
            self.stats.slots_lost += 1
            self.stats.slots_created += 1

    def _slot_rows(self, table: str, slot: int) -> tuple[int, int]:
        b = self._bounds[table]
        if not 0 <= slot < len(b) - 1:
            raise ValueError(f"slot {slot} out of range for {table!r}")
        return int(b[slot]), int(b[slot + 1])

    def install_checkpoint(self, slots: dict[str, dict[int, dict[str, torch.Tensor]]]) -> int:
        """Hold the slots of a checkpoint (before the first map). A copy is only a candidate: at
        hand-off the newest copy of a slot wins, so an old checkpoint never overwrites newer rows."""
        n = 0
        for name, by_slot in slots.items():
            if name not in self.shards:
                raise ShardError(f"checkpoint holds unknown table {name!r}")
            for slot, tensors in by_slot.items():
                self.shards[name].import_slot(slot, tensors)
                n += 1
        return n

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
            "row_clip": self.row_clip,  # robust combine of pushes (stats: rows_clipped, outlier_pushes)
            "stats": vars(self.stats).copy(),
        }

