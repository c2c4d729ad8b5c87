"""Robust row pushes (swarm/tables/robust_rows.py): the combine rule, the service's flush, scores and
the 403 of a banned sender's push (docs/design.md, "Robust row pushes")."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from swarm.bodies import SENDER
from swarm.tables import TableSpec
from swarm.tables.formats import PushRequest, encode_push
from swarm.tables.http import TableClient, add_routes
from swarm.robust import MIN_SEVERITY
from swarm.tables.robust_rows import (FULL_DISAGREEMENT, Levels, Part, combine, lower_median, row_norms, sum_rows,
                                       verdict_severity)
from swarm.tables.service import RowVerdict, TableService
from swarm.tables.shard import RowOptConfig

DIM = 8


def honest_parts(n: int = 4, rows: int = 40, seed: int = 0) -> list[Part]:
    """``n`` senders, each pushing an overlapping random subset of rows with norms around 1: a row's
    gradients share a direction (the row's true gradient) plus each sender's noise, as honest ones do."""
    g = torch.Generator().manual_seed(seed)
    truth = torch.randn(100, DIM, generator=g) / DIM ** 0.5
    parts = []
    for i in range(n):
        ids = np.sort(np.random.default_rng(seed + i).choice(100, size=rows, replace=False)).astype(np.int64)
        grads = (truth[torch.from_numpy(ids)] + torch.randn(len(ids), DIM, generator=g) / DIM ** 0.5) / 2 ** 0.5
        parts.append(Part(f"p{i}", ids, grads))
    return parts


def test_a_x1000_push_is_clipped_to_c_times_the_reference_even_on_rows_nobody_else_pushed():
    parts = honest_parts()
    own = np.arange(200, 230, dtype=np.int64)  # rows only the attacker pushes
    bad_ids = np.concatenate([parts[0].ids[:10], own])
    bad = Part("evil", bad_ids, 1000 * torch.randn(len(bad_ids), DIM))
    c = combine(parts + [bad], 2.0, agree=False)  # the clip alone (its random rows may also disagree)
    assert c.outliers == ["evil"] and c.clipped["evil"] == len(bad_ids)
    only = np.isin(c.ids, own)
    assert float(row_norms(c.grads[torch.from_numpy(only)]).max()) <= 2.0 * c.reference * (1 + 1e-6)
    # the reference is an honest level: the attacker's level does not raise it
    assert c.reference <= max(lv for s, lv in c.levels.items() if s != "evil")
    # the same push, undefended: the sum as it came
    plain = combine(parts + [bad], 0.0)
    assert float(row_norms(plain.grads[torch.from_numpy(np.isin(plain.ids, own))]).min()) > 100


def test_honest_pushes_within_the_bar_are_the_plain_sum_bit_for_bit():
    parts = honest_parts()
    for p in parts:  # every row's norm 1: nobody is above 2 x any median
        p.grads.div_(torch.from_numpy(row_norms(p.grads)).float()[:, None])
    c = combine(parts, 2.0)
    ids, grads = sum_rows([(p.ids, p.grads) for p in parts])
    assert np.array_equal(c.ids, ids) and torch.equal(c.grads, grads)
    assert sum(c.clipped.values()) == 0 and c.outliers == []


def at_thread_counts(parts: list[Part]) -> list:
    """``combine`` of the same parts with 1, 2 and again 1 torch threads (C = 2, two remembered
    levels): what determinism across machines needs."""
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2, 1):
            torch.set_num_threads(n)
            runs.append(combine(parts, 2.0, [0.9, 1.1]))
    finally:
        torch.set_num_threads(threads)
    return runs


def test_clip_zero_is_the_plain_sum_and_the_rule_is_deterministic():
    parts = honest_parts() + [Part("evil", np.arange(5, dtype=np.int64), torch.full((5, DIM), 1e6))]
    off = combine(parts, 0.0)
    ids, grads = sum_rows([(p.ids, p.grads) for p in parts])
    assert np.array_equal(off.ids, ids) and torch.equal(off.grads, grads) and off.levels == {}
    runs = at_thread_counts(parts)
    assert all(torch.equal(r.grads, runs[0].grads) and r.reference == runs[0].reference for r in runs)


def test_a_flush_holding_only_the_attacker_is_measured_against_the_senders_remembered():
    levels = Levels()
    honest = combine(honest_parts(), 2.0)
    levels.remember("t", honest.levels, now=0)
    bad = Part("evil", np.arange(10, dtype=np.int64), 1000 * torch.ones(10, DIM))
    alone = combine([bad], 2.0, levels.others("t", 1, {"evil"}))
    assert alone.outliers == ["evil"] and alone.clipped["evil"] == 10
    assert float(row_norms(alone.grads).max()) <= 2.0 * max(honest.levels.values()) * (1 + 1e-6)
    assert levels.others("t", 40, set()) == []  # forgotten after KEPT_FLUSHES flushes


def test_one_hostile_sender_cannot_move_a_row_further_than_an_honest_one():
    """Through TableService.flush (delta mode: a row moves by exactly the combined gradient)."""
    spec = TableSpec("t", 256, DIM)

    def flush(row_clip: float, scale: float) -> torch.Tensor:
        svc = TableService("me", [spec], replicas=1, slots=4, opt=RowOptConfig(deltas=True), row_clip=row_clip)
        svc.set_members(["me"], 0.0)
        for p in honest_parts():
            svc.accept_push(PushRequest(svc.view, f"{p.sender}:1", {"t": p.ids}, {"t": p.grads}))
        ids = np.arange(200, 210, dtype=np.int64)  # rows only it pushes
        g = torch.ones(len(ids), DIM) / DIM ** 0.5 * scale
        svc.accept_push(PushRequest(svc.view, "evil:1", {"t": ids}, {"t": g}))
        before = svc.read_local("t", np.arange(256))
        svc.flush()
        if row_clip:
            verdicts = {v.sender: v for v in svc.verdicts}
            assert verdicts["evil"].outlier == (scale > 4) and not verdicts["p0"].outlier
        return row_norms(before - svc.read_local("t", np.arange(256)))

    honest_moves = flush(2.0, 1.0)
    hostile_moves = flush(2.0, 1000.0)
    assert hostile_moves[200:210].max() <= 2.0 * np.median(honest_moves[honest_moves > 0]) * 1.01
    assert flush(0.0, 1000.0)[200:210].min() > 900  # undefended: the push as it came


def unit_rows(parts: list[Part]) -> list[Part]:
    """The same parts with every row scaled to norm 1 (nothing is clipped: only rule 5 acts)."""
    return [Part(p.sender, p.ids, p.grads / torch.from_numpy(row_norms(p.grads)).float()[:, None]) for p in parts]


def flipped_among_honest(seed: int = 0) -> tuple[list[Part], Part]:
    """4 honest senders and one pushing an honest sender's rows sign-flipped (honest norms)."""
    *honest, other = unit_rows(honest_parts(5, seed=seed))
    return honest, Part("evil", other.ids, -other.grads)


def test_a_sign_flipped_sender_on_shared_rows_is_flagged_and_left_out_and_the_honest_ones_are_not():
    honest, evil = flipped_among_honest()
    c = combine(honest + [evil], 2.0)
    assert c.disagreeing == ["evil"] and c.outliers == ["evil"] and sum(c.clipped.values()) == 0
    assert c.agreement["evil"] < 0 < min(c.agreement[p.sender] for p in honest)
    assert c.shared["evil"] >= 8
    # its rows take no part in this flush: the sum of the honest pushes, bit for bit
    ids, grads = sum_rows([(p.ids, p.grads) for p in honest])
    assert np.array_equal(c.ids, ids) and torch.equal(c.grads, grads)
    # without the check (agree=False), or with the defence off (clip 0): it is summed as it came
    for off in (combine(honest + [evil], 2.0, agree=False), combine(honest + [evil], 0.0)):
        ids, grads = sum_rows([(p.ids, p.grads) for p in honest + [evil]])
        assert off.disagreeing == [] and np.array_equal(off.ids, ids) and torch.equal(off.grads, grads)
    # honest senders alone: nobody flagged, the plain sum
    alone = combine(honest, 2.0)
    assert alone.disagreeing == [] and torch.equal(alone.grads, sum_rows([(p.ids, p.grads) for p in honest])[1])


def test_agreement_is_not_judged_with_two_senders_or_too_few_shared_rows():
    honest, evil = flipped_among_honest()
    two = combine([honest[0], evil], 2.0)  # either could be the one pointing the wrong way
    assert two.disagreeing == [] and two.outliers == []
    few = Part("evil", evil.ids[:5], evil.grads[:5])  # under MIN_SHARED shared rows: not judged
    c = combine(honest + [few], 2.0)
    assert c.disagreeing == [] and "evil" not in c.agreement


def test_the_agreement_rule_is_deterministic():
    honest, evil = flipped_among_honest(seed=3)
    parts = [honest[0], evil, *honest[1:]]
    runs = at_thread_counts(parts)
    assert all(torch.equal(r.grads, runs[0].grads) and r.agreement == runs[0].agreement
               and r.disagreeing == runs[0].disagreeing == ["evil"] for r in runs)


def test_an_outlier_pays_by_how_far_out_its_level_is_and_a_disagreeing_one_in_full():
    """Row pushes are scored like dense payloads (robust.severity): honest levels spike now and
    then (bench/norm_tail.py), an attack worth banning is far out every flush."""
    peer = _Peer()
    alone = combine(honest_parts(), 2.0)
    assert set(alone.ratios) == set(alone.levels) and lower_median(np.asarray(list(alone.ratios.values()))) == 1.0
    assert combine(honest_parts()[:2], 2.0).ratios == {}  # two levels judge nothing
    just_over = [RowVerdict("spiky", 10, 0, True, ratio=4.4), RowVerdict("p1", 10, 0, False, ratio=1.0),
                 RowVerdict("p2", 10, 0, False, ratio=0.9)]
    for _ in range(3):  # three in a row just over the bar, which the flat cost banned for
        peer.table_client.observe(just_over)
    score = peer.table_client.status()["push_scores"]["spiky"]["score"]
    assert not peer.table_client.banned("spiky") and score > 0.8
    flipped = [RowVerdict("flip", 10, 0, True, agreement=-0.7, disagreed=True, ratio=1.1),
               RowVerdict("p1", 10, 0, False, ratio=1.0), RowVerdict("p2", 10, 0, False, ratio=0.9)]
    for step in range(3):  # its level is honest, its direction far from it: the whole cost each time
        peer.table_client.observe(flipped)
        assert peer.table_client.banned("flip") == (step == 2)
    # an honest sender's agreement reaches -0.24 at batch 4: one just past the bar pays a tenth
    barely = [RowVerdict("noisy", 10, 0, True, agreement=-0.26, disagreed=True, ratio=1.0),
              RowVerdict("p1", 10, 0, False, ratio=1.0), RowVerdict("p2", 10, 0, False, ratio=0.9)]
    for _ in range(3):
        peer.table_client.observe(barely)
    assert not peer.table_client.banned("noisy") and peer.table_client.status()["push_scores"]["noisy"]["score"] > 0.9
    peer.table_client.batcher.close()


def test_a_verdicts_severity_is_the_larger_of_its_level_and_its_disagreement():
    assert verdict_severity(100.0, None, False) == 1.0 and verdict_severity(8.0, None, False) == pytest.approx(0.5)
    assert verdict_severity(4.2, None, False) == MIN_SEVERITY
    assert verdict_severity(1.0, -0.26, True) == MIN_SEVERITY
    assert verdict_severity(1.0, -0.375, True) == pytest.approx(0.5)
    assert verdict_severity(1.0, FULL_DISAGREEMENT, True) == 1.0 and verdict_severity(1.0, -0.9, True) == 1.0
    assert verdict_severity(1.0, None, True) == 1.0  # disagreeing with no agreement to go by: all of it
    assert verdict_severity(8.0, -0.26, True) == pytest.approx(0.5)  # the larger
    assert verdict_severity(0.0, None, False) == 1.0  # an outlier with nothing to grade it by: all of it


def test_a_sender_flagged_in_repeated_flushes_is_banned():
    """Through TableService.flush and TableClient.observe (the 403 of a banned sender: below)."""
    peer = _Peer()
    svc = peer.tables
    for step in range(3):
        honest, evil = flipped_among_honest(seed=step)
        for p in honest + [evil]:
            svc.accept_push(PushRequest(svc.view, f"{p.sender}:{step}", {"t": p.ids}, {"t": p.grads}))
        svc.flush()
        v = {v.sender: v for v in svc.verdicts}
        assert v["evil"].disagreed and v["evil"].outlier and v["evil"].agreement < 0 < v["p0"].agreement
        assert not any(v[p.sender].disagreed or v[p.sender].outlier for p in honest)
        peer.table_client.observe(svc.verdicts)
        assert peer.table_client.banned("evil") == (step == 2)  # 1.0 -> 0.7 -> 0.4 -> 0.1 < 0.25
    assert peer.table_client.banned("evil") and not any(peer.table_client.banned(f"p{i}") for i in range(4))
    assert svc.stats.disagreeing_pushes == 3 and svc.stats.outlier_pushes == 3
    peer.table_client.batcher.close()


class _Peer:
    """What the table routes use of a Peer."""

    def __init__(self):
        self.tables = TableService("me", [TableSpec("t", 256, DIM)], replicas=1, slots=4)
        self.tables.set_members(["me"], 0.0)  # (pushes are fenced by view, not by membership)
        self.table_client = TableClient(self.tables, None, self.table_work, "me", lambda p: None, set,
                                        push_window=0.01, ban_seconds=60.0)

    async def table_work(self, fn, *args):
        return fn(*args)


async def test_a_sender_whose_row_pushes_are_outliers_is_banned_and_refused_with_403():
    from swarm.server import errors

    peer = _Peer()
    assert not peer.table_client.banned("evil")
    for _ in range(3):  # three outlier flushes at 100x the reference: 1.0 -> 0.7 -> 0.4 -> 0.1 < 0.25
        peer.table_client.observe([RowVerdict("evil", 10, 10, True, ratio=100.0),
                                   RowVerdict("p1", 10, 0, False, ratio=1.0),
                                   RowVerdict("me", 10, 0, True, ratio=100.0)])
    assert peer.table_client.banned("evil") and not peer.table_client.banned("p1")
    assert not peer.table_client.banned("me")  # our own pushes are never scored
    m = peer.tables.map
    mine = np.arange(4, dtype=np.int64)

    @web.middleware
    async def signed_by(request, handler):  # stands in for server.authenticate: who signed the request
        request[SENDER] = request.headers["X-Test-Sender"]
        return await handler(request)

    app = web.Application(middlewares=[errors, signed_by])
    add_routes(app, lambda request: peer)
    async with TestClient(TestServer(app)) as client:
        body = encode_push(PushRequest(m.view, "evil:3", {"t": mine}, {"t": torch.ones(len(mine), DIM)}))
        r = await client.post("/v1/rows/push", data=body, headers={"X-Test-Sender": "evil"})
        assert r.status == 403 and (await r.json())["code"] == "banned"
        # nor can it push in another's name: the key must name its signer
        body = encode_push(PushRequest(m.view, "p1:4", {"t": mine}, {"t": torch.ones(len(mine), DIM)}))
        r = await client.post("/v1/rows/push", data=body, headers={"X-Test-Sender": "evil"})
        assert r.status == 403 and (await r.json())["code"] == "sender"
        assert peer.tables.pending == {}
        # a refused push is no arrival (a slow peer reads the others' window ends from arrivals)
        assert peer.table_client.pushed_in(3, {"evil"}) is None and peer.table_client.pushed_in(4, {"p1"}) is None
        body = encode_push(PushRequest(m.view, "p1:3", {"t": mine}, {"t": torch.ones(len(mine), DIM)}))
        r = await client.post("/v1/rows/push", data=body, headers={"X-Test-Sender": "p1"})
        assert r.status == 200, await r.text()
        assert peer.table_client.pushed_in(3, {"p1"}) is not None
        assert peer.table_client.pushed_in(3, {"p1", "evil"}) is None
    st = peer.table_client.status()["push_scores"]
    assert st["evil"]["bans"] == 1 and st["evil"]["refused"] == 1 and st["p1"]["bans"] == 0
    peer.table_client.batcher.close()
