"""Row pull, gradient push, replica updates and slot hand-off over HTTP: a thin shell around
TableService (routes) and the client side a training peer uses each step.

Routes (docs/protocol.md, "Sharded tables"):
  POST /v1/rows/pull     PullRequest (msgpack)    -> rows (safetensors), in request order (a tagged
                         request: the rows whose tags changed, and which were left out)
  POST /v1/rows/push     PushRequest (safetensors) -> JSON, after the replicas acknowledged
  POST /v1/rows/replay   a primary's applied flush, every table, replayed by a replica (safetensors)
                         -> JSON {applied, stale: {table: [row id, ...]}}
  POST /v1/rows/replica  full-state replica update (safetensors) -> JSON: a heal of the rows a replay
                         found stale, or a catch-up of rows whose replay did not land (tables/owed.py)
  POST /v1/rows/slots    {"table", "slots": [..]} (msgpack) -> {"slots": [slot blob, ...]} (msgpack)
  POST /v1/rows/digests  {"table", "view", "slots": [..]} (msgpack) -> {"digests": [[count, checksum] | None]}

Every TableService call runs on the peer's table thread (``work``), one at a time.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import numpy as np
import torch
from aiohttp import web

from .. import encoding, robust
from ..transport import PeerUnreachable, Transport
from ..bodies import INLINE_BYTES, MSGPACK_TYPE, SENDER, BadRequest, msgpack_response, pack, read_body, unpack_map
from .audit import MAX_DIGESTS, Digest, ReplicaAudit
from .handoff import DEADLINE_S, Done, HandoffPlan, Sleep
from .owed import Debt, OwedRows
from .ownership import Move
from .robust_rows import verdict_severity
from .service import FRESH, Fenced, Moving, NotPrimary, RowVerdict, TableService, sender_of
from .shard import ShardError
from .formats import (PullRequest, PushRequest, Replay, WireError, decode_pull, decode_push, decode_replays,
                   decode_replica, decode_rows, decode_rows_tagged, encode_pull, encode_push, encode_replay_reply, encode_replays,
                   encode_replica, encode_rows, roundtrip, stale_rows)
from .arrivals import PushArrivals
from .held import HeldRows
from .replays_due import ReplaysDue

log = logging.getLogger("swarm.tables")
Work = Callable[..., Awaitable]
MAX_IDS = 1 << 22  # ids in one pull or push request
SLOTS_PER_REQUEST = 64
CATCH_UP_ROWS = 2048  # rows per catch-up request (~3 MB of Adam state at dim 128: seconds on a slow link)
CATCH_UP_FIRST_S, CATCH_UP_MAX_S = 0.5, 10.0  # a catch-up round's wait: doubles while none lands
# the longest a pull waits for a replay it was told of before it reads our (older) copy: a flush's
# replays take ~0.1-0.3 s at 1 MB/s; one that has not come by then is late for a reason (a primary
# dead or moving, a replay refused) that waiting will not cure
REPLAY_WAIT_S = 2.0


@dataclass
class RowStats:
    pulls: int = 0
    rows_pulled_remote: int = 0
    rows_read_local: int = 0
    rows_missing: int = 0  # rows a pull could not get in time (zeros were used)
    rows_offered: int = 0  # of rows_pulled_remote: held rows whose tags a pull carried (HeldRows)
    rows_reused: int = 0  # of rows_offered: those their owners left out, unchanged
    pushes_sent: int = 0
    push_failures: int = 0
    retries: int = 0
    rows_healed: int = 0  # replica rows a replay found stale, sent in full state (as a primary)
    rows_caught_up: int = 0  # replica rows whose replay did not land, caught up since (as a primary)
    # with local steps, flushes that went without a push from every contributor (the wait for a
    # window's pushes ran out: one touched none of our rows, or was slow, dead or banned)
    flushes_partial: int = 0
    # pulls that waited for a replay before reading our replica copy, and the seconds they waited
    replay_waits: int = 0
    replay_wait_s: float = 0.0
    latency_ms: collections.deque = field(default_factory=lambda: collections.deque(maxlen=512))

    def percentiles(self) -> dict[str, float | None]:
        if not self.latency_ms:
            return {"p50": None, "p95": None, "p99": None}
        a = np.asarray(self.latency_ms)
        return {f"p{q}": round(float(np.percentile(a, q)), 2) for q in (50, 95, 99)}


class Banned(Exception):
    """A push from a sender banned for now (HTTP 403 ``banned``)."""


def push_sender(request: web.Request, req: PushRequest) -> str:
    """Who sent a push, for the robust combine's scores and bans: the request's authenticated
    sender (server.authenticate). A push whose key ("peer:step") names another peer is refused: a
    member cannot push in another's name."""
    sender = request[SENDER]
    if sender_of(req) != sender:
        raise BadRequest(f"push names sender {sender_of(req)[:16]!r} but was signed by {sender[:16]!r}", 403,
                         code="sender")
    return sender


class TableClient:
    """The puller and pusher side: cut ids by owner, one request per owner, concurrently; and, as a
    primary, the scores of the members whose pushes it combines (``scores``)."""

    def __init__(self, service: TableService, transport: Transport, work: Work, self_id: str,
                 addr_of: Callable[[str], str | None], down: Callable[[], set[str]],
                 row_dtype: str = "int8", push_dtype: str = "int8", timeout: float = 10.0,
                 push_window: float = 0.1, ban_seconds: float = 60.0,
                 event: Callable[[str, str], None] | None = None,
                 complete_pushes: Callable[[], set[str]] | None = None, ack_when_applied: bool = False,
                 whole_wait: float | None = None):
        self.service = service
        self.transport = transport
        self.work = work
        self.self_id = self_id
        self.addr_of = addr_of
        self.down = down
        self.row_dtype = row_dtype
        self.push_dtype = push_dtype
        self.timeout = timeout
        self.stats = RowStats()
        # with local steps: the last window's pulled rows and their tags (use_held); a pull then
        # asks their owners only for the rows that changed
        self.held: HeldRows | None = None
        # push key -> the longest a primary held it for the rest of its flush, seconds (push_held)
        self._push_held: dict[str, float] = {}
        self.dims = {s.name: s.dim for s in service.specs}
        # the primary's side of the pushes it receives
        self.batcher = PushBatcher(self, push_window, complete_pushes, ack_when_applied, whole_wait)
        # row pushes are scored apart from dense payloads: only this primary sees its flushes, so a
        # ban here must not change the dense rounds it takes (those are the same on every peer)
        self.scores = robust.Scoreboard(robust.ScoreConfig(ban_seconds=ban_seconds))
        self.event = event
        # replica rows whose replay did not land, and the task that catches them up (tables/owed.py)
        self.owed = OwedRows()
        self._catching_up: asyncio.Task | None = None
        # replays our push answers said are coming to us as a replica; pulls wait for them before
        # they read our copy of those primaries' slots (tables/replays_due.py), REPLAY_WAIT_S at most
        self.replays = ReplaysDue()
        self._replay_in = asyncio.Event()  # set and renewed each time a replay lands

    # -- pull ---------------------------------------------------------------------------------
    def use_held(self, cap: int) -> None:
        """Conditional pulls (local steps): keep up to ``cap`` rows of each window's remote pulls,
        in the client's dtype, and offer their tags to the next window's pulls (tables/held.py)."""
        self.held = HeldRows(self.dims, self.row_dtype, cap) if cap else None

    def next_window(self) -> None:
        """A local-step window begins: the rows the last one pulled are what its pulls may reuse."""
        if self.held is not None:
            self.held.next_window()

    async def pull(self, want: dict[str, np.ndarray], dtype: str | None = None, primaries: bool = False
                   ) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
        """Rows of ``want`` (sorted-unique ids per table), fp32 in ids order, and the ids that could
        not be had before the timeout (their rows are zeros); ``dtype``: the wire dtype of remote
        rows, when not the client's (``row_dtype``). ``primaries``: read every row from its slot's
        primary, ours included, not from our replica copy, which a replay may not have reached
        yet (an evaluation: every peer then reads the same rows; a replica slot whose primary is
        down is read wherever the pull would read it)."""
        t0 = time.monotonic()
        rows = {t: torch.zeros(len(ids), self.dims[t]) for t, ids in want.items()}
        # what is left to fetch, as positions into want[table] (ascending)
        todo = {t: np.arange(len(ids)) for t, ids in want.items() if len(ids)}
        unreachable: set[str] = set()
        if not primaries:
            await self._replays_for(want)
        attempt = 0
        while todo:
            omap = self.service.map
            if omap is None:
                break
            by_peer: dict[str, dict[str, np.ndarray]] = {}  # peer -> table -> positions into want
            for table, pos in todo.items():
                ids = want[table][pos]
                # ids whose slot this peer owns (primary or replica; with ``primaries``, primary) are read here: a replica is
                # written before the primary acknowledges a push (--push-ack replicated), so it is
                # as current as the primary; with --push-ack applied (local steps) its replay may
                # still be on its way (docs/design.md, "When a primary answers a push")
                mine = omap.owned_mask(self.self_id, table, ids, primary=primaries)
                if mine.any():
                    by_peer.setdefault(self.self_id, {})[table] = pos[mine]
                rest = pos[~mine]
                for peer, p in omap.cut(table, want[table][rest], down=self.down() | unreachable).items():
                    part = by_peer.setdefault(peer, {})
                    # (ours already with ``primaries``: a replica slot of ours whose primary is down)
                    part[table] = np.sort(np.concatenate([part[table], rest[p]])) if table in part else rest[p]
            results = await asyncio.gather(*(self.pull_from(peer, {t: want[t][p] for t, p in sub.items()}, omap.view,
                                                            dtype) for peer, sub in by_peer.items()))
            left: dict[str, list[np.ndarray]] = {}
            for (peer, sub), (got, gone) in zip(by_peer.items(), results):
                if gone:
                    unreachable.add(peer)  # route its slots to a replica on the next try
                for table, p in sub.items():
                    if got is None:
                        left.setdefault(table, []).append(p)
                    else:
                        rows[table][torch.from_numpy(p)] = got[table]
            todo = {t: np.sort(np.concatenate(ps)) for t, ps in left.items()}
            attempt += 1
            if not todo or not await self._again(t0, attempt):
                break
        self.stats.pulls += 1
        missing = {t: want[t][pos] for t, pos in todo.items()}
        self.stats.rows_missing += sum(len(v) for v in missing.values())
        self.stats.latency_ms.append((time.monotonic() - t0) * 1000)
        return rows, missing

    def replay_landed(self, key: str) -> None:
        """A primary's replay keyed ``key`` was applied to our replica rows (the replay route)."""
        self.replays.landed(key)
        self._replay_in.set()
        self._replay_in = asyncio.Event()

    async def _replays_for(self, want: dict[str, np.ndarray]) -> None:
        """Read-your-writes for replica rows: before a pull reads our copy of slots whose primary
        said a replay of its last flush is coming to us (the flush that applied our push), wait
        for it, REPLAY_WAIT_S at most; then read whatever our copy holds (tables/replays_due.py)."""
        omap = self.service.map
        if omap is None or not self.replays:  # nothing due: the common case, no work on the pull's path
            return
        me = omap.index.get(self.self_id)
        primaries: set[str] = set()
        for table, ids in want.items():
            if len(ids) and me is not None:
                om = omap.owner_matrix(table)[omap.slot_of(table, ids)]
                held = (om[:, 1:] == me).any(axis=1)  # our replica rows among them
                primaries.update(omap.members[i] for i in np.unique(om[held, 0]).tolist())
        waiting = self.replays.due(primaries - self.down())
        if not waiting:
            return
        t0 = time.monotonic()
        deadline = t0 + REPLAY_WAIT_S
        while waiting and (left := deadline - time.monotonic()) > 0:
            try:
                await asyncio.wait_for(self._replay_in.wait(), left)
            except asyncio.TimeoutError:
                break
            waiting = self.replays.due(waiting)
        self.replays.give_up(waiting)
        self.stats.replay_waits += 1
        self.stats.replay_wait_s += time.monotonic() - t0

    async def _again(self, t0: float, attempt: int) -> bool:
        """Whether a pull or push with parts left (begun at ``t0``) tries again: not past ``timeout``;
        then after a backoff that grows with ``attempt`` (50 ms a try, 0.5 s at most)."""
        if time.monotonic() - t0 > self.timeout:
            return False
        self.stats.retries += 1
        await asyncio.sleep(min(0.05 * attempt, 0.5))
        return True

    async def pull_from(self, peer: str, sub: dict[str, np.ndarray], view: str, dtype: str | None = None
                         ) -> tuple[dict[str, torch.Tensor] | None, bool]:
        """One owner's share of a pull, its rows in ``dtype`` on the wire (None: ``row_dtype``):
        (rows or None when it failed, whether the owner is unreachable)."""
        if peer == "":
            return None, False  # every owner of these slots is down right now
        if peer == self.self_id:
            try:
                out = await self.work(lambda: {t: self.service.read_local(t, ids) for t, ids in sub.items()})
            except (Moving, NotPrimary):
                return None, False
            self.stats.rows_read_local += sum(len(v) for v in sub.values())
            return out, False
        addr = self.addr_of(peer)
        if addr is None:
            return None, True
        dtype = dtype or self.row_dtype
        tags, held = {}, {}
        for t, ids in sub.items() if self.held is not None else ():
            got = self.held.lookup(t, ids, dtype)
            if got is not None:
                tags[t], held[t] = got
        req = PullRequest(view=view, dtype=dtype, ids=sub, tags=tags)

        def decode(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
            if self.held is None:
                return decode_rows(data, req, self.dims, held), {}
            return decode_rows_tagged(data, req, self.dims, held)

        try:
            data = await self.transport.request("POST", addr + "/v1/rows/pull", to=peer, body=encode_pull(req),
                                                timeout=self.timeout, reply_limit=_rows_limit(sub, self.dims) + 65536,
                                                kind="rows", reply_kind="rows")
            if len(data) <= INLINE_BYTES:  # a thread hop costs about what decoding this does
                out, now = decode(data)
            else:
                out, now = await asyncio.to_thread(decode, data)
        except PeerUnreachable as e:
            return None, e.status is None
        except WireError:
            return None, False
        self.stats.rows_pulled_remote += sum(len(v) for v in sub.values())
        for t, ids in sub.items() if self.held is not None else ():
            if t in tags:  # a held row whose tag is unchanged was left out by its owner
                offered = tags[t] != 0
                self.stats.rows_offered += int(offered.sum())
                self.stats.rows_reused += int((offered & (tags[t] == now[t])).sum())
            self.held.remember(t, ids, out[t], now[t], dtype)
        return out, False

    # -- push ---------------------------------------------------------------------------------
    async def push(self, grads: dict[str, tuple[np.ndarray, torch.Tensor]], key: str) -> bool:
        """Row gradients to their primaries (same cut as the pull); True when every part landed."""
        t0 = time.monotonic()
        # what is left to deliver, as positions into grads[table] (ascending)
        todo = {t: np.arange(len(ids)) for t, (ids, _) in grads.items() if len(ids)}
        attempt = 0
        refused = False
        while todo:
            omap = self.service.map
            by_peer: dict[str, dict[str, np.ndarray]] = {}  # peer -> table -> positions into grads
            for table, pos in todo.items():
                for peer, p in omap.cut(table, grads[table][0][pos]).items():
                    by_peer.setdefault(peer, {})[table] = pos[p]
            reqs = {peer: self._part(sub, grads, key, omap.view) for peer, sub in by_peer.items()}
            remote = {p: r for p, r in reqs.items() if p not in ("", self.self_id)}
            # every primary's body in one trip to a helper thread (one hop a step, not one per primary)
            bodies = await asyncio.to_thread(lambda: {p: encode_push(r, self.push_dtype) for p, r in remote.items()})
            oks = await asyncio.gather(*(self._push_to(peer, req, bodies.get(peer)) for peer, req in reqs.items()))
            left: dict[str, list[np.ndarray]] = {}
            for (peer, sub), ok in zip(by_peer.items(), oks):
                if ok is None:  # refused for good (we are banned there): not retried
                    refused = True
                elif not ok:
                    for table, p in sub.items():
                        left.setdefault(table, []).append(p)
            todo = {t: np.sort(np.concatenate(ps)) for t, ps in left.items()}
            attempt += 1
            if not todo or not await self._again(t0, attempt):
                break
        if todo or refused:
            self.stats.push_failures += 1
        return not todo and not refused

    @staticmethod
    def _part(sub: dict[str, np.ndarray], grads, key: str, view: str) -> PushRequest:
        """The push of the rows at positions ``sub`` (per table) of ``grads``, with their gradients."""
        ids, parts = {}, {}
        for table, pos in sub.items():
            all_ids, g = grads[table]
            if len(pos) == len(all_ids):  # one primary has them all (positions are ascending)
                ids[table], parts[table] = all_ids, g
            else:
                ids[table], parts[table] = all_ids[pos], g[torch.from_numpy(pos)]
        return PushRequest(view=view, key=key, ids=ids, grads=parts)

    async def _push_to(self, peer: str, req: PushRequest, body: bytes | None) -> bool | None:
        """One primary's part of a push (``body``: it encoded, for a remote primary); None when the
        primary refused it for good (403 banned: retrying would only hold up our steps)."""
        self.stats.pushes_sent += 1
        if peer == self.self_id:
            # no wire: the flush rounds what it applies to the push dtype, as for a remote push
            try:
                _, held = await self.batcher.submit_timed(req)
            except (Fenced, Moving, NotPrimary, ShardError):
                return False
            self._note_held(req.key, held)
            return True
        addr = self.addr_of(peer)
        if addr is None or peer == "" or body is None:
            return False
        try:
            reply = await self.transport.request("POST", addr + "/v1/rows/push", to=peer, body=body, timeout=self.timeout,
                                                 content_type="application/octet-stream", kind="rows", reply_kind="rows")
        except PeerUnreachable as e:
            return None if e.code == "banned" else False
        held, replay = push_answer(reply)
        self._note_held(req.key, held)
        self.replays.expect(peer, replay)
        return True

    def _note_held(self, key: str, held: float) -> None:
        """The longest a primary held push ``key`` for the rest of its flush (push_held)."""
        self._push_held[key] = max(self._push_held.get(key, 0.0), held)
        while len(self._push_held) > 64:
            self._push_held.pop(next(iter(self._push_held)))

    def push_held(self, key: str) -> float:
        """Seconds the primaries held push ``key`` for the rest of their flushes, the most of any
        (their answers' ``held_s``; 0 when none said): time its pusher spent waiting for others'
        pushes, not for its own bytes (LocalSteps times its pushes without it)."""
        return self._push_held.get(key, 0.0)

    def pushed_in(self, step: int, senders: set[str]) -> float | None:
        """When the last of ``senders`` had pushed rows of ``step`` to us as their primary (their
        push keys' step; monotonic seconds), or None while one has not."""
        return self.batcher.arrivals.all_in(step, senders)

    # -- hand-off -----------------------------------------------------------------------------
    async def fetch(self, moves: list[Move]) -> None:
        """Fetch newly owned slots, in chunks of SLOTS_PER_REQUEST per table, fetched concurrently:
        each asks the slot's old owners (later every member) for their copies and keeps the newest
        (the most row updates applied); swarm/tables/handoff.py says whom to ask and when."""
        by_table: dict[str, list[Move]] = {}
        for mv in moves:
            by_table.setdefault(mv.table, []).append(mv)
        chunks = [ms[i:i + SLOTS_PER_REQUEST] for ms in by_table.values() for i in range(0, len(ms), SLOTS_PER_REQUEST)]
        await asyncio.gather(*(self._fetch_chunk(c) for c in chunks))

    async def _fetch_chunk(self, chunk: list[Move], deadline_s: float = DEADLINE_S) -> None:
        """Carry out the hand-off policy of one chunk (swarm/tables/handoff.py: whom to ask for
        which slot, which offers count, backoff, when to give up): ask, install the newest copy
        offered (import_best), wait, and in the end give up what no source could hand over."""
        plan = HandoffPlan(chunk, time.monotonic(), deadline_s)
        table = chunk[0].table

        def still_pending(mv: Move) -> bool:
            return self.service.moving.get((mv.table, mv.slot)) is mv

        def reachable(peer: str) -> bool:
            return self.addr_of(peer) is not None

        def members() -> tuple[str, ...] | None:
            return None if self.service.map is None else self.service.map.members

        while not isinstance(step := plan.next_round(time.monotonic(), members(), reachable, still_pending), Done):
            if isinstance(step, Sleep):
                await asyncio.sleep(step.seconds)
                continue
            replies = await asyncio.gather(*(self._ask_slots(src, table, slots) for src, slots in step.asked.items()))
            offers = step.offers(dict(zip(step.asked, replies)))
            installed: dict[Move, bool] = {}
            for mv in step.moves:
                installed[mv] = False
                if mv.slot in offers:
                    try:
                        installed[mv] = await self.work(self.service.import_best, mv, offers[mv.slot])
                    except (WireError, ShardError):
                        pass  # an unusable copy: the slot is asked again
            wait = plan.after_install(installed, still_pending)
            if wait is not None:
                await asyncio.sleep(wait.seconds)
        for mv in step.give_up:
            await self.work(self.service.give_up, mv)

    async def _ask_slots(self, source: str, table: str, slots: list[int]) -> list[bytes | int | None] | None:
        """``source``'s copies of ``slots`` (None for one it does not hold), or None when it did not answer."""
        addr = self.addr_of(source)
        if addr is None:
            return None
        try:
            reply = await self.transport.call(addr, "/v1/rows/slots", {"table": table, "slots": slots}, to=source,
                                              timeout=30.0, kind="handoff", reply_limit=1 << 28)
        except PeerUnreachable:
            return None
        blobs = reply.get("slots")
        if not isinstance(blobs, list) or len(blobs) != len(slots):
            return None
        return [b if isinstance(b, bytes) or (type(b) is int and b == FRESH) else None for b in blobs]

    # -- replica audit ------------------------------------------------------------------------
    async def audit(self, audit: ReplicaAudit) -> list[tuple[str, int]]:
        """Compare every slot this peer replicates with its primary's digest and install the
        primary's copy of those that differ (swarm/tables/audit.py); returns the slots repaired.
        Our digests are taken before the primary's: its update count only grows, so a replay in
        flight can make ours look behind (judged next time), never ahead."""
        plan = await self.work(self.service.replica_slots)
        view = self.service.view
        repaired: list[tuple[str, int]] = []
        for primary, by_table in plan.items():
            if primary in self.down() or self.addr_of(primary) is None:
                continue
            for table, slots in by_table.items():
                for i in range(0, len(slots), MAX_DIGESTS):
                    chunk = slots[i:i + MAX_DIGESTS]
                    ours = await digests_in_pieces(self.work, self.service.digests, table, chunk)
                    theirs = await self._ask_digests(primary, table, chunk, view)
                    if theirs is None or self.service.view != view:
                        continue
                    bad = audit.judge(view, table, chunk, ours, theirs)
                    repaired += [(table, s) for s in await self._repair(primary, table, bad, view)]
        return repaired

    async def _repair(self, primary: str, table: str, slots: list[int], view: str) -> list[int]:
        done = []
        for i in range(0, len(slots), SLOTS_PER_REQUEST):
            part = slots[i:i + SLOTS_PER_REQUEST]
            blobs = await self._ask_slots(primary, table, part)
            for slot, blob in zip(part, blobs or ()):
                if blob is None:
                    continue
                try:
                    if await self.work(self.service.repair, table, slot, blob, view):
                        done.append(slot)
                except (WireError, ShardError) as e:
                    log.warning("primary %s sent an unusable copy of slot %d of %r: %s", primary[:8], slot, table, e)
        return done

    async def _ask_digests(self, primary: str, table: str, slots: list[int], view: str) -> list[Digest | None] | None:
        """The primary's digests of ``slots`` under ``view``; None when it did not answer, answered
        under another view, or sent something malformed."""
        addr = self.addr_of(primary)
        if addr is None:
            return None
        try:
            reply = await self.transport.call(addr, "/v1/rows/digests", {"table": table, "view": view, "slots": slots}, to=primary,
                                              timeout=self.timeout, kind="audit", reply_limit=64 * (len(slots) + 16))
        except PeerUnreachable:
            return None
        got = reply.get("digests")
        if not isinstance(got, list) or len(got) != len(slots):
            return None
        out: list[Digest | None] = []
        for d in got:
            if d is None:
                out.append(None)
            elif (isinstance(d, list) and len(d) == 2 and type(d[0]) is int and d[0] >= 0
                  and isinstance(d[1], str) and len(d[1]) == 32):
                out.append(Digest(d[0], d[1]))
            else:
                return None
        return out

    # -- scores of the pushes this primary combines (docs/design.md, "Robust row pushes") --------
    def banned(self, sender: str) -> bool:
        """True while ``sender``'s row pushes are refused here (a read: safe from the table thread)."""
        return sender != self.self_id and self.scores.banned(sender, time.monotonic())

    def refuse(self, sender: str) -> bool:
        """banned(), counting the refusal (on the table thread: a banned sender already has a score,
        so nothing is inserted into the scoreboard the event loop reads)."""
        if not self.banned(sender):
            return False
        self.scores.get(sender).refused += 1
        return True

    def observe(self, verdicts: list[RowVerdict]) -> list[str]:
        """Score one flush's senders (outliers lose score, by how far out they are; clipped rows
        are counted); returns the senders it banned. Our own pushes are not scored."""
        others = [v for v in verdicts if v.sender != self.self_id]
        if not others:
            return []
        newly = self.scores.observe(verdict_report(others), time.monotonic())
        for pid in newly:
            msg = f"{pid[:8]} for {self.scores.cfg.ban_seconds:g} s: its row pushes were outliers"
            if self.event is not None:
                self.event("rows-banned", msg)
            else:
                log.warning("banned %s", msg)
        return newly

    # -- replicas a replay did not reach (swarm/tables/owed.py) ---------------------------------
    def owe(self, peer: str, table: str, ids: np.ndarray) -> None:
        """``peer``'s replica of these rows missed their last update: catch it up in the background."""
        self.owed.add(peer, table, ids)
        if self._catching_up is None or self._catching_up.done():
            self._catching_up = asyncio.ensure_future(self._catch_up_loop())

    async def _catch_up_loop(self) -> None:
        """Catch-up rounds until nothing is owed: at once after a round that landed rows, else
        after a wait that doubles (a replica that is down is soon out of the map, its debt with it)."""
        delay = CATCH_UP_FIRST_S
        while len(self.owed):
            await asyncio.sleep(delay)
            try:
                landed = await self.catch_up()
            except Exception:  # a bug: keep the debt and try again later rather than lose the task
                log.exception("catching replicas up failed")
                landed = 0
            delay = CATCH_UP_FIRST_S if landed else min(2 * delay, CATCH_UP_MAX_S)

    async def catch_up(self) -> int:
        """One round: every replica still owed rows gets their full state, in the current view;
        returns the rows it acknowledged. A replica keeps what a newer replay gave it meanwhile
        (TableService.apply_replica, mode "catch-up")."""
        omap = self.service.map
        debts = self.owed.due(omap, self.self_id)
        if not debts:
            return 0
        return sum(await asyncio.gather(*(self._pay(d, omap.view) for d in debts)))

    async def pay_debts(self, within: float) -> bool:
        """Catch-up rounds for at most ``within`` seconds, until nothing is owed (a peer about to
        leave: its replicas are about to be promoted in its place); True when nothing is. These
        rounds take the background ones' place (two would send the same rows)."""
        if self._catching_up is not None:
            self._catching_up.cancel()
        t0 = time.monotonic()
        while len(self.owed) and time.monotonic() - t0 < within:
            if not await self.catch_up():
                await asyncio.sleep(0.1)
        return not len(self.owed)

    async def _pay(self, debt: Debt, view: str) -> int:
        addr = self.addr_of(debt.peer)
        if addr is None:
            return 0
        landed = 0
        for i in range(0, len(debt.ids), CATCH_UP_ROWS):
            ids = debt.ids[i:i + CATCH_UP_ROWS]
            # (not sent: the map moved on meanwhile, or the replica is out of reach: the next round sees)
            if not await self.send_state(debt.peer, addr, debt.table, ids, view,
                                         f"catch-up-{self.self_id[:16]}:{debt.gen}", "catch-up", timeout=30.0):
                return landed
            n = self.owed.settle(debt.peer, debt.table, ids, debt.gen)
            self.stats.rows_caught_up += n
            landed += n
        return landed

    async def send_state(self, peer: str, addr: str, table: str, ids: np.ndarray, view: str, key: str,
                         mode: str, timeout: float) -> bool:
        """Our rows' full state to a replica of them (``mode``: a heal or a catch-up,
        TableService.apply_replica); False when it was not sent or not taken: we no longer hold
        the rows as they are (the map moved on), or the replica could not be reached."""
        try:
            state = await self.work(self.service.full_state, table, ids)
        except (Moving, NotPrimary, ShardError):
            return False
        body = await asyncio.to_thread(encode_replica, table, state, view, key, mode)
        try:
            await self.transport.request("POST", addr + "/v1/rows/replica", to=peer, body=body, timeout=timeout,
                                         content_type="application/octet-stream", kind="replica", reply_kind="replica")
        except PeerUnreachable:
            return False
        return True

    def close(self) -> None:
        """Stop the background work: the push batcher and the catch-up (what is owed is dropped)."""
        self.batcher.close()
        if self._catching_up is not None:
            self._catching_up.cancel()

    def status(self) -> dict:
        s = self.stats
        return {"pulls": s.pulls, "rows_pulled_remote": s.rows_pulled_remote, "rows_read_local": s.rows_read_local,
                "rows_offered": s.rows_offered, "rows_reused": s.rows_reused, "rows_held": self.held.rows() if self.held is not None else 0,
                "rows_missing": s.rows_missing, "pushes_sent": s.pushes_sent, "push_failures": s.push_failures,
                "retries": s.retries, "rows_healed": s.rows_healed,
                # as a primary: when it answers a push (--push-ack): once applied here, or replicated too
                "push_ack": "applied" if self.batcher.ack_when_applied else "replicated",
                # as a primary: replica rows whose replay did not land and are not caught up yet, by replica
                "rows_owed": self.owed.by_peer(), "rows_caught_up": s.rows_caught_up,
                # as a primary with local steps: flushes that went without every contributor's push
                "flushes_partial": s.flushes_partial,
                # as a replica: pulls that waited for a replay a push answer named, the seconds they
                # waited in all, and replays that had not come by REPLAY_WAIT_S (read-your-writes)
                "replay_waits": s.replay_waits, "replay_wait_s": round(s.replay_wait_s, 3),
                "replays_given_up": self.replays.given_up,
                # per sender of the pushes this primary combined: score, outlier flushes, bans, refusals
                "push_scores": self.scores.status(time.monotonic(), time.time() - time.monotonic())}


def verdict_report(verdicts: list[RowVerdict]) -> robust.Report:
    """A flush's verdicts as the scoreboard reads them: each outlier pays by how far out its level
    or its disagreement is (robust_rows.verdict_severity), as a dense payload pays by its norm."""
    outliers = [v for v in verdicts if v.outlier]
    return robust.Report(count=len(verdicts), senders=[v.sender for v in verdicts],
                         clipped=[v.sender for v in verdicts if v.clipped],
                         outliers=[v.sender for v in outliers],
                         severity={v.sender: verdict_severity(v.ratio, v.agreement, v.disagreed) for v in outliers})


class PushBatcher:
    """The primary's side of row pushes: a push is checked and queued at once (TableService.
    accept_push); ``window`` seconds after the first one, every queued push is applied together
    (TableService.flush: one update per row) and the flush's replays go to the replicas, one
    request per replica. Flushes run one at a time, each replicated before the next is applied, so
    a replica receives them in the order they were applied. A push is answered when its flush has
    been replicated or, with ``ack_when_applied`` (--push-ack applied: local steps by default), as
    soon as it is applied here: its replays then travel while the pusher goes on, and a primary
    that dies before they land leaves its replicas without that flush (docs/design.md, "When a
    primary answers a push").

    ``complete`` (local steps) names the senders whose pushes make a flush whole: one window's
    deltas from every contributor. Once a push from each of them is queued the flush goes without
    waiting further, since a peer sends its window's payload only when its pushes are answered
    (swarm/local_steps.py). Until then it waits up to ``whole_wait`` seconds (default: ``window``)
    after the first: a window's pushes are spread over more than a push window (each peer's
    --push-lead, its window ending a little before or after the others'), and a flush that went
    with part of them left the rest to later flushes, each applied only once the last was
    replicated: the window's last pusher waited out that chain, and every row the peers shared took
    one update, replay and robust combine per part (docs/design.md "Tables in windows")."""

    def __init__(self, client: "TableClient", window: float, complete: Callable[[], set[str]] | None = None,
                 ack_when_applied: bool = False, whole_wait: float | None = None):
        self.client = client
        self.window = window
        self.whole_wait = window if whole_wait is None else whole_wait
        self.complete = complete
        self.ack_when_applied = ack_when_applied
        self._whole = asyncio.Event()  # a push completed the queue (``complete``)
        self._waiting: dict[int, asyncio.Future] = {}
        # (refusal or None, replicated) of pushes whose flush ended before their waiter registered
        self._done: dict[int, tuple[Exception | None, bool]] = {}
        # when each waiting push registered, and how long each answered one was held for the rest
        # of its flush (the window's other pushes), seconds: held_for
        self._since: dict[int, float] = {}
        self._held: dict[int, float] = {}
        # per answered ticket: its flush's replay key and the replicas it goes to (replay_for)
        self._replays: dict[int, tuple[str, frozenset[str]]] = {}
        self._task: asyncio.Task | None = None
        self._closed = False
        # when each member's push of each recent step came in (LocalSteps.others_done_at)
        self.arrivals = PushArrivals()

    def arrived(self, key: str) -> None:
        """A push keyed ``key`` was accepted here (queued, or acknowledged as a repeat) just now."""
        self.arrivals.note(key, time.monotonic())

    async def submit(self, req: PushRequest) -> bool:
        """Apply ``req`` with the next flush; True when its replicas acknowledged it (False when
        the answer went before they did, or they did not). Raises the
        service's refusal (Fenced, NotPrimary, Moving, ShardError): at once, or at the flush when
        the map changed in between."""
        return (await self.submit_timed(req))[0]

    async def submit_timed(self, req: PushRequest) -> tuple[bool, float]:
        """submit(), and the seconds the push was held for the rest of its flush (held_for)."""
        ticket = await self.client.work(self.client.service.accept_push, req)
        self.arrived(req.key)
        replicated = await self.wait(ticket)
        return replicated, self.held_for(ticket)

    async def wait(self, ticket: int | None) -> bool:
        """Wait for the flush of the push TableService.accept_push queued as ``ticket`` (None: a
        repeat, acknowledged at once); True when its replicas acknowledged it. Raises the refusal
        of a push whose map changed before its flush."""
        if ticket is None:
            return True  # a repeat of a push already applied (or queued)
        if ticket in self._done:  # its flush ended before we got here
            err, replicated = self._done.pop(ticket)
        elif self._closed:  # queued as the peer shut down: no flush will come for it
            raise Moving("this peer is shutting down")
        else:
            fut = self._waiting[ticket] = asyncio.get_running_loop().create_future()
            self._since[ticket] = time.monotonic()
            if self._task is None or self._task.done():
                self._task = asyncio.ensure_future(self._run())
            if await self._is_whole():
                self._whole.set()
            err, replicated = await fut
        if err is not None:
            raise err
        return replicated

    def replay_for(self, ticket: int | None, sender: str) -> str | None:
        """The replay key of the flush that applied push ``ticket`` when ``sender`` is one of the
        replicas it goes to (read once; None otherwise): the pusher then waits for that replay
        before it reads its own copy of our slots (tables/replays_due.py)."""
        got = self._replays.pop(ticket, None) if ticket is not None else None
        return got[0] if got is not None and sender in got[1] else None

    def held_for(self, ticket: int | None) -> float:
        """Seconds the answered push ``ticket`` waited for the rest of its flush (0 for a repeat, or
        one whose flush was ready before it registered): what it did not cost its pusher's link. A
        pusher that times its pushes (--push-lead auto) leaves it out, since with local steps a flush
        waits for the window's last pusher (``complete``)."""
        return self._held.pop(ticket, 0.0) if ticket is not None else 0.0

    async def _is_whole(self) -> bool:
        """A push from every sender ``complete`` names is queued."""
        want = self.complete() if self.complete is not None else set()
        return bool(want) and want <= await self.client.work(self.client.service.pending_senders)

    async def _gather(self) -> None:
        """Wait out the push window; with ``complete``, until the queue is whole, ``whole_wait``
        at most (a flush that goes without every sender's push is counted: ``flushes_partial``)."""
        if self.complete is None:
            await asyncio.sleep(self.window)
            return
        self._whole.clear()  # a set() before this is seen by the check below (its push is queued)
        if await self._is_whole():
            return
        try:
            await asyncio.wait_for(self._whole.wait(), self.whole_wait)
        except asyncio.TimeoutError:
            if not await self._is_whole():
                self.client.stats.flushes_partial += 1

    async def _run(self) -> None:
        try:
            await self._flushes()
        finally:  # however the loop ended, nobody is left waiting for a flush that will not come
            self._refuse_waiting()

    def _refuse_waiting(self) -> None:
        """Answer every push still waiting: its flush will not happen (the loop ended, e.g. a
        shutdown cancelled a flush queued on the table thread, or the batcher closed)."""
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_result((Moving("this peer is shutting down"), False))
        self._waiting.clear()
        self._since.clear()

    async def _flushes(self) -> None:
        while self._waiting:
            await self._gather()
            gathered = time.monotonic()
            try:
                forward, outcome, verdicts = await self.client.work(self._flush)
            except Exception as e:  # a bug, not a refusal: answer everyone waiting rather than hang them
                log.exception("flushing row pushes failed")
                outcome = {t: Moving(f"the flush failed: {type(e).__name__}") for t in self._waiting}
                forward, verdicts = {}, []
            observe = getattr(self.client, "observe", None)
            if verdicts and observe is not None:
                observe(verdicts)
            replays = _replay_of(forward)
            if self.ack_when_applied:  # answered now; replicated below, before the next flush
                self._answer(outcome, False, gathered, replays)
            try:
                replicated = await replicate(self.client, forward)
            except Exception:  # a bug, not a refusal: the flush is applied here, so answer (unreplicated)
                log.exception("replicating a flush failed")
                replicated = False
            if not self.ack_when_applied:  # the replays have landed or failed: none to name
                self._answer(outcome, replicated, gathered)

    def _answer(self, outcome: dict[int, Exception | None], replicated: bool, gathered: float,
                replays: tuple[str, frozenset[str]] | None = None) -> None:
        """Resolve the waiters of a flush's tickets (refusal or None; whether replicated); each
        waited ``gathered`` (when the flush stopped gathering) less when it came; ``replays``: the
        flush's replay key and its replicas (replay_for)."""
        for ticket, err in outcome.items():
            since = self._since.pop(ticket, None)
            if since is not None:
                self._held[ticket] = max(0.0, gathered - since)
                while len(self._held) > 1024:
                    self._held.pop(next(iter(self._held)))
            if replays is not None and err is None:
                self._replays[ticket] = replays
                while len(self._replays) > 1024:
                    self._replays.pop(next(iter(self._replays)))
            fut = self._waiting.pop(ticket, None)
            if fut is None:  # its submitter has not registered yet (or was cancelled meanwhile)
                self._done[ticket] = (err, replicated)
                while len(self._done) > 1024:
                    self._done.pop(next(iter(self._done)))
            elif not fut.done():
                fut.set_result((err, replicated))

    def _flush(self) -> tuple[dict, dict, list[RowVerdict]]:
        """On the table thread: the flush, and what its robust combine saw of each sender."""
        forward, outcome = self.client.service.flush(self.client.push_dtype)
        return forward, outcome, list(self.client.service.verdicts)

    async def settled(self) -> None:
        """Return once no push queued here is waiting for its flush (nor one queued meanwhile)."""
        while self._task is not None and not self._task.done():
            await asyncio.gather(asyncio.shield(self._task), return_exceptions=True)

    def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
        self._refuse_waiting()


def _replay_of(forward: dict[str, list[Replay]]) -> tuple[str, frozenset[str]] | None:
    """A flush's replay key and the replicas its replays go to (None: it has none)."""
    for rps in forward.values():
        if rps:
            return rps[0].key, frozenset(forward)
    return None


async def replicate(client: "TableClient", forward: dict[str, list[Replay]]) -> bool:
    """Send a primary's applied pushes to its replicas and wait for them (bounded); True if all landed.

    One message per replica carries every table of a flush. Each replica replays the same
    gradients, in the smallest wire dtype that carries them exactly (a push that came in int4 or
    bf16 replays in it). A replica applies them to the rows at the primary's update count and names
    the others (it missed an update: a join's fetch, a lost replay) in its reply; those rows alone
    get their full state, one request per table."""
    async def one(peer: str, rps: list[Replay], body: bytes) -> bool:
        ok = await deliver(peer, rps, body)
        if not ok:  # (some of) these rows may be behind there: owed a catch-up (swarm/tables/owed.py)
            for rp in rps:
                client.owe(peer, rp.table, rp.ids)
        return ok

    async def deliver(peer: str, rps: list[Replay], body: bytes) -> bool:
        addr = client.addr_of(peer)
        if addr is None:
            return False
        try:
            reply = await client.transport.request("POST", addr + "/v1/rows/replay", to=peer, body=body, timeout=5.0,
                                                   content_type="application/octet-stream", kind="replica",
                                                   reply_kind="replica",
                                                   reply_limit=4096 + 12 * sum(len(rp.ids) for rp in rps))
            stale = stale_rows(reply, rps)
        except PeerUnreachable:
            return False
        except WireError as e:
            log.warning("replica %s answered a replay with %s", peer[:16], e)
            return False
        if not stale:
            return True
        parts = {rp.table: rp for rp in rps}
        return all([await heal(peer, addr, parts[t], ids) for t, ids in stale.items()])

    async def heal(peer: str, addr: str, rp: Replay, ids: np.ndarray) -> bool:
        if not await client.send_state(peer, addr, rp.table, ids, rp.view, rp.key, "heal", timeout=5.0):
            return False
        client.stats.rows_healed += len(ids)
        return True

    # one message per replica and flush (a host group's owner forwards several pushes, keyed apart)
    messages: dict[tuple[str, str, str], list[Replay]] = {}
    for peer, rps in forward.items():
        for rp in rps:
            messages.setdefault((peer, rp.view, rp.key), []).append(rp)
    if not messages:
        return True
    # every replica's body in one trip to a helper thread
    bodies = await asyncio.to_thread(lambda: [encode_replays(rps, [rp.dtype or exact_dtype(rp.grads) for rp in rps])
                                              for rps in messages.values()])
    oks = await asyncio.gather(*(one(peer, rps, body) for ((peer, _, _), rps), body in zip(messages.items(), bodies)))
    return all(oks)


DIGEST_PIECE = 256  # slots checksummed per table-thread job (~12 ms for 16 x 128 Adam rows): pulls wait no longer


async def digests_in_pieces(work: Work, fn: Callable, table: str, slots: list[int]) -> list:
    """``fn(table, part)`` on the table thread for DIGEST_PIECE slots at a time, concatenated: a
    whole audit's checksums in one job would hold up every pull and push it serves meanwhile."""
    out: list = []
    for i in range(0, len(slots), DIGEST_PIECE):
        out += await work(fn, table, slots[i:i + DIGEST_PIECE])
    return out


def push_answer(reply: bytes) -> tuple[float, object]:
    """A push answer's ``held_s`` (seconds the primary held the push for the rest of its flush; 0.0
    when it has none or an unusable one: it only tunes the pusher's --push-lead) and its ``replay``
    (the flush's replay key when it comes to us too; ReplaysDue.expect checks it)."""
    try:
        answer = json.loads(reply)
        held, replay = answer.get("held_s", 0.0), answer.get("replay")
    except (ValueError, AttributeError):
        return 0.0, None
    ok = isinstance(held, (int, float)) and not isinstance(held, bool) and math.isfinite(held) and 0 <= held <= 3600
    return (float(held) if ok else 0.0), replay


def exact_dtype(g: torch.Tensor) -> str:
    """The smallest wire dtype that carries ``g`` without changing a bit (replicas replay exactly)."""
    for dtype in ("int4", "int8", "bf16", "fp16"):
        if torch.equal(roundtrip(g, dtype), g):
            return dtype
    return "fp32"


def _rows_limit(sub: dict[str, np.ndarray], dims: dict[str, int]) -> int:
    return sum(len(ids) * dims[t] * 4 for t, ids in sub.items())


# -- routes -----------------------------------------------------------------------------------------

def _service_errors(e: Exception) -> BadRequest:
    if isinstance(e, Fenced):
        return BadRequest(f"{e}", 409, code="view-mismatch")
    if isinstance(e, Moving):
        return BadRequest(f"{e}", 503, code="slot-moving")
    if isinstance(e, NotPrimary):
        return BadRequest(f"{e}", 409, code="not-owner")
    if isinstance(e, Banned):
        return BadRequest(f"{e}", 403, code="banned")
    return BadRequest(f"{e}", 400)


def body_limits(service: TableService) -> dict[str, int]:
    """Body limit of each table route (bytes), checked before and while the body is read (413).

    A request's ids are strictly increasing and below each table's row count, so no valid body
    carries more than ``rows`` ids per table (and never more than MAX_IDS): the limits follow the
    tables' real size, not MAX_IDS alone (which would allow bodies of several GB)."""
    ids = min(MAX_IDS, sum(s.rows for s in service.specs))
    dim = max(s.dim for s in service.specs)
    return {
        "/v1/rows/pull": 1024 + 8 * ids,  # an id and its tag (conditional pulls)
        "/v1/rows/push": ids * (4 + 4 * dim) + 65536,
        "/v1/rows/replica": ids * 4 * (3 * dim + 4) + 65536,
        "/v1/rows/replay": ids * (4 + 8 + 4 * dim) + 65536,
        "/v1/rows/slots": 65536,
        "/v1/rows/digests": 1024 + 10 * MAX_DIGESTS,
    }


def add_routes(app: web.Application, get_peer: Callable[[web.Request], object]) -> None:
    """Mount the table routes; ``get_peer`` returns the Peer (or raises BadRequest 503 while starting)."""

    def ready(request):
        peer = get_peer(request)
        if getattr(peer, "tables", None) is None or peer.tables.map is None:
            raise BadRequest("this peer serves no tables yet", 503, code="starting")
        return peer

    async def pull(request: web.Request) -> web.Response:
        peer = ready(request)
        body = await read_body(request, body_limits(peer.tables)["/v1/rows/pull"])
        try:
            req = decode_pull(body, peer.tables.by_name, MAX_IDS)
        except WireError as e:
            raise BadRequest(f"bad pull request: {e}") from None

        accept = request.headers.get("Accept-Encoding")

        def serve() -> tuple[bytes, dict[str, str]]:
            data = encode_rows(peer.tables.serve_pull(req), req.dtype, req.tags)
            return encoding.reply(data, accept, peer.transport.compress)  # (here, off the loop)

        try:
            data, headers = await peer.table_work(serve)
        except (Fenced, Moving, NotPrimary, ShardError) as e:
            raise _service_errors(e) from None
        return web.Response(body=data, content_type="application/octet-stream", headers=headers)

    async def decoded_then_applied(request: web.Request, route: str, what: str, decode, apply):
        """The shared path of the write routes: bounded read, then ``apply(peer, decode(body, peer))``
        in one call on the table thread (one thread hop, not two: these bodies are small and
        frequent); 400 on WireError, the service's refusals mapped to 409/503."""
        peer = ready(request)
        body = await read_body(request, body_limits(peer.tables)[route])

        def run():
            try:
                msg = decode(body, peer)
            except WireError as e:
                raise BadRequest(f"bad {what}: {e}") from None
            return apply(peer, msg)

        try:
            return await peer.table_work(run)
        except (Fenced, Moving, NotPrimary, ShardError, Banned) as e:
            raise _service_errors(e) from None

    def admit(peer, request: web.Request, req: PushRequest) -> int | None:
        """On the table thread: refuse a banned sender's push (its rows' outliers here, or its dense
        payloads everywhere), else check and queue it (applied with the next flush)."""
        sender = push_sender(request, req)
        dense = getattr(peer, "robust", None)
        if peer.table_client.refuse(sender) or (dense is not None and dense.banned(sender, time.monotonic())):
            raise Banned(f"sender {sender[:16]!r} is banned for now: its recent row pushes or payloads were "
                         "outliers (docs/design.md, \"Robust row pushes\")")
        return peer.tables.accept_push(req, sender)

    async def push(request: web.Request) -> web.Response:
        ticket, key = await decoded_then_applied(
            request, "/v1/rows/push", "push request",
            lambda body, p: decode_push(body, p.tables.by_name, MAX_IDS),
            lambda p, req: (admit(p, request, req), req.key))
        batcher = ready(request).table_client.batcher
        batcher.arrived(key)
        try:
            replicated = await batcher.wait(ticket)
        except (Fenced, Moving, NotPrimary, ShardError) as e:
            raise _service_errors(e) from None
        answer = {"applied": True, "replicated": replicated, "held_s": round(batcher.held_for(ticket), 3)}
        # the flush's replay, when it goes to the pusher too: its pulls wait for it (tables/replays_due.py)
        replay = batcher.replay_for(ticket, request[SENDER])
        if replay is not None:
            answer["replay"] = replay
        return web.json_response(answer)

    async def replica(request: web.Request) -> web.Response:
        fresh = await decoded_then_applied(
            request, "/v1/rows/replica", "replica update",
            lambda body, p: decode_replica(body, p.tables.by_name, p.tables.opt.kind),
            lambda p, m: p.tables.apply_replica(*m))
        return web.json_response({"applied": fresh})

    async def replay(request: web.Request) -> web.Response:
        outcome, keys = await decoded_then_applied(
            request, "/v1/rows/replay", "replay",
            lambda body, p: decode_replays(body, p.tables.by_name, MAX_IDS),
            lambda p, rps: (p.tables.apply_replays(rps), {rp.key for rp in rps}))
        client = ready(request).table_client
        for key in keys:  # pulls waiting for this replay read our copy now
            client.replay_landed(key)
        return web.json_response(encode_replay_reply(outcome.applied, outcome.stale))

    async def slots(request: web.Request) -> web.Response:
        peer = ready(request)
        limit = body_limits(peer.tables)["/v1/rows/slots"]
        msg = unpack_map(await read_body(request, limit), limit)
        table, wanted = msg.get("table"), msg.get("slots")
        if table not in peer.tables.by_name:
            raise BadRequest(f"unknown table {str(table)[:40]!r}")
        if (not isinstance(wanted, list) or not 0 < len(wanted) <= SLOTS_PER_REQUEST
                or not all(type(s) is int for s in wanted)):
            raise BadRequest(f"slots must be a list of 1..{SLOTS_PER_REQUEST} ints")

        def export() -> list[bytes | int | None]:
            out: list[bytes | int | None] = []
            for s in wanted:
                try:
                    out.append(peer.tables.export_slot_or_fresh(table, s))
                except (NotPrimary, ShardError, ValueError):
                    out.append(None)  # no copy to give (yet): the asker tries the other owners
            return out

        accept = request.headers.get("Accept-Encoding")

        def export_packed() -> tuple[bytes, dict[str, str]]:  # slots of fresh rows are mostly zeros
            return encoding.reply(pack({"slots": export()}), accept, peer.transport.compress)

        data, headers = await peer.table_work(export_packed)
        return web.Response(body=data, content_type=MSGPACK_TYPE, headers=headers)

    async def digests(request: web.Request) -> web.Response:
        peer = ready(request)
        limit = body_limits(peer.tables)["/v1/rows/digests"]
        msg = unpack_map(await read_body(request, limit), limit)
        table, view, wanted = msg.get("table"), msg.get("view"), msg.get("slots")
        if table not in peer.tables.by_name:
            raise BadRequest(f"unknown table {str(table)[:40]!r}")
        if not isinstance(view, str):
            raise BadRequest("view must be a string")
        if (not isinstance(wanted, list) or not 0 < len(wanted) <= MAX_DIGESTS
                or not all(type(s) is int for s in wanted)):
            raise BadRequest(f"slots must be a list of 1..{MAX_DIGESTS} ints")

        def answer(t: str, part: list[int]) -> list:
            return [None if d is None else [d.version, d.checksum] for d in peer.tables.digests_under(view, t, part)]

        try:
            return msgpack_response({"digests": await digests_in_pieces(peer.table_work, answer, table, wanted)})
        except (Fenced, Moving, ShardError) as e:
            raise _service_errors(e) from None

    app.router.add_post("/v1/rows/pull", pull)
    app.router.add_post("/v1/rows/push", push)
    app.router.add_post("/v1/rows/replica", replica)
    app.router.add_post("/v1/rows/replay", replay)
    app.router.add_post("/v1/rows/slots", slots)
    app.router.add_post("/v1/rows/digests", digests)


__all__ = ["TableClient", "add_routes", "body_limits", "replicate", "RowStats", "pack"]
