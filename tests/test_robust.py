"""swarm/robust.py: aggregation rules (pure, deterministic, fast), message clipping, scoring and bans,
and the grads route's 403 for a banned sender."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm import robust, roundbook
from swarm.codec.payload import Decoded
from swarm.config import ConfigError
from swarm.cli import parse_config
from swarm.robust import MEAN, RobustConfig, Scoreboard, ScoreConfig, aggregate

N = 476416  # the default model's dense parameters
CC = RobustConfig(rule="centered-clip", msg_clip=0.0)
TRIM = RobustConfig(rule="trimmed", msg_clip=0.0, trim=0.2)


def sparse(sender: str, idx, vals, step: int = 0, n: int = 16) -> Decoded:
    i = torch.as_tensor(np.asarray(idx, dtype=np.int64))
    order = torch.argsort(i)
    return Decoded(step, sender, n, "topk-int8", i[order], torch.as_tensor(np.asarray(vals, np.float32))[order])


def dense(sender: str, vals, step: int = 0) -> Decoded:
    v = torch.as_tensor(np.asarray(vals, np.float32))
    return Decoded(step, sender, v.numel(), "none", None, v)


def random_round(m: int, n: int, k: int, seed: int = 0, attacker_scale: float | None = None) -> list[Decoded]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(m):
        idx = torch.sort(torch.randperm(n, generator=g)[:k]).values
        v = torch.randn(k, generator=g)
        if attacker_scale is not None and i == m - 1:
            v = v * attacker_scale
        out.append(Decoded(0, f"p{i}", n, "topk-int8", idx, v))
    return out


def agg(cs, cfg, n=None, divisor=None) -> tuple[torch.Tensor, robust.Report]:
    out = torch.zeros(n or cs[0].n)
    rep = aggregate(out, cs, cfg, divisor=divisor)
    return out, rep


# -- rules ---------------------------------------------------------------------------------------

def test_mean_is_the_historical_aggregate_bit_for_bit():
    cs = random_round(4, 1000, 50, seed=1)
    ref = torch.zeros(1000)
    for c in cs:
        c.add_to(ref, 1.0 / 3)  # divisor: 3 on time, the fourth late
    r = roundbook.RoundResult(step=1, on_time=cs[:3], late=cs[3:], missing=[], timed_out=False)
    out = torch.zeros(1000)
    assert roundbook.aggregate_into(out, r) == 4
    assert torch.equal(out, ref)
    out2 = torch.zeros(1000)
    assert roundbook.aggregate_into(out2, r, RobustConfig(rule="mean", msg_clip=0)) == 4
    assert torch.equal(out2, ref)


def test_robust_rules_need_three_contributors_else_clipped_mean():
    a, b = sparse("a", [0, 1], [1.0, 2.0]), sparse("b", [1, 2], [3.0, -1.0])
    for cfg in (CC, TRIM):
        out, rep = agg([a, b], cfg)
        assert rep.rule == "mean" and rep.count == 2 and rep.outliers == []
        assert out[:3].tolist() == [0.5, 2.5, -0.5]


def test_trimmed_counts_missing_senders_as_zero():
    # index 0: sent by one sender only -> trimmed away; index 1: by all five -> extremes cut
    cs = [sparse("a", [0, 1], [9.0, 1.0]), sparse("b", [1], [2.0]), sparse("c", [1], [3.0]),
          sparse("d", [1], [4.0]), sparse("e", [1], [-100.0])]
    out, rep = agg(cs, TRIM)
    assert rep.rule == "trimmed"
    assert out[0].item() == 0.0
    assert out[1].item() == pytest.approx((1.0 + 2.0 + 3.0) / 3)
    assert out[2:].abs().sum().item() == 0.0


def test_trimmed_matches_a_numpy_reference_on_dense_vectors():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(7, 300)).astype(np.float32)
    out, _ = agg([dense(f"p{i}", x[i]) for i in range(7)], TRIM)
    cut = int(0.2 * 7)
    ref = np.sort(x, axis=0)[cut:7 - cut].mean(axis=0)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-6)


def test_centered_clip_on_the_union_equals_centered_clip_on_dense_vectors():
    cs = random_round(5, 2000, 40, seed=4, attacker_scale=-100.0)
    sp, _ = agg(cs, CC)
    dn, _ = agg([dense(c.sender, c.to_dense()) for c in cs], CC)
    torch.testing.assert_close(sp, dn, rtol=1e-5, atol=1e-6)


def test_centered_clip_bounds_an_attacker_that_the_mean_follows():
    honest = random_round(4, 5000, 500, seed=5)
    ref = torch.zeros(5000)
    for c in honest:
        c.add_to(ref, 1 / 4)
    cs = random_round(5, 5000, 500, seed=5, attacker_scale=-100.0)
    mean, _ = agg(cs, MEAN)
    cc, rep = agg(cs, CC)
    clip_mean, rep2 = agg(cs, RobustConfig(rule="mean", msg_clip=2.0))
    assert rep.outliers == ["p4"] and rep2.clipped == ["p4"]
    err = lambda v: float((v - ref).norm() / ref.norm())  # noqa: E731
    assert err(mean) > 10  # the attacker owns the mean
    assert err(cc) < 0.6  # bounded: about one honest message's worth
    assert err(clip_mean) < 1.0
    # on a clean round CenteredClip stays close to the mean
    clean_cc, rep = agg(honest, CC)
    assert rep.outliers == [] and err(clean_cc) < 0.3


def test_late_payloads_are_contributors_of_the_robust_rule():
    cs = random_round(3, 500, 30, seed=6)
    r = roundbook.RoundResult(step=2, on_time=cs[:2], late=cs[2:], missing=[], timed_out=False)
    out = torch.zeros(500)
    rep = roundbook.aggregate_report(out, r, CC)
    assert rep.rule == "centered-clip" and rep.count == 3 and rep.senders == ["p0", "p1", "p2"]


def test_empty_round_and_all_zero_payloads():
    out, rep = agg([], CC, n=10)
    assert rep.count == 0 and out.abs().sum() == 0
    zs = [sparse(f"p{i}", [], []) for i in range(4)]
    out, rep = agg(zs, CC)
    assert rep.count == 4 and out.abs().sum() == 0 and rep.outliers == [] and rep.clipped == []


def test_msg_clip_scales_messages_to_k_times_the_median_norm():
    cs = [dense("a", [1.0, 0.0]), dense("b", [0.0, 2.0]), dense("c", [3.0, 0.0]), dense("d", [0.0, -40.0])]
    out, rep = agg(cs, RobustConfig(rule="mean", msg_clip=2.0))
    assert rep.median_norm == 2.0 and rep.clipped == ["d"] and rep.outliers == ["d"]
    # d clipped to norm 4; c (3 <= 4) untouched
    assert out.tolist() == pytest.approx([(1 + 3) / 4, (2 - 4) / 4])


def test_aggregation_is_deterministic_and_independent_of_thread_count():
    cs = random_round(5, 50_000, 2000, seed=7, attacker_scale=-100.0)
    cs.append(dense("q", torch.randn(50_000, generator=torch.Generator().manual_seed(8))))
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)
            for cfg in (RobustConfig(), RobustConfig(rule="trimmed")):
                results.append(agg(cs, cfg)[0])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[2]) and torch.equal(results[0], results[4])
    assert torch.equal(results[1], results[3]) and torch.equal(results[1], results[5])


def test_five_contributors_at_half_a_million_params_aggregate_fast():
    cs = random_round(5, N, N // 100, seed=9, attacker_scale=-100.0)
    out = torch.zeros(N)
    best = float("inf")
    for _ in range(5):
        out.zero_()
        t = time.perf_counter()
        aggregate(out, cs, RobustConfig())
        best = min(best, time.perf_counter() - t)
    assert best < 0.05, f"{best * 1e3:.1f} ms"


@settings(max_examples=60, deadline=None)
@given(st.integers(3, 7), st.integers(1, 40), st.integers(0, 2**31 - 1),
       st.floats(1e-3, 1e4), st.sampled_from(["centered-clip", "trimmed", "mean"]), st.sampled_from([0.0, 1.0, 2.0]))
def test_robust_aggregate_stays_within_the_inputs(m, n, seed, scale, rule, clip):
    rng = np.random.default_rng(seed)
    cs = []
    for i in range(m):
        k = int(rng.integers(0, n + 1))
        idx = np.sort(rng.choice(n, size=k, replace=False))
        cs.append(sparse(f"p{i}", idx, rng.normal(size=k) * (scale if i == 0 else 1.0), n=n))
    out, rep = agg(cs, RobustConfig(rule=rule, msg_clip=clip))
    assert torch.isfinite(out).all()
    if rule == "mean":
        return
    x = torch.stack([c.to_dense() for c in cs])
    bound = max(float(x.norm(dim=1).max()), 1e-12)
    assert float(out.norm()) <= bound * (1 + 1e-5) + 1e-6  # a mean of convex combinations of 0 and the x_i
    if rule == "trimmed" and not clip:
        assert bool((out <= x.max(0).values + 1e-5).all() and (out >= x.min(0).values - 1e-5).all())


# -- scoring -------------------------------------------------------------------------------------

def report(senders, outliers=(), clipped=()):
    return robust.Report(count=len(senders), senders=list(senders), outliers=list(outliers), clipped=list(clipped))


def test_outliers_lose_score_and_are_banned_then_come_back_on_probation():
    sb = Scoreboard(ScoreConfig(ban_seconds=60))
    peers = ["a", "b", "c", "x"]
    assert sb.observe(report(peers, ["x"], ["x"]), 0.0) == []
    assert sb.observe(report(peers, ["x"]), 1.0) == []
    assert sb.observe(report(peers, ["x"]), 2.0) == ["x"]
    assert sb.banned("x", 2.0) and sb.banned_ids(30.0) == {"x"} and not sb.banned("a", 2.0)
    kept, dropped = sb.split([sparse("a", [], []), sparse("x", [], [])], 3.0)
    assert [c.sender for c in kept] == ["a"] and [c.sender for c in dropped] == ["x"]
    st_ = sb.status(3.0, clock_offset=1000.0)
    assert st_["x"]["outliers"] == 3 and st_["x"]["clipped"] == 1 and st_["x"]["bans"] == 1
    assert st_["x"]["banned_until"] == pytest.approx(1062.0) and st_["x"]["excluded"] == 1
    assert st_["a"]["score"] == 1.0 and st_["a"]["banned_until"] is None
    # the ban runs out; one more outlier round bans again
    assert not sb.banned("x", 62.5)
    sb.observe(report(peers), 63.0)
    assert sb.get("x").score == pytest.approx(0.51)
    assert sb.observe(report(peers, ["x"]), 64.0) == ["x"] and sb.get("x").bans == 2


def test_scores_recover_slowly_and_invalid_payloads_count():
    sb = Scoreboard()
    sb.observe(report(["a", "b", "c"], ["a"]), 0.0)
    s0 = sb.get("a").score
    for t in range(10):
        sb.observe(report(["a", "b", "c"]), 1.0 + t)
    assert sb.get("a").score == pytest.approx(min(1.0, s0 + 0.10))
    assert not sb.invalid("b", 20.0) and not sb.invalid("b", 20.0) and not sb.invalid("b", 20.0)
    assert sb.invalid("b", 20.0)  # 1.0 - 4 x 0.2 < 0.25
    assert sb.banned("b", 21.0) and sb.get("b").invalid == 4


def test_an_outlier_loses_more_score_the_further_out_it_is():
    sev = robust.severity
    assert sev(robust.OUTLIER_FACTOR) == robust.MIN_SEVERITY  # just over the bar: a tenth
    assert sev(4.6) == pytest.approx(0.1, abs=0.005)  # an honest spike measured at batch 4
    assert sev(8.0) == pytest.approx(0.5) and sev(16.0) == 1.0 and sev(100.0) == 1.0
    assert sev(float("inf")) == 1.0 and sev(float("nan")) == 1.0
    xs = [4.0 + 0.5 * i for i in range(40)]
    assert all(sev(a) <= sev(b) for a, b in zip(xs, xs[1:]))  # never cheaper further out


def spike_round(scale: float, rnd: int) -> list[Decoded]:
    """Four senders of equal norm (2.0), ``x`` at ``scale`` x theirs."""
    return [dense(s, [2.0 * (scale if s == "x" else 1.0), 0.0], rnd) for s in ("a", "b", "c", "x")]


def test_an_honest_spike_now_and_then_is_never_banned_an_attacker_still_is():
    # honest gradient norms are heavy-tailed (docs/design.md): one payload 4.6x its round's median
    # costs a tenth of the penalty, so even three in a row leave the sender far from a ban
    sb = Scoreboard()
    for rnd in range(3):
        _, rep = agg(spike_round(4.6, rnd), RobustConfig())
        assert rep.outliers == ["x"]
        assert sb.observe(rep, float(rnd)) == []
    assert sb.get("x").score == pytest.approx(1.0 - 3 * 0.3 * robust.severity(4.6) + 3 * 0.01) and sb.get("x").outliers == 3
    # a x100 attacker is banned at its third round, as with the flat penalty
    sb = Scoreboard()
    bans = [sb.observe(agg(spike_round(100.0, rnd), RobustConfig())[1], float(rnd)) for rnd in range(3)]
    assert bans == [[], [], ["x"]]
    # x8: half the penalty a round, banned at its sixth
    sb = Scoreboard()
    rounds = 0
    while not sb.banned("x", float(rounds)):
        sb.observe(agg(spike_round(8.0, rounds), RobustConfig())[1], float(rounds))
        rounds += 1
    assert rounds == 6
    # a sender with an on-time and a late payload in one round is scored by the larger of the two
    _, rep = agg(spike_round(1.0, 5) + [dense("x", [16.0, 0.0], 4)], RobustConfig())
    assert rep.outliers == ["x"] and robust.outlier_ratios(rep)["x"] == 8.0


def test_ban_seconds_zero_disables_banning():
    sb = Scoreboard(ScoreConfig(ban_seconds=0.0))
    for t in range(5):
        sb.observe(report(["a", "b", "x"], ["x"]), float(t))
        assert not sb.banned("x", float(t))


def test_config_and_flags():
    cfg, _ = parse_config(["--aggregation", "trimmed", "--trim", "0.1", "--msg-clip", "0", "--ban-seconds", "5"])
    assert (cfg.aggregation, cfg.trim, cfg.msg_clip, cfg.ban_seconds) == ("trimmed", 0.1, 0.0, 5.0)
    d, _ = parse_config([])
    assert (d.aggregation, d.msg_clip, d.ban_seconds) == ("centered-clip", 2.0, 60.0)
    for argv in (["--aggregation", "median"], ["--trim", "0.5"], ["--msg-clip", "0.5"], ["--ban-seconds", "-1"]):
        with pytest.raises(ConfigError):
            parse_config(argv)


# -- the route -----------------------------------------------------------------------------------

async def test_grads_route_refuses_a_banned_sender_with_403_and_counts_it():
    from .conftest import small_cfg
    from .test_routes import admit, member_key, payload, post
    from swarm.codec import HEADER
    from swarm.node import Peer

    p = Peer(small_cfg(), out=lambda line: None)
    await p.start()
    try:
        bad_key = member_key("bad")
        bad = admit(p, bad_key)
        for _ in range(3):
            p.robust.invalid(bad, time.monotonic())
        p.robust.invalid(bad, time.monotonic())
        assert p.robust.banned(bad, time.monotonic())
        enc = payload(p, bad)
        status, reply = await post(p, "/v1/grads", enc.blob, {HEADER: enc.mode}, key=bad_key)
        assert status == 403 and reply["code"] == "banned" and "banned" in reply["error"]
        assert p.rejected["banned"] == 1 and not p.book.has(0, bad)
        assert bad not in p.expected(0)
        st_ = p.status()["robust"]
        assert st_["refused_banned"] == 1 and st_["peers"][bad]["refused"] == 1
        assert st_["peers"][bad]["banned_until"] > time.time()
        # an invalid payload costs the live member that signed it score
        odd_key = member_key("odd")
        odd = admit(p, odd_key)
        status, _ = await post(p, "/v1/grads", payload(p, odd).blob[:-10], {HEADER: "topk-int8"}, key=odd_key)
        assert status == 400 and p.robust.get(odd).invalid == 1
    finally:
        await p.close()
