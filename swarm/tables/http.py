"""Row pull, gradient push, replica updates and slot hand-off over HTTP: a thin shell around
TableService (routes) and the client side a training peer uses each step.

Routes (docs/protocol.md, "Sharded tables"):
  POST /v1/rows/pull     PullRequest (msgpack)    -> rows (safetensors), in request order
  POST /v1/rows/push     PushRequest (safetensors) -> JSON, after the replicas acknowledged
  POST /v1/rows/replica  replica update (safetensors) -> JSON
  POST /v1/rows/slots    {"table", "slots": [..]} (msgpack) -> {"slots": [slot blob, ...]} (msgpack)

Every TableService call runs on the peer's table thread (``work``), one at a time.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import numpy as np
import torch
from aiohttp import web

from ..transport import PeerUnreachable, Transport
from ..wire import BadRequest, msgpack_response, pack, read_body, unpack_map
from .ownership import Move
from .service import Fenced, Moving, NotPrimary, TableService
from .shard import ShardError
from .wire import (PullRequest, PushRequest, WireError, decode_pull, decode_push, decode_replica, decode_rows,
                   encode_pull, encode_push, encode_replica, encode_rows)

Work = Callable[..., Awaitable]
MAX_IDS = 1 << 22  # ids in one pull or push request
SLOTS_PER_REQUEST = 64


@dataclass
class RowStats:
    pulls: int = 0
    rows_pulled_remote: int = 0
    rows_read_local: int = 0
    rows_missing: int = 0  # rows a pull could not get in time (zeros were used)
    pushes_sent: int = 0
    push_failures: int = 0
    retries: int = 0
    latency_ms: collections.deque = field(default_factory=lambda: collections.deque(maxlen=512))

    def percentiles(self) -> dict[str, float | None]:
        if not self.latency_ms:
            return {"p50": None, "p95": None, "p99": None}
        a = np.asarray(self.latency_ms)
        return {f"p{q}": round(float(np.percentile(a, q)), 2) for q in (50, 95, 99)}


class TableClient:
    """The puller and pusher side: cut ids by owner, one request per owner, concurrently."""

    def __init__(self, service: TableService, transport: Transport, work: Work, self_id: str,
                 addr_of: Callable[[str], str | None], down: Callable[[], set[str]],
                 row_dtype: str = "fp16", push_dtype: str = "bf16", timeout: float = 10.0):
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
        self.dims = {s.name: s.dim for s in service.specs}

    # -- pull ---------------------------------------------------------------------------------
    async def pull(self, want: dict[str, np.ndarray]) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
        """Rows of ``want`` (sorted-unique ids per table), fp32 in ids order, and the ids that could
        not be had before the timeout (their rows are zeros)."""
        t0 = time.monotonic()
        rows = {t: torch.zeros(len(ids), self.dims[t]) for t, ids in want.items()}
        todo = {t: ids for t, ids in want.items() if len(ids)}
        unreachable: set[str] = set()
        attempt = 0
        while todo:
            omap = self.service.map
            if omap is None:
                break
            by_peer: dict[str, dict[str, np.ndarray]] = {}
            for table, ids in todo.items():
                for peer, sub in omap.plan(table, ids, down=self.down() | unreachable).items():
                    by_peer.setdefault(peer, {})[table] = sub
            results = await asyncio.gather(*(self._pull_from(peer, sub, omap.view) for peer, sub in by_peer.items()))
            for peer, (got, gone) in zip(by_peer, results):
                if gone:
                    unreachable.add(peer)  # route its slots to a replica on the next try
                if got is None:
                    continue
                for table, t_rows in got.items():
                    sub = by_peer[peer][table]
                    rows[table][torch.from_numpy(np.searchsorted(want[table], sub))] = t_rows
                    todo[table] = np.setdiff1d(todo[table], sub, assume_unique=True)
            todo = {t: ids for t, ids in todo.items() if len(ids)}
            if not todo or time.monotonic() - t0 > self.timeout:
                break
            attempt += 1
            self.stats.retries += 1
            await asyncio.sleep(min(0.05 * attempt, 0.5))
        self.stats.pulls += 1
        missing = {t: ids for t, ids in todo.items() if len(ids)}
        self.stats.rows_missing += sum(len(v) for v in missing.values())
        self.stats.latency_ms.append((time.monotonic() - t0) * 1000)
        return rows, missing

    async def _pull_from(self, peer: str, sub: dict[str, np.ndarray], view: str
                         ) -> tuple[dict[str, torch.Tensor] | None, bool]:
        """One owner's share of a pull: (rows or None when it failed, whether the owner is unreachable)."""
        if peer == "":
            return None, False  # every owner of these slots is down right now
        if peer == self.self_id:
            try:
                out = {t: await self.work(self.service.read_local, t, ids) for t, ids in sub.items()}
            except (Moving, NotPrimary):
                return None, False
            self.stats.rows_read_local += sum(len(v) for v in sub.values())
            return out, False
        addr = self.addr_of(peer)
        if addr is None:
            return None, True
        req = PullRequest(view=view, dtype=self.row_dtype, ids=sub)
        try:
            data = await self.transport.request("POST", addr + "/v1/rows/pull", body=encode_pull(req),
                                                timeout=self.timeout, reply_limit=_rows_limit(sub, self.dims) + 65536,
                                                kind="rows", reply_kind="rows")
            out = await asyncio.to_thread(decode_rows, data, req, self.dims)
        except PeerUnreachable as e:
            return None, e.status is None
        except WireError:
            return None, False
        self.stats.rows_pulled_remote += sum(len(v) for v in sub.values())
        return out, False

    # -- push ---------------------------------------------------------------------------------
    async def push(self, grads: dict[str, tuple[np.ndarray, torch.Tensor]], key: str) -> bool:
        """Row gradients to their primaries (same cut as the pull); True when every part landed."""
        t0 = time.monotonic()
        todo = {t: (ids, g) for t, (ids, g) in grads.items() if len(ids)}
        attempt = 0
        while todo:
            omap = self.service.map
            by_peer: dict[str, dict[str, np.ndarray]] = {}
            for table, (ids, _) in todo.items():
                for peer, sub in omap.plan(table, ids).items():
                    by_peer.setdefault(peer, {})[table] = sub
            oks = await asyncio.gather(*(self._push_to(peer, sub, todo, key, omap.view) for peer, sub in by_peer.items()))
            for (peer, sub), ok in zip(by_peer.items(), oks):
                if not ok:
                    continue
                for table, ids in sub.items():
                    all_ids, g = todo[table]
                    keep = ~np.isin(all_ids, ids, assume_unique=True)
                    todo[table] = (all_ids[keep], g[torch.from_numpy(keep)])
            todo = {t: v for t, v in todo.items() if len(v[0])}
            if not todo or time.monotonic() - t0 > self.timeout:
                break
            attempt += 1
            self.stats.retries += 1
            await asyncio.sleep(min(0.05 * attempt, 0.5))
        if todo:
            self.stats.push_failures += 1
        return not todo

    async def _push_to(self, peer: str, sub: dict[str, np.ndarray], todo, key: str, view: str) -> bool:
        parts = {}
        for table, ids in sub.items():
            all_ids, g = todo[table]
            pos = torch.from_numpy(np.searchsorted(all_ids, ids))
            parts[table] = g[pos]
        req = PushRequest(view=view, key=key, ids=sub, grads=parts)
        self.stats.pushes_sent += 1
        if peer == self.self_id:
            try:
                forward = await self.work(self.service.apply_push, req)
            except (Fenced, Moving, NotPrimary):
                return False
            return await replicate(self, forward, key)
        addr = self.addr_of(peer)
        if addr is None or peer == "":
            return False
        try:
            body = await asyncio.to_thread(encode_push, req, self.push_dtype)
            await self.transport.request("POST", addr + "/v1/rows/push", body=body, timeout=self.timeout,
                                         content_type="application/octet-stream", kind="rows", reply_kind="rows")
            return True
        except PeerUnreachable:
            return False

    # -- hand-off -----------------------------------------------------------------------------
    async def fetch(self, moves: list[Move]) -> None:
        """Fetch newly owned slots from their old owners, batched per (source, table)."""
        groups: dict[tuple[str, str], list[Move]] = {}
        for mv in moves:
            groups.setdefault((mv.sources[0], mv.table), []).append(mv)
        await asyncio.gather(*(self._fetch_group(list(g)) for g in groups.values()))

    async def _fetch_group(self, group: list[Move]) -> None:
        for i in range(0, len(group), SLOTS_PER_REQUEST):
            batch = group[i:i + SLOTS_PER_REQUEST]
            pending = list(batch)
            for source in batch[0].sources:
                addr = self.addr_of(source)
                if addr is None or not pending:
                    continue
                try:
                    reply = await self.transport.call(addr, "/v1/rows/slots",
                                                      {"table": pending[0].table, "slots": [m.slot for m in pending]},
                                                      timeout=30.0, kind="handoff", reply_limit=1 << 28)
                except PeerUnreachable:
                    continue
                blobs = reply.get("slots")
                if not isinstance(blobs, list) or len(blobs) != len(pending):
                    continue
                left = []
                for mv, blob in zip(pending, blobs):
                    try:
                        if not isinstance(blob, bytes):
                            raise WireError("slot blob must be bytes")
                        await self.work(self.service.import_slot, mv, blob)
                    except (WireError, ShardError):
                        left.append(mv)
                pending = left
            for mv in pending:
                await self.work(self.service.give_up, mv)

    def status(self) -> dict:
        s = self.stats
        return {"pulls": s.pulls, "rows_pulled_remote": s.rows_pulled_remote, "rows_read_local": s.rows_read_local,
                "rows_missing": s.rows_missing, "pushes_sent": s.pushes_sent, "push_failures": s.push_failures,
                "retries": s.retries}


async def replicate(client_or_peer, forward: dict[str, list[tuple[str, dict]]], key: str) -> bool:
    """Send a primary's updates to its replicas and wait for them (bounded); True if all landed."""
    transport: Transport = client_or_peer.transport
    addr_of = client_or_peer.addr_of
    view = client_or_peer.service.view

    async def one(peer: str, table: str, update: dict) -> bool:
        addr = addr_of(peer)
        if addr is None:
            return False
        body = await asyncio.to_thread(encode_replica, table, update, view, key)
        try:
            await transport.request("POST", addr + "/v1/rows/replica", body=body, timeout=5.0,
                                    content_type="application/octet-stream", kind="replica", reply_kind="replica")
            return True
        except PeerUnreachable:
            return False

    oks = await asyncio.gather(*(one(p, t, u) for p, ups in forward.items() for t, u in ups))
    return all(oks)


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
    return BadRequest(f"{e}", 400)


def add_routes(app: web.Application, get_peer: Callable[[web.Request], object]) -> None:
    """Mount the table routes; ``get_peer`` returns the Peer (or raises BadRequest 503 while starting)."""

    def ready(request):
        peer = get_peer(request)
        if getattr(peer, "tables", None) is None or peer.tables.map is None:
            raise BadRequest("this peer serves no tables yet", 503, code="starting")
        return peer

    async def pull(request: web.Request) -> web.Response:
        peer = ready(request)
        body = await read_body(request, 1024 + 4 * MAX_IDS)
        try:
            req = decode_pull(body, peer.tables.by_name, MAX_IDS)
        except WireError as e:
            raise BadRequest(f"bad pull request: {e}") from None

        def serve() -> bytes:
            return encode_rows(peer.tables.serve_pull(req), req.dtype)

        try:
            data = await peer.table_work(serve)
        except (Fenced, Moving, NotPrimary, ShardError) as e:
            raise _service_errors(e) from None
        return web.Response(body=data, content_type="application/octet-stream")

    async def push(request: web.Request) -> web.Response:
        peer = ready(request)
        limit = MAX_IDS * (4 + 4 * max(s.dim for s in peer.tables.specs)) + 65536
        body = await read_body(request, limit)
        try:
            req = await asyncio.to_thread(decode_push, body, peer.tables.by_name, MAX_IDS)
        except WireError as e:
            raise BadRequest(f"bad push request: {e}") from None
        try:
            forward = await peer.table_work(peer.tables.apply_push, req)
        except (Fenced, Moving, NotPrimary, ShardError) as e:
            raise _service_errors(e) from None
        replicated = await replicate(peer.table_client, forward, req.key)
        return web.json_response({"applied": True, "replicated": replicated})

    async def replica(request: web.Request) -> web.Response:
        peer = ready(request)
        limit = MAX_IDS * 4 * (3 * max(s.dim for s in peer.tables.specs) + 4) + 65536
        body = await read_body(request, limit)
        try:
            table, update, view, key = await asyncio.to_thread(decode_replica, body, peer.tables.by_name,
                                                               peer.tables.opt.kind)
        except WireError as e:
            raise BadRequest(f"bad replica update: {e}") from None
        try:
            fresh = await peer.table_work(peer.tables.apply_replica, table, update, view, key)
        except (Fenced, Moving, NotPrimary, ShardError) as e:
            raise _service_errors(e) from None
        return web.json_response({"applied": fresh})

    async def slots(request: web.Request) -> web.Response:
        peer = ready(request)
        msg = unpack_map(await read_body(request, 65536), 65536)
        table, wanted = msg.get("table"), msg.get("slots")
        if table not in peer.tables.by_name:
            raise BadRequest(f"unknown table {str(table)[:40]!r}")
        if (not isinstance(wanted, list) or not 0 < len(wanted) <= SLOTS_PER_REQUEST
                or not all(type(s) is int for s in wanted)):
            raise BadRequest(f"slots must be a list of 1..{SLOTS_PER_REQUEST} ints")

        def export() -> list[bytes]:
            return [peer.tables.export_slot(table, s) for s in wanted]

        try:
            blobs = await peer.table_work(export)
        except (NotPrimary, ShardError, ValueError) as e:
            raise _service_errors(e) from None
        return msgpack_response({"slots": blobs})

    app.router.add_post("/v1/rows/pull", pull)
    app.router.add_post("/v1/rows/push", push)
    app.router.add_post("/v1/rows/replica", replica)
    app.router.add_post("/v1/rows/slots", slots)


__all__ = ["TableClient", "add_routes", "replicate", "RowStats", "pack"]
