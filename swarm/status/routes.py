"""The status page's routes: the page and its assets, /api/events (SSE), /metrics (Prometheus).

``/api/status`` itself is served by swarm/server.py from ``Peer.status()``; this module adds the
rest and is mounted by ``build_app`` through ``setup(app, peer)``. Every asset comes from
``static/`` next to this file: the page loads nothing from anywhere else and works offline.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from ..node import Peer

STATIC = Path(__file__).resolve().parent / "static"
SSE_INTERVAL = 1.0  # seconds between two /api/events messages

STATUS_PEER: web.AppKey[Peer] = web.AppKey("status_peer")
CLOSING = web.AppKey("status_closing", asyncio.Event)


class SharedStatus:
    """The /api/events message of the current second, built once for every open stream: a
    document costs milliseconds to build, and each open stream would build its own every second
    (a flood's few streams, or many browser tabs, multiply it; docs/security.md)."""

    def __init__(self) -> None:
        self.at = -1e9
        self.message = b""

    def get(self, peer: "Peer", now: float) -> bytes:
        if now - self.at >= SSE_INTERVAL / 2:
            data = json.dumps(peer.status(), separators=(",", ":"), default=_json_default)
            self.message = f"event: status\ndata: {data}\n\n".encode()
            self.at = now
        return self.message


SHARED = web.AppKey("status_shared", SharedStatus)
REGISTRY = web.AppKey("status_registry", CollectorRegistry)


def setup(app: web.Application, peer: "Peer") -> None:
    """Mount the page, its assets, /api/events and /metrics on ``app`` (before it starts)."""
    app[STATUS_PEER] = peer
    app[CLOSING] = asyncio.Event()
    app[SHARED] = SharedStatus()
    registry = CollectorRegistry(auto_describe=True)  # one per peer: several peers share a test process
    registry.register(PeerCollector(peer))
    app[REGISTRY] = registry
    app.on_shutdown.append(_on_shutdown)
    app.router.add_get("/", index)
    app.router.add_get("/api/events", events)
    app.router.add_get("/metrics", metrics)
    app.router.add_static("/static/", STATIC, append_version=False)


async def _on_shutdown(app: web.Application) -> None:
    app[CLOSING].set()  # open event streams end now, so the server's shutdown never waits on them


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


async def events(request: web.Request) -> web.StreamResponse:
    """``text/event-stream``: the /api/status document once a second until the peer shuts down."""
    peer = request.app[STATUS_PEER]
    closing = request.app[CLOSING]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    try:
        await resp.write(b"retry: 2000\n\n")
        shared = request.app[SHARED]
        while not closing.is_set() and not peer.stopping:
            await resp.write(shared.get(peer, time.monotonic()))
            try:
                await asyncio.wait_for(closing.wait(), SSE_INTERVAL)
            except asyncio.TimeoutError:
                pass
    except (ConnectionResetError, ConnectionError):
        return resp  # the browser went away
    try:
        await resp.write(b"event: bye\ndata: {}\n\n")
        await resp.write_eof()
    except (ConnectionResetError, ConnectionError):
        pass
    return resp


def _json_default(o):
    return str(o)


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[REGISTRY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


class PeerCollector(Collector):
    """Reads the peer's counters at scrape time (nothing is double-booked into client-side metrics)."""

    def __init__(self, peer: "Peer"):
        self.peer = peer

    def describe(self):
        return []  # names are only known at scrape time; skip the registry's duplicate check

    def collect(self) -> Iterator:
        p = self.peer
        prog = p.progress
        yield InfoMetricFamily("swarm_peer", "This peer's identity.", value={"peer_id": p.id, "addr": p.addr or ""})
        yield _gauge("swarm_step", "Next round this peer will take (its training step).", p.book.step)
        yield _gauge("swarm_active", "1 while this peer contributes gradients.", int(bool(p.active)))
        recent = prog.losses[-10:]
        if recent and math.isfinite(sum(recent)):
            yield _gauge("swarm_loss", "Mean train loss of this peer's last 10 steps.", sum(recent) / len(recent))
        if prog.val_loss is not None and math.isfinite(prog.val_loss):
            yield _gauge("swarm_val_loss", "Last held-out loss this peer evaluated.", prog.val_loss)
        yield _counter("swarm_tokens", "Tokens this peer trained on.", prog.tokens)
        yield _counter("swarm_steps_contributed", "Steps this peer computed a gradient for.", prog.contributed)
        yield _counter("swarm_samples", "Samples this peer trained on.", prog.samples)
        resyncs = CounterMetricFamily("swarm_resyncs", "State re-syncs of this peer's replica, by cause (lag: "
                                      "fell behind; diverged: its sketch differed from the majority's).",
                                      labels=["cause"])
        for cause in ("lag", "diverged"):
            resyncs.add_metric([cause], p.resyncs.get(cause, 0))
        yield resyncs
        failures = CounterMetricFamily("swarm_task_failures", "Background tasks of this peer that failed, by task "
                                       "(each is a task-failed event).", labels=["task"])
        for task, n in sorted(p.task_failures.items()):
            failures.add_metric([task], n)
        yield failures
        if p.tables is not None:
            yield _counter("swarm_table_replicas_repaired", "Replica slots of the sharded tables that differed from "
                           "their primary's copy (update count or checksum) and were replaced by it.",
                           p.tables.stats.replicas_repaired)
            yield _counter("swarm_table_rows_clipped", "Pushed row gradients this primary scaled down to --row-clip x "
                           "its flush's reference row norm.", p.tables.stats.rows_clipped)
            yield _counter("swarm_table_outlier_pushes", "Senders' parts of a flush whose rows were outliers "
                           "(level > 4 x the flush's reference, or pointing against the other senders' rows): "
                           "each costs the sender score.",
                           p.tables.stats.outlier_pushes)
            yield _counter("swarm_table_disagreeing_pushes", "Senders' parts of a flush whose rows pointed against "
                           "the other senders' pushes of the same rows (left out of that flush).",
                           p.tables.stats.disagreeing_pushes)
        sent = CounterMetricFamily("swarm_bytes_sent", "Bytes sent, by kind.", labels=["kind"])
        for kind, n in sorted(p.counts.sent.items()):
            sent.add_metric([kind], n)
        yield sent
        recv = CounterMetricFamily("swarm_bytes_received", "Bytes received, by kind.", labels=["kind"])
        for kind, n in sorted(p.counts.received.items()):
            recv.add_metric([kind], n)
        yield recv
        yield _counter("swarm_dense_bytes", "Bytes dense fp32 gradients to the same targets would have cost.",
                       p.dense_bytes)
        yield _counter("swarm_payload_bytes", "Gradient payload bytes produced (once, not per target).",
                       prog.wire_bytes)
        yield _counter("swarm_payload_dense_bytes", "fp32 bytes of the same gradients.", prog.dense_equiv)
        pacing = p.pacing.status()
        yield _gauge("swarm_payload_share", "Each payload of this peer carries 1/this of the entries its codec "
                     "would send (the contributor cap by bytes; 1: whole payloads).", pacing["payload_share"])
        yield _gauge("swarm_payload_stride", "Rounds between two payloads of this peer (the cap by rounds, or a "
                     "free-running peer's own; 1: every round).", pacing["stride"])
        if prog.wire_bytes:
            yield _gauge("swarm_compression_ratio", "Dense fp32 bytes per payload byte, since start.",
                         prog.dense_equiv / prog.wire_bytes)
        phases = p.step_times.report()
        if phases.get("steps"):
            ms = GaugeMetricFamily("swarm_step_phase_seconds", "Mean seconds of this peer's last steps (up to 512) "
                                   "spent in each phase (docs/protocol.md, step_phases).", labels=["phase"])
            for name, v in phases.items():
                if isinstance(v, dict):
                    ms.add_metric([name], v["mean_ms"] / 1000)
            yield ms
            if phases.get("wait_share") is not None:
                yield _gauge("swarm_step_wait_share", "Share of this peer's mean step spent waiting on other peers "
                             "(the rows, held and round phases).", phases["wait_share"])
        stats = vars(p.book.stats)
        payloads = CounterMetricFamily("swarm_payloads", "Payloads filed in the round book, by verdict.",
                                       labels=["verdict"])
        for verdict in ("accepted", "late", "duplicate", "too_old", "too_far_ahead"):
            payloads.add_metric([verdict], stats.get(verdict, 0))
        yield payloads
        yield _counter("swarm_rounds_timed_out", "Rounds that went ahead without every expected payload.",
                       stats.get("timed_out_rounds", 0))
        rejected = CounterMetricFamily("swarm_rejected", "Messages this peer rejected, by reason.", labels=["reason"])
        for reason, n in sorted(p.rejected.items()):
            rejected.add_metric([reason], n)
        yield rejected
        yield _counter("swarm_dropped_sends", "Outgoing payloads dropped because a send queue was full.",
                       p.dropped_sends)
        guard = getattr(p, "guard", None)
        if guard is not None:
            yield from _limit_metrics(guard.limits)
        members = GaugeMetricFamily("swarm_members", "Members this peer knows, by state (itself included).",
                                    labels=["state"])
        counts = {"alive": 0, "suspect": 0, "dead": 0, "left": 0}
        if p.members is not None:
            for m in p.members.members():
                counts[m.state] = counts.get(m.state, 0) + 1
        for state, n in counts.items():
            members.add_metric([state], n)
        yield members
        if p.members is not None:
            yield _gauge("swarm_membership_epoch", "Changes of the set of alive members seen so far.",
                         p.members.epoch)
        timeline = getattr(p, "timeline", None)
        if timeline is not None:
            rtt = GaugeMetricFamily("swarm_peer_rtt_seconds", "Smoothed ping round-trip time to each peer.",
                                    labels=["peer"])
            for pid, lk in sorted(timeline.links.items()):
                if lk.rtt is not None:
                    rtt.add_metric([pid], lk.rtt)
            yield rtt


def _limit_metrics(limits) -> Iterator:
    """The per-client limits (swarm/limits.py): refusals by client kind and reason, tracked clients,
    open connections and event streams by kind."""
    refused = CounterMetricFamily("swarm_limited", "Connections and requests refused with 429 by the per-client "
                                  "limits, by client kind (member, outsider) and reason (rate, connections, "
                                  "streams, clients).", labels=["client", "reason"])
    clients = GaugeMetricFamily("swarm_limit_clients", "Clients the per-client limits track, by kind.",
                                labels=["client"])
    conns = GaugeMetricFamily("swarm_limit_connections", "Open connections, by client kind.", labels=["client"])
    streams = GaugeMetricFamily("swarm_limit_streams", "Open /api/events streams, by client kind.", labels=["client"])
    for kind, st in limits.status().items():
        if not isinstance(st, dict):
            continue
        for reason, n in st["refused"].items():
            refused.add_metric([kind, reason], n)
        clients.add_metric([kind], st["clients"])
        conns.add_metric([kind], st["connections"])
        streams.add_metric([kind], st["streams"])
    yield from (refused, clients, conns, streams)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
