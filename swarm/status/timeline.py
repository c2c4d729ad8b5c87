"""Bounded time series and per-peer link stats recorded by a peer for its status page.

Everything here is plain bookkeeping on the event loop: no I/O, no threads. A ``Series`` holds at
most ``cap`` points; when it is full, its older half is merged pairwise (averaged), so recent
history stays at full resolution and older history gets coarser, and memory stays bounded however
long the run is.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    from ..node import Peer

CAP = 600  # points per series
LOG_CAP = 200  # entries in the rejected-payload log



class Series:
    """Points of equal arity, oldest first, at most ``cap`` of them.

    The newest half are kept exactly. Older points go into buckets that each average the same
    number of consecutive points; when the buckets run out of room, neighbours are merged and the
    bucket size doubles. So the whole history stays represented, uniformly coarser the longer the run.
    """

    def __init__(self, cap: int = CAP):
        if cap < 8:
            raise ValueError("a series needs room for at least 8 points")
        self.cap = cap
        self._recent_cap = cap // 2
        self._old_cap = (cap - self._recent_cap - 1) // 2 * 2  # even, so that merging pairs is exact
        self._recent: collections.deque[tuple[float, ...]] = collections.deque()
        self._old: list[tuple[float, ...]] = []
        self._bucket = 1  # points averaged into each old point
        self._pending: list[float] | None = None  # sums of the bucket being filled
        self._pending_n = 0

    def add(self, *point: float) -> None:
        self._recent.append(tuple(float(v) for v in point))
        if len(self._recent) <= self._recent_cap:
            return
        spill = self._recent.popleft()
        self._pending = list(spill) if self._pending is None else [a + b for a, b in zip(self._pending, spill)]
        self._pending_n += 1
        if self._pending_n == self._bucket:
            self._old.append(tuple(v / self._pending_n for v in self._pending))
            self._pending, self._pending_n = None, 0
            if len(self._old) >= self._old_cap:
                self._old = [tuple((a + b) / 2 for a, b in zip(self._old[i], self._old[i + 1]))
                             for i in range(0, len(self._old), 2)]
                self._bucket *= 2

    @property
    def points(self) -> list[tuple[float, ...]]:
        partial = [tuple(v / self._pending_n for v in self._pending)] if self._pending else []
        return self._old + partial + list(self._recent)

    def __len__(self) -> int:
        return len(self._old) + (1 if self._pending else 0) + len(self._recent)

    def last(self) -> tuple[float, ...] | None:
        return self._recent[-1] if self._recent else None

    def to_json(self, digits: int = 6) -> list[list[float]]:
        """Points as lists: the time (first value) to 10 ms, the rest to ``digits`` significant digits."""
        return [[round(p[0], 2), *(_round(v, digits) for v in p[1:])] for p in self.points]


@dataclass
class Link:
    """What this peer saw of one other peer."""

    rtt: float | None = None  # seconds, smoothed (EWMA) over successful pings
    last_seen: float | None = None  # time.monotonic() of the last ack or accepted payload from it
    bytes_in: int = 0  # gradient payload bytes it sent us (accepted or not, counted per request)
    bytes_out: int = 0  # gradient payload bytes we delivered to it (on the wire: zstd where it paid)
    payloads_in: int = 0


class Timeline:
    """The status page's memory of one peer: series over time, link stats, a rejection log."""

    def __init__(self, cap: int = CAP):
        self.loss = Series(cap)  # (t, step, train loss of this peer)
        self.swarm_loss = Series(cap)  # (t, step, mean reported loss of the contributing peers)
        self.val_loss = Series(cap)  # (t, step, held-out loss)
        self.wire = Series(cap)  # (t, bytes sent, bytes received, payload bytes produced, dense fp32 equivalent)
        self.links: dict[str, Link] = {}
        self.rejections: list[dict] = []
        self._rejected_seen: dict[str, int] = {}
        self._dropped_seen = 0
        self._val_seen = 0
        self._last_val: float | None = None
        self.recent_losses: list[float] = []

    # -- recording (called by the peer) -------------------------------------------------------
    def link(self, peer_id: str) -> Link:
        lk = self.links.get(peer_id)
        if lk is None:
            lk = self.links[peer_id] = Link()
        return lk

    def record_rtt(self, peer_id: str, seconds: float) -> None:
        lk = self.link(peer_id)
        lk.rtt = seconds if lk.rtt is None else 0.8 * lk.rtt + 0.2 * seconds
        lk.last_seen = time.monotonic()

    def sent_to(self, peer_id: str, nbytes: int) -> None:
        self.link(peer_id).bytes_out += nbytes

    def payload_from(self, peer_id: str, nbytes: int) -> None:
        """A decoded payload of ``nbytes`` from ``peer_id`` reached the round book."""
        lk = self.link(peer_id)
        lk.payloads_in += 1
        lk.bytes_in += nbytes
        lk.last_seen = time.monotonic()

    def record_step(self, peer: "Peer", step: int, loss: float) -> dict[str, Any]:
        """After each applied round: this peer's loss, the swarm's, the wire. Returns what the peer
        tells the others of itself (meta: throughput and recent loss); the timeline only reads the peer."""
        now = time.time()
        finite = isinstance(loss, (int, float)) and math.isfinite(loss)
        if finite:
            self.loss.add(now, step, loss)
            self.recent_losses = (self.recent_losses + [float(loss)])[-10:]
        p = peer.progress
        elapsed = time.monotonic() - p.started_at if p.started_at else 0.0
        # throughput in the task's unit: tokens for a language model, else samples (the page says which)
        done = p.tokens if p.tokens else p.samples
        meta: dict[str, Any] = {"tps": int(done / elapsed) if elapsed > 0 else 0}
        if self.recent_losses:
            meta["loss"] = round(sum(self.recent_losses) / len(self.recent_losses), 4)
        swarm = swarm_loss(peer)
        if swarm is not None:
            self.swarm_loss.add(now, step, swarm)
        self.wire.add(now, sum(peer.counts.sent.values()), sum(peer.counts.received.values()),
                      p.wire_bytes, p.dense_equiv)
        self.poll(peer)
        return meta

    def poll(self, peer: "Peer") -> None:
        """Pick up what the peer records elsewhere: new validation losses, rejection counters."""
        now = time.time()
        p = peer.progress
        hist = list(p.val_history)
        for step, val in hist[self._val_seen:]:
            if math.isfinite(val):
                self.val_loss.add(now, step, val)
        self._val_seen = len(hist)
        if p.val_loss is not None and p.val_loss != self._last_val and not hist:
            if math.isfinite(p.val_loss):
                self.val_loss.add(now, peer.book.step, p.val_loss)
        self._last_val = p.val_loss
        for reason, n in peer.rejected.items():
            delta = n - self._rejected_seen.get(reason, 0)
            if delta > 0:
                self._reject(now, reason, f"{delta} message{'s' if delta > 1 else ''} rejected ({reason})")
            self._rejected_seen[reason] = n
        delta = peer.dropped_sends - self._dropped_seen
        if delta > 0:
            self._reject(now, "dropped-send", f"{delta} outgoing payload{'s' if delta > 1 else ''} dropped "
                                              "(a peer's send queue was full)")
        self._dropped_seen = peer.dropped_sends

    def _reject(self, at: float, reason: str, detail: str) -> None:
        self.rejections.append({"at": at, "source": "rejected", "kind": reason, "peer_id": "", "detail": detail})
        del self.rejections[:-LOG_CAP]

    # -- reading (status()) -------------------------------------------------------------------
    def series(self) -> dict:
        return {"loss": self.loss.to_json(), "swarm_loss": self.swarm_loss.to_json(),
                "val_loss": self.val_loss.to_json(), "wire": self.wire.to_json(digits=12)}

    def members(self, peer: "Peer") -> list[dict]:
        """Membership records for the page: the existing keys plus loss, lag, RTT, bytes, ages."""
        if peer.members is None:
            return []
        mono = time.monotonic()
        rows = []
        top = swarm_step(peer)
        known = peer.members.members()
        ids = {m.peer_id for m in known}
        for gone in [p for p in self.links if p not in ids]:
            del self.links[gone]  # membership forgot it (tombstone expired): so do we
        for m in known:
            step = int(m.meta.get("step", 0))
            lk = self.links.get(m.peer_id)
            is_self = m.peer_id == peer.id
            loss = m.meta.get("loss")
            rows.append({
                "peer_id": m.peer_id, "addr": m.addr, "state": m.state, "incarnation": m.incarnation,
                "step": step, "active": bool(m.meta.get("active")),
                # a host group's ranks: the group (its leader's id) and the rank (0 gossips for all)
                "group": m.meta.get("group") if isinstance(m.meta.get("group"), str) else None,
                "grank": m.meta.get("grank") if type(m.meta.get("grank")) is int else None,
                "self": is_self,
                "lag": max(0, top - step) if m.state in ("alive", "suspect") else None,
                "loss": loss if isinstance(loss, (int, float)) else None,
                "tokens_per_s": int(m.meta.get("tps", 0) or 0),
                "rtt_ms": _round(lk.rtt * 1000, 4) if lk and lk.rtt is not None else None,
                "last_seen_s": (0.0 if is_self else
                                _round(mono - lk.last_seen, 3) if lk and lk.last_seen is not None else None),
                "state_for_s": _round(mono - m.changed_at, 3),
                "bytes_in": lk.bytes_in if lk else 0,
                "bytes_out": lk.bytes_out if lk else 0,
            })
        return rows

    def log(self, peer: "Peer", limit: int = 100) -> list[dict]:
        """Membership events, the peer's own events and rejections, oldest first, wall-clock times."""
        wall_minus_mono = time.time() - time.monotonic()
        entries: list[dict] = []
        if peer.members is not None:
            for e in list(peer.members.events):
                entries.append({"at": e.at + wall_minus_mono, "source": "membership", "kind": e.kind,
                                "peer_id": e.peer_id, "detail": e.detail})
        for e in list(peer.events):
            entries.append({"at": e["at"], "source": "peer", "kind": e["kind"], "peer_id": peer.id,
                            "detail": e["detail"]})
        entries += self.rejections
        entries.sort(key=lambda e: e["at"])
        return [{**e, "at": round(e["at"], 3)} for e in entries[-limit:]]

    def swarm(self, peer: "Peer") -> dict:
        counts = {"alive": 0, "suspect": 0, "dead": 0, "left": 0}
        tps = 0
        if peer.members is not None:
            for m in peer.members.members():
                counts[m.state] = counts.get(m.state, 0) + 1
                if m.state in ("alive", "suspect") and m.meta.get("active"):
                    tps += int(m.meta.get("tps", 0) or 0)
        return {**counts, "step": swarm_step(peer), "tokens_per_s": tps, "loss": swarm_loss(peer),
                "epoch": peer.members.epoch if peer.members is not None else 0}


def swarm_step(peer: "Peer") -> int:
    """The furthest step any live member reports (this peer's own included)."""
    best = peer.book.step
    if peer.members is not None:
        for m in peer.members.members():
            if m.state in ("alive", "suspect"):
                best = max(best, int(m.meta.get("step", 0)))
    return best


def swarm_loss(peer: "Peer") -> float | None:
    """Mean of the recent train losses that live, contributing members report in their meta."""
    vals = _losses(peer.members.members() if peer.members is not None else [])
    return sum(vals) / len(vals) if vals else None


def _losses(members: Iterable[Any]) -> list[float]:
    out = []
    for m in members:
        v = m.meta.get("loss")
        if m.state in ("alive", "suspect") and m.meta.get("active") and isinstance(v, (int, float)) \
                and not isinstance(v, bool) and math.isfinite(v):
            out.append(float(v))
    return out


def _round(v: float, digits: int) -> float:
    """``v`` to ``digits`` significant digits (keeps the JSON small)."""
    if v == 0 or not math.isfinite(v):
        return v
    return round(v, max(0, digits - 1 - int(math.floor(math.log10(abs(v))))))
