"""Several peers in this process, on ephemeral localhost ports, training together."""

from __future__ import annotations

import asyncio

import pytest

from swarm.core.meta import PeerMeta
from swarm.node import Peer

from .conftest import rel_l2, small_cfg

pytestmark = pytest.mark.timeout(180)


async def start_peer(**kw) -> Peer:
    peer = Peer(small_cfg(**kw), out=lambda line: None)
    await peer.start()
    return peer


async def test_three_peers_train_in_lockstep_with_identical_replicas():
    a = await start_peer(steps=20, min_peers=3)
    join = f"127.0.0.1:{a.port}"
    b = await start_peer(steps=20, min_peers=3, join=join)
    c = await start_peer(steps=20, min_peers=3, join=join)
    try:
        results = await asyncio.wait_for(asyncio.gather(a.run(), b.run(), c.run()), 150)
    finally:
        for p in (a, b, c):
            await p.close()
    for r in results:
        assert r["steps"] == 20 and r["steps_contributed"] == 20
        assert r["rounds_timed_out"] == 0
        assert r["final_loss"] < r["first_loss"]
        # each peer sends the same bytes to two others; the bytes are a small fraction of dense fp32
        assert 0 < r["bytes_sent"] <= 0.03 * r["dense_bytes"]
        assert r["bytes_received"] > 0
    sketches = [r["param_sketch"] for r in results]
    assert rel_l2(sketches[0], sketches[1]) <= 1e-3
    assert rel_l2(sketches[0], sketches[2]) <= 1e-3
    # identical dense replicas; table rows arrive as int8 from remote owners and fp32 from our own
    # shard (every peer waits for the last flush of row pushes before it evaluates), so the held-out
    # losses agree to int8 rounding, not bit for bit: how much depends on which slots each peer owns
    # (random ids); 1.8e-4 was seen once in a full-suite run, so the bar is 5e-4
    assert max(r["val_loss"] for r in results) - min(r["val_loss"] for r in results) < 5e-4


async def test_late_joiner_downloads_state_and_catches_up():
    a = await start_peer(steps=45, min_peers=2)
    b = await start_peer(steps=45, min_peers=2, join=f"127.0.0.1:{a.port}")
    runs = [asyncio.ensure_future(a.run()), asyncio.ensure_future(b.run())]
    c = None
    try:
        while a.book.step < 15:
            await asyncio.sleep(0.05)
        c = await start_peer(steps=45, join=f"127.0.0.1:{b.port}")
        assert c.started  # it joined a running swarm, so it must sync state before contributing
        runs.append(asyncio.ensure_future(c.run()))
        results = await asyncio.wait_for(asyncio.gather(*runs), 150)
    finally:
        for p in (a, b, c):
            if p is not None:
                await p.close()
    ra, rb, rc = results
    assert ra["steps"] == rb["steps"] == rc["steps"] == 45
    assert rc["state_bytes_received"] > 0
    assert 0 < rc["steps_contributed"] < 45 - 15
    assert rel_l2(ra["param_sketch"], rb["param_sketch"]) <= 1e-3
    assert rel_l2(ra["param_sketch"], rc["param_sketch"]) <= 1e-2
    assert rc["val_loss"] == pytest.approx(ra["val_loss"], rel=0.01) and rc["val_loss"] < 4.5  # ln 256 = 5.55


async def test_stop_leaves_gracefully_and_others_see_left():
    a = await start_peer(steps=0, min_peers=2)
    b = await start_peer(steps=0, min_peers=2, join=f"127.0.0.1:{a.port}")
    ra, rb = asyncio.ensure_future(a.run()), asyncio.ensure_future(b.run())
    try:
        while a.book.step < 5:
            await asyncio.sleep(0.05)
        b.stop()
        summary_b = await asyncio.wait_for(rb, 30)
        assert summary_b["steps"] >= 5
        for _ in range(100):
            m = a.members.get(b.id)
            if m is not None and m.state == "left":
                break
            await asyncio.sleep(0.05)
        assert a.members.get(b.id).state == "left"
        step = a.book.step
        for _ in range(200):  # a goes on training alone without waiting for rounds to time out
            if a.book.step >= step + 5:
                break
            await asyncio.sleep(0.05)
        assert a.book.step >= step + 5
        a.stop()
        await asyncio.wait_for(ra, 30)
    finally:
        await a.close()
        await b.close()


async def test_peers_that_finished_do_not_fetch_the_slots_of_one_that_left_first(monkeypatch):
    # every peer done: the first to leave handed its slots to the others on their way out, and they
    # fetched them (bytes nobody would read); one peer here lingers 2 s after the others left
    peers = [await start_peer(steps=4, min_peers=3)]
    join = f"127.0.0.1:{peers[0].port}"
    peers += [await start_peer(steps=4, min_peers=3, join=join) for _ in range(2)]
    last = peers[2]
    leave, fetched = last.leave, []

    async def when_done() -> None:  # the others leave once they see it done (gossip), not before
        while not PeerMeta.parse(last.members.get(last.id).meta).done:
            await asyncio.sleep(0.01)
        fetched.append((last.tables.stats.slots_fetched, len(last.events)))  # fetched at its join

    async def late_leave() -> None:
        await asyncio.sleep(2.0)
        await leave()

    monkeypatch.setattr(last, "leave", late_leave)
    watch = asyncio.ensure_future(when_done())
    try:
        results = await asyncio.wait_for(asyncio.gather(*(p.run() for p in peers)), 150)
        await asyncio.wait_for(watch, 5)
    finally:
        watch.cancel()
        for p in peers:
            await p.close()
    assert all(r["steps"] == 4 for r in results)
    assert last.tables.stats.view_changes > 1  # it saw the others leave and re-cut the map
    since = [e["detail"] for e in list(last.events)[fetched[0][1]:] if e["kind"] == "handoff"]
    assert since and all(d.startswith("not fetching") for d in since), since  # no fetch begun since it finished
    assert results[2]["table_stats"]["slots_fetched"] == fetched[0][0]
