"""Sans-I/O membership core for swarm (SWIM-style failure detection + gossip).

This module does no I/O.  It never reads the clock, never opens a socket and
never sleeps: every entry point takes the current time ``now`` (float seconds,
any monotonic origin) and returns plain data -- reply dicts for requests it
received, and *actions* (``SendPing``, ``SendPingReq``, ``SendSync``,
``SendLeave``) that a thin HTTP shell must carry out, reporting the outcome
back through ``handle_ack`` / ``probe_failed`` / ``ping_req_result`` /
``handle_sync_reply``.  All randomness comes from one ``random.Random`` so a
run is reproducible from its seed.

Every received message is validated completely before any of it is applied;
a malformed message raises :class:`MembershipError` and leaves the state
untouched.  See docs/design.md, section "Membership", for the design.
"""

from __future__ import annotations

import collections
import math
import random
import zlib
from dataclasses import dataclass, field, replace
from typing import Any, Union

__all__ = [
    "ALIVE", "SUSPECT", "DEAD", "LEFT", "STATES",
    "MembershipError", "MembershipConfig", "Member", "Event",
    "SendPing", "SendPingReq", "SendSync", "SendLeave", "Membership",
    "PROTOCOL_VERSION", "MAX_UPDATES", "MAX_MEMBERS",
]

ALIVE, SUSPECT, DEAD, LEFT = "alive", "suspect", "dead", "left"
STATES = (ALIVE, SUSPECT, DEAD, LEFT)
# Precedence at equal incarnation: a higher rank overrides a lower one.
# LEFT outranks DEAD so that a graceful leave is never "downgraded" to a death.
_RANK = {ALIVE: 0, SUSPECT: 1, DEAD: 2, LEFT: 3}

PROTOCOL_VERSION = 1
MAX_ID_LEN = 128
MAX_ADDR_LEN = 256
MAX_UPDATES = 256          # piggybacked updates per ping/ack/ping-req/leave
MAX_MEMBERS = 4096         # records in a full-state message (join reply, sync)
MAX_MSG_KEYS = 32          # top-level keys of any message
MAX_RECORD_KEYS = 8        # keys of one member record
MAX_META_KEYS = 24
MAX_META_KEY_LEN = 64
MAX_META_STR_LEN = 128
MAX_INCARNATION = 2**53    # exactly representable everywhere (msgpack, JSON, float)
MAX_META_VERSION = 2**53
_INT64 = 2**63
MAX_EVENTS = 200


class MembershipError(ValueError):
    """A received message (or an argument) is malformed or not acceptable."""


@dataclass
class MembershipConfig:
    probe_interval: float = 0.5    # one new probe per interval
    probe_timeout: float = 0.8     # HTTP timeout of one ping (direct or relayed)
    indirect_probes: int = 2       # ping-req fan-out after a failed direct ping
    suspicion_timeout: float = 3.0  # SUSPECT -> DEAD unless refuted meanwhile
    dead_retention: float = 60.0   # tombstones (DEAD/LEFT) kept this long
    max_piggyback: int = 16        # updates piggybacked per message
    retransmit_mult: int = 3       # each update sent ~mult*ceil(log2(n+1)) times
    sync_interval: float = 5.0     # anti-entropy full-state push-pull

    def __post_init__(self) -> None:
        for name in ("probe_interval", "probe_timeout", "suspicion_timeout",
                     "dead_retention", "sync_interval"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not v > 0 or math.isinf(v):
                raise ValueError(f"MembershipConfig.{name} must be a positive finite number, got {v!r}")
        for name in ("indirect_probes", "max_piggyback", "retransmit_mult"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"MembershipConfig.{name} must be a non-negative int, got {v!r}")
        if self.retransmit_mult < 1:
            raise ValueError("MembershipConfig.retransmit_mult must be >= 1")

    @property
    def ping_req_timeout(self) -> float:
        """HTTP timeout of a ping-req: the intermediary needs a whole ping timeout itself."""
        return 2.0 * self.probe_timeout

    @property
    def probe_deadline(self) -> float:
        """Overall budget of one probe (direct ping, then ping-reqs), from its start."""
        return self.probe_timeout + self.ping_req_timeout + 0.1 * self.probe_timeout


@dataclass
class Member:
    peer_id: str
    addr: str
    state: str
    incarnation: int
    changed_at: float
    meta: dict[str, Union[int, float, str]] = field(default_factory=dict)


@dataclass
class Event:
    kind: str   # "joined" | "alive" | "suspect" | "dead" | "left" | "refuted"
    peer_id: str
    at: float
    detail: str = ""


# ----------------------------------------------------------------- actions --
# ``timeout`` is an addition to the agreed API (defaulted, so positional use is
# unchanged): the HTTP timeout the shell should apply to that request.

@dataclass
class SendPing:
    target: str
    addr: str
    msg: dict
    probe_id: int
    timeout: float = 0.8


@dataclass
class SendPingReq:
    via: str
    via_addr: str
    target: str
    target_addr: str
    msg: dict
    probe_id: int
    timeout: float = 1.6


@dataclass
class SendSync:
    target: str
    addr: str
    msg: dict
    timeout: float = 1.6


@dataclass
class SendLeave:
    target: str
    addr: str
    msg: dict
    timeout: float = 0.8


# -------------------------------------------------------------- validation --

@dataclass(frozen=True)
class _Rec:
    """A validated member record (one update)."""
    peer_id: str
    addr: str
    state: str
    inc: int
    meta: dict | None
    mv: int | None


@dataclass
class _Msg:
    kind: str
    sender: _Rec
    records: list[_Rec]
    target: str | None = None
    target_addr: str | None = None


def _tname(v: Any) -> str:
    return type(v).__name__


def _check_str(v: Any, what: str, maxlen: int) -> str:
    if type(v) is not str:
        raise MembershipError(f"{what} must be a str, got {_tname(v)}")
    if not v:
        raise MembershipError(f"{what} must not be empty")
    if len(v) > maxlen:
        raise MembershipError(f"{what} too long ({len(v)} > {maxlen} chars)")
    return v


def _check_id(v: Any, what: str) -> str:
    s = _check_str(v, what, MAX_ID_LEN)
    if not s.isprintable() or s != s.strip():
        raise MembershipError(f"{what} contains unprintable characters or surrounding whitespace")
    return s


def _check_addr(v: Any, what: str) -> str:
    s = _check_str(v, what, MAX_ADDR_LEN)
    if not (s.startswith("http://") or s.startswith("https://")):
        raise MembershipError(f"{what} must start with http:// or https://")
    if not s.isprintable() or any(c.isspace() for c in s):
        raise MembershipError(f"{what} contains whitespace or unprintable characters")
    return s


def _check_uint(v: Any, what: str, maximum: int) -> int:
    if type(v) is not int:
        raise MembershipError(f"{what} must be an int, got {_tname(v)}")
    if v < 0:
        raise MembershipError(f"{what} must not be negative ({v})")
    if v > maximum:
        raise MembershipError(f"{what} absurdly large ({v})")
    return v


def _check_state(v: Any, what: str, allowed: tuple[str, ...] = STATES) -> str:
    if type(v) is not str:
        raise MembershipError(f"{what} must be a str, got {_tname(v)}")
    if v not in allowed:
        raise MembershipError(f"{what} {v[:32]!r} is not one of {', '.join(allowed)}")
    return v


def _check_meta(v: Any, what: str) -> dict:
    if type(v) is not dict:
        raise MembershipError(f"{what} must be a dict, got {_tname(v)}")
    if len(v) > MAX_META_KEYS:
        raise MembershipError(f"{what} has too many keys ({len(v)} > {MAX_META_KEYS})")
    out: dict = {}
    for k, x in v.items():
        _check_str(k, f"{what} key", MAX_META_KEY_LEN)
        t = type(x)
        if t is int:
            if not -_INT64 <= x < _INT64:
                raise MembershipError(f"{what}[{k!r}] int out of 64-bit range")
        elif t is float:
            if not math.isfinite(x):
                raise MembershipError(f"{what}[{k!r}] must be finite")
        elif t is str:
            if len(x) > MAX_META_STR_LEN:
                raise MembershipError(f"{what}[{k!r}] string too long ({len(x)} > {MAX_META_STR_LEN})")
        else:
            raise MembershipError(f"{what}[{k!r}] must be int, float or str, got {t.__name__}")
        out[k] = x
    return out


def _check_keys(d: dict, what: str, limit: int) -> None:
    if len(d) > limit:
        raise MembershipError(f"{what} has too many keys ({len(d)} > {limit})")
    for k in d:
        if type(k) is not str:
            raise MembershipError(f"{what} has a non-str key ({_tname(k)})")


def _req(d: dict, key: str, what: str) -> Any:
    try:
        return d[key]
    except KeyError:
        raise MembershipError(f"{what} is missing {key!r}") from None


def _parse_record(d: Any, what: str) -> _Rec:
    if type(d) is not dict:
        raise MembershipError(f"{what} must be a dict, got {_tname(d)}")
    _check_keys(d, what, MAX_RECORD_KEYS)
    pid = _check_id(_req(d, "id", what), f"{what}.id")
    addr = _check_addr(_req(d, "addr", what), f"{what}.addr")
    state = _check_state(_req(d, "state", what), f"{what}.state")
    inc = _check_uint(_req(d, "inc", what), f"{what}.inc", MAX_INCARNATION)
    meta = mv = None
    if "meta" in d or "mv" in d:
        meta = _check_meta(_req(d, "meta", what), f"{what}.meta")
        mv = _check_uint(_req(d, "mv", what), f"{what}.mv", MAX_META_VERSION)
    return _Rec(pid, addr, state, inc, meta, mv)


def _parse_list(v: Any, what: str, cap: int) -> list[_Rec]:
    if type(v) is not list:
        raise MembershipError(f"{what} must be a list, got {_tname(v)}")
    if len(v) > cap:
        raise MembershipError(f"too many {what} ({len(v)} > {cap})")
    return [_parse_record(x, f"{what}[{i}]") for i, x in enumerate(v)]


_FULL_STATE = ("join_reply", "sync", "sync_reply")
_WITH_UPDATES = ("ping", "ack", "ping_req", "leave")


def _parse_message(msg: Any, kind: str, self_id: str) -> _Msg:
    """Validate ``msg`` completely; raise MembershipError, never anything else."""
    if type(msg) is not dict:
        raise MembershipError(f"{kind} message must be a dict, got {_tname(msg)}")
    _check_keys(msg, f"{kind} message", MAX_MSG_KEYS)
    v = _req(msg, "v", "message")
    if type(v) is not int or v != PROTOCOL_VERSION:
        raise MembershipError(f"unsupported protocol version {v!r:.32}")
    t = _req(msg, "type", "message")
    if type(t) is not str or t != kind:
        raise MembershipError(f"expected a {kind!r} message, got type {t!r:.40}")
    sender_id = _check_id(_req(msg, "from", kind), f"{kind}.from")
    addr = _check_addr(_req(msg, "addr", kind), f"{kind}.addr")
    inc = _check_uint(_req(msg, "inc", kind), f"{kind}.inc", MAX_INCARNATION)
    state = _check_state(_req(msg, "state", kind), f"{kind}.state", (ALIVE, LEFT))
    meta = _check_meta(_req(msg, "meta", kind), f"{kind}.meta")
    mv = _check_uint(_req(msg, "mv", kind), f"{kind}.mv", MAX_META_VERSION)
    if sender_id == self_id:
        raise MembershipError(f"{kind} message claims to come from this peer ({self_id!r})")
    if kind == "leave" and state != LEFT:
        raise MembershipError("leave message must carry state 'left'")
    out = _Msg(kind, _Rec(sender_id, addr, state, inc, meta, mv), [])
    if kind in _FULL_STATE:
        out.records = _parse_list(_req(msg, "members", kind), "members", MAX_MEMBERS)
    elif kind in _WITH_UPDATES:
        out.records = _parse_list(_req(msg, "updates", kind), "updates", MAX_UPDATES)
    if kind in ("ping", "ping_req"):
        out.target = _check_id(_req(msg, "target", kind), f"{kind}.target")
    if kind == "ping_req":
        out.target_addr = _check_addr(_req(msg, "target_addr", kind), f"{kind}.target_addr")
    if kind == "ping" and out.target != self_id:
        raise MembershipError(f"ping addressed to {out.target!r}, this is {self_id!r}")
    return out


# ------------------------------------------------------------------ core --

@dataclass
class _Probe:
    target: str
    addr: str
    started: float
    deadline: float
    direct_failed: bool = False
    indirect_pending: int = 0


class Membership:
    """One peer's view of the swarm.  See the module docstring and docs/design.md."""

    def __init__(self, peer_id: str, addr: str, now: float,
                 config: MembershipConfig | None = None,
                 rng: random.Random | None = None,
                 meta: dict | None = None) -> None:
        _check_id(peer_id, "peer_id")
        _check_addr(addr, "addr")
        own_meta = _check_meta({} if meta is None else meta, "meta")
        self.config = config if config is not None else MembershipConfig()
        self.rng = rng if rng is not None else random.Random(zlib.crc32(peer_id.encode()))
        self.self_id = peer_id
        self.addr = addr
        self.events: collections.deque[Event] = collections.deque(maxlen=MAX_EVENTS)
        self.epoch = 0
        self._members: dict[str, Member] = {
            peer_id: Member(peer_id, addr, ALIVE, 0, now, own_meta)}
        self._mv: dict[str, int] = {peer_id: 0}     # meta version per peer
        self._bcast: dict[str, int] = {}            # peer_id -> times piggybacked
        self._probes: dict[int, _Probe] = {}        # our own outstanding probes
        self._relays: dict[int, tuple[str, float]] = {}  # pings we forward for others
        self._order: list[str] = []                 # SWIM round-robin probe order
        self._order_idx = 0
        self._next_pid = 1
        self._left = False
        cfg = self.config
        # Desynchronise peers started together; deterministic via rng.
        self._next_probe = now + self.rng.uniform(0.0, cfg.probe_interval)
        self._next_sync = now + cfg.sync_interval * self.rng.uniform(0.5, 1.0)
        self._alive_set = frozenset([peer_id])

    # ------------------------------------------------------------ queries --
    @property
    def incarnation(self) -> int:
        return self._members[self.self_id].incarnation

    @property
    def left(self) -> bool:
        return self._left

    def members(self) -> list[Member]:
        return [replace(m, meta=dict(m.meta)) for _, m in sorted(self._members.items())]

    def alive_ids(self, include_self: bool = True) -> list[str]:
        return sorted(p for p, m in self._members.items()
                      if m.state == ALIVE and (include_self or p != self.self_id))

    def live_ids(self, include_self: bool = True) -> list[str]:
        return sorted(p for p, m in self._members.items()
                      if m.state in (ALIVE, SUSPECT) and (include_self or p != self.self_id))

    def get(self, peer_id: str) -> Member | None:
        m = self._members.get(peer_id)
        return None if m is None else replace(m, meta=dict(m.meta))

    def snapshot(self) -> dict:
        """Everything this core holds, as plain data (copies, comparable with ``==``): the members
        and their meta versions, the gossip queue, our outstanding probes (``probes``, by probe id)
        and the pings we relay, the probe order, the counters, timers and the rng's state.
        Two cores with equal snapshots answer every input alike, so it shows that a refused message
        changed nothing (every handler validates the whole message first) and what a step did when
        debugging. Its keys are for reading, not a wire format."""
        return {
            "members": [(m.peer_id, m.addr, m.state, m.incarnation, m.changed_at, dict(m.meta))
                        for _, m in sorted(self._members.items())],
            "meta_versions": dict(self._mv), "gossip": dict(self._bcast),
            "probes": {pid: (p.target, p.addr, p.started, p.deadline, p.direct_failed, p.indirect_pending)
                       for pid, p in self._probes.items()},
            "relays": dict(self._relays), "order": list(self._order), "order_idx": self._order_idx,
            "next_probe_id": self._next_pid, "next_probe": self._next_probe, "next_sync": self._next_sync,
            "epoch": self.epoch, "alive": sorted(self._alive_set), "events": list(self.events), "left": self._left, "rng": self.rng.getstate(),
        }

    def set_meta(self, **kv: Any) -> None:
        me = self._members[self.self_id]
        merged = _check_meta({**me.meta, **kv}, "meta")   # raises before any change
        if merged != me.meta:
            me.meta = merged
            self._mv[self.self_id] += 1

    # --------------------------------------------------------------- join --
    def join_request(self) -> dict:
        return self._header("join")

    def handle_join(self, msg: dict, now: float) -> dict:
        parsed = _parse_message(msg, "join", self.self_id)
        if self._left:
            raise MembershipError("this peer has left the swarm; join through another member")
        self._apply_msg(parsed, now)
        reply = self._full_state("join_reply")
        self._after()
        return reply

    def handle_join_reply(self, msg: dict, now: float) -> None:
        parsed = _parse_message(msg, "join_reply", self.self_id)
        self._apply_msg(parsed, now)
        self._after()

    # ------------------------------------------------------------ probing --
    def tick(self, now: float) -> list[SendPing | SendPingReq | SendSync]:
        if self._left:
            return []
        cfg = self.config
        actions: list[SendPing | SendPingReq | SendSync] = []
        # 1. probes whose overall deadline passed without any ack
        for pid, p in list(self._probes.items()):
            if now >= p.deadline:
                del self._probes[pid]
                self._suspect(p.target, now, "no ack before the probe deadline")
        for rid, (_, deadline) in list(self._relays.items()):
            if now >= deadline:
                del self._relays[rid]
        # 2. suspicions that were not refuted in time
        for m in self._members.values():
            if (m.state == SUSPECT and m.peer_id != self.self_id
                    and now - m.changed_at >= cfg.suspicion_timeout):
                self._set_state(m, DEAD, m.incarnation, now,
                                f"suspicion not refuted within {cfg.suspicion_timeout:g}s")
        # 3. forget old tombstones
        for pid in [p for p, m in self._members.items()
                    if m.state in (DEAD, LEFT) and p != self.self_id
                    and now - m.changed_at >= cfg.dead_retention]:
            del self._members[pid]
            self._mv.pop(pid, None)
            self._bcast.pop(pid, None)
        # 4. at most one new probe per interval
        if now >= self._next_probe:
            self._next_probe += cfg.probe_interval
            if self._next_probe <= now:
                self._next_probe = now + cfg.probe_interval
            target = self._next_target()
            if target is not None:
                m = self._members[target]
                pid = self._new_pid()
                self._probes[pid] = _Probe(target, m.addr, now, now + cfg.probe_deadline)
                actions.append(SendPing(target, m.addr, self._ping_msg(target), pid,
                                        timeout=cfg.probe_timeout))
        # 5. periodic anti-entropy with a random alive member, plus one reconnect
        #    attempt to a random DEAD member (heals partitions: if it answers, the
        #    exchange makes both sides refute and see each other again).
        if now >= self._next_sync:
            self._next_sync = now + cfg.sync_interval
            for cands in (self.alive_ids(include_self=False),
                          sorted(p for p, m in self._members.items() if m.state == DEAD)):
                if cands:
                    t = self.rng.choice(cands)
                    actions.append(SendSync(t, self._members[t].addr, self._full_state("sync"),
                                            timeout=cfg.ping_req_timeout))
        self._after()
        return actions

    def handle_ping(self, msg: dict, now: float) -> dict:
        parsed = _parse_message(msg, "ping", self.self_id)
        self._apply_msg(parsed, now)
        ack = self._header("ack")
        ack["updates"] = self._piggyback(parsed.sender.peer_id)
        self._after()
        return ack

    def handle_ack(self, probe_id: int, msg: dict, now: float) -> None:
        parsed = _parse_message(msg, "ack", self.self_id)
        expected = self._expected_target(probe_id)
        if expected is not None and parsed.sender.peer_id != expected:
            raise MembershipError(
                f"ack from {parsed.sender.peer_id!r} but probe {probe_id} was for {expected!r}")
        self._apply_msg(parsed, now)
        self._probes.pop(probe_id, None)   # satisfied: any ack before the deadline counts
        self._relays.pop(probe_id, None)
        self._after()

    def probe_failed(self, probe_id: int, now: float) -> list[SendPingReq]:
        if self._relays.pop(probe_id, None) is not None:
            return []
        p = self._probes.get(probe_id)
        if p is None or p.direct_failed or self._left:
            return []
        tm = self._members.get(p.target)
        if tm is None or tm.state not in (ALIVE, SUSPECT):
            del self._probes[probe_id]      # already declared dead/left meanwhile
            return []
        p.direct_failed = True
        cands = [x for x in self.alive_ids(include_self=False) if x != p.target]
        k = min(self.config.indirect_probes, len(cands))
        if k == 0:
            del self._probes[probe_id]
            self._suspect(p.target, now, "direct probe failed and no one to ask")
            self._after()
            return []
        vias = self.rng.sample(cands, k)
        p.indirect_pending = k
        out = []
        for via in vias:
            msg = self._header("ping_req")
            msg["target"] = p.target
            msg["target_addr"] = p.addr
            msg["updates"] = self._piggyback(via)
            out.append(SendPingReq(via, self._members[via].addr, p.target, p.addr, msg,
                                   probe_id, timeout=self.config.ping_req_timeout))
        return out

    def handle_ping_req(self, msg: dict, now: float) -> SendPing | None:
        parsed = _parse_message(msg, "ping_req", self.self_id)
        self._apply_msg(parsed, now)
        target = parsed.target
        assert target is not None and parsed.target_addr is not None
        if self._left or target == self.self_id or target == parsed.sender.peer_id:
            self._after()
            return None
        rid = self._new_pid()
        self._relays[rid] = (target, now + self.config.ping_req_timeout)
        action = SendPing(target, parsed.target_addr, self._ping_msg(target), rid,
                          timeout=self.config.probe_timeout)
        self._after()
        return action

    def ping_req_result(self, probe_id: int, ok: bool, msg: dict | None, now: float) -> None:
        p = self._probes.get(probe_id)
        if ok:
            if msg is None:
                raise MembershipError("successful ping-req result needs the target's ack")
            parsed = _parse_message(msg, "ack", self.self_id)
            if p is not None and parsed.sender.peer_id != p.target:
                raise MembershipError(
                    f"relayed ack from {parsed.sender.peer_id!r} but probe {probe_id} "
                    f"was for {p.target!r}")
            self._apply_msg(parsed, now)
            self._probes.pop(probe_id, None)
        elif p is not None and p.direct_failed:
            p.indirect_pending -= 1
            if p.indirect_pending <= 0:
                del self._probes[probe_id]
                self._suspect(p.target, now, "direct and indirect probes failed")
        self._after()

    # --------------------------------------------------------------- sync --
    def sync_message(self) -> dict:
        """A full-state ``sync`` body, for an extra push-pull the shell wants to start itself
        (e.g. right after catching up).  POST it to /v1/sync; feed the reply to handle_sync_reply."""
        return self._full_state("sync")

    def handle_sync(self, msg: dict, now: float) -> dict:
        parsed = _parse_message(msg, "sync", self.self_id)
        self._apply_msg(parsed, now)
        reply = self._full_state("sync_reply")
        self._after()
        return reply

    def handle_sync_reply(self, msg: dict, now: float) -> None:
        parsed = _parse_message(msg, "sync_reply", self.self_id)
        self._apply_msg(parsed, now)
        self._after()

    # -------------------------------------------------------------- leave --
    def leave(self, now: float) -> list[SendLeave]:
        if self._left:
            return []
        targets = self.live_ids(include_self=False)
        self._left = True
        me = self._members[self.self_id]
        self._set_state(me, LEFT, me.incarnation, now, "graceful leave")
        self._probes.clear()
        self._relays.clear()
        out = []
        for t in targets:
            msg = self._header("leave")
            msg["updates"] = self._piggyback(t)
            out.append(SendLeave(t, self._members[t].addr, msg, timeout=self.config.probe_timeout))
        self._after()
        return out

    def handle_leave(self, msg: dict, now: float) -> None:
        parsed = _parse_message(msg, "leave", self.self_id)
        self._apply_msg(parsed, now)
        self._after()

    # ----------------------------------------------------------- internals --
    def _new_pid(self) -> int:
        pid = self._next_pid
        self._next_pid += 1
        return pid

    def _expected_target(self, probe_id: int) -> str | None:
        p = self._probes.get(probe_id)
        if p is not None:
            return p.target
        r = self._relays.get(probe_id)
        return None if r is None else r[0]

    def _event(self, kind: str, peer_id: str, now: float, detail: str = "") -> None:
        self.events.append(Event(kind, peer_id, now, detail))

    def _after(self) -> None:
        """Bump the epoch if the set of ALIVE members changed."""
        alive = frozenset(p for p, m in self._members.items() if m.state == ALIVE)
        if alive != self._alive_set:
            self._alive_set = alive
            self.epoch += 1

    def _record(self, pid: str) -> dict:
        m = self._members[pid]
        return {"id": pid, "addr": m.addr, "state": m.state, "inc": m.incarnation,
                "meta": dict(m.meta), "mv": self._mv.get(pid, 0)}

    def _header(self, kind: str) -> dict:
        me = self._members[self.self_id]
        return {"v": PROTOCOL_VERSION, "type": kind, "from": self.self_id, "addr": self.addr,
                "inc": me.incarnation, "state": LEFT if self._left else ALIVE,
                "meta": dict(me.meta), "mv": self._mv[self.self_id]}

    def _full_state(self, kind: str) -> dict:
        msg = self._header(kind)
        msg["members"] = [self._record(p) for p in sorted(self._members)][:MAX_MEMBERS]
        return msg

    def _ping_msg(self, target: str) -> dict:
        msg = self._header("ping")
        msg["target"] = target
        msg["updates"] = self._piggyback(target)
        return msg

    def _retransmit_limit(self) -> int:
        n = sum(1 for m in self._members.values() if m.state in (ALIVE, SUSPECT))
        return self.config.retransmit_mult * max(1, math.ceil(math.log2(n + 1)))

    def _piggyback(self, recipient: str | None) -> list[dict]:
        """Pick the least-sent pending updates; always tell a suspected recipient."""
        budget = min(self.config.max_piggyback, MAX_UPDATES - 1)
        out: list[dict] = []
        sent: set[str] = set()
        rm = self._members.get(recipient) if recipient is not None else None
        if rm is not None and rm.state != ALIVE:
            # The recipient is suspected/dead in our view: tell it, so it can refute.
            out.append(self._record(recipient))
            sent.add(recipient)
        limit = self._retransmit_limit()
        for pid, count in sorted(self._bcast.items(), key=lambda kv: (kv[1], kv[0])):
            if len(out) >= budget:
                break
            if pid not in self._members:
                del self._bcast[pid]
                continue
            if pid in sent:
                continue
            out.append(self._record(pid))
            if count + 1 >= limit:
                del self._bcast[pid]
            else:
                self._bcast[pid] = count + 1
        return out

    def _next_target(self) -> str | None:
        for _ in range(2):
            while self._order_idx < len(self._order):
                pid = self._order[self._order_idx]
                self._order_idx += 1
                m = self._members.get(pid)
                if (m is not None and pid != self.self_id and m.state in (ALIVE, SUSPECT)
                        and not any(p.target == pid for p in self._probes.values())):
                    return pid
            self._order = self.live_ids(include_self=False)
            self.rng.shuffle(self._order)
            self._order_idx = 0
            if not self._order:
                return None
        return None

    def _add_to_order(self, pid: str) -> None:
        if pid in self._order[self._order_idx:]:
            return
        pos = self.rng.randint(self._order_idx, len(self._order))
        self._order.insert(pos, pid)

    def _suspect(self, pid: str, now: float, why: str) -> None:
        m = self._members.get(pid)
        if m is not None and m.state == ALIVE and pid != self.self_id:
            self._set_state(m, SUSPECT, m.incarnation, now, why)

    def _set_state(self, m: Member, state: str, inc: int, now: float, detail: str) -> None:
        old = m.state
        m.state, m.incarnation, m.changed_at = state, inc, now
        self._bcast[m.peer_id] = 0
        if state != old:
            if state == ALIVE:
                self._event("alive", m.peer_id, now, detail or f"back as alive (inc {inc})")
            else:
                self._event(state, m.peer_id, now, detail)
        if state in (ALIVE, SUSPECT) and m.peer_id != self.self_id:
            self._add_to_order(m.peer_id)

    def _apply_msg(self, parsed: _Msg, now: float) -> None:
        self._apply(parsed.sender, now)
        for rec in parsed.records:
            self._apply(rec, now)

    def _apply(self, rec: _Rec, now: float) -> None:
        pid = rec.peer_id
        if pid == self.self_id:
            self._about_self(rec, now)
            return
        cur = self._members.get(pid)
        if cur is None:
            meta = rec.meta if rec.meta is not None else {}
            self._members[pid] = Member(pid, rec.addr, rec.state, rec.inc, now, dict(meta))
            self._mv[pid] = rec.mv or 0
            if rec.state in (ALIVE, SUSPECT):
                # Tombstones for strangers are kept silently (they stop stale
                # ALIVE rumours from resurrecting the peer) but not re-gossiped.
                self._bcast[pid] = 0
                self._event("joined", pid, now, f"{rec.addr} ({rec.state}, inc {rec.inc})")
                self._add_to_order(pid)
            return
        if (rec.inc, _RANK[rec.state]) > (cur.incarnation, _RANK[cur.state]):
            cur.addr = rec.addr
            detail = ""
            if rec.state == ALIVE and cur.state != ALIVE:
                detail = f"refuted {cur.state} with incarnation {rec.inc}"
            elif rec.state != ALIVE:
                detail = f"incarnation {rec.inc} (gossip)"
            self._set_state(cur, rec.state, rec.inc, now, detail)
        if rec.mv is not None and rec.mv > self._mv.get(pid, 0) and rec.meta is not None:
            cur.meta = dict(rec.meta)
            self._mv[pid] = rec.mv

    def _about_self(self, rec: _Rec, now: float) -> None:
        if self._left:
            return
        me = self._members[self.self_id]
        if rec.inc < me.incarnation:
            return
        if rec.state == ALIVE and rec.inc == me.incarnation:
            return
        # Someone holds SUSPECT/DEAD/LEFT about us at our incarnation (or any
        # record at a higher one): refute by outbidding it.
        new_inc = rec.inc + 1
        if new_inc > MAX_INCARNATION:
            return
        me.incarnation = new_inc
        me.changed_at = now
        self._bcast[self.self_id] = 0
        self._event("refuted", self.self_id, now,
                    f"heard {rec.state} at incarnation {rec.inc}; now incarnation {new_inc}")
