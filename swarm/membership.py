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

Self-certifying records: what a member says of itself (address, incarnation,
meta, public key, TLS fingerprint) is a *claim* it signs with its key
(swarm/identity.py); every receiver checks that the key is the id's and the
signature is good, so no peer can speak for another, also not through a relay
or in gossip.  ``suspect`` and ``dead`` are rumours other peers attach to a
claim's incarnation; ``left`` only comes from the member's own signed claim.
"""

from __future__ import annotations

import collections
import math
import random
import zlib
from dataclasses import dataclass, field, replace
from typing import Any, Union

import msgpack

from . import identity
from .identity import PeerKey, owns

__all__ = [
    "ALIVE", "SUSPECT", "DEAD", "LEFT", "STATES",
    "MembershipError", "MembershipConfig", "Member", "Event",
    "SendPing", "SendPingReq", "SendSync", "SendLeave", "Membership",
    "PROTOCOL_VERSION", "MAX_UPDATES", "MAX_MEMBERS", "CLAIM_LABEL", "CLAIM_KEYS",
]

ALIVE, SUSPECT, DEAD, LEFT = "alive", "suspect", "dead", "left"
STATES = (ALIVE, SUSPECT, DEAD, LEFT)
# Precedence at equal incarnation: a higher rank overrides a lower one.
# LEFT outranks DEAD so that a graceful leave is never "downgraded" to a death.
_RANK = {ALIVE: 0, SUSPECT: 1, DEAD: 2, LEFT: 3}

PROTOCOL_VERSION = 2       # 2: member records are signed claims (CLAIM_LABEL), the sender's header one of them
CLAIM_LABEL = b"swarm member v1\n"   # signed: CLAIM_LABEL + the claim's msgpack bytes
CLAIM_KEYS = ("id", "addr", "inc", "st", "meta", "mv", "pk", "tls")   # exactly these, in this order
RECORD_KEYS = frozenset(("id", "state", "claim", "sig"))
MAX_CLAIM_LEN = 8192       # bytes of one encoded claim (24 meta entries of 64+128 chars fit)
MAX_ID_LEN = 128
MAX_ADDR_LEN = 256
MAX_UPDATES = 256          # piggybacked updates per ping/ack/ping-req/leave
MAX_MEMBERS = 4096         # records in a full-state message (join reply, sync)
MAX_MSG_KEYS = 32          # top-level keys of any message
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
    public: bytes = b""   # its Ed25519 public key (the id is derived from it)
    tls: str = ""         # its TLS certificate's SHA-256 fingerprint, hex ("" without TLS)


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

@dataclass(eq=False)
class _Rec:
    """A structurally valid member record (one update): its state and its decoded claim.

    ``trust`` is set against this core's state before anything is applied: 2 = the claim is the
    subject's (its signature checked, or the very bytes this core already holds), 1 = only the
    rumour's state counts (its incarnation is that of a claim this core holds), 0 = not checked
    because it would change nothing (it is skipped)."""
    peer_id: str
    state: str
    inc: int
    addr: str
    st: str
    meta: dict
    mv: int
    pk: bytes
    tls: str
    claim: bytes
    sig: bytes
    trust: int = 0


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


def _check_tls(v: Any, what: str) -> str:
    if type(v) is not str:
        raise MembershipError(f"{what} must be a str, got {_tname(v)}")
    if v and not (len(v) == 64 and all(c in "0123456789abcdef" for c in v)):
        raise MembershipError(f"{what} must be empty or 64 lowercase hex digits (SHA-256)")
    return v


def _encode_claim(peer_id: str, addr: str, inc: int, st: str, meta: dict, mv: int, pk: bytes,
                  tls: str) -> bytes:
    """A claim's bytes: one msgpack map in CLAIM_KEYS order (deterministic for equal inputs)."""
    return msgpack.packb({"id": peer_id, "addr": addr, "inc": inc, "st": st, "meta": meta, "mv": mv,
                          "pk": pk, "tls": tls}, use_bin_type=True)


def _decode_claim(data: bytes, what: str) -> dict:
    try:
        c = msgpack.unpackb(data, raw=False, strict_map_key=True, max_str_len=MAX_CLAIM_LEN,
                            max_bin_len=MAX_CLAIM_LEN, max_array_len=MAX_META_KEYS,
                            max_map_len=MAX_CLAIM_LEN, max_ext_len=0)
    except Exception as e:  # msgpack raises a handful of types on malformed input
        raise MembershipError(f"{what} is not one msgpack map ({type(e).__name__})") from None
    if type(c) is not dict:
        raise MembershipError(f"{what} must be a map, got {_tname(c)}")
    if len(c) != len(CLAIM_KEYS) or any(k not in c for k in CLAIM_KEYS):
        raise MembershipError(f"{what} must have exactly the keys {', '.join(CLAIM_KEYS)}")
    return c


def _parse_record(d: Any, what: str, allowed: tuple[str, ...] = STATES) -> _Rec:
    """Check one record in full, short of its signature (which needs the core's state)."""
    if type(d) is not dict:
        raise MembershipError(f"{what} must be a dict, got {_tname(d)}")
    if len(d) != len(RECORD_KEYS) or any(k not in d for k in RECORD_KEYS):
        raise MembershipError(f"{what} must have exactly the keys {', '.join(sorted(RECORD_KEYS))}")
    pid = _check_id(d["id"], f"{what}.id")
    state = _check_state(d["state"], f"{what}.state", allowed)
    claim, sig = d["claim"], d["sig"]
    if type(claim) is not bytes or not 0 < len(claim) <= MAX_CLAIM_LEN:
        raise MembershipError(f"{what}.claim must be bytes, at most {MAX_CLAIM_LEN}")
    if type(sig) is not bytes or len(sig) != identity.SIGNATURE_LEN:
        raise MembershipError(f"{what}.sig must be {identity.SIGNATURE_LEN} bytes")
    c = _decode_claim(claim, f"{what}.claim")
    if c["id"] != pid:
        raise MembershipError(f"{what} is about {pid[:40]!r} but its claim names {str(c['id'])[:40]!r}")
    addr = _check_addr(c["addr"], f"{what}.claim.addr")
    inc = _check_uint(c["inc"], f"{what}.claim.inc", MAX_INCARNATION)
    st = _check_state(c["st"], f"{what}.claim.st", (ALIVE, LEFT))
    meta = _check_meta(c["meta"], f"{what}.claim.meta")
    mv = _check_uint(c["mv"], f"{what}.claim.mv", MAX_META_VERSION)
    pk = c["pk"]
    if type(pk) is not bytes or len(pk) != identity.PUBLIC_LEN:
        raise MembershipError(f"{what}.claim.pk must be {identity.PUBLIC_LEN} bytes")
    tls = _check_tls(c["tls"], f"{what}.claim.tls")
    # Its own state is the member's word; suspect/dead are others' rumours about an alive claim;
    # nobody but the member can say it left.
    if state != st and not (st == ALIVE and state in (SUSPECT, DEAD)):
        raise MembershipError(f"{what} says {state!r} of a claim that says {st!r}"
                              + (" (only the member's own signed claim can say it left)" if state == LEFT else ""))
    if not owns(pk, pid):
        raise MembershipError(f"{what}: the key in the claim is not the key of {pid[:40]!r}")
    return _Rec(pid, state, inc, addr, st, meta, mv, pk, tls, claim, sig)


def _parse_list(v: Any, what: str, cap: int) -> list[_Rec]:
    if type(v) is not list:
        raise MembershipError(f"{what} must be a list, got {_tname(v)}")
    if len(v) > cap:
        raise MembershipError(f"too many {what} ({len(v)} > {cap})")
    return [_parse_record(x, f"{what}[{i}]") for i, x in enumerate(v)]


_FULL_STATE = ("join_reply", "sync", "sync_reply")
_WITH_UPDATES = ("ping", "ack", "ping_req", "leave")


def _parse_message(msg: Any, kind: str, self_id: str, origin: str | None = None) -> _Msg:
    """Validate ``msg``'s structure completely; raise MembershipError, never anything else."""
    if type(msg) is not dict:
        raise MembershipError(f"{kind} message must be a dict, got {_tname(msg)}")
    _check_keys(msg, f"{kind} message", MAX_MSG_KEYS)
    v = _req(msg, "v", "message")
    if type(v) is not int or v != PROTOCOL_VERSION:
        raise MembershipError(f"unsupported protocol version {v!r:.32}")
    t = _req(msg, "type", "message")
    if type(t) is not str or t != kind:
        raise MembershipError(f"expected a {kind!r} message, got type {t!r:.40}")
    # the sender's header is its own signed record: its state is its claim's (alive or left)
    sender = _parse_record(_req(msg, "from", kind), f"{kind}.from", (ALIVE, LEFT))
    if sender.peer_id == self_id:
        raise MembershipError(f"{kind} message claims to come from this peer ({self_id!r})")
    if origin is not None and sender.peer_id != origin:
        raise MembershipError(f"{kind} message claims to come from {sender.peer_id[:40]!r} "
                              f"but was sent by {str(origin)[:40]!r}")
    if kind == "leave" and sender.state != LEFT:
        raise MembershipError("leave message must carry state 'left'")
    out = _Msg(kind, sender, [])
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

    def __init__(self, key: PeerKey, addr: str, now: float,
                 config: MembershipConfig | None = None,
                 rng: random.Random | None = None,
                 meta: dict | None = None, *,
                 peer_id: str | None = None, tls: str = "") -> None:
        """``key`` signs this peer's claims; ``peer_id`` is ``key.id`` unless given (a host group's
        rank is ``f"{key.id}~{rank}"``); ``tls`` is the fingerprint of the certificate this peer
        serves (``key.fingerprint()``), "" when the swarm runs without TLS."""
        if not isinstance(key, PeerKey):
            raise MembershipError(f"key must be a PeerKey, got {_tname(key)}")
        peer_id = key.id if peer_id is None else peer_id
        _check_id(peer_id, "peer_id")
        if not owns(key.public, peer_id):
            raise MembershipError(f"peer_id {peer_id[:40]!r} is not the id of this key ({key.id})")
        _check_addr(addr, "addr")
        _check_tls(tls, "tls")
        own_meta = _check_meta({} if meta is None else meta, "meta")
        self.config = config if config is not None else MembershipConfig()
        self.rng = rng if rng is not None else random.Random(zlib.crc32(peer_id.encode()))
        self.key = key
        self.self_id = peer_id
        self.addr = addr
        self.tls = tls
        self.events: collections.deque[Event] = collections.deque(maxlen=MAX_EVENTS)
        self.epoch = 0
        self._members: dict[str, Member] = {
            peer_id: Member(peer_id, addr, ALIVE, 0, now, own_meta, key.public, tls)}
        self._mv: dict[str, int] = {peer_id: 0}     # meta version per peer
        self._claims: dict[str, tuple[bytes, bytes]] = {}  # peer_id -> (claim, sig) as held
        self._own_fields: tuple | None = None       # what our own held claim says (re-sign on change)
        self._bcast: dict[str, int] = {}            # peer_id -> times piggybacked
        self._probes: dict[int, _Probe] = {}        # our own outstanding probes
        self._relays: dict[int, tuple[str, float]] = {}  # pings we forward for others
        self._order: list[str] = []                 # SWIM round-robin probe order
        self._order_idx = 0
        self._next_pid = 1
        self._left = False
        # diagnostics, not state (not in snapshot()): signatures checked and made
        self.verifications = 0
        self.signatures = 0
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

    def pin(self, peer_id: str) -> tuple[bytes, str] | None:
        """``(public key, TLS fingerprint hex or "")`` of a member this core knows (any state),
        from its own signed claim: what the transport pins a connection to; None for a stranger."""
        m = self._members.get(peer_id)
        return None if m is None else (m.public, m.tls)

    def snapshot(self) -> dict:
        """Everything this core holds, as plain data (copies, comparable with ``==``): the members
        and their meta versions, the gossip queue, our outstanding probes (``probes``, by probe id)
        and the pings we relay, the probe order, the counters, timers and the rng's state.
        Two cores with equal snapshots answer every input alike, so it shows that a refused message
        changed nothing (every handler validates the whole message first) and what a step did when
        debugging. Its keys are for reading, not a wire format."""
        return {
            "members": [(m.peer_id, m.addr, m.state, m.incarnation, m.changed_at, dict(m.meta), m.public, m.tls)
                        for _, m in sorted(self._members.items())],
            "claims": {p: c for p, c in self._claims.items() if p != self.self_id},  # ours: re-signed lazily
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

    def handle_join(self, msg: dict, now: float, *, origin: str | None = None) -> dict:
        parsed = self._parse(msg, "join", origin)
        if self._left:
            raise MembershipError("this peer has left the swarm; join through another member")
        self._apply_msg(parsed, now)
        reply = self._full_state("join_reply")
        self._after()
        return reply

    def handle_join_reply(self, msg: dict, now: float, *, origin: str | None = None) -> None:
        parsed = self._parse(msg, "join_reply", origin)
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
            self._claims.pop(pid, None)
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

    def handle_ping(self, msg: dict, now: float, *, origin: str | None = None) -> dict:
        parsed = self._parse(msg, "ping", origin)
        self._apply_msg(parsed, now)
        ack = self._header("ack")
        ack["updates"] = self._piggyback(parsed.sender.peer_id)
        self._after()
        return ack

    def handle_ack(self, probe_id: int, msg: dict, now: float, *, origin: str | None = None) -> None:
        parsed = _parse_message(msg, "ack", self.self_id, origin)
        expected = self._expected_target(probe_id)
        if expected is not None and parsed.sender.peer_id != expected:
            raise MembershipError(
                f"ack from {parsed.sender.peer_id!r} but probe {probe_id} was for {expected!r}")
        self._authenticate(parsed)
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

    def handle_ping_req(self, msg: dict, now: float, *, origin: str | None = None) -> SendPing | None:
        parsed = self._parse(msg, "ping_req", origin)
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
            # the target's own ack, passed through by the relay: its header is the target's signed
            # record, checked like any other (a relay cannot make one up)
            parsed = _parse_message(msg, "ack", self.self_id)
            if p is not None and parsed.sender.peer_id != p.target:
                raise MembershipError(
                    f"relayed ack from {parsed.sender.peer_id!r} but probe {probe_id} "
                    f"was for {p.target!r}")
            self._authenticate(parsed)
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

    def handle_sync(self, msg: dict, now: float, *, origin: str | None = None) -> dict:
        parsed = self._parse(msg, "sync", origin)
        self._apply_msg(parsed, now)
        reply = self._full_state("sync_reply")
        self._after()
        return reply

    def handle_sync_reply(self, msg: dict, now: float, *, origin: str | None = None) -> None:
        parsed = self._parse(msg, "sync_reply", origin)
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

    def handle_leave(self, msg: dict, now: float, *, origin: str | None = None) -> None:
        parsed = self._parse(msg, "leave", origin)
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

    def _own_claim(self) -> tuple[bytes, bytes]:
        """Our claim as it stands, signed again only when something in it changed (set_meta runs
        every training step; a claim is signed at most once per outgoing message)."""
        me = self._members[self.self_id]
        st = LEFT if self._left else ALIVE
        fields = (self.addr, me.incarnation, st, tuple(me.meta.items()), self._mv[self.self_id], self.tls)
        if fields != self._own_fields:
            claim = _encode_claim(self.self_id, self.addr, me.incarnation, st, me.meta,
                                  self._mv[self.self_id], self.key.public, self.tls)
            self._claims[self.self_id] = (claim, self.key.sign(CLAIM_LABEL + claim))
            self._own_fields = fields
            self.signatures += 1
        return self._claims[self.self_id]

    def _record(self, pid: str) -> dict:
        m = self._members[pid]
        claim, sig = self._own_claim() if pid == self.self_id else self._claims[pid]
        return {"id": pid, "state": m.state, "claim": claim, "sig": sig}

    def _header(self, kind: str) -> dict:
        return {"v": PROTOCOL_VERSION, "type": kind, "from": self._record(self.self_id)}

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

    def _parse(self, msg: Any, kind: str, origin: str | None) -> _Msg:
        parsed = _parse_message(msg, kind, self.self_id, origin)
        self._authenticate(parsed)
        return parsed

    def _authenticate(self, parsed: _Msg) -> None:
        """Set each record's ``trust``, checking the signatures that matter; MembershipError for a
        bad one. Nothing is applied yet. A signature costs ~160 us, so claims this core already
        holds (the same bytes) are not checked again, nor records that would change nothing; a
        rumour (suspect/dead) at the incarnation of the claim we hold needs no signature either: it
        is a third party's word about a claim already proven. The sender's own record is always
        checked (it stands for the sender: acks and relayed acks are matched to their probe by it)."""
        checked: set[tuple[bytes, bytes]] = set()   # good within this message
        for i, rec in enumerate([parsed.sender, *parsed.records]):
            pid = rec.peer_id
            cur = self._members.get(pid)
            if cur is not None and cur.public != rec.pk:
                raise MembershipError(f"record of {pid[:40]!r} carries another key than the one it has")
            pair = (rec.claim, rec.sig)
            if self._claims.get(pid) == pair or pair in checked:
                rec.trust = 2
                continue
            if i > 0 and cur is not None:
                if pid == self.self_id:
                    if not self._refutes(rec):
                        continue
                elif not self._fresher(rec, cur):
                    if (rec.inc, _RANK[rec.state]) <= (cur.incarnation, _RANK[cur.state]):
                        continue   # changes nothing
                    if rec.state in (SUSPECT, DEAD):
                        rec.trust = 1   # a rumour at the incarnation of the claim we hold
                        continue
            self.verifications += 1
            if not identity.verify(rec.pk, rec.sig, CLAIM_LABEL + rec.claim):
                lst = "members" if parsed.kind in _FULL_STATE else "updates"
                what = f"{parsed.kind}.from" if i == 0 else f"{lst}[{i - 1}]"
                raise MembershipError(f"{what}: the claim about {pid[:40]!r} is not signed by its key")
            checked.add(pair)
            rec.trust = 2

    def _fresher(self, rec: _Rec, cur: Member) -> bool:
        """Is the record's claim newer than the one we hold? Claims are ordered by (incarnation,
        meta version, left): the member signs a left claim after its last alive one."""
        return ((rec.inc, rec.mv, rec.st == LEFT)
                > (cur.incarnation, self._mv.get(cur.peer_id, 0), cur.state == LEFT))

    def _refutes(self, rec: _Rec) -> bool:
        """Would this record about ourselves make us raise our incarnation?"""
        me = self._members[self.self_id]
        if self._left or rec.inc < me.incarnation:
            return False
        return not (rec.state == ALIVE and rec.inc == me.incarnation)

    def _apply_msg(self, parsed: _Msg, now: float) -> None:
        self._apply(parsed.sender, now)
        for rec in parsed.records:
            self._apply(rec, now)

    def _apply(self, rec: _Rec, now: float) -> None:
        if rec.trust == 0:
            return   # judged to change nothing (so its signature was not checked)
        pid = rec.peer_id
        if pid == self.self_id:
            if rec.trust == 2:
                self._about_self(rec, now)
            return
        cur = self._members.get(pid)
        if cur is None:
            if rec.trust != 2:
                return
            self._members[pid] = Member(pid, rec.addr, rec.state, rec.inc, now, dict(rec.meta), rec.pk, rec.tls)
            self._mv[pid] = rec.mv
            self._claims[pid] = (rec.claim, rec.sig)
            if rec.state in (ALIVE, SUSPECT):
                # Tombstones for strangers are kept silently (they stop stale
                # ALIVE rumours from resurrecting the peer) but not re-gossiped.
                self._bcast[pid] = 0
                self._event("joined", pid, now, f"{rec.addr} ({rec.state}, inc {rec.inc})")
                self._add_to_order(pid)
            return
        if rec.trust == 1 and (rec.inc != cur.incarnation or rec.state not in (SUSPECT, DEAD)):
            return   # a rumour is only as good as the incarnation of the claim we hold
        wins = (rec.inc, _RANK[rec.state]) > (cur.incarnation, _RANK[cur.state])
        state = rec.state if wins else cur.state
        # A fresher claim replaces what the member says of itself, unless it would leave a `left`
        # state standing on an alive claim (which nobody would accept from us); a `left` state
        # always comes with the member's own left claim.
        if rec.trust == 2 and ((wins and rec.state == LEFT)
                               or (self._fresher(rec, cur) and (state != LEFT or rec.st == LEFT))):
            cur.addr, cur.meta, cur.tls = rec.addr, dict(rec.meta), rec.tls
            self._mv[pid] = rec.mv
            self._claims[pid] = (rec.claim, rec.sig)   # (at our incarnation, or it wins below)
        if wins:
            detail = ""
            if rec.state == ALIVE and cur.state != ALIVE:
                detail = f"refuted {cur.state} with incarnation {rec.inc}"
            elif rec.state != ALIVE:
                detail = f"incarnation {rec.inc} (gossip)"
            self._set_state(cur, rec.state, rec.inc, now, detail)

    def _about_self(self, rec: _Rec, now: float) -> None:
        if not self._refutes(rec):
            return
        me = self._members[self.self_id]
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
