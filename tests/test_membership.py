"""Tests for the sans-I/O membership core (swarm/membership.py).

A tiny discrete-event network drives several ``Membership`` objects with a fake
clock, carrying out their actions the way the aiohttp shell will: a ping is
answered by ``handle_ping`` on the target and the reply fed to ``handle_ack``;
an unreachable or too-slow target makes the "HTTP request" time out and the
sender gets ``probe_failed`` / ``ping_req_result(ok=False)``.

Peers are named ("p3", "a") in the tests; each name has a deterministic key
(``key``) and so a peer id (``pid``); ``name`` maps an id back. The tests hold
every key, so they can sign a record as any member (``rec``) -- what a peer
gossiping another's record does is pass on that member's own signed claim.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import heapq
import itertools
import math
import random

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm import identity
from swarm.identity import PeerKey
from swarm.membership import (
    ALIVE, CLAIM_LABEL, DEAD, LEFT, MAX_UPDATES, PROTOCOL_VERSION, SUSPECT, Membership,
    MembershipConfig, MembershipError, SendLeave, SendPing, SendPingReq, SendSync,
)

CFG = MembershipConfig()
_NAMES: dict[str, str] = {}   # peer id -> name


@functools.lru_cache(maxsize=None)
def key(n: str) -> PeerKey:
    k = PeerKey.from_seed(hashlib.sha256(n.encode()).digest())
    _NAMES[k.id] = n
    return k


def pid(n: str) -> str:
    return key(n).id


def name(peer_id: str) -> str:
    return _NAMES[peer_id]


def names(ids) -> list[str]:
    return sorted(name(i) for i in ids)


def addr(n: str) -> str:
    return f"http://{n}:7000"


def core(n: str, t: float = 0.0, cfg: MembershipConfig | None = None, rng=None, meta=None) -> Membership:
    return Membership(key(n), addr(n), t, cfg, rng, meta=meta)


def encode(claim: dict) -> bytes:
    """A claim as the wire carries it (docs/protocol.md, "Member records")."""
    return msgpack.packb(claim, use_bin_type=True)


def claim_of(record: dict) -> dict:
    return msgpack.unpackb(record["claim"], raw=False)


def info(msg: dict) -> dict:
    """The sender's record of a message, decoded: its claim's fields and its state."""
    return {**claim_of(msg["from"]), "state": msg["from"]["state"]}


def rec(n, state, inc, a=None, meta=None, mv=None, tls="", signer: PeerKey | None = None) -> dict:
    """``n``'s record in ``state``: its own claim (alive, or left for a left state), signed by its
    key (or by ``signer``)."""
    st = state if state in (ALIVE, LEFT) else ALIVE
    c = encode({"id": pid(n), "addr": a or addr(n), "inc": inc, "st": st, "meta": meta or {},
                "mv": mv or 0, "pk": key(n).public, "tls": tls})
    return {"id": pid(n), "state": state, "claim": c, "sig": (signer or key(n)).sign(CLAIM_LABEL + c)}


def resign(record: dict, state: str | None = None, signer: PeerKey | None = None, drop=(), **changes) -> dict:
    """``record`` with its claim changed and signed again (by its subject's key, or ``signer``)."""
    c = {**claim_of(record), **changes}
    for k in drop:
        del c[k]
    raw = encode(c)
    return {**record, "state": state or record["state"], "claim": raw,
            "sig": (signer or key(name(record["id"]))).sign(CLAIM_LABEL + raw)}


def tamper(record: dict, **changes) -> dict:
    """``record`` with its claim changed but its old signature kept."""
    return {**record, "claim": encode({**claim_of(record), **changes})}


class Net:
    """Discrete-event simulation of peers talking HTTP request/response."""

    def __init__(self, seed: int = 0, cfg: MembershipConfig | None = None, dt: float = 0.1):
        self.cfg = cfg or MembershipConfig()
        self.rng = random.Random(seed)
        self.seed = seed
        self.t = 0.0
        self.dt = dt
        self.peers: dict[str, Membership] = {}
        self.crashed: set[str] = set()
        self.cut: set[tuple[str, str]] = set()      # (src, dst) pairs that cannot talk
        self.latency: dict[str, float] = {}         # response time of a peer (default 0.02)
        self.drop = None                            # f(src, dst, action) -> bool: request lost
        self._q: list = []
        self._seq = itertools.count()
        self.sent: list[tuple[float, str, object]] = []

    # -- topology --
    def add(self, n: str, via: str | None = None, meta: dict | None = None) -> Membership:
        m = core(n, self.t, self.cfg, random.Random(f"{self.seed}-{n}"), meta=meta)
        self.peers[n] = m
        if via is not None:
            reply = self.peers[via].handle_join(m.join_request(), self.t)
            m.handle_join_reply(reply, self.t)
        return m

    def up(self) -> list[str]:
        return [p for p in sorted(self.peers) if p not in self.crashed]

    def partition(self, a: str, b: str) -> None:
        self.cut |= {(a, b), (b, a)}

    # -- event loop --
    def at(self, when: float, fn) -> None:
        heapq.heappush(self._q, (when, next(self._seq), fn))

    def run(self, seconds: float) -> None:
        end = self.t + seconds
        while self.t < end - 1e-9:
            self.t = round(self.t + self.dt, 6)
            while self._q and self._q[0][0] <= self.t + 1e-9:
                when, _, fn = heapq.heappop(self._q)
                fn(when)
            for p in self.up():
                m = self.peers[p]
                for action in m.tick(self.t):
                    self.dispatch(p, action)

    def request(self, src, dst, timeout, handler, on_reply, on_fail, action=None) -> None:
        """src POSTs to dst; handler runs on dst; reply or failure comes back to src."""
        lat = self.latency.get(dst, 0.02)
        lost = (dst in self.crashed or (src, dst) in self.cut or lat > timeout
                or (self.drop is not None and self.drop(src, dst, action)))
        t0 = self.t

        def fail(now):
            if src not in self.crashed:
                on_fail(now)

        if lost:
            self.at(t0 + timeout, fail)
            return

        def deliver(now):
            if dst in self.crashed:
                return fail(now)
            try:
                reply = handler(now)
            except MembershipError:
                return fail(now)
            if src not in self.crashed:
                on_reply(reply, now)

        self.at(t0 + lat, deliver)

    def dispatch(self, src: str, a) -> None:
        self.sent.append((self.t, src, a))
        s = self.peers[src]
        if isinstance(a, SendPing):
            d = self.peers.get(name(a.target))
            self.request(
                src, name(a.target), a.timeout,
                lambda now: d.handle_ping(a.msg, now),
                lambda ack, now: self._ack(s, a.probe_id, ack, now),
                lambda now: [self.dispatch(src, x) for x in s.probe_failed(a.probe_id, now)],
                a)
        elif isinstance(a, SendPingReq):
            self.request(
                src, name(a.via), a.timeout,
                lambda now: self._relay(name(a.via), a.msg, now, src, a.probe_id),
                lambda _r, now: None,
                lambda now: s.ping_req_result(a.probe_id, False, None, now),
                a)
        elif isinstance(a, SendSync):
            d = self.peers[name(a.target)]
            self.request(src, name(a.target), a.timeout,
                         lambda now: d.handle_sync(a.msg, now),
                         lambda r, now: s.handle_sync_reply(r, now),
                         lambda now: None, a)
        elif isinstance(a, SendLeave):
            d = self.peers[name(a.target)]
            self.request(src, name(a.target), a.timeout,
                         lambda now: d.handle_leave(a.msg, now),
                         lambda r, now: None, lambda now: None, a)
        else:  # pragma: no cover
            raise AssertionError(a)

    def _ack(self, m: Membership, probe_id: int, ack: dict, now: float) -> None:
        try:
            m.handle_ack(probe_id, ack, now)
        except MembershipError:
            m.probe_failed(probe_id, now)

    def _relay(self, via: str, msg: dict, now: float, requester: str, probe_id: int):
        """The intermediary's shell: forward the ping, then answer the requester."""
        v = self.peers[via]
        fwd = v.handle_ping_req(msg, now)
        req = self.peers[requester]
        if fwd is None:
            self.at(now + 0.02, lambda t: req.ping_req_result(probe_id, False, None, t))
            return None
        tgt = self.peers.get(name(fwd.target))

        def ok(ack, t):
            v.handle_ack(fwd.probe_id, ack, t)
            self.at(t + 0.02, lambda t2: None if requester in self.crashed
                    else req.ping_req_result(probe_id, True, ack, t2))

        def failed(t):
            v.probe_failed(fwd.probe_id, t)
            self.at(t + 0.02, lambda t2: None if requester in self.crashed
                    else req.ping_req_result(probe_id, False, None, t2))

        self.request(via, name(fwd.target), fwd.timeout, lambda t: tgt.handle_ping(fwd.msg, t),
                     ok, failed, fwd)
        return None

    # -- assertions helpers --
    def views(self, n: str) -> dict[str, str]:
        """state of ``n`` as seen by every up peer (excluding itself)."""
        return {o: (self.peers[o].get(pid(n)).state if self.peers[o].get(pid(n)) else None)
                for o in self.up() if o != n}

    def events(self, kind: str, n: str) -> list:
        return [(o, e) for o in self.up() for e in self.peers[o].events
                if e.kind == kind and e.peer_id == pid(n)]


def build(n: int, seed: int = 0, cfg: MembershipConfig | None = None, settle: float = 5.0) -> Net:
    net = Net(seed, cfg)
    ids = [f"p{i}" for i in range(n)]
    net.add(ids[0])
    for i, p in enumerate(ids[1:], start=1):
        net.add(p, via=net.rng.choice(ids[:i]))
        net.run(0.2)
    net.run(settle)
    return net


def all_agree_alive(net: Net) -> bool:
    want = net.up()
    return all(names(net.peers[p].alive_ids()) == want for p in want)


# ------------------------------------------------------------------ join --

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_join_through_one_member_everyone_learns_everyone(seed):
    net = Net(seed)
    ids = [f"p{i}" for i in range(8)]
    net.add(ids[0])
    for i, p in enumerate(ids[1:], start=1):
        net.add(p, via=net.rng.choice(ids[:i]))   # each through a random earlier peer
    # everyone learns everyone transitively within a few simulated seconds
    for _ in range(40):
        net.run(0.1)
        if all_agree_alive(net):
            break
    assert all_agree_alive(net), {p: names(net.peers[p].alive_ids()) for p in ids}
    assert net.t <= 4.0
    for p in ids:
        for m in net.peers[p].members():
            assert m.state == ALIVE and m.addr == addr(name(m.peer_id))
            assert m.public == key(name(m.peer_id)).public and m.tls == ""
            assert m.incarnation == 0   # nobody was ever suspected
    assert not net.events("suspect", "p0")


def test_join_larger_swarm_chain():
    """20 peers, each joining through the previous one only."""
    net = Net(5)
    net.add("p00")
    for i in range(1, 20):
        net.add(f"p{i:02d}", via=f"p{i - 1:02d}")
    net.run(6.0)
    assert all_agree_alive(net)
    assert all(not net.events(k, p) for k in ("suspect", "dead") for p in net.peers)


def test_join_reply_contains_everyone_and_joiner_learns_immediately():
    net = build(4, settle=3.0)
    new = net.add("zz", via="p2")
    assert names(new.alive_ids()) == ["p0", "p1", "p2", "p3", "zz"]
    assert pid("zz") in net.peers["p2"].alive_ids()
    assert [e.kind for e in net.peers["p2"].events if e.peer_id == pid("zz")] == ["joined"]


# ---------------------------------------------------------------- failure --

@pytest.mark.parametrize("seed", [0, 3])
def test_crashed_peer_becomes_suspect_then_dead_everywhere(seed):
    n = 8
    net = build(n, seed)
    assert all_agree_alive(net)
    t_crash = net.t
    net.crashed.add("p3")
    budget = CFG.probe_interval * n + CFG.probe_deadline + CFG.suspicion_timeout + 1.0
    while net.t - t_crash < budget:
        net.run(0.1)
        if all(v == DEAD for v in net.views("p3").values()):
            break
    views = net.views("p3")
    assert all(v == DEAD for v in views.values()), (net.t - t_crash, views)
    # the first observer went through SUSPECT before DEAD, at least suspicion_timeout apart
    sus = min(e.at for _, e in net.events("suspect", "p3"))
    dead = min(e.at for _, e in net.events("dead", "p3"))
    assert dead - sus >= CFG.suspicion_timeout - 1e-6
    # survivors agree on each other and nobody else was ever suspected
    assert all_agree_alive(net)
    for p in net.up():
        assert not net.events("suspect", p)
    # no more probes to the dead peer (only a rare reconnect sync, <= 1 per sync_interval)
    mark = len(net.sent)
    net.run(3.0)
    assert not [a for _, _, a in net.sent[mark:] if isinstance(a, SendPing) and a.target == pid("p3")]
    syncs = [src for _, src, a in net.sent[mark:] if isinstance(a, SendSync) and a.target == pid("p3")]
    assert all(syncs.count(p) <= 1 for p in net.up())
    assert not [a for _, _, a in net.sent[mark:]
                if isinstance(a, SendPingReq) and pid("p3") in (a.target, a.via)]


def test_tombstones_are_dropped_after_retention():
    cfg = MembershipConfig(dead_retention=5.0)
    net = build(4, cfg=cfg)
    net.crashed.add("p1")
    while not all(v == DEAD for v in net.views("p1").values()):
        net.run(0.1)
    assert net.t < 30
    net.run(cfg.dead_retention + 4.0)
    assert all(v is None for v in net.views("p1").values())


def test_slow_peer_within_timeout_is_never_suspected():
    net = build(6)
    net.latency["p2"] = 0.7          # answers late (after the next probe interval) but in time
    net.run(40.0)
    assert not net.events("suspect", "p2")
    assert not net.events("dead", "p2")
    assert all_agree_alive(net)


def test_peer_reachable_only_indirectly_is_not_suspected():
    """p0 cannot reach p2 directly; relayed acks arrive after the direct timeout
    but before the probe deadline and satisfy the probe."""
    net = build(5)
    net.partition("p0", "p2")
    net.run(30.0)
    assert not net.events("suspect", "p2")
    assert not net.events("suspect", "p0")
    assert all_agree_alive(net)


def test_flaky_peer_missing_probes_never_flaps_to_dead():
    net = build(6, seed=7)
    rnd = random.Random(1)
    # 40% of all pings *to* p4 (direct or relayed) are lost
    net.drop = lambda src, dst, a: dst == "p4" and isinstance(a, SendPing) and rnd.random() < 0.4
    net.run(60.0)
    assert net.events("suspect", "p4"), "the scenario should at least provoke suspicion"
    assert not net.events("dead", "p4")
    assert net.peers["p4"].incarnation > 0          # it refuted
    assert [e for e in net.peers["p4"].events if e.kind == "refuted"]
    net.drop = None
    net.run(5.0)
    assert all_agree_alive(net)


def manual(n: int, t: float = 0.0) -> dict[str, Membership]:
    """n peers that know each other, no probes in flight, driven by hand."""
    ms = {f"p{i}": core(f"p{i}", t, CFG, random.Random(i)) for i in range(n)}
    for p, m in ms.items():
        if p != "p0":
            m.handle_join_reply(ms["p0"].handle_join(m.join_request(), t), t)
    for p, m in ms.items():
        if p != "p0":
            m.handle_sync_reply(ms["p0"].handle_sync(m.sync_message(), t), t)
    assert all(names(m.alive_ids()) == sorted(ms) for m in ms.values())
    return ms


def first_ping(a: Membership, t: float):
    acts: list = []
    while not any(isinstance(x, SendPing) for x in acts):
        t += 0.1
        acts = a.tick(t)
    return next(x for x in acts if isinstance(x, SendPing)), t


def test_ack_after_direct_timeout_but_before_deadline_satisfies_probe():
    ms = manual(3)
    a = ms["p0"]
    t = 0.0
    acts: list = []
    while not any(isinstance(x, SendPing) for x in acts):
        t += 0.1
        acts = a.tick(t)
    ping = next(x for x in acts if isinstance(x, SendPing))
    reqs = a.probe_failed(ping.probe_id, t + CFG.probe_timeout)
    assert len(reqs) == 1 and reqs[0].target == ping.target and reqs[0].via not in (ping.target, pid("p0"))
    assert a.probe_failed(ping.probe_id, t + CFG.probe_timeout) == []   # idempotent
    # while ping-reqs are pending, no second probe of the same target
    for k in range(1, int(CFG.probe_deadline / 0.1) - 10):
        for x in a.tick(t + CFG.probe_timeout + 0.1 * k):
            assert not (isinstance(x, SendPing) and x.target == ping.target)
    # relayed ack arrives late, but before the deadline
    ack = ms[name(ping.target)].handle_ping(ms[name(reqs[0].via)].handle_ping_req(reqs[0].msg, t + 1.0).msg,
                                            t + 1.0)
    a.ping_req_result(ping.probe_id, True, ack, t + CFG.probe_deadline - 0.05)
    assert ping.probe_id not in a.snapshot()["probes"]
    a.tick(t + CFG.probe_deadline + 0.05)       # past the deadline: nothing to expire
    assert a.get(ping.target).state == ALIVE
    assert not [e for e in a.events if e.kind == "suspect"]


def test_probe_deadline_without_any_answer_suspects():
    a = manual(3)["p0"]
    ping, t = first_ping(a, 0.0)
    a.probe_failed(ping.probe_id, t + 0.8)        # ping-reqs sent but never answered
    a.tick(t + CFG.probe_deadline - 0.01)
    assert a.get(ping.target).state == ALIVE
    a.tick(t + CFG.probe_deadline + 0.01)
    assert a.get(ping.target).state == SUSPECT
    a.tick(t + CFG.probe_deadline + CFG.suspicion_timeout + 0.02)
    assert a.get(ping.target).state == DEAD


def test_round_robin_probes_everyone_once_per_pass():
    net = build(6, settle=2.0)
    a = net.peers["p0"]
    net.sent.clear()
    net.run(CFG.probe_interval * 5 * 4)
    targets = [name(x.target) for _, src, x in net.sent if src == "p0" and isinstance(x, SendPing)]
    assert len(targets) >= 15
    # each live member is probed once per pass: 3..5 times in ~4 passes
    counts = {p: targets.count(p) for p in names(a.live_ids(include_self=False))}
    assert all(3 <= c <= 5 for c in counts.values()), counts


# ------------------------------------------------------------ refutation --

def header(src: Membership, kind: str) -> dict:
    """The header every message of ``src`` starts with (its join request is just that)."""
    return {**src.join_request(), "type": kind}


def _ping_from(src: Membership, dst: Membership, updates: list[dict]) -> dict:
    return {**header(src, "ping"), "target": dst.self_id, "updates": updates}


def test_refutation_by_incarnation_bump():
    a = core("a")
    b = core("b")
    b.handle_join_reply(a.handle_join(b.join_request(), 0.0), 0.0)
    ack = a.handle_ping(_ping_from(b, a, [rec("a", SUSPECT, 0)]), 1.0)
    assert a.incarnation == 1 and info(ack)["inc"] == 1
    assert a.events[-1].kind == "refuted"
    # b held a as suspect: the ack (alive, inc 1) clears it
    c = core("c")
    b.handle_ping(_ping_from(c, b, [rec("a", SUSPECT, 0)]), 1.0)   # gossip: a suspected
    assert b.get(pid("a")).state == SUSPECT
    b.handle_ack(999, ack, 1.1)
    assert b.get(pid("a")).state == ALIVE and b.get(pid("a")).incarnation == 1
    assert [e.kind for e in b.events if e.peer_id == pid("a")][-2:] == ["suspect", "alive"]
    # a stale suspicion (lower incarnation) is ignored
    a.handle_ping(_ping_from(b, a, [rec("a", SUSPECT, 0), rec("a", DEAD, 0)]), 2.0)
    assert a.incarnation == 1
    # being declared dead at the current incarnation is refuted too
    a.handle_ping(_ping_from(b, a, [rec("a", DEAD, 1)]), 3.0)
    assert a.incarnation == 2


def test_precedence_rules():
    a = core("a")
    b = core("b")

    def send(*updates):
        a.handle_ping(_ping_from(b, a, list(updates)), 1.0)
        return a.get(pid("x"))

    assert send(rec("x", ALIVE, 3)).state == ALIVE
    assert send(rec("x", ALIVE, 2)).incarnation == 3               # older ignored
    assert send(rec("x", SUSPECT, 3)).state == SUSPECT             # suspect > alive at same inc
    assert send(rec("x", ALIVE, 3)).state == SUSPECT               # alive does not undo it
    assert send(rec("x", ALIVE, 4)).state == ALIVE                 # higher inc wins
    assert send(rec("x", DEAD, 4)).state == DEAD                   # dead > alive
    assert send(rec("x", SUSPECT, 4)).state == DEAD                # dead > suspect
    assert send(rec("x", ALIVE, 4)).state == DEAD                  # no resurrection at same inc
    assert send(rec("x", LEFT, 4)).state == LEFT                   # left > dead
    assert send(rec("x", DEAD, 4)).state == LEFT
    m = send(rec("x", ALIVE, 5, a="http://x:9"))                   # back with a higher inc
    assert (m.state, m.incarnation, m.addr) == (ALIVE, 5, "http://x:9")


def test_partitioned_peer_refutes_after_heal():
    net = build(5, seed=2)
    for o in net.peers:
        if o != "p1":
            net.partition("p1", o)
    # long enough to be suspected by someone, short of suspicion_timeout after that
    for _ in range(60):
        net.run(0.1)
        if any(v == SUSPECT for v in net.views("p1").values()):
            break
    assert any(v == SUSPECT for v in net.views("p1").values())
    net.cut.clear()
    net.run(8.0)
    assert not net.events("dead", "p1")
    assert net.peers["p1"].incarnation >= 1
    assert all_agree_alive(net)


def test_dead_peer_that_was_only_partitioned_comes_back_with_higher_incarnation():
    net = build(4, seed=4)
    for o in net.peers:
        if o != "p2":
            net.partition("p2", o)
    net.run(15.0)
    assert all(v == DEAD for v in net.views("p2").values())
    net.cut.clear()
    net.run(10.0)   # p2 keeps probing / syncing; it learns it is dead and refutes
    assert all_agree_alive(net), {p: names(net.peers[p].alive_ids()) for p in net.peers}
    assert net.peers["p2"].incarnation >= 1


# ------------------------------------------------------------------ leave --

def test_graceful_leave_seen_as_left_not_dead():
    net = build(6, seed=1)
    before = {p: net.peers[p].epoch for p in net.up()}
    leaves = net.peers["p4"].leave(net.t)
    assert names(x.target for x in leaves) == ["p0", "p1", "p2", "p3", "p5"]
    assert all(isinstance(x, SendLeave) for x in leaves)
    for x in leaves[1:]:          # the first leave message is lost: gossip covers it
        net.dispatch("p4", x)
    assert net.peers["p4"].tick(net.t + 1) == []
    assert net.peers["p4"].get(pid("p4")).state == LEFT
    net.run(0.5)
    net.crashed.add("p4")         # the process exits
    net.run(CFG.suspicion_timeout + 8.0)
    assert all(v == LEFT for v in net.views("p4").values()), net.views("p4")
    assert not net.events("dead", "p4")
    assert all(net.peers[p].epoch > before[p] for p in net.up())
    assert net.peers["p4"].leave(net.t) == []


def test_leave_from_two_peer_swarm():
    net = build(2, settle=2.0)
    for x in net.peers["p1"].leave(net.t):
        net.dispatch("p1", x)
    net.run(1.0)
    assert net.peers["p0"].get(pid("p1")).state == LEFT
    net.sent.clear()
    net.run(5.0)
    assert not [a for _, s, a in net.sent if s == "p0" and isinstance(a, SendPing)]


# ------------------------------------------------------------------- meta --

def test_set_meta_propagates():
    net = build(6, seed=3)
    net.peers["p0"].set_meta(step=12, phase="warmup")
    net.peers["p5"].set_meta(loss=0.25)
    net.run(CFG.sync_interval + 2.0)
    for p in net.up():
        assert net.peers[p].get(pid("p0")).meta == {"step": 12, "phase": "warmup"}
        assert net.peers[p].get(pid("p5")).meta == {"loss": 0.25}
    net.peers["p0"].set_meta(step=13)
    net.run(CFG.sync_interval + 2.0)
    assert all(net.peers[p].get(pid("p0")).meta["step"] == 13 for p in net.up())
    assert net.peers["p0"].incarnation == 0      # meta bumps nothing


def test_set_meta_rejects_bad_values_without_change():
    m = core("a", meta={"step": 1})
    for bad in ({"x": [1]}, {"x": True}, {"x": float("nan")}, {"x": "s" * 10_000}, {"x": None}):
        with pytest.raises(MembershipError):
            m.set_meta(**bad)
    assert m.get(pid("a")).meta == {"step": 1}


def test_old_meta_does_not_overwrite_newer():
    a = core("a")
    b = core("b")
    a.handle_ping(_ping_from(b, a, [rec("x", ALIVE, 0, meta={"step": 5}, mv=5)]), 1.0)
    a.handle_ping(_ping_from(b, a, [rec("x", ALIVE, 0, meta={"step": 3}, mv=3)]), 1.0)
    assert a.get(pid("x")).meta == {"step": 5}


# ------------------------------------------------------------------ epoch --

def test_epoch_increments_on_alive_set_changes():
    a = core("a")
    assert a.epoch == 0
    a.handle_ping(_ping_from(core("b"), a, []), 0.5)  # learns b
    assert a.epoch == 1
    a.handle_ping(_ping_from(core("b"), a, []), 0.6)  # no change
    assert a.epoch == 1
    b = core("b")
    a.handle_ping(_ping_from(b, a, [rec("b", SUSPECT, 0)]), 0.7)
    assert a.epoch == 2                       # suspects are not "alive"
    a.handle_ping(_ping_from(b, a, [rec("c", ALIVE, 0)]), 0.8)
    assert a.epoch == 3
    a.tick(0.7 + CFG.suspicion_timeout + 0.01)   # b: suspect -> dead, alive set unchanged
    assert a.get(pid("b")).state == DEAD and a.epoch == 3
    a.leave(5.0)
    assert a.epoch == 4


def test_epoch_consistent_in_simulation():
    net = build(5)
    e = {p: net.peers[p].epoch for p in net.up()}
    net.run(5.0)
    assert {p: net.peers[p].epoch for p in net.up()} == e       # stable swarm: no change
    net.crashed.add("p2")
    net.run(12.0)
    assert all(net.peers[p].epoch > e[p] for p in net.up())


# ---------------------------------------------------------- tiny swarms --

def test_swarm_of_one_emits_nothing():
    m = core("solo")
    out = []
    for i in range(1, 300):
        out += m.tick(i * 0.1)
    assert out == []
    assert m.alive_ids() == [pid("solo")] and m.live_ids(include_self=False) == []
    assert m.alive_ids(include_self=False) == []
    assert m.leave(30.0) == []
    assert m.get(pid("solo")).state == LEFT


def test_swarm_of_two_failed_direct_probe_goes_straight_to_suspect():
    a = manual(2)["p0"]
    ping, t = first_ping(a, 0.0)
    assert a.probe_failed(ping.probe_id, t + 0.8) == []     # nobody to ask
    assert a.get(pid("p1")).state == SUSPECT
    a.tick(t + 0.8 + CFG.suspicion_timeout)
    assert a.get(pid("p1")).state == DEAD
    # alone again: no probes; only a reconnect sync to the dead peer each sync_interval
    acts = [x for k in range(1, 101) for x in a.tick(t + 5 + 0.1 * k)]
    assert all(isinstance(x, SendSync) and x.target == pid("p1") for x in acts)
    assert len(acts) <= math.ceil(10.0 / CFG.sync_interval)
    a.tick(t + 0.8 + CFG.dead_retention + 1)   # tombstone dropped: now truly silent
    assert [x for k in range(1, 150) for x in a.tick(t + 70 + 0.1 * k)] == []


def test_swarm_of_two_in_simulation():
    net = build(2, settle=20.0)
    assert all_agree_alive(net)
    assert not net.events("suspect", "p0") and not net.events("suspect", "p1")
    net.crashed.add("p1")
    net.run(CFG.probe_interval * 2 + CFG.probe_deadline + CFG.suspicion_timeout + 0.5)
    assert net.peers["p0"].get(pid("p1")).state == DEAD


# ------------------------------------------------------------- validation --

def _fixture():
    """p0 with two peers and an outstanding probe (so acks have something to match)."""
    ms = manual(3)
    a = ms["p0"]
    ping, t = first_ping(a, 0.0)
    other = ms[name(ping.target)]
    hdr = header(other, "leave")
    valid = {
        "ping": _ping_from(other, a, [rec("p9", ALIVE, 0)]),
        "ack": other.handle_ping(ping.msg, t),
        "join": core("nj").join_request(),
        "join_reply": {**other.sync_message(), "type": "join_reply"},
        "sync": other.sync_message(),
        "sync_reply": {**other.sync_message(), "type": "sync_reply"},
        "leave": {**hdr, "from": resign(hdr["from"], state=LEFT, st=LEFT), "updates": []},
        "ping_req": {**header(other, "ping_req"), "target": pid("p9"), "target_addr": addr("p9"),
                     "updates": []},
    }
    return a, ping, valid, t


def _call(a: Membership, kind: str, msg, probe_id: int, t: float, origin: str | None = None):
    o = {} if origin is None else {"origin": origin}
    if kind == "ping":
        return a.handle_ping(msg, t, **o)
    if kind == "ack":
        return a.handle_ack(probe_id, msg, t, **o)
    if kind == "ack_relayed":
        return a.ping_req_result(probe_id, True, msg, t)
    if kind == "join":
        return a.handle_join(msg, t, **o)
    if kind == "join_reply":
        return a.handle_join_reply(msg, t, **o)
    if kind == "sync":
        return a.handle_sync(msg, t, **o)
    if kind == "sync_reply":
        return a.handle_sync_reply(msg, t, **o)
    if kind == "leave":
        return a.handle_leave(msg, t, **o)
    if kind == "ping_req":
        return a.handle_ping_req(msg, t, **o)
    raise AssertionError(kind)


HANDLERS = ["ping", "ack", "ack_relayed", "join", "join_reply", "sync", "sync_reply",
            "leave", "ping_req"]


def _base_kind(kind):
    return "ack" if kind == "ack_relayed" else kind


def _bad_variants(valid: dict, kind: str):
    base = valid[_base_kind(kind)]
    me = base["from"]
    lst = "members" if kind in ("join_reply", "sync", "sync_reply") else "updates"
    good_rec = rec("p8", ALIVE, 0)
    yield "not a dict", ["ping"]
    yield "none", None
    yield "empty", {}
    yield "wrong type", {**base, "type": "pong"}
    yield "bad version", {**base, "v": 1}
    yield "missing from", {k: v for k, v in base.items() if k != "from"}
    yield "int from", {**base, "from": 5}
    yield "from an old-style header", {**base, "from": me["id"]}
    yield "from self", {**base, "from": rec("p0", ALIVE, 0)}
    yield "from: record without sig", {**base, "from": {k: v for k, v in me.items() if k != "sig"}}
    yield "from: record with an extra key", {**base, "from": {**me, "inc": 0}}
    yield "from: id too long", {**base, "from": {**me, "id": "x" * 1000}}
    yield "from: claim not bytes", {**base, "from": {**me, "claim": "x"}}
    yield "from: claim not msgpack", {**base, "from": {**me, "claim": b"\xc1"}}
    yield "from: claim a list", {**base, "from": {**me, "claim": encode([1, 2])}}
    yield "from: sig too short", {**base, "from": {**me, "sig": me["sig"][:32]}}
    yield "negative inc", {**base, "from": resign(me, inc=-1)}
    yield "bool inc", {**base, "from": resign(me, inc=True)}
    yield "float inc", {**base, "from": resign(me, inc=1.0)}
    yield "huge inc", {**base, "from": resign(me, inc=2**60)}
    yield "sender suspect", {**base, "from": {**me, "state": SUSPECT}}
    yield "sender dead", {**base, "from": {**me, "state": DEAD}}
    yield "unknown state", {**base, "from": {**me, "state": "zombie"}}
    yield "claim st unknown", {**base, "from": resign(me, st="zombie")}
    yield "addr not http", {**base, "from": resign(me, addr="ftp://x")}
    yield "addr too long", {**base, "from": resign(me, addr="http://" + "a" * 1000)}
    yield "meta list", {**base, "from": resign(me, meta=[1])}
    yield "meta bad value", {**base, "from": resign(me, meta={"k": {"nested": 1}})}
    yield "meta nan", {**base, "from": resign(me, meta={"k": math.nan})}
    yield "meta too many", {**base, "from": resign(me, meta={f"k{i}": i for i in range(100)})}
    yield "claim without mv", {**base, "from": resign(me, drop=("mv",))}
    yield "claim with an extra key", {**base, "from": resign(me, extra=1)}
    yield "claim about another id", {**base, "from": resign(me, id=pid("p9"))}
    yield "claim tls not hex", {**base, "from": resign(me, tls="z" * 64)}
    yield "claim tls short", {**base, "from": resign(me, tls="ab")}
    yield "claim pk short", {**base, "from": resign(me, pk=b"\x01" * 31)}
    # the sender's own record: signed by another key, naming another's key, or changed since signed
    yield "sender signed by another key", {**base, "from": resign(me, signer=key("p9"))}
    yield "sender with another's key", {**base, "from": resign(me, pk=key("p9").public, signer=key("p9"))}
    yield "sender claim tampered", {**base, "from": tamper(me, meta={"step": 99})}
    yield "sender claim re-addressed", {**base, "from": tamper(me, addr="http://evil:1")}
    yield "too many keys", {**base, **{f"x{i}": 0 for i in range(40)}}
    yield "non-str key", {**base, 7: 1}
    if kind in ("ping", "ping_req", "ack", "ack_relayed", "leave",
                "join_reply", "sync", "sync_reply"):
        yield "list missing", {k: v for k, v in base.items() if k != lst}
        yield "list not list", {**base, lst: {"a": 1}}
        yield "record not dict", {**base, lst: [good_rec, "x"]}
        yield "record bad state", {**base, lst: [good_rec, rec("p7", "zombie", 0)]}
        yield "record negative inc", {**base, lst: [good_rec, rec("p7", ALIVE, -3)]}
        yield "record id too long", {**base, lst: [good_rec, {**rec("p7", ALIVE, 0), "id": "p" * 500}]}
        yield "record meta without mv", {**base, lst: [resign(good_rec, drop=("mv",))]}
        yield "record id empty", {**base, lst: [{**good_rec, "id": ""}]}
        yield "record unprintable id", {**base, lst: [{**good_rec, "id": "a\x00b"}]}
        yield "record id differs from its claim's", {**base, lst: [{**good_rec, "id": pid("p7")}]}
        # signatures: another key, another's id, a changed claim, a forged leave, a forged rumour
        yield "record signed by another key", {**base, lst: [rec("p7", ALIVE, 0, signer=key("p9"))]}
        yield "record signed by A naming B", {**base, lst: [resign(rec("p7", ALIVE, 0), pk=key("p9").public,
                                                                   signer=key("p9"))]}
        yield "record tampered meta", {**base, lst: [tamper(rec("p7", ALIVE, 0, meta={"step": 1}, mv=1),
                                                            meta={"step": 2})]}
        yield "forged left for another", {**base, lst: [{**rec("p1", ALIVE, 0), "state": LEFT}]}
        yield "left claim signed by another", {**base, lst: [rec("p1", LEFT, 0, signer=key("p9"))]}
        yield "left claim signed by another, higher inc", {**base, lst: [rec("p2", LEFT, 3, signer=key("p9"))]}
        yield "rumour at an unclaimed incarnation", {**base, lst: [tamper(rec("p1", SUSPECT, 0), inc=4)]}
        yield "rumour, claim signed by another", {**base, lst: [rec("p2", DEAD, 7, signer=key("p9"))]}
        yield "rumour about this peer, forged", {**base, lst: [rec("p0", DEAD, 5, signer=key("p9"))]}
        yield "known id, another key", {**base, lst: [resign(rec("p1", ALIVE, 5), pk=key("p9").public)]}
        # the last record is bad: nothing of the earlier good ones may be applied
        yield "late bad record", {**base, lst: [good_rec] * 3 + [rec("p7", ALIVE, "1")]}
        yield "late forged record", {**base, lst: [good_rec] * 3 + [rec("p7", ALIVE, 0, signer=key("p8"))]}
    if kind in ("ping", "ping_req", "ack", "ack_relayed", "leave"):
        yield "too many updates", {**base, "updates": [good_rec] * (MAX_UPDATES + 1)}
    if kind in ("join_reply", "sync", "sync_reply"):
        yield "too many members", {**base, "members": [good_rec] * 5000}
    if kind == "ping":
        yield "ping for someone else", {**base, "target": pid("p1")}
        yield "ping target int", {**base, "target": 3}
    if kind == "ping_req":
        yield "ping_req no target_addr", {k: v for k, v in base.items() if k != "target_addr"}
        yield "ping_req bad target_addr", {**base, "target_addr": 12}
    if kind == "leave":
        yield "leave while alive", {**base, "from": {**me, "state": ALIVE}}
        yield "leave with an alive claim", {**base, "from": {**header(core(name(me["id"])), "leave")["from"],
                                                             "state": LEFT}}
    if kind in ("ack", "ack_relayed"):
        yield "ack from wrong peer", {**valid["ping"], "type": "ack", "from": rec("p9", ALIVE, 0)}
        yield "ack from wrong peer, its key", {**valid["ping"], "type": "ack",
                                               "from": resign(me, id=pid("p9"))}


@pytest.mark.parametrize("kind", HANDLERS)
def test_malformed_messages_raise_and_change_nothing(kind):
    a, ping, valid, t = _fixture()
    n = 0
    for reason, msg in _bad_variants(valid, kind):
        before = a.snapshot()
        with pytest.raises(MembershipError):
            _call(a, kind, msg, ping.probe_id, t + 0.1)
        assert a.snapshot() == before, reason
        n += 1
    assert n > 40
    # and the valid message is accepted
    _call(a, kind, valid[_base_kind(kind)], ping.probe_id, t + 0.1)


def test_error_is_a_value_error_with_reason():
    a = core("a")
    with pytest.raises(ValueError, match="too many updates"):
        a.handle_ping({**_ping_from(core("b"), a, []),
                       "updates": [rec("x", ALIVE, 0)] * 300}, 0.0)
    with pytest.raises(MembershipError, match="negative"):
        a.handle_ping({**_ping_from(core("b"), a, []), "from": rec("b", ALIVE, -5)}, 0.0)
    with pytest.raises(MembershipError, match="not signed by its key"):
        a.handle_ping(_ping_from(core("b"), a, [rec("x", ALIVE, 0, signer=key("b"))]), 0.0)


_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
    st.floats(allow_nan=True), st.text(max_size=20), st.binary(max_size=70),
    st.sampled_from(["ping", "ack", "alive", "suspect", "dead", "left", "p0", "p1",
                     "http://x:1", "from", "inc", b"\x80", b"\x00" * 64]),
)
_garbage = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.one_of(st.sampled_from(
            ["v", "type", "from", "addr", "inc", "state", "meta", "mv", "updates",
             "members", "target", "target_addr", "id", "claim", "sig", "st", "pk", "tls"]),
            st.text(max_size=5)),
            inner, max_size=8)),
    max_leaves=25)

_FIX = None


def _fix():
    global _FIX
    if _FIX is None:
        _FIX = _fixture()
    return _FIX


@settings(max_examples=150, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(HANDLERS), garbage=_garbage)
def test_garbage_never_raises_anything_but_membership_error(kind, garbage):
    a, ping, valid, t = _fix()
    before = a.snapshot()
    with pytest.raises(MembershipError):
        _call(a, kind, garbage, ping.probe_id, t + 0.1)
    assert a.snapshot() == before


@settings(max_examples=200, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(HANDLERS), data=st.data())
def test_mutated_valid_messages_either_apply_or_change_nothing(kind, data):
    a, ping, valid, t = _fix()
    msg = copy.deepcopy(valid[_base_kind(kind)])
    # mutate one top-level key, one field of one record, or one field of a record's claim
    keys = sorted(msg, key=str)
    k = data.draw(st.sampled_from(keys))
    r = None
    if isinstance(msg[k], list) and msg[k] and data.draw(st.booleans()):
        r = msg[k][data.draw(st.integers(0, len(msg[k]) - 1))]
    elif k == "from" and data.draw(st.booleans()):
        r = msg[k]
    if r is None:
        msg[k] = data.draw(_garbage)
    elif data.draw(st.booleans()):
        fld = data.draw(st.sampled_from(sorted(r)))
        r[fld] = data.draw(_garbage)
    else:  # inside the claim, signed again or not
        c = claim_of(r)
        c[data.draw(st.sampled_from(sorted(c)))] = data.draw(_garbage)
        try:
            raw = encode(c)
        except (OverflowError, TypeError, ValueError):
            return
        r["claim"] = raw
        if data.draw(st.booleans()):
            r["sig"] = key(name(r["id"])).sign(CLAIM_LABEL + raw)
    before = a.snapshot()
    try:
        _call(a, kind, msg, ping.probe_id, t + 0.1)
    except MembershipError:
        assert a.snapshot() == before


def test_sync_message_push_pull_merges_both_views():
    a = core("a")
    b = core("b")
    c = core("c")
    a.handle_ping(_ping_from(c, a, []), 0.1)          # a knows c
    b.handle_sync_reply(a.handle_sync(b.sync_message(), 0.2), 0.2)
    assert names(a.alive_ids()) == names(b.alive_ids()) == ["a", "b", "c"]


def test_left_peer_answers_with_left_and_refuses_joins():
    ms = manual(3)
    ms["p1"].leave(1.0)
    ack = ms["p1"].handle_ping(_ping_from(ms["p0"], ms["p1"], []), 1.1)
    assert info(ack)["state"] == LEFT and info(ack)["st"] == LEFT
    ms["p0"].handle_ack(12345, ack, 1.2)
    assert ms["p0"].get(pid("p1")).state == LEFT
    with pytest.raises(MembershipError):
        ms["p1"].handle_join(core("n").join_request(), 1.3)


# ------------------------------------------------------- signed records --

def test_records_are_claims_signed_by_their_member():
    a = core("a", meta={"step": 3})
    msg = a.join_request()
    assert msg["v"] == PROTOCOL_VERSION == 2 and set(msg) == {"v", "type", "from"}
    r = msg["from"]
    assert set(r) == {"id", "state", "claim", "sig"} and r["id"] == pid("a") and r["state"] == ALIVE
    c = claim_of(r)
    assert list(c) == ["id", "addr", "inc", "st", "meta", "mv", "pk", "tls"]
    assert c == {"id": pid("a"), "addr": addr("a"), "inc": 0, "st": ALIVE, "meta": {"step": 3}, "mv": 0,
                 "pk": key("a").public, "tls": ""}
    assert identity.verify(key("a").public, r["sig"], b"swarm member v1\n" + r["claim"])
    assert identity.owns(c["pk"], r["id"])


def test_claim_signed_by_another_key_than_the_ids_is_refused():
    a, b = core("a"), core("b")
    forged = rec("x", ALIVE, 0, signer=key("b"))          # x's id and key, b's signature
    before = a.snapshot()
    with pytest.raises(MembershipError, match="not signed by its key"):
        a.handle_ping(_ping_from(b, a, [forged]), 1.0)
    assert a.snapshot() == before and a.get(pid("x")) is None


def test_record_signed_by_a_naming_b_is_refused():
    a = core("a")
    b, c = core("b"), core("c")
    # b makes a record naming c, with its own key in it: the key is not c's
    forged = resign(rec("c", ALIVE, 1), pk=key("b").public, signer=key("b"))
    before = a.snapshot()
    with pytest.raises(MembershipError, match="not the key of"):
        a.handle_ping(_ping_from(b, a, [forged]), 1.0)
    # nor can b send a message under c's name (its header signed by b)
    with pytest.raises(MembershipError):
        a.handle_ping({**_ping_from(c, a, []), "from": resign(c.join_request()["from"], signer=key("b"))}, 1.0)
    assert a.snapshot() == before
    # a grads payload and its header are the lead's; membership names a sender only through records


def test_tampered_claim_is_refused():
    a, b = core("a"), core("b")
    a.handle_ping(_ping_from(b, a, []), 1.0)
    b.set_meta(step=7)
    honest = _ping_from(b, a, [])
    for forged in (tamper(honest["from"], meta={"step": 8}), tamper(honest["from"], inc=5),
                   tamper(honest["from"], addr="http://evil:1")):
        before = a.snapshot()
        with pytest.raises(MembershipError, match="not signed"):
            a.handle_ping({**honest, "from": forged}, 2.0)
        assert a.snapshot() == before
    a.handle_ping(honest, 2.0)
    assert a.get(pid("b")).meta == {"step": 7}


def test_nobody_can_make_another_member_leave():
    ms = manual(3)
    a = ms["p0"]
    p1 = ms["p1"].join_request()["from"]
    before = a.snapshot()
    for forged in ({**p1, "state": LEFT},                          # its alive claim, said to be left
                   resign(p1, st=LEFT, state=LEFT, signer=key("p2")),  # a left claim signed by p2
                   resign(p1, st=LEFT, state=LEFT, inc=3, signer=key("p2")),
                   {**tamper(p1, st=LEFT), "state": LEFT}):          # its claim, changed to left
        with pytest.raises(MembershipError):
            a.handle_ping(_ping_from(ms["p2"], a, [forged]), 1.0)
        with pytest.raises(MembershipError):
            a.handle_leave({**header(ms["p2"], "leave"), "from": {**forged, "id": pid("p2")}, "updates": []}, 1.0)
        assert a.snapshot() == before
    assert a.get(pid("p1")).state == ALIVE
    # its own leave is accepted, also relayed by another member
    leave = ms["p1"].leave(1.0)
    own = leave[0].msg["from"]
    assert own["state"] == LEFT and claim_of(own)["st"] == LEFT
    a.handle_ping(_ping_from(ms["p2"], a, [own]), 1.1)
    assert a.get(pid("p1")).state == LEFT


def test_rumour_at_an_incarnation_never_claimed_is_refused():
    ms = manual(3)
    a = ms["p0"]
    p1 = ms["p1"].join_request()["from"]            # p1 claims incarnation 0
    before = a.snapshot()
    for forged in ({**tamper(p1, inc=4), "state": SUSPECT},
                   {**tamper(p1, inc=4), "state": DEAD},
                   resign({**p1, "state": DEAD}, inc=9, signer=key("p2"))):
        with pytest.raises(MembershipError, match="not signed"):
            a.handle_ping(_ping_from(ms["p2"], a, [forged]), 1.0)
        assert a.snapshot() == before
    # a rumour about the claim it made is the gossiper's word (SWIM): accepted, refuted by p1
    a.handle_ping(_ping_from(ms["p2"], a, [{**p1, "state": SUSPECT}]), 1.0)
    assert a.get(pid("p1")).state == SUSPECT
    ack = ms["p1"].handle_ping(_ping_from(a, ms["p1"], [{**p1, "state": SUSPECT}]), 1.1)  # p1 refutes
    assert info(ack)["inc"] == 1
    a.handle_ack(1, ack, 1.2)
    assert (a.get(pid("p1")).state, a.get(pid("p1")).incarnation) == (ALIVE, 1)
    # a rumour about this peer at an incarnation it never claimed does not make it bump
    me = ms["p0"]
    with pytest.raises(MembershipError):
        me.handle_ping(_ping_from(ms["p2"], me, [tamper({**rec("p0", DEAD, 0)}, inc=40)]), 1.3)
    assert me.incarnation == 0


def test_relay_passes_a_members_record_unchanged():
    """C gossips A's record to B: B holds A's own bytes, and passes them on as they are."""
    a, b, c = core("a", meta={"step": 1}), core("b"), core("c")
    a.set_meta(step=2)
    c.handle_ping(_ping_from(a, c, []), 0.1)
    c.handle_sync_reply(b.handle_sync(c.sync_message(), 0.2), 0.2)   # c's full state reaches b
    assert b.get(pid("a")).meta == {"step": 2}
    own = a.join_request()["from"]
    relayed = {r["id"]: r for r in b.sync_message()["members"]}[pid("a")]
    assert relayed == own
    assert b.pin(pid("a")) == (key("a").public, "") and b.pin(pid("zz")) is None


def test_relayed_ack_must_be_the_targets_own():
    ms = manual(3)
    a = ms["p0"]
    ping, t = first_ping(a, 0.0)
    reqs = a.probe_failed(ping.probe_id, t + CFG.probe_timeout)
    via = ms[name(reqs[0].via)]
    fwd = via.handle_ping_req(reqs[0].msg, t + 1.0)
    ack = ms[name(ping.target)].handle_ping(fwd.msg, t + 1.0)
    before = a.snapshot()
    for forged in ({**ack, "from": resign(ack["from"], signer=key(name(via.self_id)))},
                   {**ack, "from": tamper(ack["from"], inc=3)},
                   {**header(via, "ack"), "updates": []}):
        with pytest.raises(MembershipError):
            a.ping_req_result(ping.probe_id, True, forged, t + 1.1)
        assert a.snapshot() == before
    a.ping_req_result(ping.probe_id, True, ack, t + 1.1)         # verbatim: accepted
    assert ping.probe_id not in a.snapshot()["probes"]


def test_known_claims_are_not_verified_again(monkeypatch):
    calls = []
    real = identity.verify
    monkeypatch.setattr(identity, "verify", lambda *args: calls.append(args[0]) or real(*args))
    ms = {f"p{i}": core(f"p{i}", 0.0, CFG, random.Random(i)) for i in range(16)}
    hub = ms["p0"]
    for m in ms.values():
        if m is not hub:
            m.handle_join_reply(hub.handle_join(m.join_request(), 0.0), 0.0)
    p5 = ms["p5"]
    p5.handle_sync_reply(hub.handle_sync(p5.sync_message(), 0.1), 0.1)
    assert len(p5.alive_ids()) == 16
    # a full-state sync of 16 members, nothing new: no signature checked on either side
    calls.clear()
    n = hub.verifications + p5.verifications
    p5.handle_sync_reply(hub.handle_sync(p5.sync_message(), 0.2), 0.2)
    assert calls == [] and hub.verifications + p5.verifications == n
    # set_meta every step: signed once, lazily, when a message goes out; checked once by each receiver
    s0 = p5.signatures
    for step in range(10):
        p5.set_meta(step=step)
    assert p5.signatures == s0
    msg = p5.sync_message()
    assert p5.sync_message() == msg and p5.signatures == s0 + 1
    hub.handle_sync(msg, 0.3)
    assert calls == [key("p5").public]
    hub.handle_sync(msg, 0.4)
    assert calls == [key("p5").public]
    # a rumour about a claim held (suspect at its incarnation) needs no check; a gossiped meta change one
    calls.clear()
    p7 = ms["p7"].join_request()["from"]
    hub.handle_ping(_ping_from(ms["p3"], hub, [{**p7, "state": SUSPECT}]), 0.5)
    assert hub.get(pid("p7")).state == SUSPECT and calls == []
    ms["p7"].set_meta(step=1)
    hub.handle_ping(_ping_from(ms["p3"], hub, [ms["p7"].join_request()["from"]] * 3), 0.6)
    assert calls == [key("p7").public] and hub.get(pid("p7")).meta == {"step": 1}
    # an older claim of a member changes nothing and is not checked
    calls.clear()
    hub.handle_ping(_ping_from(ms["p3"], hub, [p7]), 0.7)
    assert calls == []


def test_origin_must_be_the_sender():
    a, ping, valid, t = _fixture()
    for kind in HANDLERS:
        if kind == "ack_relayed":
            continue
        msg = valid[_base_kind(kind)]
        before = a.snapshot()
        with pytest.raises(MembershipError, match="but was sent by"):
            _call(a, kind, msg, ping.probe_id, t + 0.1, origin=pid("p9"))
        assert a.snapshot() == before
    sender = valid["sync"]["from"]["id"]
    a.handle_sync(valid["sync"], t + 0.1, origin=sender)


def test_key_of_a_known_id_cannot_change():
    a, b = core("a"), core("b")
    a.handle_ping(_ping_from(b, a, []), 0.1)
    before = a.snapshot()
    with pytest.raises(MembershipError):
        a.handle_ping(_ping_from(b, a, [resign(rec("b", ALIVE, 3), pk=key("c").public, signer=key("c"))]), 0.2)
    assert a.snapshot() == before


def test_constructor_checks_the_id_is_the_keys():
    k = key("a")
    assert core("a").self_id == k.id
    rank = Membership(k, addr("a"), 0.0, peer_id=f"{k.id}~3", tls="ab" * 32)
    assert rank.self_id == f"{k.id}~3" and rank.pin(rank.self_id) == (k.public, "ab" * 32)
    assert claim_of(rank.join_request()["from"])["tls"] == "ab" * 32
    for bad in (dict(peer_id="p0"), dict(peer_id=key("b").id), dict(peer_id=f"{k.id}~x"), dict(tls="xy")):
        with pytest.raises(MembershipError):
            Membership(k, addr("a"), 0.0, **bad)


def test_restart_with_the_same_key_refutes_its_old_incarnation():
    """A peer restarted with its key file starts at incarnation 0; others hold its older claims."""
    a, b = core("a"), core("b")
    b.handle_join_reply(a.handle_join(b.join_request(), 0.0), 0.0)
    for i in range(3):
        b.handle_ping(_ping_from(a, b, [rec("b", SUSPECT, b.incarnation)]), 0.1 * i)
    b.set_meta(step=50)
    a.handle_ping(_ping_from(b, a, []), 1.0)
    assert a.get(pid("b")).incarnation == 3 and a.get(pid("b")).meta == {"step": 50}
    b2 = core("b")                                        # same key, new process
    b2.handle_join_reply(a.handle_join(b2.join_request(), 2.0), 2.0)
    assert b2.incarnation == 4
    a.handle_ping(_ping_from(b2, a, []), 2.1)
    assert a.get(pid("b")).incarnation == 4 and a.get(pid("b")).meta == {}
