"""The peer core (swarm/core): typed member metadata, which peers a round expects, lateness and
re-sync, donor choice, the --min-peers gate, lingering and the lifecycle. No socket, no event loop."""

from __future__ import annotations

import pytest

from swarm.core import rounds
from swarm.core.lifecycle import (TRAINING_GRACE, JoinTraining, Lifecycle, LifecycleError, MinPeersGate, Start,
                                  State, Wait, linger_over, winding_down)
from swarm.core.meta import MAX_STEP, PeerMeta


def meta(**kw) -> PeerMeta:
    return PeerMeta.parse(kw)


# -- metadata -----------------------------------------------------------------------------------

def test_meta_is_parsed_once_with_every_hostile_value_taking_its_default():
    m = PeerMeta.parse({"step": 7, "active": 1, "active_from": 3, "active_until": -1, "run": 1, "done": 0,
                        "group": "g", "grank": 2, "loss": 1.5, "tps": 10, "sk": "ignored"})
    assert m == PeerMeta(step=7, active=True, active_from=3, active_until=-1, run=True, done=False, group="g",
                         grank=2, loss=1.5, tps=10)
    assert m.follower and not m.contributor
    for hostile in ("1", "x", 1.5, None, [1], {"a": 1}, -5, MAX_STEP + 1, float("nan")):
        h = PeerMeta.parse({"step": hostile, "active_from": hostile, "active_until": hostile, "grank": hostile,
                            "tps": hostile})
        assert (h.step, h.active_from, h.active_until, h.grank, h.tps) == (0, 0, None, None, 0)
        assert not h.follower
    assert PeerMeta.parse(None) == PeerMeta() == PeerMeta.parse("not a dict")
    assert PeerMeta.parse({"active": True}).active and not PeerMeta.parse({"active": "yes"}).active
    assert PeerMeta.parse({"grank": 1}).follower and not PeerMeta.parse({"grank": 0}).follower
    assert not PeerMeta.parse({"grank": True}).follower  # a bool is not a rank
    for hostile in (float("inf"), float("nan"), "1.5", [1.5], None):
        assert PeerMeta.parse({"loss": hostile}).loss is None


# -- rounds -------------------------------------------------------------------------------------

def test_a_round_expects_contributors_from_their_first_round_and_ourselves_when_active():
    live = {"a": meta(active=1, active_from=0), "b": meta(active=1, active_from=5), "c": meta(active=0)}
    assert rounds.expected(4, live, set(), set(), "me", True) == {"a", "me"}
    assert rounds.expected(5, live, set(), set(), "me", False) == {"a", "b"}


def test_a_recent_sender_is_expected_until_its_last_round_and_not_before_its_first():
    live = {"a": meta(active=0, active_until=6), "b": meta(active=1, active_from=9), "c": meta(active=0)}
    senders = {"a", "b", "c", "gone"}
    # a: gossip says it stopped after 6; c: its 'active' has not reached us by gossip, its payloads have
    assert rounds.expected(6, live, senders, set(), "me", False) == {"a", "c"}
    assert rounds.expected(7, live, senders, set(), "me", False) == {"c"}
    assert rounds.expected(9, live, senders, set(), "me", False) == {"b", "c"}
    assert "gone" not in rounds.expected(9, live, senders, set(), "me", False)  # not live: not waited for


def test_banned_peers_are_never_waited_for():
    live = {"a": meta(active=1), "b": meta(active=1)}
    assert rounds.expected(3, live, {"a"}, {"a"}, "me", True) == {"b", "me"}


def test_behind_counts_only_contributors_and_a_peer_resyncs_past_the_lag_or_when_diverged():
    alive = {"a": meta(active=1, step=20), "b": meta(active=0, step=99), "c": meta(active=1, step=12)}
    assert rounds.behind(10, alive) == 10
    assert rounds.behind(25, alive) == 0
    assert rounds.behind(3, {}) == 0
    assert rounds.must_resync(20 - rounds.RESYNC_LAG - 1, alive, False)
    assert not rounds.must_resync(20 - rounds.RESYNC_LAG, alive, False)
    assert rounds.must_resync(20, alive, True)


def test_the_donor_is_the_preferred_contributor_else_the_one_furthest_ahead():
    alive = {"a": meta(active=1, step=5), "b": meta(active=1, step=9), "c": meta(active=1, step=9),
             "d": meta(active=0, step=50)}
    assert rounds.pick_donor(alive) == "b"  # the furthest ahead; the lowest id among equals
    assert rounds.pick_donor(alive, prefer="a") == "a"
    assert rounds.pick_donor(alive, prefer="d") == "b"  # not contributing
    assert rounds.pick_donor(alive, prefer="zz") == "b"  # not alive
    assert rounds.pick_donor({"d": meta(active=0)}) is None


def test_a_state_sync_waits_until_every_contributors_traffic_reaches_us():
    alive = {"a": meta(active=1, step=10), "b": meta(active=1, step=4), "c": meta(active=0, step=30)}
    assert not rounds.traffic_reaches_us(alive, {"a": 8})
    assert rounds.traffic_reaches_us(alive, {"a": 8, "b": 2})
    assert not rounds.traffic_reaches_us(alive, {"a": 7, "b": 2})
    assert not rounds.traffic_reaches_us({"c": meta(active=0)}, {})  # nobody contributes yet


# -- lifecycle ----------------------------------------------------------------------------------

def test_min_peers_counts_contributors_and_a_host_group_as_one():
    gate = MinPeersGate(3)
    alive = {"a": meta(active=1), "g0": meta(active=1, grank=0, group="g0"), "g1": meta(grank=1, group="g0")}
    assert gate.decide(alive, 0.0) == Start()  # us, a, and the group (its leader)
    assert MinPeersGate(4).decide(alive, 0.0) == Wait()


def test_a_waiting_peer_joins_a_swarm_that_trains_without_it():
    gate = MinPeersGate(3)
    at_zero = {"a": meta(active=1, run=1, step=0)}
    assert gate.decide(at_zero, 100.0) == Wait()  # step 0: the gossip may not show everyone yet
    assert gate.decide(at_zero, 100.0 + TRAINING_GRACE / 2) == Wait()
    assert gate.decide(at_zero, 100.0 + TRAINING_GRACE + 0.1) == JoinTraining(0)
    assert MinPeersGate(3).decide({"a": meta(active=1, run=1, step=7)}, 0.0) == JoinTraining(7)
    assert MinPeersGate(3).decide({"a": meta(active=1, run=0, step=7)}, 0.0) == Wait()  # not training


def test_lingering_ends_when_every_contributor_and_group_rank_is_done():
    assert linger_over({"a": meta(active=1, done=1), "b": meta(active=0)})
    assert not linger_over({"a": meta(active=1)})
    assert not linger_over({"r": meta(grank=1)})  # a rank evaluates too
    assert linger_over({"r": meta(grank=1, done=1)})
    assert linger_over({})


def test_a_run_winds_down_when_we_and_every_live_peer_are_done():
    done = meta(active=1, done=1)
    assert winding_down(done, {"a": meta(active=1, done=1), "b": meta(active=0)})
    assert not winding_down(meta(active=1), {"a": done})  # we still train or evaluate
    assert not winding_down(done, {"a": meta(active=1)})  # a peer still reads rows
    assert not winding_down(done, {"r": meta(grank=1)})  # a rank of a host group evaluates too
    assert winding_down(done, {})


def test_the_lifecycle_moves_only_along_its_table():
    lc = Lifecycle(0.0)
    for st in (State.WAITING, State.SYNCING, State.TRAINING, State.RESYNCING, State.SYNCING, State.TRAINING,
               State.FINISHING, State.LEFT):
        lc.to(st, 1.0)
    assert lc.state == State.LEFT and [s for s, _ in lc.history][:3] == [State.STARTING, State.WAITING, State.SYNCING]
    with pytest.raises(LifecycleError):
        lc.to(State.TRAINING, 2.0)
    lc2 = Lifecycle(0.0)
    lc2.to(State.STARTING, 1.0)  # staying is no move
    with pytest.raises(LifecycleError):
        lc2.to(State.RESYNCING, 1.0)  # never trained


def test_snapshot_gap_names_the_senders_whose_round_after_the_snapshot_is_lost():
    alive = {"a": PeerMeta(step=5, active=True), "b": PeerMeta(step=5, active=True), "c": PeerMeta(step=5),
             "d": PeerMeta(step=4, active=True)}
    have = {"b"}  # round 5's payloads here
    last = {"a": 6, "b": 6, "c": 6, "d": 4}  # a sent round 6 (and 5 before it knew us); d has not sent 5 yet
    assert rounds.snapshot_gap(5, alive, lambda p: p in have, last) == ["a"]  # c does not contribute
    assert rounds.snapshot_gap(6, alive, lambda p: True, last) == []


def test_a_round_is_lost_in_catch_up_once_a_later_payload_of_its_sender_came_instead():
    have = {"b"}  # round 5's payloads here
    last = {"a": 6, "b": 5, "d": 4}
    # a's round 6 came, its round 5 never will (sends go in step order); d's round 5 is still to come
    assert rounds.lost_in_catch_up(5, {"a", "b", "d"}, lambda p: p in have, last) == ["a"]
    assert rounds.lost_in_catch_up(5, {"b", "d"}, lambda p: p in have, last) == []
    assert rounds.lost_in_catch_up(5, {"a", "x"}, lambda p: False, {}) == []  # nothing heard: still waited for
