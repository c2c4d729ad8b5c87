"""The per-client limits core (swarm/limits.py): buckets, caps, separate budgets, expiry, bounds."""

from __future__ import annotations

import pytest

from swarm.config import ConfigError, PeerConfig
from swarm.limits import (CLIENTS, CONNECTIONS, MEMBER, OUTSIDER, RATE, STREAMS, Budget, Limits, LimitsError,
                          parse_budget)

SMALL = Budget(rate=2.0, burst=4.0, connections=2, streams=1)
BIG = Budget(rate=100.0, burst=200.0, connections=8, streams=2)
OUT = (OUTSIDER, "127.0.0.2")
MEM = (MEMBER, "peer-a")


def test_bucket_allows_a_burst_then_refuses_until_it_refills():
    lim = Limits(BIG, SMALL)
    assert all(lim.request(OUT, 0.0).ok for _ in range(4))
    d = lim.request(OUT, 0.0)
    assert not d.ok and d.reason == RATE and d.retry_after == pytest.approx(0.5) and d.retry_seconds == 1
    assert not lim.request(OUT, 0.4).ok  # 0.8 of a token back
    assert lim.request(OUT, 0.5).ok and not lim.request(OUT, 0.5).ok
    assert sum(lim.request(OUT, 100.0).ok for _ in range(10)) == 4  # refills to the burst, no more
    assert lim.refused[(OUTSIDER, RATE)] == 9


def test_members_and_outsiders_have_separate_budgets():
    lim = Limits(BIG, SMALL)
    for _ in range(50):
        lim.request(OUT, 0.0)
        lim.connect(OUT, 0.0)
    assert not lim.request(OUT, 0.0).ok
    assert all(lim.connect(MEM, 0.0).ok for _ in range(8)) and not lim.connect(MEM, 0.0).ok
    assert all(lim.request(MEM, 0.0).ok for _ in range(200))  # the member's own bucket
    assert lim.request((MEMBER, "peer-b"), 0.0).ok  # and every member has its own
    assert lim.refused[(MEMBER, RATE)] == 0


def test_refund_and_charge():
    lim = Limits(BIG, SMALL)
    for _ in range(4):
        assert lim.request(OUT, 0.0).ok
        lim.refund(OUT, 0.0)  # each request turned out to be a member's
    assert lim.request(OUT, 0.0).ok
    for _ in range(20):
        lim.charge(OUT, 0.0)  # served anyway: the debt is bounded by the burst
    d = lim.request(OUT, 0.0)
    assert not d.ok and d.retry_after == pytest.approx((1 + 4) / 2)


def test_connection_cap_and_release():
    lim = Limits(BIG, SMALL)
    assert lim.connect(OUT, 0.0).ok and lim.connect(OUT, 0.0).ok
    d = lim.connect(OUT, 0.0)
    assert not d.ok and d.reason == CONNECTIONS
    lim.disconnect(OUT, 1.0)
    assert lim.connect(OUT, 1.0).ok
    assert lim.connections[OUTSIDER] == 2


def test_no_new_connection_while_the_request_budget_is_spent():
    lim = Limits(BIG, SMALL)
    for _ in range(4):
        lim.request(OUT, 0.0)
    d = lim.connect(OUT, 0.0)
    assert not d.ok and d.reason == RATE and lim.connections[OUTSIDER] == 0


def test_all_outsiders_together_have_a_connection_cap():
    lim = Limits(BIG, SMALL, max_outsider_connections=3)
    assert all(lim.connect((OUTSIDER, f"10.0.0.{i}"), 0.0).ok for i in range(3))
    assert lim.connect((OUTSIDER, "10.0.0.9"), 0.0).reason == CONNECTIONS
    assert lim.connect(MEM, 0.0).ok  # members are not in that count


def test_claim_moves_a_connection_to_its_member():
    lim = Limits(Budget(100, 200, 1, 1), SMALL)
    assert lim.connect(OUT, 0.0).ok and lim.connect(OUT, 0.0).ok
    assert lim.claim(OUT, MEM, 0.0).ok
    assert lim.connect(OUT, 0.0).ok  # the address has room again
    assert lim.claim(OUT, MEM, 0.0).reason == CONNECTIONS  # the member's own cap (1)
    assert lim.connections == {MEMBER: 1, OUTSIDER: 2}
    lim.disconnect(MEM, 1.0)
    assert lim.connections[MEMBER] == 0


def test_stream_cap():
    lim = Limits(BIG, SMALL)
    assert lim.open_stream(OUT, 0.0).ok
    d = lim.open_stream(OUT, 0.0)
    assert not d.ok and d.reason == STREAMS and d.retry_seconds >= 1
    assert lim.open_stream(MEM, 0.0).ok and lim.open_stream(MEM, 0.0).ok
    lim.close_stream(OUT, 1.0)
    assert lim.open_stream(OUT, 1.0).ok


def test_scale_multiplies_a_shared_key_budget():
    lim = Limits(Budget(1, 2, 1, 1), SMALL)
    host = (MEMBER, "@127.0.0.1")
    assert sum(lim.request(host, 0.0, scale=3).ok for _ in range(10)) == 6
    assert sum(lim.connect(host, 0.0, scale=3).ok for _ in range(10)) == 0  # bucket spent: no connection
    assert lim.request(host, 10.0, scale=3).ok
    assert sum(lim.connect(host, 10.0, scale=3).ok for _ in range(10)) == 3


def test_idle_entries_expire_and_memory_is_bounded():
    lim = Limits(BIG, SMALL, max_clients=8)
    for i in range(8):
        assert lim.request((OUTSIDER, f"10.0.0.{i}"), 0.0).ok
    assert lim.clients(OUTSIDER) == 8
    # full of clients still refilling: a new one is refused (fails closed), members are unaffected
    d = lim.request((OUTSIDER, "10.0.1.1"), 0.1)
    assert not d.ok and d.reason == CLIENTS
    assert lim.request(MEM, 0.1).ok
    # once their buckets refilled (0.5 s), each new call forgets a few: the table never grows past 8
    for i in range(100):
        lim.request((OUTSIDER, f"10.1.0.{i}"), 10.0 + i)
        assert lim.clients(OUTSIDER) <= 8
    assert lim.expired >= 90
    # a busy client (an open connection) is never forgotten
    busy = (OUTSIDER, "10.9.9.9")
    lim2 = Limits(BIG, SMALL, max_clients=4)
    assert lim2.connect(busy, 0.0).ok
    for i in range(50):
        lim2.request((OUTSIDER, f"10.2.0.{i}"), 100.0 + i)
    lim2.disconnect(busy, 200.0)
    assert lim2.connections[OUTSIDER] == 0 and lim2.refused[(OUTSIDER, CLIENTS)] == 0


def test_status_counts():
    lim = Limits(BIG, SMALL)
    for _ in range(6):
        lim.request(OUT, 0.0)
    st = lim.status()
    assert st[OUTSIDER]["refused"][RATE] == 2 and st[OUTSIDER]["clients"] == 1
    assert st[MEMBER]["budget"]["rate"] == 100.0


def test_parse_budget_and_config_errors():
    assert parse_budget("", SMALL, "--x") == SMALL
    assert parse_budget("rate=5, streams=3", SMALL, "--x") == Budget(5.0, 4.0, 2, 3)
    for bad in ("rate", "speed=3", "rate=abc", "rate=0", "connections=1.5", "burst=0.5", "rate=inf", "streams=-1"):
        with pytest.raises(LimitsError):
            parse_budget(bad, SMALL, "--x")
    with pytest.raises(ConfigError, match="--outsider-limits"):
        PeerConfig(outsider_limits="rate=fast").validate()
    with pytest.raises(ConfigError, match="--client-limits"):
        PeerConfig(client_limits=2).validate()
    PeerConfig(member_limits="rate=1000,burst=2000", client_limits=0).validate()
