"""TableService, the sync core of a peer's tables: fencing, one writer, replays, hand-off choices."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

from swarm.tables import TableSpec
from swarm.tables.http import PushBatcher, RowStats, push_answer
from swarm.tables.service import FRESH, Fenced, Moving, NotPrimary, TableService
from swarm.tables.formats import (PullRequest, PushRequest, Replay, WireError, decode_replays, encode_replay_reply,
                                 stale_rows)

SPECS = [TableSpec("ngram", 256, 8), TableSpec("value", 256, 8)]
PEERS = ["p-a", "p-b", "p-c"]


def services(members=PEERS, replicas=2) -> dict[str, TableService]:
    out = {}
    for pid in members:
        s = TableService(pid, SPECS, replicas=replicas, slots=32)
        s.set_members([pid], now=0.0) if pid == members[0] else None
        out[pid] = s
    for pid, s in out.items():  # everybody starts from the same zero rows: no hand-off needed here
        s.set_members(members, now=0.0)
        for mv in list(s.moving.values()):
            s.moving.pop((mv.table, mv.slot))
            s.shards[mv.table].create_slot(mv.slot)
    return out


def push_to_primaries(svcs, ids: np.ndarray, key: str, g: float = 1.0):
    """Push the same gradient for `ids` of 'ngram' to their primaries; returns the replays to deliver."""
    m = next(iter(svcs.values())).map
    forwards = []
    for owner, sub in m.plan("ngram", ids).items():
        req = PushRequest(view=m.view, key=key, ids={"ngram": sub},
                          grads={"ngram": torch.full((len(sub), 8), g)})
        forwards.append(svcs[owner].apply_push(req))
    return forwards


def test_push_goes_to_the_primary_only_and_replays_make_replicas_identical():
    svcs = services()
    m = svcs["p-a"].map
    ids = np.arange(0, 256, 3)
    for step in range(3):
        for fwd in push_to_primaries(svcs, ids, key=f"x:{step}", g=0.1 * (step + 1)):
            for peer, replays in fwd.items():
                for rp in replays:
                    assert svcs[peer].apply_replays([rp]).applied is True
    for slot in range(m.n_slots("ngram")):
        owners = m.owners("ngram", slot)
        assert len({svcs[o].shards["ngram"].checksum(slot) for o in owners}) == 1
    # a push that reaches a replica is refused: one writer per slot
    slot = int(m.slot_of("ngram", np.array([0]))[0])
    replica = m.owners("ngram", slot)[1]
    with pytest.raises(NotPrimary):
        svcs[replica].apply_push(PushRequest(view=m.view, key="x:9", ids={"ngram": np.array([0])},
                                             grads={"ngram": torch.ones(1, 8)}))


def test_a_repeated_push_is_applied_once_and_another_view_is_fenced():
    svcs = services()
    m = svcs["p-a"].map
    ids = m.plan("ngram", np.arange(256))["p-b"][:5]
    req = PushRequest(view=m.view, key="y:1", ids={"ngram": ids}, grads={"ngram": torch.ones(len(ids), 8)})
    svcs["p-b"].apply_push(req)
    before = svcs["p-b"].shards["ngram"].steps(ids).clone()
    svcs["p-b"].apply_push(req)
    assert torch.equal(svcs["p-b"].shards["ngram"].steps(ids), before)
    with pytest.raises(Fenced):
        svcs["p-b"].apply_push(PushRequest(view="0" * 16, key="y:2", ids={"ngram": ids},
                                           grads={"ngram": torch.ones(len(ids), 8)}))
    with pytest.raises(Fenced):
        svcs["p-b"].serve_pull(PullRequest(view="0" * 16, dtype="fp32", ids={"ngram": ids}))


def test_a_replica_that_missed_an_update_names_the_stale_rows_and_their_full_state_heals_them():
    svcs = services()
    m = svcs["p-a"].map
    ids = np.arange(0, 256, 5)
    first = push_to_primaries(svcs, ids, key="z:1")
    second = push_to_primaries(svcs, ids, key="z:2")
    delivered_first = 0
    for fwd in first:  # the first round of replays is lost on the way
        delivered_first += sum(len(r) for r in fwd.values())
    assert delivered_first > 0
    healed = 0
    for fwd in second:
        for peer, replays in fwd.items():
            for rp in replays:
                before = svcs[peer].shards[rp.table].steps(rp.ids).clone()
                out = svcs[peer].apply_replays([rp])
                assert out.applied and set(out.stale) == {rp.table}
                assert out.stale[rp.table].tolist() == rp.ids.tolist()  # every row missed the first update
                assert torch.equal(svcs[peer].shards[rp.table].steps(rp.ids), before)  # none was stepped
                primary = m.owners(rp.table, int(m.slot_of(rp.table, rp.ids[:1])[0]))[0]
                state = svcs[primary].full_state(rp.table, out.stale[rp.table])
                svcs[peer].apply_replica(rp.table, state, rp.view, rp.key)
                healed += 1
    assert healed > 0
    for slot in np.unique(m.slot_of("ngram", ids)).tolist():
        owners = m.owners("ngram", slot)
        assert len({svcs[o].shards["ngram"].checksum(slot) for o in owners}) == 1


class WatchedService(TableService):
    """Checks, at every write of ``map`` or ``moving``, what a reader on another thread would see
    then: set_members runs on the table thread while the event loop reads the two without it."""

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name in ("map", "moving") and getattr(self, "map", None) is not None and hasattr(self, "moving"):
            for spec in SPECS:
                for slot in range(self.map.n_slots(spec.name)):
                    if self.self_id in self.map.owners(spec.name, slot):
                        assert self.shards[spec.name].has_slot(slot) or (spec.name, slot) in self.moving, \
                            f"{name} published with {spec.name}:{slot} owned, neither held nor awaited"


def test_a_new_map_is_published_only_with_the_slots_it_still_awaits():
    a = WatchedService("p-a", SPECS, replicas=2, slots=32)
    a.set_members(["p-a"], now=0.0)  # every slot fresh, created here
    fetch = a.set_members(["p-a", "p-b", "p-c"], now=0.0)  # keeps some, owns none anew
    for mv in fetch:
        a.import_best(mv, [FRESH])
    b = WatchedService("p-b", SPECS, replicas=2, slots=32)
    fetch = b.set_members(["p-a", "p-b", "p-c"], now=0.0)  # a joiner: every owned slot awaited
    assert fetch
    later = b.set_members(["p-b", "p-c"], now=1.0)  # p-a died: more slots to fetch, the old ones still awaited
    assert later and {(m.table, m.slot) for m in fetch} <= set(b.moving)


def test_hand_off_keeps_the_newest_copy_and_slots_are_moving_until_installed():
    svcs = services(["p-a", "p-b"])
    ids = np.arange(256)
    for step in range(2):
        for fwd in push_to_primaries(svcs, ids, key=f"w:{step}"):
            for peer, replays in fwd.items():
                for rp in replays:
                    svcs[peer].apply_replays([rp])
    joiner = TableService("p-c", SPECS, replicas=2, slots=32)
    fetch = joiner.set_members(["p-a", "p-b", "p-c"], now=0.0)
    assert fetch and all(set(mv.sources) <= {"p-a", "p-b"} for mv in fetch)
    mv = fetch[0]
    lo, _ = joiner.map.slot_rows(mv.table, mv.slot)
    with pytest.raises(Moving):
        joiner.read_local(mv.table, np.array([lo]))
    src = svcs[mv.sources[0]]
    current = src.export_slot(mv.table, mv.slot)
    stale = TableService("p-z", SPECS, replicas=2, slots=32)
    stale.set_members(["p-z"], now=0.0)  # zero rows: an older copy of the same slot
    assert joiner.import_best(mv, [stale.export_slot(mv.table, mv.slot), current]) is True
    assert joiner.shards[mv.table].checksum(mv.slot) == src.shards[mv.table].checksum(mv.slot)
    assert joiner.import_best(mv, [current]) is False  # no longer awaited
    # a slot nobody ever updated travels as a marker, not as rows; a real copy beats the marker
    other = fetch[1]
    assert stale.export_slot_or_fresh(other.table, other.slot) == FRESH
    assert src.export_slot_or_fresh(mv.table, mv.slot) != FRESH  # it has updates
    assert joiner.import_best(other, [FRESH]) is True
    assert not joiner.shards[other.table].read(np.arange(*joiner.map.slot_rows(other.table, other.slot))).any()
    third = fetch[2]
    real = svcs[third.sources[0]].export_slot(third.table, third.slot)
    assert joiner.import_best(third, [FRESH, real]) is True
    assert joiner.shards[third.table].checksum(third.slot) == svcs[third.sources[0]].shards[third.table].checksum(third.slot)


def test_slots_a_peer_no_longer_owns_are_released_after_the_grace_period():
    svcs = services(["p-a", "p-b"], replicas=1)
    a = svcs["p-a"]
    a.release(now=100.0)  # what the first maps left over
    held = sum(len(sh.slots()) for sh in a.shards.values())
    a.set_members(["p-a", "p-b", "p-c"], now=100.0)
    assert a.releasing and a.release(now=100.0 + a.release_after - 1) == 0
    dropped = a.release(now=100.0 + a.release_after + 1)
    assert dropped > 0 and sum(len(sh.slots()) for sh in a.shards.values()) == held - dropped


def test_peers_restarted_from_checkpoints_at_once_hand_each_other_their_copies():
    """Two peers start from checkpoints together: each is fetching the slots the other holds.
    Each offers the copy it holds, each keeps the newest, and nothing restarts from zeros."""
    a, b = (TableService(p, SPECS, replicas=2, slots=32) for p in ("p-a", "p-b"))
    a.set_members(["p-a"], now=0.0)
    for m in list(a.moving.values()):
        a.moving.pop((m.table, m.slot))
    ids = np.arange(0, 256, 5)
    a.apply_push(PushRequest(view=a.view, key="x:1", ids={"ngram": ids}, grads={"ngram": torch.ones(len(ids), 8)}))
    blob = {s: a.shards["ngram"].export_slot(s) for s in a.shards["ngram"].slots()}
    older = {s: {**t, "rows": torch.zeros_like(t["rows"]), "step": torch.zeros_like(t["step"])} for s, t in blob.items()}
    a2, b2 = (TableService(p, SPECS, replicas=2, slots=32) for p in ("p-a", "p-b"))
    values = {s: a.shards["value"].export_slot(s) for s in a.shards["value"].slots()}
    a2.install_checkpoint({"ngram": blob, "value": values})  # a's checkpoint is newer than b's
    b2.install_checkpoint({"ngram": older, "value": values})
    fa, fb = a2.set_members(["p-a", "p-b"], 0.0), b2.set_members(["p-a", "p-b"], 0.0)
    assert fa and fb  # each waits for the other
    for me, other, moves in ((a2, b2, fa), (b2, a2, fb)):
        for mv in moves:
            offers = [other.export_slot_or_fresh(mv.table, mv.slot)] if other.shards[mv.table].has_slot(mv.slot) else []
            if not me.import_best(mv, offers):
                me.give_up(mv)
    for s in blob:
        assert a2.shards["ngram"].checksum(s) == b2.shards["ngram"].checksum(s) == a.shards["ngram"].checksum(s)
    assert a2.stats.slots_lost == b2.stats.slots_lost == 0


def test_giving_up_on_a_slot_keeps_the_copy_held():
    (svc,) = (TableService("p-b", SPECS, replicas=2, slots=32),)
    held = TableService("p-a", SPECS, replicas=1, slots=32)
    held.set_members(["p-a"], 0.0)
    copy = held.shards["ngram"].export_slot(0)
    copy["rows"] += 1.0
    svc.install_checkpoint({"ngram": {0: copy}})
    moves = svc.set_members(["p-a", "p-b"], 0.0)
    mv = next(m for m in moves if (m.table, m.slot) == ("ngram", 0))
    svc.give_up(mv)  # nobody answered in time
    assert torch.equal(svc.shards["ngram"].read(np.array([0])), copy["rows"][:1])
    assert svc.stats.slots_kept == 1 and svc.stats.slots_lost == 0
    other = next(m for m in moves if (m.table, m.slot) == ("ngram", 1))
    svc.give_up(other)  # a slot we hold no copy of starts from zeros
    assert svc.stats.slots_lost == 1


def _push(m, owner_ids, key, g, table="ngram"):
    return PushRequest(view=m.view, key=key, ids={table: owner_ids}, grads={table: g})


def test_a_flush_applies_the_pushes_it_gathered_as_one_update_per_row():
    """Two peers' pushes of overlapping rows: one optimizer step per row on the summed gradient (as
    a shard that took that one step), one replay per replica, identical replicas."""
    svcs = services()
    m = svcs["p-a"].map
    ids = np.arange(0, 256, 2)
    prim, sub = next(iter(m.plan("ngram", ids).items()))
    a, b = sub[: len(sub) * 2 // 3], sub[len(sub) // 3:]  # the middle third is in both pushes
    ga, gb = torch.full((len(a), 8), 0.25), torch.full((len(b), 8), -0.5)
    svc = svcs[prim]
    ref = TableService(prim, SPECS, replicas=2, slots=32)  # the same rows, stepped once on the sum
    ref.set_members([prim], now=0.0)
    before = svc.shards["ngram"].steps(sub).clone()
    t1 = svc.accept_push(_push(m, a, "p-b:7", ga))
    t2 = svc.accept_push(_push(m, b, "p-c:7", gb))
    assert t1 is not None and t2 is not None and t1 != t2
    assert svc.accept_push(_push(m, a, "p-b:7", ga)) is None  # a repeat while queued
    assert torch.equal(svc.shards["ngram"].steps(sub), before)  # nothing applied before the flush
    forward, outcome = svc.flush("int8")
    assert outcome == {t1: None, t2: None}
    assert torch.equal(svc.shards["ngram"].steps(sub), before + 1)  # once per row, shared rows too
    both = np.intersect1d(a, b)
    summed = torch.zeros(len(sub), 8)
    summed[torch.from_numpy(np.searchsorted(sub, a))] += ga
    summed[torch.from_numpy(np.searchsorted(sub, b))] += gb
    ref.shards["ngram"].apply_grads(sub, summed)
    assert torch.equal(svc.shards["ngram"].read(sub), ref.shards["ngram"].read(sub))
    assert svc.stats.rows_combined == len(both) and svc.stats.flushes == 1
    n_replays = 0
    for peer, replays in forward.items():
        assert len(replays) == 1  # one replay per replica and table, whatever the number of pushes
        for rp in replays:
            assert svcs[peer].apply_replays([rp]).applied is True
            n_replays += 1
    assert n_replays >= 1
    for slot in np.unique(m.slot_of("ngram", sub)).tolist():
        assert len({svcs[o].shards["ngram"].checksum(slot) for o in m.owners("ngram", slot)}) == 1
    assert svc.accept_push(_push(m, b, "p-c:7", gb)) is None  # applied keys stay remembered
    assert svc.flush("int8") == ({}, {})


def test_a_push_whose_map_changed_before_the_flush_is_refused_and_not_remembered():
    svcs = services()
    m = svcs["p-a"].map
    prim, sub = next(iter(m.plan("ngram", np.arange(0, 256, 5)).items()))
    svc = svcs[prim]
    ticket = svc.accept_push(_push(m, sub, "p-b:1", torch.ones(len(sub), 8)))
    svc.set_members([*PEERS, "p-d"], now=1.0)  # a join: a new view, some slots move
    forward, outcome = svc.flush("int8")
    assert forward == {} and isinstance(outcome[ticket], Fenced)
    assert ("p-b:1", "ngram") not in svc.applied and svc.stats.pushes_applied == 0
    # the pusher retries under the new map: the key was never applied, so it is not a repeat
    new = svc.map
    svc.moving.clear()  # (as if the hand-offs were done)
    for owner, part in new.plan("ngram", sub).items():
        if owner == prim:
            svc.shards["ngram"].create_slots([s for s in np.unique(new.slot_of("ngram", part)).tolist()
                                              if not svc.shards["ngram"].has_slot(s)])
            assert svc.accept_push(_push(new, part, "p-b:1", torch.ones(len(part), 8))) is not None


def test_pushes_with_huge_gradients_are_refused_before_they_are_queued():
    from swarm.tables.shard import ShardError

    svcs = services()
    m = svcs["p-a"].map
    prim, sub = next(iter(m.plan("ngram", np.arange(0, 256, 7)).items()))
    with pytest.raises(ShardError):
        svcs[prim].accept_push(_push(m, sub, "p-b:1", torch.full((len(sub), 8), 1e30)))
    assert svcs[prim].pending == {}


class _BatcherClient:
    """What PushBatcher uses of a TableClient: the service, its push dtype, its table thread."""

    def __init__(self, service: TableService):
        self.service, self.push_dtype, self.stats = service, "int8", RowStats()

    @staticmethod
    async def work(fn, *args):
        return fn(*args)


def _one_primary():
    """The map, some ids of one primary's slots (one replica each) and that primary's service."""
    svcs = services(replicas=1)
    m = svcs["p-a"].map
    prim, sub = next(iter(m.plan("ngram", np.arange(0, 256, 3)).items()))
    return m, sub, svcs[prim]


async def test_the_batcher_answers_each_push_after_one_shared_flush():
    """PushBatcher: concurrent pushes within the window share a flush; each is answered with its
    own outcome (a refused one raises), and a replica sees the flushes in order."""
    m, sub, svc = _one_primary()
    batcher = PushBatcher(_BatcherClient(svc), window=0.05)
    pushes = [_push(m, sub, f"p-{i}:3", torch.full((len(sub), 8), 0.1 * (i + 1))) for i in range(3)]
    bad = _push(m, sub, "p-x:3", torch.ones(len(sub), 8))
    bad.view = "f" * 16
    results = await asyncio.gather(*(batcher.submit(p) for p in pushes), batcher.submit(bad), return_exceptions=True)
    assert results[:3] == [True, True, True] and isinstance(results[3], Fenced)
    assert svc.stats.flushes == 1 and svc.stats.pushes_applied == 3
    assert svc.shards["ngram"].steps(sub).tolist() == [1] * len(sub)
    assert await batcher.submit(pushes[0]) is True  # a repeat: acknowledged, not applied again
    assert svc.stats.flushes == 1
    batcher.close()


def test_a_flush_replays_every_table_to_a_replica_at_once_and_only_stale_rows_are_left():
    """A flush of pushes to both tables gives each replica one list of replays (one message on the
    wire); a replica that missed an update of some rows applies the rest of the message, names
    those rows, and is bit-identical to its primary once their full state arrives."""
    svcs = services()
    m = svcs["p-a"].map
    prim = m.owners("ngram", 0)[0]
    mine = {t: np.array([i for i in range(256) if m.owners(t, int(m.slot_of(t, np.array([i]))[0]))[0] == prim])
            for t in ("ngram", "value")}
    req = PushRequest(view=m.view, key="p-b:1", ids=mine, grads={t: torch.full((len(i), 8), 0.5) for t, i in mine.items()})
    svcs[prim].accept_push(req)
    forward, _ = svcs[prim].flush("int8")
    assert forward and all(len({rp.table for rp in rps}) == len(rps) for rps in forward.values())
    both = [p for p, rps in forward.items() if {rp.table for rp in rps} == {"ngram", "value"}]
    assert both, "with 3 peers and R=2 some replica holds slots of both tables"
    victim = both[0]
    rps = forward[victim]
    value = next(rp for rp in rps if rp.table == "value")
    assert len(value.ids) >= 2
    # one of the victim's value rows takes an update the primary never made: its counter now differs
    svcs[victim].shards["value"].apply_grads(value.ids[:1], torch.ones(1, 8))
    ngram = next(rp for rp in rps if rp.table == "ngram")
    before = svcs[victim].shards["ngram"].steps(ngram.ids).clone()
    out = svcs[victim].apply_replays(rps)
    assert out.applied and set(out.stale) == {"value"} and out.stale["value"].tolist() == value.ids[:1].tolist()
    assert torch.equal(svcs[victim].shards["ngram"].steps(ngram.ids), before + 1)  # the other table: stepped
    assert svcs[victim].shards["value"].steps(value.ids[1:]).tolist() == [1] * (len(value.ids) - 1)
    assert svcs[victim].stats.replays_diverged == 1 and svcs[victim].stats.rows_stale == 1
    assert svcs[victim].apply_replays(rps).applied is False  # a repeat changes nothing
    svcs[victim].apply_replica("value", svcs[prim].full_state("value", out.stale["value"]), m.view, "p-b:1")
    for peer, msgs in forward.items():
        if peer != victim:
            assert svcs[peer].apply_replays(msgs).applied is True
            assert svcs[peer].apply_replays(msgs).applied is False  # a repeat
    for t in ("ngram", "value"):
        for slot in np.unique(m.slot_of(t, mine[t])).tolist():
            assert len({svcs[o].shards[t].checksum(slot) for o in m.owners(t, slot)}) == 1


def test_a_replay_reply_names_only_rows_the_replay_carried():
    """The primary heals what a replica's reply names: only tables and rows of its own replay."""
    rp = Replay("ngram", "0" * 16, "k:1", np.array([2, 5, 9]), torch.zeros(3, 8), torch.zeros(3, dtype=torch.int64))
    ok = json.dumps(encode_replay_reply(True, {"ngram": np.array([5, 9])})).encode()
    assert {t: v.tolist() for t, v in stale_rows(ok, [rp]).items()} == {"ngram": [5, 9]}
    assert stale_rows(json.dumps(encode_replay_reply(False, {})).encode(), [rp]) == {}
    for bad in (b"not json", b"[]", b'{"stale": {}}', b'{"applied": true, "stale": {"value": [2]}}',
                b'{"applied": true, "stale": {"ngram": [3]}}', b'{"applied": true, "stale": {"ngram": [5, 5]}}',
                b'{"applied": true, "stale": {"ngram": ["5"]}}', b'{"applied": true, "stale": {"ngram": 5}}'):
        with pytest.raises(WireError):
            stale_rows(bad, [rp])


async def test_the_batcher_flushes_once_a_push_from_every_window_pusher_is_queued():
    """PushBatcher with ``complete`` (local steps: one window's pushers): the flush goes once a push
    from each sender it names is queued, without waiting out the push window (a minute here: a
    flush that waited for it would time the test out); until then the pushes wait."""
    m, sub, svc = _one_primary()
    batcher = PushBatcher(_BatcherClient(svc), window=60.0, complete=lambda: {"p-0", "p-1"})
    first = asyncio.ensure_future(batcher.submit(_push(m, sub, "p-0:2", torch.full((len(sub), 8), 0.1))))
    await asyncio.sleep(0.2)
    assert not first.done() and svc.stats.flushes == 0  # p-1's push is not in yet
    second = batcher.submit(_push(m, sub, "p-1:2", torch.full((len(sub), 8), 0.2)))
    assert await asyncio.wait_for(asyncio.gather(first, second), 10) == [True, True]
    assert svc.stats.flushes == 1 and svc.stats.pushes_applied == 2
    batcher.close()


async def test_a_windows_pushes_spread_over_more_than_the_push_window_make_one_flush():
    """With local steps a window's pushes come over more than a --push-window (each peer's
    --push-lead, windows ending apart): the primary waits ``whole_wait`` for every window pusher,
    so pushes 0.3 s apart with a 0.05 s push window still make one flush (one update per row, one
    replay, one robust combine). One that never comes holds the flush ``whole_wait`` at most, and
    that flush is counted partial."""
    m, sub, svc = _one_primary()
    batcher = PushBatcher(_BatcherClient(svc), window=0.05, complete=lambda: {"p-0", "p-1"}, whole_wait=30.0)
    first = asyncio.ensure_future(batcher.submit_timed(_push(m, sub, "p-0:2", torch.full((len(sub), 8), 0.1))))
    await asyncio.sleep(0.3)
    assert not first.done() and svc.stats.flushes == 0  # six push windows on, p-1's push is awaited still
    second = batcher.submit_timed(_push(m, sub, "p-1:2", torch.full((len(sub), 8), 0.2)))
    (ok1, held1), (ok2, held2) = await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert [ok1, ok2] == [True, True]
    assert svc.stats.flushes == 1 and svc.shards["ngram"].steps(sub).tolist() == [1] * len(sub)
    assert batcher.client.stats.flushes_partial == 0
    # each push says how long it was held for the other's (its answer's held_s): the first ~0.3 s
    assert 0.25 <= held1 < 5 and held2 < 0.2
    assert batcher.held_for(1) == 0.0 and batcher.held_for(None) == 0.0  # read once; a repeat: none
    # when each pusher's push of the window came in: the last of them, p-1's, ~0.3 s after p-0's
    one, both = batcher.arrivals.all_in(2, {"p-0"}), batcher.arrivals.all_in(2, {"p-0", "p-1"})
    assert one is not None and both is not None and 0.25 <= both - one < 5
    batcher.close()

    m, sub, svc = _one_primary()
    batcher = PushBatcher(_BatcherClient(svc), window=0.05, complete=lambda: {"p-0", "p-1"}, whole_wait=0.3)
    t0 = asyncio.get_running_loop().time()
    assert await asyncio.wait_for(batcher.submit(_push(m, sub, "p-0:2", torch.full((len(sub), 8), 0.1))), 10)
    assert asyncio.get_running_loop().time() - t0 >= 0.25  # p-1 never pushed: the wait ran out, then the flush
    assert svc.stats.flushes == 1 and batcher.client.stats.flushes_partial == 1
    batcher.close()


def test_push_arrivals_say_when_the_last_of_a_steps_pushers_came_in():
    """PushArrivals: the first arrival per sender and step counts (a repeat does not move it);
    a step is in once every sender named has pushed; keys without a step are ignored, and only the
    last ``keep`` steps are kept."""
    from swarm.tables.arrivals import PushArrivals
    a = PushArrivals(keep=3)
    a.note("p-0:5", 1.0)
    assert a.all_in(5, {"p-0"}) == 1.0 and a.all_in(5, {"p-0", "p-1"}) is None and a.all_in(5, set()) is None
    a.note("p-1:5", 2.5)
    a.note("p-0:5", 9.0)  # a repeat: still 1.0
    assert a.all_in(5, {"p-0", "p-1"}) == 2.5 and a.all_in(5, {"p-0"}) == 1.0
    for bad in ("p-0", "p-0:", ":5", "p-0:x", "p-0:-1", "p-0:5.0"):
        a.note(bad, 3.0)
    assert a.all_in(5, {"p-0", "p-1"}) == 2.5 and a.all_in(4, {"p-0"}) is None
    assert a.all_in(5, {"p-0:5"}) is None
    for step in (6, 7, 8):
        a.note(f"p-0:{step}", float(step))
    assert a.all_in(5, {"p-0"}) is None and a.all_in(8, {"p-0"}) == 8.0  # step 5 fell out
    a.note("p-0:2", 1.0)  # older than every step kept: not kept
    assert a.all_in(2, {"p-0"}) is None and a.all_in(6, {"p-0"}) == 6.0
    a.note("p/retry:7", 7.5)  # a sender part with a slash is a name like any other
    assert a.all_in(7, {"p/retry"}) == 7.5 and a.all_in(7, {"p-0"}) == 7.0


def test_a_push_answer_says_how_long_it_was_held_and_a_bad_one_counts_as_none():
    assert push_answer(b'{"applied": true, "replicated": false, "held_s": 1.25}') == (1.25, None)
    assert push_answer(b'{"applied": true, "held_s": 0.5, "replay": "pa.1/flush:2"}') == (0.5, "pa.1/flush:2")
    for bad in (b"not json", b"[]", b'{"applied": true}', b'{"held_s": "1"}', b'{"held_s": -1}',
                b'{"held_s": 1e300}', b'{"held_s": NaN}', b'{"held_s": true}'):
        assert push_answer(bad)[0] == 0.0


def test_a_primary_waits_for_a_windows_pushes_an_eighth_of_the_round_timeout_unless_told(capsys):
    """--window-push-wait: auto (the default) is --round-timeout / 8, 0 the push window; a number
    must stay under the quarter of --round-timeout a pusher holds its payload for the answers, or
    the CLI says so in one line."""
    from swarm.cli import parse_config
    from swarm.config import ConfigError, PeerConfig
    assert PeerConfig().window_push_wait == -1.0 and PeerConfig().window_push_wait_s() == 2.5
    assert PeerConfig(round_timeout=8.0).window_push_wait_s() == 1.0
    assert PeerConfig(window_push_wait=0.0).window_push_wait_s() is None
    assert PeerConfig(window_push_wait=1.5).window_push_wait_s() == 1.5
    PeerConfig(window_push_wait=4.9).validate()
    PeerConfig(round_timeout=1.0).validate()  # auto follows the timeout down
    for bad in (-0.5, -2.0, 5.0, 9.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="--window-push-wait"):
            PeerConfig(window_push_wait=bad).validate()
    assert parse_config(["--window-push-wait", "auto"])[0].window_push_wait == -1.0
    assert parse_config(["--window-push-wait", "0.5"])[0].window_push_wait_s() == 0.5
    from swarm.config import from_env
    assert from_env({"SWARM_WINDOW_PUSH_WAIT": "AUTO"}) == {"window_push_wait": -1.0}
    with pytest.raises(ConfigError, match="SWARM_WINDOW_PUSH_WAIT"):
        from_env({"SWARM_WINDOW_PUSH_WAIT": "soon"})
    with pytest.raises(SystemExit):
        parse_config(["--window-push-wait", "soon"])
    err = capsys.readouterr().err
    assert "--window-push-wait" in err and "auto or a number of seconds" in err and "Traceback" not in err


class _ShutDown(_BatcherClient):
    """A TableClient stand-in whose table thread shuts down with the flush queued on it (the pool's
    shutdown cancels queued work): the awaiting flush sees CancelledError, not an Exception."""

    async def work(self, fn, *args):
        if getattr(fn, "__name__", "") == "_flush":
            raise asyncio.CancelledError
        return fn(*args)


async def test_a_push_whose_flush_a_shutdown_cancelled_is_refused_not_left_waiting():
    """A peer closing while a push waits for its flush: the flush queued on the table thread is
    cancelled by the shutdown, and a push queued after close() has no flush coming. Both are
    answered at once (Moving: "shutting down"), so the pusher's step loop ends instead of waiting
    forever (it did: a peer closed mid-run whose run() never returned)."""
    m, sub, svc = _one_primary()
    batcher = PushBatcher(_ShutDown(svc), window=0.01)
    with pytest.raises(Moving):
        await asyncio.wait_for(batcher.submit(_push(m, sub, "p-0:1", torch.full((len(sub), 8), 0.1))), 10)
    assert svc.stats.flushes == 0
    batcher = PushBatcher(_BatcherClient(svc), window=0.01)
    batcher.close()
    with pytest.raises(Moving):
        await asyncio.wait_for(batcher.submit(_push(m, sub, "p-0:2", torch.full((len(sub), 8), 0.1))), 10)
    assert svc.stats.flushes == 0
    # a push whose flush was applied before its waiter came is answered as applied, closed or not
    m, sub, svc = _one_primary()
    batcher = PushBatcher(_BatcherClient(svc), window=0.01)
    first = asyncio.ensure_future(batcher.submit(_push(m, sub, "p-0:3", torch.full((len(sub), 8), 0.1))))
    await asyncio.sleep(0)
    ticket = svc.accept_push(_push(m, sub, "p-1:3", torch.full((len(sub), 8), 0.2)))  # no waiter yet
    assert await asyncio.wait_for(first, 10) is True and svc.stats.flushes == 1 and svc.stats.pushes_applied == 2
    batcher.close()
    assert await batcher.wait(ticket) is True


class _HeldReplays(_BatcherClient):
    """A TableClient stand-in whose replays reach the replicas' services only once ``release`` is
    set (a slow link to them): what the batcher answers, and when, with a replay in flight."""

    def __init__(self, service: TableService, replicas: dict[str, TableService]):
        super().__init__(service)
        self.replicas, self.release, self.replayed = replicas, asyncio.Event(), []
        self.transport, self.stats = self, RowStats()

    @staticmethod
    def addr_of(peer: str) -> str:
        return "http://" + peer

    def owe(self, peer, table, ids):
        raise AssertionError(f"a replay to {peer} did not land")

    async def request(self, method, url, *, to, body, **kw):
        await self.release.wait()
        out = self.replicas[to].apply_replays(decode_replays(body, self.service.by_name, 1 << 20))
        self.replayed.append(to)
        return json.dumps(encode_replay_reply(out.applied, out.stale)).encode()


@pytest.mark.parametrize("ack_when_applied", [False, True])
async def test_a_push_is_answered_when_applied_or_replicated_and_replicas_keep_the_flush_order(ack_when_applied):
    """--push-ack: answered when applied, a push returns while its replay is still on its way; when
    replicated, not before the replay landed. Either way the next flush is applied only after the
    last one's replays landed, so the replica replays them in order and ends bit-identical."""
    svcs = services()
    m = svcs["p-a"].map
    prim, sub = next(iter(m.plan("ngram", np.arange(0, 256, 3)).items()))
    client = _HeldReplays(svcs[prim], svcs)
    batcher = PushBatcher(client, window=0.01, ack_when_applied=ack_when_applied)
    first = asyncio.ensure_future(batcher.submit(_push(m, sub, "p-0:1", torch.full((len(sub), 8), 0.1))))
    await asyncio.sleep(0.3)
    assert svcs[prim].stats.flushes == 1 and client.replayed == []  # applied here, the replay held up
    assert first.done() is ack_when_applied
    if ack_when_applied:
        assert first.result() is False  # answered before any replica took it
    second = asyncio.ensure_future(batcher.submit(_push(m, sub, "p-0:2", torch.full((len(sub), 8), -0.3))))
    await asyncio.sleep(0.3)
    assert svcs[prim].stats.flushes == 1 and not second.done()  # the next flush waits for the replay
    client.release.set()
    assert await asyncio.wait_for(second, 10) is (not ack_when_applied)
    assert await first is (not ack_when_applied)
    await batcher.settled()
    assert svcs[prim].stats.flushes == 2 and client.replayed and all(
        svcs[r].stats.replays_applied == 2 and svcs[r].stats.replays_diverged == 0 for r in set(client.replayed))
    for slot in np.unique(m.slot_of("ngram", sub)).tolist():
        assert len({svcs[o].shards["ngram"].checksum(slot) for o in m.owners("ngram", slot)}) == 1
    batcher.close()


def test_a_catch_up_never_rolls_back_a_row_a_newer_replay_reached():
    """A catch-up (rows whose replay did not land) may arrive after a later replay reached some of
    them: those rows keep the newer update; a heal overwrites whatever it finds."""
    svcs = services()
    m = svcs["p-a"].map
    ids = np.arange(0, 256, 7)
    prim, sub = next((o, s) for o, s in m.plan("ngram", ids).items() if len(s) >= 4)
    lost = svcs[prim].apply_push(PushRequest(view=m.view, key="c:1", ids={"ngram": sub},
                                             grads={"ngram": torch.full((len(sub), 8), 0.5)}))
    replica, (rp,) = max(lost.items(), key=lambda kv: len(kv[1][0].ids))  # its replay never reaches it
    assert len(rp.ids) >= 3
    snapshot = svcs[prim].full_state("ngram", rp.ids)  # what a catch-up read after the lost replay
    # the next flush touches the first two rows; its replay finds them stale and the heal brings
    # them up to date, after the catch-up was read but before it lands
    svcs[prim].apply_push(PushRequest(view=m.view, key="c:2", ids={"ngram": rp.ids[:2]},
                                      grads={"ngram": torch.full((2, 8), 0.25)}))
    svcs[replica].apply_replica("ngram", svcs[prim].full_state("ngram", rp.ids[:2]), m.view, "c:2")
    assert svcs[replica].apply_replica("ngram", snapshot, m.view, "c:1", "catch-up") is True
    assert svcs[replica].stats.replica_rows_newer == 2
    rep, pri = svcs[replica].shards["ngram"], svcs[prim].shards["ngram"]
    assert torch.equal(rep.read_state(rp.ids)["rows"], pri.read_state(rp.ids)["rows"])  # none rolled back
    assert rep.steps(rp.ids).tolist() == pri.steps(rp.ids).tolist() == [2, 2] + [1] * (len(rp.ids) - 2)
    # a catch-up of rows all newer here changes nothing; a heal of them overwrites (the primary's word)
    before = rep.read_state(rp.ids[:2])
    svcs[replica].apply_replica("ngram", {k: v[:2] for k, v in snapshot.items()}, m.view, "c:1", "catch-up")
    assert all(torch.equal(v, rep.read_state(rp.ids[:2])[k]) for k, v in before.items())
    svcs[replica].apply_replica("ngram", {k: v[:2] for k, v in snapshot.items()}, m.view, "c:1", "heal")
    assert rep.steps(rp.ids[:2]).tolist() == [1, 1]
    # rows with as many updates as the catch-up carries keep theirs, even another update (the
    # audit's to judge: a catch-up never overwrites one update with another)
    svcs[replica].shards["ngram"].apply_grads(rp.ids[2:3], torch.full((1, 8), 0.5))  # a step 2 of its own
    mine = rep.read_state(rp.ids[2:3])
    stale = svcs[prim].full_state("ngram", rp.ids[2:3])
    svcs[prim].apply_push(PushRequest(view=m.view, key="c:3", ids={"ngram": rp.ids[2:3]},
                                      grads={"ngram": torch.full((1, 8), -0.5)}))
    other = svcs[prim].full_state("ngram", rp.ids[2:3])  # the primary's step 2: another update
    assert int(other["step"][0]) == int(mine["step"][0]) == 2 and int(stale["step"][0]) == 1
    svcs[replica].apply_replica("ngram", other, m.view, "c:3", "catch-up")
    assert all(torch.equal(v, rep.read_state(rp.ids[2:3])[k]) for k, v in mine.items())


def test_replays_due_wait_for_the_named_replay_and_let_one_that_overtook_its_answer_pass():
    """ReplaysDue: one key per primary, the newest; a replay that landed before the answer naming
    it came is not waited for; a key that does not name its primary (or is not a short string) is
    ignored; a wait given up on is counted and not repeated."""
    from swarm.tables.replays_due import MAX_KEY, ReplaysDue
    r = ReplaysDue(keep_landed=2)
    r.expect("pa", "pa.1234/flush:3")
    r.expect("pb", "pb.99/flush:0")
    assert r.due({"pa", "pb", "pc"}) == {"pa", "pb"}
    r.expect("pa", "pa.1234/flush:4")  # a later flush's replay implies the earlier ones' (in order)
    r.expect("pa", "pa.1234/flush:2")  # an answer that came late: flush 4's replay is still the one waited for
    r.landed("pa.1234/flush:3")
    assert r.due({"pa"}) == {"pa"}
    r.landed("pa.1234/flush:4")
    assert r.due({"pa", "pb"}) == {"pb"}
    r.landed("pc.5/flush:7")  # overtook its answer
    r.expect("pc", "pc.5/flush:7")
    assert r.due({"pc"}) == set()
    for bad in ("pb.99/flush:1".replace("pb", "px"), "", "pa" + "x" * MAX_KEY, 7, None, ["pa.1/flush:1"], "pa"):
        r.expect("pa", bad)
    assert r.due({"pa"}) == set()
    r.give_up({"pb", "pa"})
    assert r.due({"pb"}) == set() and r.given_up == 1
    for i in range(3):  # only the last ``keep_landed`` landed keys are kept
        r.landed(f"pd.1/flush:{i}")
    r.expect("pd", "pd.1/flush:0")
    assert r.due({"pd"}) == {"pd"}
    r.expect("pf", "pf.1/flush:3")
    r.landed("pf.1/flush:4")  # a later flush's replay landed: flush 3's landed or failed before it
    assert r.due({"pf"}) == set() and len(r) == 1  # pd's is still due
    r.expect("pe", "pe.1/flush:5")
    r.expect("pe", "pe.2/flush:0")  # the primary restarted (a new nonce): its new run's flush is the one
    r.landed("pe.2/flush:0")
    assert r.due({"pe"}) == set()


async def test_a_push_answered_when_applied_names_its_flush_replay_to_a_replica_pusher_only():
    """PushBatcher.replay_for: with --push-ack applied the answer goes before the replays, so it
    names the flush's replay key to a pusher that is one of its replicas (its pulls wait for it);
    not to a pusher that gets no replay of it, and never when the answer waits for the replicas."""
    svcs = services()
    m = svcs["p-a"].map
    prim, replica = m.owners("ngram", 0)  # one slot's rows: one replica gets the flush's replay
    other = next(p for p in svcs if p not in (prim, replica))
    sub = np.arange(*m.slot_rows("ngram", 0))

    class Client(_BatcherClient):
        owed: list = []

        def addr_of(self, peer):
            return None  # replays cannot be delivered here: owed instead

        def owe(self, *a):
            self.owed.append(a)

    for applied in (True, False):
        svc = TableService(prim, SPECS, replicas=2, slots=32)
        svc.set_members(list(svcs), now=0.0)
        for mv in list(svc.moving.values()):
            svc.moving.pop((mv.table, mv.slot))
            svc.shards[mv.table].create_slot(mv.slot)
        batcher = PushBatcher(Client(svc), window=0.05, ack_when_applied=applied)
        ticket = svc.accept_push(_push(m, sub, f"{replica}:1", torch.full((len(sub), 8), 0.1)))
        await batcher.wait(ticket)
        key = batcher.replay_for(ticket, replica)
        if applied:
            assert key == f"{prim}.{svc.nonce}/flush:0"
            assert batcher.replay_for(ticket, replica) is None  # read once
        else:
            assert key is None
        ticket = svc.accept_push(_push(m, sub, f"{other}:1", torch.full((len(sub), 8), 0.1)))
        await batcher.wait(ticket)
        assert batcher.replay_for(ticket, other) is None
        batcher.close()
