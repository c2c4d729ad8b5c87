"""Rounds that do not wait on every peer: the contributor cap, declared next rounds, weighting by
samples, free-running slow peers (core/cadence.py, swarm/pacing.py; docs/design.md)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarm import robust, roundbook
from swarm.codec import CodecError, Compressor, CodecConfig, decode_payload
from swarm.codec import Manifest, ManifestEntry
from swarm.core import cadence, rounds
from swarm.core.meta import PeerMeta
from swarm.node import Peer

from .conftest import small_cfg, start_peers, watch_shares

pytestmark = pytest.mark.timeout(240)


# -- the cap and the rotation (sans-I/O) --------------------------------------------------------------
def test_cap_stride_is_one_up_to_the_cap_then_grows_with_the_swarm():
    assert [cadence.cap_stride(p, 4) for p in (1, 2, 4, 5, 7, 8, 11, 12, 16, 17)] == [1, 1, 1, 1, 1, 2, 2, 3, 4, 4]
    for p in range(1, 40):  # a round keeps at least the cap's payloads (a robust rule needs several)
        assert p // cadence.cap_stride(p, 4) >= min(p, 4)
    assert cadence.cap_stride(16, 0) == 1  # no cap
    # a summed payload is at most MAX_STRIDE rounds apart; a window's share has no such limit
    assert cadence.cap_stride(100, 4) == cadence.MAX_STRIDE == 8 and cadence.cap_stride(1000, 4, limit=None) == 250
    assert cadence.cap_stride(16, 4, limit=None) == cadence.cap_stride(16, 4) == 4
    assert cadence.cap_stride(1000, 4) == cadence.MAX_STRIDE


class _Swarm:
    """What Pacing reads of its peer: its id, its config, the members' metadata (no sockets)."""

    def __init__(self, contributors: int, **cfg):
        self.id = "p00"
        self.cfg = small_cfg(**cfg)
        self._metas = {f"p{i:02d}": PeerMeta(active=True) for i in range(1, contributors)}

    def metas(self) -> dict:
        return self._metas


def test_the_cap_splits_bytes_per_step_by_default_and_rounds_when_asked_or_dense():
    """--cap-by bytes: every round, at 1/k of the entries (no limit of 8 on k); --cap-by rounds, or
    a dense codec (which cannot split a payload): a whole payload every min(8, k) rounds on our
    phase; windows always split bytes; under 2C contributors nothing changes."""
    from swarm.pacing import Pacing, Send
    assert Pacing(_Swarm(16)).plan_next(5) == Send(6, 4)
    assert Pacing(_Swarm(100)).plan_next(5) == Send(6, 25)
    assert Pacing(_Swarm(16, sync_every=4, steps=40, cap_by="rounds")).plan_next(5) == Send(6, 4)
    assert Pacing(_Swarm(7)).plan_next(5) == Send(6, 1)
    for cfg in ({"cap_by": "rounds"}, {"compression": "none"}):
        pacing = Pacing(_Swarm(16, **cfg))
        assert not pacing.splits_bytes() and pacing.cap_stride() == 4
        assert pacing.plan_next(5) == Send(12, 1)  # 4 rounds on, then on p00's phase (0 of 4)
        assert pacing.status()["cap_by"] == "rounds"
    assert Pacing(_Swarm(100, cap_by="rounds")).plan_next(5) == Send(16, 1)  # stride 8


def test_phases_spread_peers_evenly_over_the_rounds():
    ids = [f"p{i:02d}" for i in range(16)]
    k = cadence.cap_stride(len(ids), 4)
    per_round: dict[int, int] = {}
    for pid in ids:
        ph = cadence.phase(pid, ids, k)
        r = cadence.next_round(0, k, k, ph)
        assert 0 < r <= 2 * k and r % k == ph
        per_round[r % k] = per_round.get(r % k, 0) + 1
    assert sorted(per_round.values()) == [4, 4, 4, 4]


def test_next_round_keeps_its_phase_and_a_free_running_stride():
    assert cadence.next_round(8, 4, 4, 0) == 12
    assert cadence.next_round(8, 1, 1, 0) == 9  # no cap: the next round
    assert cadence.next_round(8, 6, 4, 0) == 16  # a slow peer's stride, then back on its phase
    assert cadence.next_round(9, 4, 4, 2) == 14  # a phase that moved (the members changed)


def test_pace_runs_free_only_when_clearly_slower_and_comes_back():
    p = cadence.Pace()
    for _ in range(16):
        p.computed(0.14)
    assert not p.update([0.1, 0.1])  # 40% slower (a busy machine's noise): keeps up
    for _ in range(16):
        p.computed(0.2)
    assert p.update([0.1, 0.1, 0.1])  # twice as slow: runs free
    assert p.update([0.16])  # hysteresis: still free at 1.25x
    for _ in range(16):
        p.computed(0.1)
    assert not p.update([0.1])
    fresh = cadence.Pace()
    for _ in range(cadence.MIN_SEEN - 1):
        fresh.computed(1.0)
    assert not fresh.update([0.1])  # too few steps timed to judge


def test_a_window_is_cut_short_only_for_a_clearly_late_peer_to_fit_the_others_time():
    ws = cadence.window_steps

    def steps(n: int, each: float) -> list[float]:  # when each of n inner steps ended
        return [each * (i + 1) for i in range(n)]

    assert ws(32, steps(32, 1.0), 33.0, 33.0) == 32 and ws(32, steps(32, 1.0), 33.0, 40.0) == 32  # on time, early
    assert ws(32, steps(32, 1.0), 33.0, 31.0) == 32  # late within WINDOW_FIT: noise, equal peers keep H
    # twice as slow: by the time the others were in (32 s), less its 1 s of pushes, 15 steps had ended
    assert ws(32, steps(32, 2.0), 65.0, 32.0) == 15
    # a slow peer that shares cores ends its last steps faster once the others wait: counted, not extrapolated
    shared = steps(16, 2.0) + [32.0 + t for t in steps(16, 1.0)]
    assert ws(32, shared, 49.0, 33.0) == 16
    assert ws(32, steps(16, 2.0), 33.0, 33.0) == 16  # a short window that now ends on time stays as it is
    assert ws(32, steps(16, 2.0), 33.0, 41.25) == 20  # ... and grows back when it ends early
    assert ws(32, steps(16, 1.0), 17.0, 40.0) == 32  # never more than H
    assert ws(8, steps(8, 10.0), 81.0, 1.0) == 1  # never no step at all
    # a short window late by noise: one step of 4 behind (25%) is not enough to shorten it
    assert ws(4, steps(4, 1.0), 4.2, 3.2) == 4 and ws(4, steps(4, 1.0), 4.2, 2.2) == 2
    # times that say nothing: the last window's steps again
    assert ws(32, steps(20, 1.0), 21.0, float("nan")) == 20 and ws(32, steps(20, 1.0), 21.0, -1.0) == 20
    assert ws(32, steps(20, 1.0), 10.0, 30.0) == 20  # a payload before its own last step: not a window's times
    for h, n in ((0, 1), (8, 0), (8, 9)):
        with pytest.raises(ValueError):
            ws(h, steps(n, 1.0), 100.0, 100.0)


def test_a_window_is_planned_from_our_mark_of_the_kind_the_others_was_taken_with():
    """window_over: against the others' payloads, when ours went; against their row pushes (at our
    primary), when ours went, not our payload, which waited for every primary to have the whole
    window's pushes and answer. Mixed, equal peers on a slow link looked late by that wait."""
    over = cadence.window_over
    ends = [1.0 * (i + 1) for i in range(32)]  # a whole window, one step a second
    assert over(ends, 39.0, 32.2, by_pushes=False) == 39.0
    assert over(ends, 39.0, 32.2, by_pushes=True) == 32.2
    assert over(ends, 39.0, 28.0, by_pushes=True) == 32.0  # led by --push-lead: no earlier than our last step
    assert over(ends, 39.0, None, by_pushes=True) == 39.0  # no push timed (no tables): the payload
    # the 1 MB/s case (bench/wan.py swarm-diloco, 8mbit): the others' pushes in 1.5 s after our last
    # step, our payload 7 s after it (our pushes answered once every primary had the window's).
    # Against the payload we looked late and planned 26 of 32 steps, window after window; against
    # our pushes, which went 0.2 s after it, we are not late
    ws = cadence.window_steps
    assert ws(32, ends, 39.0, 33.5) == 26
    assert ws(32, ends, over(ends, 39.0, 32.2, by_pushes=True), 33.5) == 32
    # a peer at half speed is still late by the same mark: the others' pushes (whole windows of
    # 32 s) came at 33.5 s, when 16 of its steps had ended
    slow = [2.0 * (i + 1) for i in range(32)]
    assert ws(32, slow, over(slow, 71.0, 64.2, by_pushes=True), 33.5) == 16


def test_a_window_is_cut_when_the_others_are_in_with_enough_of_it_left():
    cut = cadence.end_window_now
    assert cut(32, 16, True) and not cut(32, 16, False)  # only once every other payload is in
    assert cut(32, 28, True) and not cut(32, 29, True)  # 4 of 32 left is over a tenth; 3 is not
    assert cut(4, 2, True) and not cut(4, 3, True)  # at least 2 steps left
    assert not cut(32, 0, True) and not cut(32, 32, True)  # at least one step, and not past the end


def test_a_windows_pulls_ramp_up_to_pull_steps_within_the_lookahead():
    # a window's first pulls are small (its first steps bring most of its new rows), later ones
    # take --pull-steps steps each; never more than --row-lookahead, never fewer than one
    assert [cadence.pull_group(k, 4, 8) for k in range(5)] == [2, 3, 4, 4, 4]
    assert [cadence.pull_group(k, 2, 4) for k in range(3)] == [2, 2, 2]  # the default before the ramp
    assert [cadence.pull_group(k, 1, 4) for k in range(3)] == [1, 1, 1]
    assert [cadence.pull_group(k, 8, 3) for k in range(3)] == [2, 3, 3]
    assert cadence.pull_group(0, 4, 1) == 1


def test_windows_fit_the_others_only_when_they_start_together():
    """The window rules compare a peer's window times with the others': only without --overlap do
    all windows start together (when a round is applied); --free-run 0 turns them off."""
    def fit(**kw) -> bool:
        return Peer(small_cfg(steps=8, sync_every=4, **kw), out=lambda line: None).local_steps.fit
    assert fit(free_run=1) and not fit(free_run=1, overlap=1) and not fit(free_run=0)


def test_pace_stride_fits_a_step_into_the_swarms_period_and_says_when_it_is_due():
    p = cadence.Pace(free=True)
    for _ in range(8):
        p.computed(0.2)
    for r in range(6):
        p.completed(r, 10.0 + 0.1 * r)
    assert p.period() == pytest.approx(0.1)
    assert p.stride() == 3  # ceil(1.2 * 0.2 / 0.1)
    last_t = 10.5
    assert p.due(6, last_t)  # the swarm computes round 6 now
    assert not p.due(9, last_t)  # rounds 6..8 first
    assert p.due(9, last_t + 0.2 + 1e-9 - 1.2 * 0.2 + 0.1)  # the next step would end after round 8 closes
    assert cadence.Pace().stride() == 1  # keeping up: every round


# -- who a round expects -------------------------------------------------------------------------------
def _live(*ids: str) -> dict[str, PeerMeta]:
    return {i: PeerMeta(active=True) for i in ids}


def test_a_round_waits_only_for_the_peers_that_declared_it():
    decl = {"a": 6, "b": 5, "c": None}
    exp = rounds.expected(5, _live("a", "b", "c"), {"a", "b", "c"}, set(), "me", False,
                          declared=lambda p, s: decl[p])
    assert exp == {"b", "c"}  # a declared round 6; c said nothing: waited for as before
    assert rounds.expected(6, _live("a"), set(), set(), "me", True, declared=lambda p, s: 6) == {"a", "me"}


def test_declared_next_takes_the_newer_of_payloads_and_gossip():
    meta = PeerMeta(active=True, next_round=12, declared_at=8)
    assert rounds.declared_next(10, 9, meta) == 12  # gossip knows of its round-8 payload's successor
    assert rounds.declared_next(8, 9, meta) == 9  # a declaration made at round 8 says nothing of round 8
    assert rounds.declared_next(10, None, PeerMeta()) is None


class _C:
    def __init__(self, step, sender, nxt=None, samples=None):
        self.step, self.sender, self.next, self.samples = step, sender, nxt, samples

    def add_to(self, out, weight=1.0):
        out.add_(weight)


def test_round_book_keeps_declarations_and_when_a_round_completed():
    book = roundbook.RoundBook()
    assert book.offer(_C(0, "a", nxt=4), now=1.0) == roundbook.ACCEPTED
    assert book.offer(_C(0, "b", nxt=1), now=1.5) == roundbook.ACCEPTED
    assert book.declared_for("a", 1) == 4 and book.declared_for("a", 0) is None
    res = book.take(0, {"a", "b"}, now=2.0, timeout=10.0)
    assert res.completed_at == 1.5 and not res.timed_out
    book.forget("a")
    assert book.declared_for("a", 1) is None


# -- weights -------------------------------------------------------------------------------------------
class _V:
    def __init__(self, sender, values, samples):
        self.step, self.sender, self.n, self.samples, self.indices = 0, sender, len(values), samples, None
        self.values = torch.tensor(values, dtype=torch.float32)

    def add_to(self, out, weight=1.0):
        out.add_(self.values, alpha=weight)


def test_mean_weighs_by_samples_and_equal_samples_keep_the_plain_mean():
    cs = [_V("a", [1.0, 0.0], 8), _V("b", [0.0, 1.0], 24)]
    out = torch.zeros(2)
    robust.aggregate(out, cs, robust.MEAN, divisor=2)
    assert out.tolist() == pytest.approx([0.25, 0.75])
    same = [_V("a", [1.0, 3.0], 8), _V("b", [2.0, 5.0], 8)]
    a, b = torch.zeros(2), torch.zeros(2)
    robust.aggregate(a, same, robust.MEAN, divisor=2)
    for c in same:
        c.add_to(b, 1.0 / 2)
    assert torch.equal(a, b)  # the same bits as before weights existed


def test_a_claimed_weight_is_capped_against_the_rounds_median():
    cs = [_V("a", [1.0], 4), _V("b", [1.0], 4), _V("liar", [100.0], 10 ** 9)]
    w = robust.weights(cs)
    assert w == [4.0, 4.0, robust.WEIGHT_CAP * 4.0]


def test_weighted_trimmed_mean_cuts_weight_not_count():
    # per coordinate: values 0 (w 1), 1 (w 1), 10 (w 2); trimming 25% of W=4 from each end cuts
    # the 0 entirely and half of the 10's weight: (1*1 + 10*1) / 2
    cs = [_V("a", [0.0], 4), _V("b", [1.0], 4), _V("c", [10.0], 8)]
    out = torch.zeros(1)
    robust.aggregate(out, cs, robust.RobustConfig(rule="trimmed", trim=0.25, msg_clip=0.0), divisor=3)
    assert out.tolist() == pytest.approx([5.5])
    out = torch.zeros(1)  # trim 0: the weighted mean
    robust.aggregate(out, cs, robust.RobustConfig(rule="trimmed", trim=0.0, msg_clip=0.0), divisor=3)
    assert out.tolist() == pytest.approx([(0 * 4 + 1 * 4 + 10 * 8) / 16])


def test_weighted_rules_are_deterministic():
    torch.manual_seed(0)
    cs = [_V(f"p{i}", torch.randn(50).tolist(), 4 * (i + 1)) for i in range(5)]
    for rule in ("trimmed", "centered-clip", "mean"):
        cfg = robust.RobustConfig(rule=rule)
        a, b = torch.zeros(50), torch.zeros(50)
        robust.aggregate(a, cs, cfg, divisor=5)
        robust.aggregate(b, cs, cfg, divisor=5)
        assert torch.equal(a, b) and bool(torch.isfinite(a).all())


# -- the wire ------------------------------------------------------------------------------------------
def _manifest(n=64) -> Manifest:
    return Manifest((ManifestEntry("w", (n,), "float32"),))


def test_payload_carries_samples_and_next_round_and_refuses_bad_ones():
    m = _manifest()
    comp = Compressor(m, CodecConfig(mode="topk", ratio=0.25), sender="me")
    enc = comp.compress(torch.randn(64), 7, samples=48, next_round=11)
    dec = decode_payload(enc.blob, m, max_ratio=0.25)
    assert (dec.samples, dec.next, dec.step) == (48, 11, 7)
    plain = decode_payload(comp.compress(torch.randn(64), 8).blob, m, max_ratio=0.25)
    assert plain.samples is None and plain.next is None
    for samples, nxt, why in ((0, 9, "samples"), (4, 7, "next round"), (4, 3, "next round")):
        bad = comp.compress(torch.randn(64), 7, samples=samples, next_round=nxt)
        with pytest.raises(CodecError, match=why):
            decode_payload(bad.blob, m, max_ratio=0.25)


# -- real peers ----------------------------------------------------------------------------------------
async def _run_losing_one(peers: list, victim: int, at_round: int, timeout: float) -> list[dict]:
    """Run every peer; once each has taken ``at_round`` rounds, close peers[victim] without a word
    (the others find out by SWIM). Returns the survivors' summaries, in order; all closed after."""
    runs = [asyncio.ensure_future(p.run()) for p in peers]
    try:
        while min(p.book.step for p in peers) < at_round:
            await asyncio.sleep(0.05)
        await peers[victim].close()
        return await asyncio.wait_for(asyncio.gather(*[r for i, r in enumerate(runs) if i != victim]), timeout)
    finally:
        for p in peers:
            await p.close()
        await asyncio.gather(*runs, return_exceptions=True)


async def test_eight_peers_with_a_cap_of_three_by_rounds_lose_one_and_keep_identical_replicas():
    peers = await start_peers(8, steps=16, min_peers=8, max_contributors=3, cap_by="rounds", round_timeout=10.0)
    results = await _run_losing_one(peers, victim=5, at_round=6, timeout=200)
    survivors = [p for i, p in enumerate(peers) if i != 5]
    for r, p in zip(results, survivors):
        assert r["steps"] == 16 and r["final_loss"] < r["first_loss"]
        st = p.pacing.status()
        # with 8 (then 7) contributors and a cap of 3 a peer sends every other round, summing two steps
        assert st["payloads_sent"] <= 10 and st["steps_summed"] >= 1.5 * st["payloads_sent"]
    sketches = [r["param_sketch"] for r in results]
    assert all(s == sketches[0] for s in sketches)  # bit-identical


def _spy_shares(peers: list) -> dict[int, list[int]]:
    """The share each peer's payloads were compressed at, in order (Compressor.compress's ``share``)."""
    shares: dict[int, list[int]] = {i: [] for i in range(len(peers))}
    for i, p in enumerate(peers):
        watch_shares(p, shares[i])
    return shares


async def test_eight_peers_in_windows_send_half_payloads_lose_one_and_keep_identical_replicas():
    """Windows of local steps at 8 peers and the default cap (4): every peer sends every window's
    payload at half its entries (k = 2); once one is gone (7 contributors: k = 1) the payloads are
    whole again; the survivors finish bit-identical with falling loss."""
    peers = await start_peers(8, steps=24, min_peers=8, sync_every=4, round_timeout=10.0)
    assert peers[0].cfg.max_contributors == 4  # the default
    shares = _spy_shares(peers)
    results = await _run_losing_one(peers, victim=5, at_round=2, timeout=240)
    for i, r in zip([i for i in range(8) if i != 5], results):
        assert r["steps"] == 24 and r["rounds"] == 6 and r["val_loss"] < r["first_loss"] - 1.0, r
        assert len(shares[i]) == 6 and shares[i][:2] == [2, 2] and shares[i][-1] == 1, shares
    sketches = [r["param_sketch"] for r in results]
    assert all(s == sketches[0] for s in sketches)  # bit-identical


async def test_eight_peers_per_step_send_every_round_at_half_their_entries_lose_one_and_agree():
    """Per-step rounds at 8 peers and the default cap (4, --cap-by bytes): every peer sends a
    payload every round, each at half its entries (k = 2), one step's gradient each (no sums, no
    declared strides); once one is gone the payloads are whole again; the survivors finish
    bit-identical with falling loss."""
    peers = await start_peers(8, steps=16, min_peers=8, free_run=0, round_timeout=10.0)
    assert peers[0].cfg.cap_by == "bytes" and peers[0].pacing.splits_bytes()
    shares = _spy_shares(peers)
    results = await _run_losing_one(peers, victim=5, at_round=4, timeout=200)
    for i, (r, p) in zip([i for i in range(8) if i != 5], zip(results, [p for j, p in enumerate(peers) if j != 5])):
        assert r["steps"] == 16 and r["final_loss"] < r["first_loss"], r
        st = p.pacing.status()
        assert st["payloads_sent"] == 16 and st["steps_summed"] == 16 and st["cap_by"] == "bytes", st
        assert shares[i][:3] == [2, 2, 2] and shares[i][-1] == 1, shares
    sketches = [r["param_sketch"] for r in results]
    assert all(s == sketches[0] for s in sketches)  # bit-identical


async def test_a_slow_peer_runs_free_and_its_samples_still_count():
    fast = await start_peers(2, steps=40, min_peers=3)
    slow = Peer(small_cfg(steps=40, min_peers=3, join=f"127.0.0.1:{fast[0].port}", compute_speed=0.3, free_run=1),
                out=lambda line: None)
    await slow.start()
    peers = fast + [slow]
    try:
        results = await asyncio.wait_for(asyncio.gather(*[p.run() for p in peers]), 220)
    finally:
        for p in peers:
            await p.close()
    rs = results[2]
    assert slow.pacing.pace.free  # it stopped holding the rounds up
    assert 0 < slow.pacing.sent < 40  # not a payload every round ...
    assert rs["samples"] >= slow.pacing.summed * 4 > 0  # ... but the steps it computed went out
    for r in results:
        assert r["steps"] == 40 and r["rounds_timed_out"] == 0
    assert results[0]["param_sketch"] == results[1]["param_sketch"] == rs["param_sketch"]


async def test_a_slow_peer_takes_shorter_windows_and_the_swarm_agrees():
    """Windows of local steps: a peer at a third of the others' speed cuts its first window when
    their payloads are in, then plans fewer inner steps per window (its payload weighted by its
    samples), so the windows end when theirs do; the global model stays bit-identical and
    nothing times out."""
    kw = dict(steps=32, min_peers=3, sync_every=8)
    fast = await start_peers(2, **kw)
    slow = Peer(small_cfg(join=f"127.0.0.1:{fast[0].port}", compute_speed=0.3, free_run=1, **kw),
                out=lambda line: None)
    await slow.start()
    peers = fast + [slow]
    try:
        results = await asyncio.wait_for(asyncio.gather(*[p.run() for p in peers]), 220)
        status = slow.status()
    finally:
        for p in peers:
            await p.close()
    rs = results[2]
    assert 1 <= rs["window_steps"] < 8 and status["window_steps"] == rs["window_steps"]
    # its first window, before it had measured one, was cut when the others' payloads were in, unless
    # they came in with fewer than 2 of its steps left (end_window_now leaves those): on 2 shared cores
    # a fast peer's first window can start late (seen: 0.3 s) and end barely before the slow one's
    started, ends, _ = slow.local_steps.windows[0]
    assert slow.local_steps.others_done.get(0) is not None
    others_in = slow.local_steps.others_done[0][0]
    if not any(e["kind"] == "window" and e["detail"].startswith("window 0:") for e in slow.events):
        assert len(ends) == 8 and sum(1 for e in ends if e > others_in) <= 2, (others_in - started,
                                                                               [e - started for e in ends])
    assert not any(e["kind"] == "window" for p in fast for e in p.events)
    assert results[0]["window_steps"] == results[1]["window_steps"] == 8  # free_run 0 (and fast): whole windows
    assert 0 < rs["samples"] < results[0]["samples"] == 32 * small_cfg().batch_size  # its samples went out, fewer
    for r in results:
        assert r["steps"] == 32 and r["rounds"] == 4 and r["rounds_timed_out"] == 0
    assert results[0]["param_sketch"] == results[1]["param_sketch"] == rs["param_sketch"]
    assert torch.equal(fast[0].replica.global_flat, slow.replica.global_flat)
    # the fast peers' schedule and the slow one's moved alike: its short windows skipped the steps it left out
    assert slow.replica.lr() == pytest.approx(fast[0].replica.lr(), rel=1e-9)
