"""Ownership map: slots, rendezvous owners, routing plans, moves on membership change."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from swarm.tables.ownership import Move, OwnershipMap, TableSpec, host_of, moves, scores, view_id

TABLES = [TableSpec("ngram", 65536, 128), TableSpec("value", 65536, 128)]
M64 = (1 << 64) - 1


def members(n: int, prefix: str = "peer") -> list[str]:
    return [f"{prefix}-{i:02d}" for i in range(n)]


def _mix64_ref(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _score_ref(table: str, slot: int, peer: str) -> int:
    """Pure-Python reference of the documented score (docs/tables.md)."""
    tk = int.from_bytes(hashlib.sha256(b"swarm-table\0" + table.encode()).digest()[:8], "big")
    sk = _mix64_ref(_mix64_ref(tk) ^ (((slot + 1) * 0x9E3779B97F4A7C15) & M64))
    ph = int.from_bytes(hashlib.sha256(peer.encode()).digest()[:8], "big")
    return _mix64_ref(sk ^ ph)


def test_scores_are_bit_exact_to_the_spec():
    mem = ["alice", "bob", "carol:9000"]
    got = scores("ngram", np.array([0, 1, 4095, 70000]), mem)
    for i, s in enumerate([0, 1, 4095, 70000]):
        for j, p in enumerate(mem):
            assert int(got[i, j]) == _score_ref("ngram", s, p)


def test_slot_layout_covers_all_rows_contiguously():
    for rows, slots in [(65536, 4096), (1000, 64), (5, 4096), (4097, 4096), (1, 3)]:
        om = OwnershipMap([TableSpec("t", rows, 4)], ["a"], slots=slots)
        n = om.n_slots("t")
        assert n == min(slots, rows)
        prev = 0
        for s in range(n):
            lo, hi = om.slot_rows("t", s)
            assert lo == prev and hi > lo
            prev = hi
        assert prev == rows
        ids = np.arange(rows)
        sl = om.slot_of("t", ids)
        b = om.bounds("t")
        assert np.all((b[sl] <= ids) & (ids < b[sl + 1]))
    with pytest.raises(ValueError):
        om.slot_rows("t", n)
    with pytest.raises(ValueError):
        om.slot_of("t", np.array([rows]))


@pytest.mark.parametrize("n,r", [(1, 2), (2, 2), (3, 2), (5, 3), (8, 1), (4, 10)])
def test_every_slot_has_min_r_n_distinct_owners(n, r):
    om = OwnershipMap(TABLES, members(n), replicas=r, slots=1024)
    assert om.replicas == min(r, n)
    for t in ("ngram", "value"):
        mat = om.owner_matrix(t)
        assert mat.shape == (1024, min(r, n))
        assert all(len(set(row)) == min(r, n) for row in mat.tolist())
        assert om.owners(t, 7) == tuple(om.members[i] for i in mat[7])
        prim, rep = zip(*(om.owned_slots(p, t) for p in om.members))
        assert sum(len(x) for x in prim) == 1024
        assert sum(len(x) for x in rep) == 1024 * (min(r, n) - 1)


def test_primary_is_highest_score():
    om = OwnershipMap(TABLES, members(5), replicas=3, slots=256)
    sc = scores("value", np.arange(256), om.members)
    for s in (0, 17, 255):
        best = sorted(range(5), key=lambda j: (-int(sc[s, j]), om.members[j]))[:3]
        assert om.owners("value", s) == tuple(om.members[j] for j in best)


def test_identical_maps_whatever_the_member_order():
    mem = members(7)
    a = OwnershipMap(TABLES, mem)
    b = OwnershipMap(TABLES, list(reversed(mem)) + [mem[0]])
    assert a.view == b.view == view_id(reversed(mem)) and len(a.view) == 16
    assert a.members == b.members == tuple(sorted(mem))
    for t in ("ngram", "value"):
        assert np.array_equal(a.owner_matrix(t), b.owner_matrix(t))
    assert a.ranges() == b.ranges()
    assert view_id(mem) != view_id(mem[:-1])
    # tables get different assignments
    assert not np.array_equal(a.owner_matrix("ngram"), a.owner_matrix("value"))


def test_empty_members_and_bad_args():
    with pytest.raises(ValueError):
        OwnershipMap(TABLES, [])
    with pytest.raises(ValueError):
        OwnershipMap(TABLES, ["a"], replicas=0)
    with pytest.raises(ValueError):
        OwnershipMap(TABLES, ["a"], slots=0)
    with pytest.raises(ValueError):
        OwnershipMap(TABLES + [TABLES[0]], ["a"])
    with pytest.raises(ValueError):
        TableSpec("a.b", 10, 2)


def join_fractions(n: int, slots: int = 4096) -> tuple[float, float, float]:
    """(primaries moved, owner slots moved, slots whose owner set changed) when one peer joins n."""
    mem = members(n)
    a, b = OwnershipMap(TABLES, mem, slots=slots), OwnershipMap(TABLES, mem + ["joiner"], slots=slots)
    prim = pairs = sets = 0
    for t in ("ngram", "value"):
        pa = np.array(a.members)[a.owner_matrix(t)]
        pb = np.array(b.members)[b.owner_matrix(t)]
        prim += int((pa[:, 0] != pb[:, 0]).sum())
        sets += sum(set(x) != set(y) for x, y in zip(pa.tolist(), pb.tolist()))
    pairs = len(moves(a, b))
    total = 2 * slots
    return prim / total, pairs / (total * b.replicas), sets / total


@pytest.mark.parametrize("n", [4, 6, 8, 12, 16])
def test_join_moves_about_one_nth(n):
    prim, pairs, sets = join_fractions(n)
    # Expected 1/(n+1) for primaries and owner slots (slot-owner pairs); R/(n+1) for whole owner sets.
    assert prim <= 1.5 / n
    assert pairs <= 1.5 / n
    assert sets <= 1.5 * 2 / n
    assert prim >= 0.5 / (n + 1)  # and it does move its share


def test_join_only_gives_slots_to_the_joiner():
    mem = members(6)
    a, b = OwnershipMap(TABLES, mem, slots=512), OwnershipMap(TABLES, mem + ["zed"], slots=512)
    mv = moves(a, b)
    assert mv and all(m.to == "zed" for m in mv)
    for m in mv:
        assert m.sources == a.owners(m.table, m.slot)


def test_leave_moves_only_slots_the_leaver_owned():
    mem = members(8)
    a = OwnershipMap(TABLES, mem, slots=1024)
    gone = mem[3]
    b = OwnershipMap(TABLES, [m for m in mem if m != gone], slots=1024)
    for t in ("ngram", "value"):
        for s in range(1024):
            oa, ob = a.owners(t, s), b.owners(t, s)
            if gone not in oa:
                assert oa == ob
            else:
                # survivors keep their order; one new owner appended at the end
                assert [o for o in oa if o != gone] == list(ob[:len(oa) - 1])
    mv = moves(a, b)
    assert mv
    for m in mv:
        assert gone in a.owners(m.table, m.slot)
        assert m.sources == tuple(o for o in a.owners(m.table, m.slot) if o != gone)
        assert m.to not in a.owners(m.table, m.slot) and m.to in b.owners(m.table, m.slot)


def test_moves_lists_exactly_the_new_pairs():
    a = OwnershipMap(TABLES, members(5), slots=300)
    b = OwnershipMap(TABLES, members(5)[1:] + ["x", "y"], slots=300)
    got = {(m.table, m.slot, m.to): m.sources for m in moves(a, b)}
    want = {}
    for t in ("ngram", "value"):
        for s in range(300):
            old = a.owners(t, s)
            for o in b.owners(t, s):
                if o not in old:
                    want[(t, s, o)] = tuple(x for x in old if x in b.members)
    assert got == want
    # no change, no moves
    assert moves(b, OwnershipMap(TABLES, reversed(b.members), slots=300)) == []


def test_moves_from_nothing_and_after_total_loss():
    b = OwnershipMap(TABLES, ["a", "b", "c"], slots=16)
    mv = moves(None, b)
    assert len(mv) == 2 * 16 * 2 and all(m.sources == () for m in mv)
    assert {(m.table, m.slot, m.to) for m in mv} == {
        (t, s, o) for t in ("ngram", "value") for s in range(16) for o in b.owners(t, s)}
    c = OwnershipMap(TABLES, ["d"], slots=16)
    mv = moves(b, c)
    assert len(mv) == 32 and all(m == Move(m.table, m.slot, "d", ()) for m in mv)
    with pytest.raises(ValueError):
        moves(b, OwnershipMap(TABLES, ["a"], slots=8))


def test_plan_covers_every_id_once_and_fails_over():
    om = OwnershipMap(TABLES, members(4), replicas=2, slots=4096)
    rng = np.random.default_rng(0)
    ids = np.unique(rng.integers(0, 65536, 3000))
    plan = om.plan("ngram", ids)
    assert "" not in plan
    allids = np.sort(np.concatenate(list(plan.values())))
    assert np.array_equal(allids, ids)
    sl = om.slot_of("ngram", ids)
    prim = np.array(om.members)[om.owner_matrix("ngram")[sl, 0]]
    for p, sub in plan.items():
        assert np.all(np.diff(sub) > 0)
        assert set(np.array(om.members)[om.owner_matrix("ngram")[om.slot_of("ngram", sub), 0]]) == {p}
    assert sum(len(v) for v in plan.values()) == len(ids)

    down = om.members[1]
    plan = om.plan("ngram", ids, down=[down, "not-a-member"])
    assert down not in plan
    assert np.array_equal(np.sort(np.concatenate(list(plan.values()))), ids)
    for p, sub in plan.items():
        for i in sub[:50]:
            o = om.owners("ngram", int(om.slot_of("ngram", np.array([i]))[0]))
            assert p == (o[0] if o[0] != down else o[1])
    assert np.array_equal(plan[om.members[0]], np.sort(plan[om.members[0]]))
    assert (prim == down).any()

    # two owners down: slots owned by exactly those two go to ""
    d2 = list(om.members[:2])
    plan = om.plan("ngram", ids, down=d2)
    om_t = om.owner_matrix("ngram")
    dead_slot = np.isin(om_t, [0, 1]).all(axis=1)[sl]
    assert np.array_equal(plan[""], ids[dead_slot])
    assert np.array_equal(np.sort(np.concatenate(list(plan.values()))), ids)
    # everyone down
    assert list(om.plan("value", ids, down=om.members)) == [""]
    assert om.plan("value", np.zeros(0, dtype=np.int64)) == {}
    # unsorted / repeated input is normalised
    p1 = om.plan("value", ids[::-1].repeat(2))
    p2 = om.plan("value", ids)
    assert p1.keys() == p2.keys() and all(np.array_equal(p1[k], p2[k]) for k in p1)


def test_single_member_and_r1():
    om = OwnershipMap(TABLES, ["solo"], replicas=2, slots=64)
    assert om.replicas == 1
    assert om.owners("ngram", 3) == ("solo",)
    ids = np.arange(0, 65536, 7)
    plan = om.plan("ngram", ids)
    assert list(plan) == ["solo"] and np.array_equal(plan["solo"], ids)
    assert list(om.plan("ngram", ids, down=["solo"])) == [""]
    prim, rep = om.owned_slots("solo", "ngram")
    assert len(prim) == 64 and len(rep) == 0
    assert om.ranges() == [{"table": t, "first_slot": 0, "last_slot": 63, "primary": "solo", "replicas": []}
                           for t in ("ngram", "value")]

    r1 = OwnershipMap(TABLES, members(5), replicas=1, slots=256)
    assert r1.owner_matrix("value").shape == (256, 1)
    plan = r1.plan("value", ids, down=[r1.members[0]])
    assert set(plan) <= set(r1.members[1:]) | {""}
    assert "" in plan
    mv = moves(r1, OwnershipMap(TABLES, members(6), replicas=1, slots=256))
    assert mv and all(len(m.sources) == 1 for m in mv)


def test_ranges_merge_consecutive_slots():
    om = OwnershipMap([TableSpec("t", 1000, 2)], ["a", "b"], replicas=2, slots=100)
    rs = om.ranges()
    assert rs[0]["first_slot"] == 0 and rs[-1]["last_slot"] == 99
    for x, y in zip(rs, rs[1:]):
        assert y["first_slot"] == x["last_slot"] + 1
        assert (x["primary"], x["replicas"]) != (y["primary"], y["replicas"])
    for r in rs:
        for s in range(r["first_slot"], r["last_slot"] + 1):
            assert om.owners("t", s) == (r["primary"], *r["replicas"])


@pytest.mark.parametrize("members", [
    ["g~0", "g~1", "p"],                     # a 2-rank host group and a plain peer
    ["g~0", "g~1", "g~2", "g~3", "h~0", "h~1", "p", "q"],
    ["g~0", "g~1", "h~0", "h~1"],
])
@pytest.mark.parametrize("r", [2, 3])
def test_owners_of_a_slot_are_on_distinct_hosts_when_there_are_enough(members, r):
    """A host that dies (a torchrun group) takes no slot with it while other hosts are members."""
    specs = [TableSpec("t", 8192, 4)]
    m = OwnershipMap(specs, members, replicas=r, slots=512)
    om = m.owner_matrix("t")
    hosts = np.array([host_of(p) for p in m.members])
    n_hosts = len(set(hosts))
    plain_top1 = np.argmax(scores("t", np.arange(512), m.members), axis=1)
    assert np.array_equal(om[:, 0], plain_top1)  # primaries are the plain rendezvous choice
    for row in om:
        assert len(set(row.tolist())) == m.replicas  # distinct members
        assert len(set(hosts[row].tolist())) == min(m.replicas, n_hosts)
    by_host = {h: set(np.flatnonzero(hosts == h).tolist()) for h in set(hosts)}
    for h, idx in by_host.items():  # every slot keeps an owner when any one host dies
        if n_hosts > 1:
            assert all(set(row.tolist()) - idx for row in om)


def test_a_single_host_group_still_gets_r_owners():
    m = OwnershipMap([TableSpec("t", 1024, 4)], ["g~0", "g~1", "g~2"], replicas=2, slots=64)
    om = m.owner_matrix("t")
    assert all(len(set(r.tolist())) == 2 for r in om)
    assert host_of("g~3") == "g" and host_of("abc") == "abc"


def test_cut_gives_positions_of_plan_for_any_order():
    om = OwnershipMap(TABLES, members(4), replicas=2, slots=512)
    rng = np.random.default_rng(1)
    ids = rng.permutation(np.unique(rng.integers(0, 65536, 800)))  # not sorted: positions still work
    for down in ([], [om.members[2]], list(om.members[:2])):
        cut = om.cut("ngram", ids, down=down)
        plan = om.plan("ngram", np.sort(ids), down=down)
        assert cut.keys() == plan.keys()
        for peer, pos in cut.items():
            assert np.all(np.diff(pos) > 0)  # ascending positions
            assert np.array_equal(np.sort(ids[pos]), plan[peer])
        assert np.array_equal(np.sort(np.concatenate(list(cut.values()))), np.arange(len(ids)))
    assert om.cut("ngram", np.zeros(0, dtype=np.int64)) == {}
    with pytest.raises(ValueError):
        om.cut("ngram", ids.reshape(2, -1))


def test_owned_mask_says_which_ids_a_peer_holds_and_which_as_primary():
    om = OwnershipMap(TABLES, members(4), replicas=2, slots=256)
    ids = np.arange(0, 65536, 97)
    slots = om.slot_of("ngram", ids)
    for peer in om.members:
        owners = [om.owners("ngram", int(s)) for s in slots]
        held = om.owned_mask(peer, "ngram", ids)
        first = om.owned_mask(peer, "ngram", ids, primary=True)
        assert held.tolist() == [peer in o for o in owners]
        assert first.tolist() == [o[0] == peer for o in owners]
        assert (first <= held).all() and first.any() and (held & ~first).any()  # some held only as replica
    assert not om.owned_mask("stranger", "ngram", ids, primary=True).any()
