"""TableService, the sync core of a peer's tables: fencing, one writer, replays, hand-off choices."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from swarm.tables import TableSpec
from swarm.tables.service import FRESH, Diverged, Fenced, Moving, NotPrimary, TableService
from swarm.tables.wire import PullRequest, PushRequest

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
                    assert svcs[peer].apply_replay(rp) is True
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


def test_a_replica_that_missed_an_update_diverges_and_the_full_state_heals_it():
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
                with pytest.raises(Diverged):
                    svcs[peer].apply_replay(rp)
                primary = m.owners(rp.table, int(m.slot_of(rp.table, rp.ids[:1])[0]))[0]
                state = svcs[primary].full_state(rp.table, rp.ids)
                svcs[peer].apply_replica(rp.table, state, rp.view, rp.key)
                healed += 1
    assert healed > 0
    for slot in np.unique(m.slot_of("ngram", ids)).tolist():
        owners = m.owners("ngram", slot)
        assert len({svcs[o].shards["ngram"].checksum(slot) for o in owners}) == 1


def test_hand_off_keeps_the_newest_copy_and_slots_are_moving_until_installed():
    svcs = services(["p-a", "p-b"])
    ids = np.arange(256)
    for step in range(2):
        for fwd in push_to_primaries(svcs, ids, key=f"w:{step}"):
            for peer, replays in fwd.items():
                for rp in replays:
                    svcs[peer].apply_replay(rp)
    joiner = TableService("p-c", SPECS, replicas=2, slots=32)
    fetch = joiner.set_members(["p-a", "p-b", "p-c"], now=0.0)
    assert fetch and all(set(mv.sources) <= {"p-a", "p-b"} for mv in fetch)
    mv = fetch[0]
    lo, _ = joiner._slot_rows(mv.table, mv.slot)
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
    assert not joiner.shards[other.table].read(np.arange(*joiner._slot_rows(other.table, other.slot))).any()
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
