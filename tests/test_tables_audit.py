"""The replica audit core (swarm/tables/audit.py) and the TableService calls it is carried out
with: verdicts, lagging replicas, and a perturbed replica repaired from its primary. No sockets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from swarm.tables.audit import Digest, ReplicaAudit
from swarm.tables.service import FRESH, Fenced
from swarm.tables.shard import ShardError
from swarm.tables.formats import WireError

from .test_tables_service import push_to_primaries, services

V = "0123456789abcdef"
A, B = "a" * 32, "b" * 32


def test_equal_digests_pass_and_a_different_checksum_at_the_same_count_is_repaired():
    audit = ReplicaAudit()
    got = audit.judge(V, "t", [1, 2, 3], [Digest(5, A), Digest(5, A), Digest(0, A)],
                      [Digest(5, A), Digest(5, B), Digest(0, B)])
    assert got == [2, 3]
    assert (audit.compared, audit.repaired) == (3, 2)


def test_a_replica_ahead_of_its_primary_is_repaired():
    assert ReplicaAudit().judge(V, "t", [4], [Digest(9, A)], [Digest(8, A)]) == [4]


def test_a_lagging_replica_is_repaired_only_when_the_next_audit_finds_it_still_behind():
    audit = ReplicaAudit()
    # a replay may be in flight: not judged yet
    assert audit.judge(V, "t", [1, 2], [Digest(3, A), Digest(3, A)], [Digest(4, B), Digest(4, B)]) == []
    # slot 1 caught up; slot 2 did not, and its primary took no update since: no replay is coming
    assert audit.judge(V, "t", [1, 2], [Digest(4, B), Digest(3, A)], [Digest(4, B), Digest(4, B)]) == [2]
    # a primary that moved on meanwhile: still maybe in flight
    assert audit.judge(V, "t", [7], [Digest(3, A)], [Digest(4, B)]) == []
    assert audit.judge(V, "t", [7], [Digest(4, B)], [Digest(5, A)]) == []
    # a new view forgets what lagged under the old one
    assert audit.judge(V, "t", [9], [Digest(1, A)], [Digest(2, A)]) == []
    assert audit.judge("f" * 16, "t", [9], [Digest(1, A)], [Digest(2, A)]) == []


def test_slots_either_side_does_not_hold_are_not_compared():
    audit = ReplicaAudit()
    assert audit.judge(V, "t", [1, 2], [None, Digest(1, A)], [Digest(1, B), None]) == []
    assert audit.compared == 0
    with pytest.raises(ValueError):
        audit.judge(V, "t", [1, 2], [None], [None, None])


def replicate_all(svcs, forwards) -> None:
    for fwd in forwards:
        for peer, replays in fwd.items():
            assert svcs[peer].apply_replays(replays).applied


def audit_once(svcs, me: str, audit: ReplicaAudit) -> list[tuple[str, int]]:
    """What TableClient.audit does over HTTP, as direct calls: ours, then the primary's digests,
    the verdict, and the primary's copies installed."""
    s = svcs[me]
    done = []
    for primary, by_table in s.replica_slots().items():
        for table, slots in by_table.items():
            ours = s.digests(table, slots)
            theirs = svcs[primary].digests_under(s.view, table, slots)
            for slot in audit.judge(s.view, table, slots, ours, theirs):
                blob = svcs[primary].export_slot_or_fresh(table, slot)
                if s.repair(table, slot, blob, s.view):
                    done.append((table, slot))
    return done


def test_replica_slots_lists_exactly_the_slots_held_as_replica_by_their_primary():
    svcs = services()
    for pid, s in svcs.items():
        plan = s.replica_slots()
        for table in ("ngram", "value"):
            listed = sorted(slot for by_table in plan.values() for slot in by_table.get(table, []))
            assert listed == s.map.owned_slots(pid, table)[1].tolist()
            for primary, by_table in plan.items():
                assert all(s.map.owners(table, slot)[0] == primary for slot in by_table.get(table, []))
    assert services(replicas=1)["p-a"].replica_slots() == {}


def test_a_perturbed_replica_is_found_and_replaced_by_its_primarys_copy():
    svcs = services()
    m = svcs["p-a"].map
    ids = np.arange(0, 256, 2)
    for step in range(3):
        replicate_all(svcs, push_to_primaries(svcs, ids, key=f"x:{step}", g=0.1 * (step + 1)))
    audits = {pid: ReplicaAudit() for pid in svcs}
    assert all(audit_once(svcs, pid, audits[pid]) == [] for pid in svcs)  # all in step

    slot = 5
    primary, replica = m.owners("ngram", slot)
    lo, _ = m.slot_rows("ngram", slot)
    # the rows change, their update counters do not: the replay checks cannot see this
    state = svcs[replica].shards["ngram"].read_state(np.array([lo]))
    state["rows"] = state["rows"] + 1e-3
    svcs[replica].shards["ngram"].apply_replica_update(state)
    assert svcs[replica].shards["ngram"].checksum(slot) != svcs[primary].shards["ngram"].checksum(slot)

    assert audit_once(svcs, replica, audits[replica]) == [("ngram", slot)]
    assert svcs[replica].shards["ngram"].checksum(slot) == svcs[primary].shards["ngram"].checksum(slot)
    assert svcs[replica].stats.replicas_repaired == 1
    # and replays go on landing on the repaired copy
    replicate_all(svcs, push_to_primaries(svcs, np.array([lo]), key="x:9"))
    assert svcs[replica].shards["ngram"].checksum(slot) == svcs[primary].shards["ngram"].checksum(slot)
    assert audit_once(svcs, replica, audits[replica]) == []


def test_a_replica_that_missed_an_update_nobody_replays_is_repaired_at_the_second_audit():
    svcs = services()
    m = svcs["p-a"].map
    slot = 3
    primary, replica = m.owners("ngram", slot)
    lo, _ = m.slot_rows("ngram", slot)
    push_to_primaries(svcs, np.array([lo]), key="x:0")  # its replay is lost
    audit = ReplicaAudit()
    assert audit_once(svcs, replica, audit) == []  # maybe still in flight
    assert audit_once(svcs, replica, audit) == [("ngram", slot)]
    assert svcs[replica].shards["ngram"].digest(slot) == svcs[primary].shards["ngram"].digest(slot)


def test_a_copy_older_than_ours_is_not_installed():
    """The primary's copy was taken, then a replay reached us: installing the copy would drop that
    update. The repair declines; the next audit compares again."""
    svcs = services()
    m = svcs["p-a"].map
    slot = 4
    primary, replica = m.owners("ngram", slot)
    lo, _ = m.slot_rows("ngram", slot)
    blob = svcs[primary].export_slot_or_fresh("ngram", slot)  # FRESH: never updated yet
    old = svcs[primary].export_slot("ngram", slot)
    replicate_all(svcs, push_to_primaries(svcs, np.array([lo]), key="x:0"))
    after = svcs[replica].shards["ngram"].checksum(slot)
    assert svcs[replica].repair("ngram", slot, blob, m.view) is False
    assert svcs[replica].repair("ngram", slot, old, m.view) is False
    assert svcs[replica].shards["ngram"].checksum(slot) == after == svcs[primary].shards["ngram"].checksum(slot)
    newer = svcs[primary].export_slot("ngram", slot)
    assert svcs[replica].repair("ngram", slot, newer, m.view) is True  # as new as ours: installed


def test_digests_and_repairs_are_fenced_by_the_view_and_check_the_copy():
    svcs = services()
    m = svcs["p-a"].map
    slot = 2
    primary, replica = m.owners("ngram", slot)
    with pytest.raises(Fenced):
        svcs[primary].digests_under("f" * 16, "ngram", [slot])
    with pytest.raises(ShardError):
        svcs[primary].digests("nope", [slot])
    blob = svcs[primary].export_slot("ngram", slot)
    before = svcs[replica].shards["ngram"].checksum(slot)
    assert svcs[replica].repair("ngram", slot, blob, "f" * 16) is False  # judged under another map
    assert svcs[primary].repair("ngram", slot, blob, m.view) is False  # the primary repairs nothing
    other = next(s for s in svcs[primary].shards["ngram"].slots() if s != slot)
    with pytest.raises(ShardError):  # another slot's copy
        svcs[replica].repair("ngram", slot, svcs[primary].export_slot("ngram", other), m.view)
    with pytest.raises(WireError):
        svcs[replica].repair("ngram", slot, blob[:-7], m.view)
    assert svcs[replica].shards["ngram"].checksum(slot) == before
    assert svcs[replica].repair("ngram", slot, FRESH, m.view) is True
    assert svcs[replica].stats.replicas_repaired == 1


def test_digest_counts_updates_and_changes_with_any_byte():
    svcs = services()
    m = svcs["p-a"].map
    slot = 1
    primary = m.owners("ngram", slot)[0]
    lo, hi = m.slot_rows("ngram", slot)
    shard = svcs[primary].shards["ngram"]
    v0, c0 = shard.digest(slot)
    assert v0 == 0
    push_to_primaries(svcs, np.arange(lo, hi), key="x:1")
    v1, c1 = shard.digest(slot)
    assert v1 == hi - lo and c1 != c0
    state = shard.read_state(np.array([lo]))
    state["v"] = state["v"].clone()
    state["v"][0, 0] = torch.nextafter(state["v"][0, 0], torch.tensor(1.0))
    shard.apply_replica_update(state)
    assert shard.digest(slot) == (v1, shard.checksum(slot)) and shard.checksum(slot) != c1
