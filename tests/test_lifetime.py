"""A peer's lifetime is one paired structure: a start that fails half-way releases what it took,
and no background task outlives the peer or loses its exception (docs/design.md, "Lifetime")."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from swarm.node import JoinError, Peer

from .conftest import free_port, small_cfg

pytestmark = pytest.mark.timeout(120)


def threads_of(peer: Peer) -> list[str]:
    return [t.name for t in threading.enumerate() if peer.id[:6] in t.name]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


async def test_a_start_that_fails_half_way_releases_the_port_and_the_threads():
    port = free_port()
    dead = free_port()  # nobody listens there: the join fails after the peer began serving
    peer = Peer(small_cfg(port=port, join=f"127.0.0.1:{dead}", join_timeout=1.0), out=lambda line: None)
    with pytest.raises(JoinError):
        await peer.start()
    assert not listening(port), "the failed start left its server listening"
    assert threads_of(peer) == [], threads_of(peer)
    await peer.close()  # closing again is harmless


async def test_a_failed_background_task_is_an_event_and_a_metric_and_close_waits_for_the_rest():
    peer = Peer(small_cfg(), out=lambda line: None)
    await peer.start()
    try:
        async def boom():
            raise RuntimeError("kaboom")

        async def forever():
            await asyncio.Event().wait()

        task = peer.spawn(boom(), "probe:1")
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)
        assert peer.task_failures["probe"] == 1
        assert any(e["kind"] == "task-failed" and "kaboom" in e["detail"] for e in peer.events)
        assert not peer.stopping  # not a task the peer cannot do without
        status = peer.status()
        assert status["task_failures"] == {"probe": 1}
        long = peer.spawn(forever(), "forever")
    finally:
        await peer.close()
    assert long.cancelled()  # nothing outlives the peer
    assert threads_of(peer) == []


async def test_the_membership_loop_failing_stops_the_peer_and_its_summary_says_why(monkeypatch):
    peer = Peer(small_cfg(steps=1000), out=lambda line: None)
    await peer.start()
    try:
        def broken(now):
            raise ValueError("the membership core broke")

        monkeypatch.setattr(peer.members, "tick", broken)
        summary = await asyncio.wait_for(peer.run(), 60)
    finally:
        await peer.close()
    assert summary["steps"] < 1000
    assert "membership" in summary["failure"] and "the membership core broke" in summary["failure"]
    assert summary["task_failures"] == {"membership": 1}


async def test_the_membership_loop_re_cutting_the_tables_after_we_left_is_no_failure():
    # leave() marks us left before it tells the others; the membership loop may re-cut the table
    # map in between, over a live set without us: it keeps the map (seen once as an exit 1 at the
    # end of a run: "an ownership map needs at least one member")
    import time
    peer = Peer(small_cfg(), out=lambda line: None)
    await peer.start()
    try:
        view = peer.tables.view
        peer.members.leave(time.monotonic())
        await peer.shell.update_map()
        assert peer.tables.view == view and peer.failure is None
    finally:
        await peer.close()
