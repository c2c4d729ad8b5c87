"""Per-client limits, sans-I/O: request rate, concurrent connections and open event streams.

Plain deterministic bookkeeping like the membership core: nothing here reads the clock, opens a
socket or touches aiohttp; callers pass ``now`` (monotonic seconds). swarm/guard.py is the aiohttp
shell that asks it before a connection or a request is served (docs/security.md, "Per-client
limits").

A client is a key ``(kind, name)``. ``kind`` is MEMBER (a member of the swarm, by its identity, or
by the address of a host members live on) or OUTSIDER (anyone else, by address). The two kinds have
separate budgets and separate tables, so however many outsiders there are, and whatever they send,
they never use up a member's budget or its table's room.

Each client has a token bucket (``rate`` requests per second, at most ``burst`` saved up), a count
of its open connections and one of its open ``/api/events`` streams. A refusal says how long to
wait (``Retry-After``). Memory is bounded: each table holds at most ``max_clients`` entries, and an
entry that has no open connection or stream and whose bucket has refilled is forgotten (it is then
the same as a new one). A table that is full of clients still in use refuses new clients: it fails
closed for that kind only.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from dataclasses import dataclass

MEMBER = "member"
OUTSIDER = "outsider"
KINDS = (MEMBER, OUTSIDER)
# why a client was refused (the counters of /api/status and /metrics)
RATE, CONNECTIONS, STREAMS, CLIENTS = "rate", "connections", "streams", "clients"
REASONS = (RATE, CONNECTIONS, STREAMS, CLIENTS)

Key = tuple[str, str]  # (MEMBER or OUTSIDER, an identity or an address)


@dataclass(frozen=True)
class Budget:
    """What one client may use: requests per second (and how many it may save up), connections
    open at once, ``/api/events`` streams open at once."""

    rate: float
    burst: float
    connections: int
    streams: int

    def scaled(self, n: int) -> "Budget":
        """The budget of ``n`` clients that share one key (members on one host, known only by it)."""
        if n <= 1:
            return self
        return Budget(self.rate * n, self.burst * n, self.connections * n, self.streams * n)

    def text(self) -> str:
        return f"rate={self.rate:g},burst={self.burst:g},connections={self.connections},streams={self.streams}"


# A member of a 4-peer swarm sends each other peer about 4.5 requests per step (a gradient payload,
# row pulls, pushes and replays, pings; measured in docs/benchmarks.md, "Per-client limits"): ~30/s
# at this machine's 7 steps/s, ~225/s at 50 steps/s. 500/s leaves 2x over that; its 8 pooled
# connections per peer (swarm/transport.py) fit 64 eight times.
MEMBER_BUDGET = Budget(rate=500.0, burst=1000.0, connections=64, streams=4)
# A browser on the status page: the page and its 3 assets, one event stream (or /api/status every
# 2 s), up to 6 connections; a Prometheus scrape every few seconds. A few tabs fit.
OUTSIDER_BUDGET = Budget(rate=10.0, burst=40.0, connections=16, streams=4)
MAX_CLIENTS = 4096  # entries per table (members, outsiders); ~100 bytes each
MAX_OUTSIDER_CONNECTIONS = 512  # all outsiders together (a flood from many addresses: file descriptors)
FIELDS = ("rate", "burst", "connections", "streams")


class LimitsError(ValueError):
    """A budget's text is malformed or out of range; the message says which part."""


def parse_budget(text: str, base: Budget, what: str) -> Budget:
    """``"rate=20,burst=80"`` (any of rate, burst, connections, streams) over ``base``;
    ``""`` is ``base``."""
    values = {f: getattr(base, f) for f in FIELDS}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, raw = part.partition("=")
        name = name.strip()
        if not sep or name not in FIELDS:
            raise LimitsError(f"{what} takes KEY=VALUE items separated by commas, KEY one of "
                              f"{', '.join(FIELDS)}; got {part!r}")
        try:
            v = float(raw)
        except ValueError:
            raise LimitsError(f"{what}: {name}={raw.strip()!r} is not a number") from None
        if not (math.isfinite(v) and v > 0) or (name in ("connections", "streams") and v != int(v)):
            raise LimitsError(f"{what}: {name} must be a positive {'integer' if name in ('connections', 'streams') else 'number'}, "
                              f"got {raw.strip()!r}")
        values[name] = int(v) if name in ("connections", "streams") else v
    if values["burst"] < 1:
        raise LimitsError(f"{what}: burst must be >= 1 (a request costs one token), got {values['burst']:g}")
    return Budget(**values)


@dataclass(frozen=True)
class Decision:
    """``ok``, or refused for ``reason`` (RATE, CONNECTIONS, STREAMS, CLIENTS): try again in
    ``retry_after`` seconds."""

    ok: bool
    reason: str = ""
    retry_after: float = 0.0

    @property
    def retry_seconds(self) -> int:
        """``retry_after`` as the whole seconds of a Retry-After header (at least 1)."""
        return max(1, math.ceil(self.retry_after - 1e-9))


ALLOW = Decision(True)


class _Client:
    __slots__ = ("tokens", "stamp", "connections", "streams", "budget")

    def __init__(self, budget: Budget, now: float):
        self.tokens = budget.burst
        self.stamp = now
        self.connections = 0
        self.streams = 0
        self.budget = budget

    def refill(self, now: float) -> None:
        if now > self.stamp:
            self.tokens = min(self.budget.burst, self.tokens + (now - self.stamp) * self.budget.rate)
            self.stamp = now

    def idle(self, now: float) -> bool:
        """Nothing open and the bucket full again: forgetting it changes nothing."""
        if self.connections or self.streams:
            return False
        return self.tokens + (now - self.stamp) * self.budget.rate >= self.budget.burst


class Limits:
    """The budgets of every client one peer serves (one instance per peer)."""

    def __init__(self, member: Budget = MEMBER_BUDGET, outsider: Budget = OUTSIDER_BUDGET, *,
                 max_clients: int = MAX_CLIENTS, max_outsider_connections: int = MAX_OUTSIDER_CONNECTIONS):
        if max_clients < 1 or max_outsider_connections < 1:
            raise ValueError("max_clients and max_outsider_connections must be >= 1")
        self.budgets = {MEMBER: member, OUTSIDER: outsider}
        self.max_clients = max_clients
        self.max_outsider_connections = max_outsider_connections
        # least recently used first; a busy entry met by the sweep is moved to the end
        self._tables: dict[str, OrderedDict[str, _Client]] = {k: OrderedDict() for k in KINDS}
        self.connections = {k: 0 for k in KINDS}
        self.streams = {k: 0 for k in KINDS}
        self.refused: Counter[tuple[str, str]] = Counter()  # (kind, reason) -> refusals
        self.expired = 0

    # -- the table --------------------------------------------------------------------------------
    def _sweep(self, table: OrderedDict[str, _Client], now: float, n: int) -> None:
        """Look at up to ``n`` of the least recently used entries: forget the idle ones, move the
        busy ones (open connections or streams) to the end. O(n) per call, so every call pays a
        little and none pays for the whole table."""
        for _ in range(min(n, len(table))):
            name, c = next(iter(table.items()))
            if c.idle(now):
                del table[name]
                self.expired += 1
            elif c.connections or c.streams:
                table.move_to_end(name)
            else:
                break  # the oldest is still refilling: the rest were touched later

    def _get(self, key: Key, now: float, scale: int) -> _Client | None:
        """The entry of ``key`` (made if new), or None when its table is full of busy clients."""
        kind, name = key
        table = self._tables[kind]
        self._sweep(table, now, 2)
        c = table.get(name)
        budget = self.budgets[kind].scaled(scale)
        if c is None:
            if len(table) >= self.max_clients:
                self._sweep(table, now, 16)
                if len(table) >= self.max_clients:
                    return None
            c = table[name] = _Client(budget, now)
        else:
            table.move_to_end(name)
            c.refill(now)
            if c.budget != budget:  # the number of members on a host changed
                c.budget = budget
                c.tokens = min(c.tokens, budget.burst)
        return c

    def _refuse(self, kind: str, reason: str, retry_after: float) -> Decision:
        self.refused[(kind, reason)] += 1
        return Decision(False, reason, retry_after)

    # -- requests -----------------------------------------------------------------------------------
    def request(self, key: Key, now: float, scale: int = 1) -> Decision:
        """One request of ``key``: take a token, or refuse it with the wait until one is back."""
        c = self._get(key, now, scale)
        if c is None:
            return self._refuse(key[0], CLIENTS, 1.0)
        if c.tokens < 1:
            return self._refuse(key[0], RATE, (1 - c.tokens) / c.budget.rate)
        c.tokens -= 1
        return ALLOW

    def refund(self, key: Key, now: float) -> None:
        """Give back the token of a request that turned out to be another client's (a member's
        request, charged to its address before its identity was known)."""
        c = self._tables[key[0]].get(key[1])
        if c is not None:
            c.refill(now)
            c.tokens = min(c.budget.burst, c.tokens + 1)

    def charge(self, key: Key, now: float, scale: int = 1) -> None:
        """A request ``key`` made whatever its budget (it was already served): the bucket may go
        below zero, down to -burst, so the next ones wait for it."""
        c = self._get(key, now, scale)
        if c is not None:
            c.tokens = max(-c.budget.burst, c.tokens - 1)

    # -- connections --------------------------------------------------------------------------------
    def connect(self, key: Key, now: float, scale: int = 1) -> Decision:
        """A new connection of ``key``: refused when it has all its connections open, when its bucket
        is empty (a client refused for its rate gets no new connection either: refusing one is
        cheaper than refusing its requests), or when outsiders hold all theirs together."""
        kind = key[0]
        c = self._get(key, now, scale)
        if c is None:
            return self._refuse(kind, CLIENTS, 1.0)
        if c.tokens < 1:
            return self._refuse(kind, RATE, (1 - c.tokens) / c.budget.rate)
        if c.connections >= c.budget.connections or (
                kind == OUTSIDER and self.connections[OUTSIDER] >= self.max_outsider_connections):
            return self._refuse(kind, CONNECTIONS, 1.0)
        c.connections += 1
        self.connections[kind] += 1
        return ALLOW

    def disconnect(self, key: Key, now: float) -> None:
        c = self._tables[key[0]].get(key[1])
        if c is not None and c.connections > 0:
            c.connections -= 1
            self.connections[key[0]] -= 1

    def claim(self, old: Key, new: Key, now: float, scale: int = 1) -> Decision:
        """An open connection of ``old`` turns out to be ``new``'s (it carried ``new``'s
        authenticated request): it counts against ``new`` from now on. Refused (and left with
        ``old``) when ``new`` has all its connections open already."""
        c = self._get(new, now, scale)
        if c is None:
            return self._refuse(new[0], CLIENTS, 1.0)
        if c.connections >= c.budget.connections:
            return self._refuse(new[0], CONNECTIONS, 1.0)
        self.disconnect(old, now)
        c.connections += 1
        self.connections[new[0]] += 1
        return ALLOW

    # -- event streams ------------------------------------------------------------------------------
    def open_stream(self, key: Key, now: float, scale: int = 1) -> Decision:
        c = self._get(key, now, scale)
        if c is None:
            return self._refuse(key[0], CLIENTS, 1.0)
        if c.streams >= c.budget.streams:
            return self._refuse(key[0], STREAMS, 2.0)
        c.streams += 1
        self.streams[key[0]] += 1
        return ALLOW

    def close_stream(self, key: Key, now: float) -> None:
        c = self._tables[key[0]].get(key[1])
        if c is not None and c.streams > 0:
            c.streams -= 1
            self.streams[key[0]] -= 1

    # -- reports ------------------------------------------------------------------------------------
    def clients(self, kind: str) -> int:
        return len(self._tables[kind])

    def status(self) -> dict:
        """For /api/status: budgets, tracked clients, what is open, refusals by kind and reason."""
        return {k: {"budget": vars(self.budgets[k]).copy(), "clients": len(self._tables[k]),
                    "connections": self.connections[k], "streams": self.streams[k],
                    "refused": {r: self.refused[(k, r)] for r in REASONS}}
                for k in KINDS} | {"max_clients": self.max_clients,
                                   "max_outsider_connections": self.max_outsider_connections,
                                   "expired": self.expired}
