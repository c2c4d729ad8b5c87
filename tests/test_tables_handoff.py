"""The hand-off source policy (swarm/tables/handoff.py), with the clock and the replies as inputs:
no socket, no event loop. The last tests carry the policy out against real TableServices, as
TableClient._fetch_chunk does over HTTP."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from swarm.tables import Move, ShardError, TableSpec
from swarm.tables.handoff import DEADLINE_S, WIDEN_AFTER, Done, HandoffPlan, Round, Sleep
from swarm.tables.service import FRESH, NotPrimary, TableService
from swarm.tables.formats import PushRequest

ME = "p-me"
MEMBERS = ("p-a", "p-b", "p-c", ME)


def chunk() -> list[Move]:
    """Slot 0 was held by p-a and p-b, slot 1 by p-b alone, slot 2 by p-x (no longer a member)."""
    return [Move("t", 0, ME, ("p-a", "p-b")), Move("t", 1, ME, ("p-b",)), Move("t", 2, ME, ("p-x",))]


def everyone_up(peer: str) -> bool:
    return True


def awaited(mv: Move) -> bool:
    return True


def fail_round(plan: HandoffPlan, now: float = 0.0, members=MEMBERS, reachable=everyone_up) -> Round:
    """One round in which no copy was installed; returns it."""
    rnd = plan.next_round(now, members, reachable, awaited)
    assert isinstance(rnd, Round)
    assert isinstance(plan.after_install({m: False for m in rnd.moves}, awaited), Sleep)
    return rnd


def test_the_first_rounds_ask_only_each_slots_old_owners_that_can_be_reached():
    plan = HandoffPlan(chunk(), started=0.0)
    rnd = plan.next_round(0.0, MEMBERS, everyone_up, awaited)
    assert isinstance(rnd, Round) and rnd.everyone is None
    assert rnd.asked == {"p-a": [0], "p-b": [0, 1], "p-x": [2]}  # an old owner outside the map too; p-c not
    assert [m.slot for m in rnd.moves] == [0, 1, 2]
    rnd = plan.next_round(0.0, MEMBERS, lambda p: p != "p-b", awaited)
    assert rnd.asked == {"p-a": [0], "p-x": [2]}  # slot 1's only old owner has no address now


def test_with_no_old_owner_reachable_it_waits_with_growing_backoff():
    plan = HandoffPlan(chunk(), started=0.0)
    waits = [plan.next_round(0.1 * i, None, lambda p: False, awaited) for i in range(12)]
    assert all(isinstance(w, Sleep) for w in waits)
    assert [w.seconds for w in waits] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.0, 2.0])
    # an owner that comes back (it refuted) is asked, even after a long wait
    rnd = plan.next_round(2.0, None, lambda p: p == "p-x", awaited)
    assert isinstance(rnd, Round) and rnd.asked == {"p-x": [2]}


def test_a_round_without_a_copy_backs_off_between_rounds():
    plan = HandoffPlan(chunk(), started=0.0, widen_after=100)
    waits = []
    for _ in range(12):
        rnd = plan.next_round(0.0, MEMBERS, everyone_up, awaited)
        waits.append(plan.after_install({m: False for m in rnd.moves}, awaited).seconds)
    assert waits == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.0, 1.0])


def test_after_widen_after_rounds_every_member_is_asked_for_every_slot():
    plan = HandoffPlan(chunk(), started=0.0)
    for _ in range(WIDEN_AFTER):
        assert fail_round(plan).everyone is None
    rnd = plan.next_round(1.0, MEMBERS, lambda p: p != "p-c", awaited)
    assert isinstance(rnd, Round)
    assert rnd.everyone == ("p-a", "p-b", "p-c")  # not this peer; p-c although it cannot be asked
    # the old owners as before (p-x although no member), and every member it can reach for every slot
    assert rnd.asked == {"p-a": [0, 1, 2], "p-b": [0, 1, 2], "p-x": [2]}
    # waits with nobody to ask count as attempts too
    plan = HandoffPlan(chunk(), started=0.0)
    for _ in range(WIDEN_AFTER):
        assert isinstance(plan.next_round(0.0, MEMBERS, lambda p: False, awaited), Sleep)
    assert plan.next_round(0.0, MEMBERS, lambda p: p == "p-c", awaited).asked == {"p-c": [0, 1, 2]}


def test_without_a_map_the_rounds_never_widen():
    plan = HandoffPlan(chunk(), started=0.0)
    for _ in range(2 * WIDEN_AFTER):
        assert fail_round(plan, members=None).everyone is None


def widened(plan: HandoffPlan) -> Round:
    for _ in range(WIDEN_AFTER):
        fail_round(plan)
    rnd = plan.next_round(1.0, MEMBERS, everyone_up, awaited)
    assert rnd.everyone is not None
    return rnd


def test_another_members_offer_counts_only_in_a_round_every_member_answered():
    rnd = widened(HandoffPlan(chunk(), started=0.0))
    # p-c (no old owner of any slot) offers slot 1; p-a does not answer
    replies = {"p-a": None, "p-b": [None, None, None], "p-c": [None, b"c1", None], "p-x": [None]}
    assert rnd.offers(replies) == {}
    replies["p-a"] = [None, None, FRESH]  # now every member answered
    assert rnd.offers(replies) == {1: [b"c1"], 2: [FRESH]}
    # a member left unasked (no address) has not answered: the round is not complete
    del replies["p-a"]
    assert rnd.offers(replies) == {}


def test_an_old_owners_offer_always_counts():
    plan = HandoffPlan(chunk(), started=0.0)
    rnd = plan.next_round(0.0, MEMBERS, everyone_up, awaited)
    got = rnd.offers({"p-a": [b"a0"], "p-b": [b"b0", FRESH], "p-x": None})
    assert got == {0: [b"a0", b"b0"], 1: [FRESH]}  # every old owner's copy: import_best keeps the newest
    # in a widened round too, although a member did not answer; an old owner outside the map included
    rnd = widened(HandoffPlan(chunk(), started=0.0))
    got = rnd.offers({"p-a": [b"a0", b"a1", None], "p-b": None, "p-c": None, "p-x": [b"x2"]})
    assert got == {0: [b"a0"], 2: [b"x2"]}  # p-a's slot 1 is another member's offer (p-b did not answer)


def test_a_move_no_longer_awaited_is_dropped():
    moves = chunk()
    gone = {moves[1]}  # superseded by a newer view, or installed by another fetch
    plan = HandoffPlan(moves, started=0.0)
    rnd = plan.next_round(0.0, MEMBERS, everyone_up, lambda m: m not in gone)
    assert [m.slot for m in rnd.moves] == [0, 2] and rnd.asked == {"p-a": [0], "p-b": [0], "p-x": [2]}
    # after a round: installed, or dropped meanwhile although not installed
    gone.add(moves[2])
    wait = plan.after_install({moves[0]: False, moves[2]: False}, lambda m: m not in gone)
    assert isinstance(wait, Sleep) and plan.pending == [moves[0]]
    assert plan.after_install({moves[0]: True}, awaited) is None and plan.pending == []
    assert plan.next_round(0.5, MEMBERS, everyone_up, awaited) == Done(())
    # every move dropped before any round: nothing to ask, nothing to give up
    assert HandoffPlan(chunk(), started=0.0).next_round(0.0, MEMBERS, everyone_up, lambda m: False) == Done(())


def test_at_the_deadline_the_moves_left_are_given_up():
    moves = chunk()
    plan = HandoffPlan(moves, started=10.0)
    plan.next_round(10.0, MEMBERS, everyone_up, awaited)
    plan.after_install({moves[0]: True, moves[1]: False, moves[2]: False}, awaited)
    rnd = plan.next_round(10.0 + DEADLINE_S - 0.01, MEMBERS, everyone_up, awaited)
    assert isinstance(rnd, Round) and [m.slot for m in rnd.moves] == [1, 2]
    plan.after_install({m: False for m in rnd.moves}, awaited)
    assert plan.next_round(10.0 + DEADLINE_S, MEMBERS, everyone_up, awaited) == Done((moves[1], moves[2]))
    # also while nobody can be asked; a shorter deadline
    plan = HandoffPlan(moves, started=0.0, deadline_s=1.0)
    assert isinstance(plan.next_round(0.9, MEMBERS, lambda p: False, awaited), Sleep)
    assert plan.next_round(1.0, MEMBERS, lambda p: False, awaited) == Done(tuple(moves))


def test_a_move_superseded_before_the_deadline_is_not_given_up():
    """The last wait before the deadline: a newer view took the slot away and gave it back (a new
    Move, fetched by another chunk). Giving up the old move would restart that slot from zeros."""
    moves = chunk()
    plan = HandoffPlan(moves, started=0.0)
    rnd = plan.next_round(0.0, MEMBERS, everyone_up, awaited)
    assert isinstance(plan.after_install({m: False for m in rnd.moves}, awaited), Sleep)
    superseded = {moves[0]}
    assert plan.next_round(DEADLINE_S, MEMBERS, everyone_up, lambda m: m not in superseded) == Done(tuple(moves[1:]))


def test_a_chunk_is_distinct_slots_of_one_table():
    with pytest.raises(ValueError):
        HandoffPlan([Move("t", 0, ME, ("p-a",)), Move("u", 1, ME, ("p-a",))], started=0.0)
    with pytest.raises(ValueError):
        HandoffPlan([Move("t", 0, ME, ("p-a",)), Move("t", 0, ME, ("p-b",))], started=0.0)


# -- the policy carried out against real TableServices (what the HTTP shell does) -----------------

SPECS = [TableSpec("ngram", 256, 8)]


def answer(svc: TableService, table: str, slots: list[int]) -> list:
    """What POST /v1/rows/slots answers (swarm/tables/http.py)."""
    out = []
    for s in slots:
        try:
            out.append(svc.export_slot_or_fresh(table, s))
        except (NotPrimary, ShardError, ValueError):
            out.append(None)
    return out


def carry_out(svc: TableService, moves: list[Move], peers: dict[str, TableService], down=frozenset(),
              widen_after: int = WIDEN_AFTER) -> tuple[float, int]:
    """TableClient._fetch_chunk on a simulated clock: returns (seconds taken, rounds asked)."""
    plan = HandoffPlan(moves, started=0.0, widen_after=widen_after)
    now, rounds = 0.0, 0

    def still_pending(mv: Move) -> bool:
        return svc.moving.get((mv.table, mv.slot)) is mv

    def reachable(p: str) -> bool:
        return p in peers and p not in down

    while not isinstance(step := plan.next_round(now, svc.map.members, reachable, still_pending), Done):
        if isinstance(step, Round):
            rounds += 1
            replies = {src: answer(peers[src], moves[0].table, slots) for src, slots in step.asked.items()}
            offers = step.offers(replies)
            step = plan.after_install({mv: mv.slot in offers and svc.import_best(mv, offers[mv.slot])
                                       for mv in step.moves}, still_pending)
        if step is not None:
            now += step.seconds
    for mv in step.give_up:
        svc.give_up(mv)
    return now, rounds


def pushed(svc: TableService, key: str, times: int = 1) -> None:
    """Update every row of 'ngram' on ``svc``, its only owner (``times`` updates)."""
    ids = np.arange(256)
    for i in range(times):
        svc.apply_push(PushRequest(view=svc.view, key=f"{key}:{i}", ids={"ngram": ids},
                                   grads={"ngram": torch.full((256, 8), 0.5)}))


def test_two_joins_at_once_find_the_slot_at_its_first_owner_by_widening():
    """p0 -> a -> b within seconds, one replica: a dropped its fetch when b became the owner, so b's
    old owner (a) has no copy; only p0 still holds it, for release. The widened round finds it."""
    p0, a, b = (TableService(p, SPECS, replicas=1, slots=16) for p in ("p-0", "p-a", "p-b"))
    p0.set_members(["p-0"], 0.0)
    pushed(p0, "x")
    a.set_members(["p-0", "p-a"], 0.0)
    for svc in (p0, a):
        svc.set_members(["p-0", "p-a", "p-b"], 0.0)
    fetch = b.set_members(["p-0", "p-a", "p-b"], 0.0)
    via_a = [mv for mv in fetch if mv.sources == ("p-a",)]
    assert via_a, "some slot moved p-0 -> p-a -> p-b"
    peers = {"p-0": p0, "p-a": a}
    seconds, rounds = carry_out(b, via_a, peers)
    assert rounds == WIDEN_AFTER + 1 and seconds < 1.0
    for mv in via_a:
        assert b.shards["ngram"].checksum(mv.slot) == p0.shards["ngram"].checksum(mv.slot)
    assert b.stats.slots_fetched == len(via_a) and b.stats.slots_lost == 0
    # never widening, the same slots wait out the deadline and restart from zero rows
    b2 = TableService("p-b", SPECS, replicas=1, slots=16)
    fetch2 = {(mv.table, mv.slot): mv for mv in b2.set_members(["p-0", "p-a", "p-b"], 0.0)}
    seconds, _ = carry_out(b2, [fetch2[(mv.table, mv.slot)] for mv in via_a], peers, widen_after=10**6)
    assert seconds >= DEADLINE_S and b2.stats.slots_lost == len(via_a)


def test_the_newest_of_the_old_owners_copies_wins_not_the_first_offered():
    """Both old owners offer (p-a's copy first, being asked first): import_best keeps the copy
    with the most updates, p-b's."""
    a, b = (TableService(p, SPECS, replicas=2, slots=16) for p in ("p-a", "p-b"))
    b.set_members(["p-b"], 0.0)
    pushed(b, "x", times=3)
    a.install_checkpoint({"ngram": {s: b.shards["ngram"].export_slot(s) for s in b.shards["ngram"].slots()}})
    pushed(b, "y", times=2)
    b.set_members(["p-a", "p-b"], 0.0)
    for mv in list(a.set_members(["p-a", "p-b"], 0.0)):
        a.give_up(mv)  # p-a goes on with its checkpoint's copy, two updates behind
    c = TableService("p-c", SPECS, replicas=2, slots=16)
    both = [mv for mv in c.set_members(["p-a", "p-b", "p-c"], 0.0) if set(mv.sources) == {"p-a", "p-b"}]
    assert both
    carry_out(c, both, {"p-a": a, "p-b": b})
    for mv in both:
        assert c.shards["ngram"].checksum(mv.slot) == b.shards["ngram"].checksum(mv.slot)
        assert c.shards["ngram"].checksum(mv.slot) != a.shards["ngram"].checksum(mv.slot)
    # with the newer owner down, the older copy is what there is
    c2 = TableService("p-c", SPECS, replicas=2, slots=16)
    fetch2 = {mv.slot: mv for mv in c2.set_members(["p-a", "p-b", "p-c"], 0.0)}
    carry_out(c2, [fetch2[mv.slot] for mv in both], {"p-a": a, "p-b": b}, down={"p-b"})
    for mv in both:
        assert c2.shards["ngram"].checksum(mv.slot) == a.shards["ngram"].checksum(mv.slot)


def superseded_move(svc: TableService) -> tuple[Move, Move]:
    """A slot ``svc`` (p-b, one replica, 16 slots) owned under [p-a, p-b], lost to p-d under
    [p-a, p-b, p-d] and owns again, from p-d, under [p-a, p-b]: (the first view's move, the third's)."""
    first = {(mv.table, mv.slot): mv for mv in svc.set_members(["p-a", "p-b"], 0.0)}
    svc.set_members(["p-a", "p-b", "p-d"], 0.0)
    third = {(mv.table, mv.slot): mv for mv in svc.set_members(["p-a", "p-b"], 0.0)}
    key = next(k for k in third if k in first)
    assert first[key] is not third[key] and svc.moving[key] is third[key] and third[key].sources == ("p-d",)
    return first[key], third[key]


def test_giving_up_a_superseded_move_leaves_the_newer_fetch_alone():
    b = TableService("p-b", SPECS, replicas=1, slots=16)
    old, new = superseded_move(b)
    b.give_up(old)  # the first view's fetch reached its deadline
    assert b.moving[(new.table, new.slot)] is new and not b.shards[new.table].has_slot(new.slot)
    assert b.stats.slots_lost == 0
    b.give_up(new)
    assert b.stats.slots_lost == 1 and (new.table, new.slot) not in b.moving


def test_the_old_fetch_at_its_deadline_does_not_cost_the_newer_fetch_its_slot():
    """Both fetches carried out: the old one's plan drops its superseded move, the newer one installs
    the copy its source (p-d, holding it) offers."""
    d = TableService("p-d", SPECS, replicas=1, slots=16)
    d.set_members(["p-d"], 0.0)
    pushed(d, "x")
    b = TableService("p-b", SPECS, replicas=1, slots=16)
    old, new = superseded_move(b)
    still_pending = lambda mv: b.moving.get((mv.table, mv.slot)) is mv  # noqa: E731
    plan = HandoffPlan([old], started=0.0)
    done = plan.next_round(DEADLINE_S, b.map.members, everyone_up, still_pending)
    assert done == Done(())
    for mv in done.give_up:  # what the shell does with it
        b.give_up(mv)
    carry_out(b, [new], {"p-d": d})
    assert b.shards["ngram"].checksum(new.slot) == d.shards["ngram"].checksum(new.slot)
    assert b.stats.slots_lost == 0 and b.stats.slots_fetched == 1
