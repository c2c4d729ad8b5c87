"""Sharded tables across real peers on localhost: pulls, exactly-once pushes, replicas, crashes, joins."""

from __future__ import annotations

import asyncio
import time

import msgpack
import numpy as np
import pytest
import torch

from swarm.node import Peer
from swarm.tables.formats import PushRequest, encode_push, roundtrip

from .conftest import signed, small_cfg, start_peers

pytestmark = pytest.mark.timeout(180)

TABLES = ("ngram", "value")


async def until(cond, timeout: float = 30.0, what: str = "condition") -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def settled(peers: list[Peer]) -> bool:
    """Every peer has the same view over exactly these peers, and no hand-off or replica catch-up
    is pending."""
    ids = sorted(p.id for p in peers)
    return all(p.tables.map is not None and list(p.tables.map.members) == ids and not p.tables.moving
               and not len(p.table_client.owed) for p in peers)


def holders(peers: list[Peer], table: str, slot: int) -> list[Peer]:
    owners = peers[0].tables.map.owners(table, slot)
    return [p for p in peers if p.id in owners]


async def push_random(peer: Peer, rng: np.random.Generator, key: str, n: int = 300) -> dict[str, np.ndarray]:
    grads = {}
    for t in TABLES:
        ids = np.unique(rng.integers(0, peer.cfg.table_rows, n))
        grads[t] = (ids, torch.from_numpy(rng.standard_normal((len(ids), 128)).astype(np.float32)) * 0.01)
    assert await peer.table_client.push(grads, key=key)
    return {t: g[0] for t, g in grads.items()}


async def pushed_peers(n: int, seed: int, **kw) -> tuple[list[Peer], np.random.Generator]:
    """``n`` peers with a shared view, each having pushed random row gradients once."""
    peers = await start_peers(n, **kw)
    try:
        await until(lambda: settled(peers), what="a shared view")
        rng = np.random.default_rng(seed)
        for i, p in enumerate(peers):
            await push_random(p, rng, key=f"{p.id}:{i}")
    except BaseException:
        for p in peers:
            await p.close()
        raise
    return peers, rng


async def test_pulled_rows_equal_the_owners_copy_and_replicas_match_their_primary():
    peers = await start_peers(3, row_dtype="fp32")
    try:
        await until(lambda: settled(peers), what="a shared view")
        rng = np.random.default_rng(0)
        for i, p in enumerate(peers * 2):
            await push_random(p, rng, key=f"{p.id}:{i}")
        want = {t: np.unique(rng.integers(0, peers[0].cfg.table_rows, 500)) for t in TABLES}
        rows, missing = await peers[1].table_client.pull(want)
        assert not any(len(v) for v in missing.values())
        omap = peers[0].tables.map
        for t in TABLES:
            for owner, sub in omap.plan(t, want[t]).items():
                peer = next(p for p in peers if p.id == owner)
                pos = torch.from_numpy(np.searchsorted(want[t], sub))
                assert torch.equal(rows[t][pos], peer.tables.shards[t].read(sub))
        # every replica replayed every update: bit-identical rows and optimizer state
        for t in TABLES:
            for slot in range(omap.n_slots(t)):
                sums = {p.tables.shards[t].checksum(slot) for p in holders(peers, t, slot)}
                assert len(sums) == 1, (t, slot)
        assert sum(p.tables.stats.replays_applied for p in peers) > 0
    finally:
        for p in peers:
            await p.close()


async def test_a_push_is_applied_exactly_once_even_when_retried():
    import aiohttp

    peers = await start_peers(2)
    try:
        await until(lambda: settled(peers), what="a shared view")
        a, b = peers
        ids = a.tables.map.plan("ngram", np.arange(1024))[b.id][:8]  # rows whose primary is b (64 rows = 8 slots were all a's now and then)
        before = b.tables.shards["ngram"].steps(ids).clone()
        req = PushRequest(view=b.tables.view, key=f"{a.id}:7", ids={"ngram": ids},
                          grads={"ngram": torch.full((len(ids), 128), 0.5)})
        body = encode_push(req)
        async with aiohttp.ClientSession() as s:
            for _ in range(3):  # (each a new request, signed anew, with the same push key)
                async with s.post(f"http://127.0.0.1:{b.port}/v1/rows/push", data=body,
                                  headers=signed(a, b, "POST", "/v1/rows/push", body)) as r:
                    assert r.status == 200
            stale = encode_push(PushRequest(view="0" * 16, key=f"{a.id}:8", ids={"ngram": ids},
                                            grads={"ngram": torch.ones(len(ids), 128)}))
            async with s.post(f"http://127.0.0.1:{b.port}/v1/rows/push", data=stale,
                              headers=signed(a, b, "POST", "/v1/rows/push", stale)) as r:
                assert r.status == 409 and (await r.json())["code"] == "view-mismatch"
            async with s.post(f"http://127.0.0.1:{b.port}/v1/rows/push", data=body[:-10],
                              headers=signed(a, b, "POST", "/v1/rows/push", body[:-10])) as r:
                assert r.status == 400
        assert torch.equal(b.tables.shards["ngram"].steps(ids), before + 1)
        assert b.tables.stats.duplicate_pushes == 2
    finally:
        for p in peers:
            await p.close()


async def test_a_replica_behind_on_some_rows_gets_the_rest_replayed_and_only_those_rows_healed():
    """Over HTTP: a replay that finds a few rows of the replica at another update count (a join's
    fetch missed a flush) is applied to the other rows; the primary sends the full state of those
    few only, and the replica ends bit-identical."""
    peers = await start_peers(2, replicas=2, row_dtype="fp32")
    try:
        await until(lambda: settled(peers), what="a shared view")
        a, b = peers
        mine = a.tables.map.plan("ngram", np.arange(a.cfg.table_rows))[a.id][:200]  # a primary, b replica
        behind = mine[[3, 50, 120]]
        b.tables.shards["ngram"].apply_grads(behind, torch.full((3, 128), 0.25))  # counters now differ
        g = torch.from_numpy(np.random.default_rng(3).standard_normal((len(mine), 128)).astype(np.float32)) * 0.01
        assert await a.table_client.push({"ngram": (mine, g)}, key=f"{b.id}:1")
        await until(lambda: b.tables.stats.replays_diverged == 1 and a.table_client.stats.rows_healed == 3,
                    what="the replay and its heal")
        assert b.tables.stats.rows_stale == 3 and b.tables.stats.replica_updates == 1
        for s in np.unique(a.tables.map.slot_of("ngram", mine)).tolist():
            assert a.tables.shards["ngram"].checksum(s) == b.tables.shards["ngram"].checksum(s)
        assert b.tables.shards["ngram"].steps(mine).tolist() == [1] * len(mine)
    finally:
        for p in peers:
            await p.close()


async def test_a_replica_a_replay_did_not_reach_is_caught_up_in_the_background():
    """A replay that does not land (the replica timed out, was unreachable or on another view for
    a moment) leaves the replica's rows behind; the primary owes them their full state and sends
    it until the replica takes it, so a crash of the primary then would lose nothing."""
    from swarm.transport import PeerUnreachable

    peers = await start_peers(2, replicas=2, row_dtype="fp32")
    try:
        await until(lambda: settled(peers), what="a shared view")
        a, b = peers
        mine = a.tables.map.plan("ngram", np.arange(a.cfg.table_rows))[a.id][:300]  # a primary, b replica
        down = {"replays": True, "catch_ups": 2}  # replays fail; so do the first two catch-ups
        real = a.transport.request

        async def flaky(method, url, **kw):
            if url.endswith("/v1/rows/replay") and down["replays"]:
                raise PeerUnreachable(url, "dropped by the test")
            if url.endswith("/v1/rows/replica") and down["catch_ups"] > 0:
                down["catch_ups"] -= 1
                raise PeerUnreachable(url, "dropped by the test")
            return await real(method, url, **kw)

        a.transport.request = flaky
        rng = np.random.default_rng(4)
        g = torch.from_numpy(rng.standard_normal((len(mine), 128)).astype(np.float32)) * 0.01
        assert await b.table_client.push({"ngram": (mine, g)}, key=f"{b.id}:1")
        down["replays"] = False
        slots = np.unique(a.tables.map.slot_of("ngram", mine)).tolist()
        assert a.table_client.status()["rows_owed"] == {b.id: len(mine)}
        assert any(a.tables.shards["ngram"].checksum(s) != b.tables.shards["ngram"].checksum(s) for s in slots)
        # a second push of half the rows replays fine while the first is still owed
        half = mine[::2]
        assert await b.table_client.push({"ngram": (half, g[::2])}, key=f"{b.id}:2")
        await until(lambda: not len(a.table_client.owed), what="the catch-up to land")
        assert down["catch_ups"] == 0 and a.table_client.stats.rows_caught_up > 0
        assert a.table_client.status()["rows_owed"] == {}
        for s in slots:
            assert a.tables.shards["ngram"].checksum(s) == b.tables.shards["ngram"].checksum(s), s
        assert b.tables.shards["ngram"].steps(mine).tolist() == [2 if i % 2 == 0 else 1 for i in range(len(mine))]
    finally:
        for p in peers:
            await p.close()


async def test_a_leaving_primary_catches_its_replicas_up_before_it_goes():
    from swarm.transport import PeerUnreachable

    peers = await start_peers(2, replicas=2, row_dtype="fp32")
    try:
        await until(lambda: settled(peers), what="a shared view")
        a, b = peers
        mine = a.tables.map.plan("value", np.arange(a.cfg.table_rows))[a.id][:200]
        real = a.transport.request
        drop = {"replays": True}

        async def flaky(method, url, **kw):
            if url.endswith("/v1/rows/replay") and drop["replays"]:
                raise PeerUnreachable(url, "dropped by the test")
            return await real(method, url, **kw)

        a.transport.request = flaky
        g = torch.full((len(mine), 128), 0.01)
        assert await b.table_client.push({"value": (mine, g)}, key=f"{b.id}:1")
        assert len(a.table_client.owed) == len(mine)
        want = a.tables.shards["value"].read_state(mine)
        await a.leave()  # before the background catch-up's first round (0.5 s after the failure)
        got = b.tables.shards["value"].read_state(mine)
        assert all(torch.equal(got[k], v) for k, v in want.items())
        assert a.table_client.stats.rows_caught_up == len(mine)
        assert not [e for e in a.events if e["kind"] == "rows-owed"]
    finally:
        for p in peers:
            await p.close()


async def test_a_crashed_peer_loses_no_rows_with_two_replicas():
    peers = await start_peers(4, replicas=2)
    try:
        await until(lambda: settled(peers), what="a shared view")
        rng = np.random.default_rng(1)
        for i, p in enumerate(peers * 2):
            await push_random(p, rng, key=f"{p.id}:{i}")
        # a false suspicion under load can change the view during the pushes: the checksums are of
        # the slots where the view, once settled again, has them (no hand-off still fetching)
        await until(lambda: settled(peers), timeout=60, what="a shared view after the pushes")
        omap = peers[0].tables.map
        written = {(t, s): holders(peers, t, s)[0].tables.shards[t].checksum(s)
                   for t in TABLES for s in range(omap.n_slots(t))}
        for (t, s), checksum in written.items():  # every replica holds what its primary wrote
            assert all(h.tables.shards[t].checksum(s) == checksum for h in holders(peers, t, s)), (t, s)
        victim, survivors = peers[2], [p for i, p in enumerate(peers) if i != 2]
        await victim.close()  # a crash: no leave message, the socket just goes away
        await until(lambda: settled(survivors), timeout=60, what="the survivors to re-own the victim's slots")
        for t in TABLES:
            for s in range(omap.n_slots(t)):
                for h in holders(survivors, t, s):
                    assert h.tables.shards[t].checksum(s) == written[(t, s)], (t, s)
        assert sum(p.tables.stats.slots_lost for p in survivors) == 0
        assert sum(p.tables.stats.slots_fetched for p in survivors) > 0
    finally:
        for p in peers:
            await p.close()


async def test_a_joiner_gets_its_slots_from_the_old_owners():
    peers = await start_peers(2)
    try:
        await until(lambda: settled(peers), what="a shared view")
        rng = np.random.default_rng(2)
        await push_random(peers[0], rng, key=f"{peers[0].id}:1")
        omap = peers[0].tables.map
        before = {(t, s): holders(peers, t, s)[0].tables.shards[t].checksum(s)
                  for t in TABLES for s in range(omap.n_slots(t))}
        joiner = Peer(small_cfg(join=f"127.0.0.1:{peers[1].port}"), out=lambda line: None)
        await joiner.start()
        peers.append(joiner)
        await until(lambda: settled(peers), timeout=60, what="the joiner to fetch its slots")
        newmap = joiner.tables.map
        mine = [(t, s) for t in TABLES for s in range(newmap.n_slots(t)) if joiner.id in newmap.owners(t, s)]
        moved = sum(1 for t, s in mine if newmap.owners(t, s)[0] == joiner.id)
        total = sum(newmap.n_slots(t) for t in TABLES)
        assert 0 < moved <= 1.5 * total / 3  # about 1/N of the primaries move to the joiner
        for t, s in mine:
            assert joiner.tables.shards[t].checksum(s) == before[(t, s)]
        assert joiner.tables.stats.slots_fetched == len(mine) and joiner.tables.stats.slots_lost == 0
    finally:
        for p in peers:
            await p.close()


async def test_two_joins_at_once_lose_no_rows_with_one_replica():
    """With R = 1, a slot can move on again (p0 -> a -> b) before its first new owner fetched it;
    the last owner then finds it only at p0, which holds it for release and is in no map it saw."""
    first = Peer(small_cfg(replicas=1), out=lambda line: None)
    await first.start()
    peers = [first]
    try:
        await until(lambda: settled(peers), what="the first peer's map")
        await push_random(first, np.random.default_rng(5), key=f"{first.id}:1", n=2000)
        omap = first.tables.map
        before = {(t, s): first.tables.shards[t].checksum(s) for t in TABLES for s in range(omap.n_slots(t))}
        joiners = [Peer(small_cfg(replicas=1, join=f"127.0.0.1:{first.port}"), out=lambda line: None)
                   for _ in range(3)]
        await asyncio.gather(*(j.start() for j in joiners))
        peers += joiners
        await until(lambda: settled(peers), timeout=90, what="every joiner to fetch its slots")
        newmap = first.tables.map
        for (t, s), checksum in before.items():
            (owner,) = holders(peers, t, s)
            assert owner.tables.shards[t].checksum(s) == checksum, (t, s, owner.id)
        assert sum(p.tables.stats.slots_lost for p in peers) == 0
        assert newmap.members == tuple(sorted(p.id for p in peers))
    finally:
        for p in peers:
            await p.close()


async def test_a_perturbed_table_replica_is_repaired_from_its_primary_by_the_audit():
    """A replica slot whose rows changed with their update counters intact (the replay checks
    cannot see it) is found by the audit and replaced by the primary's copy, over HTTP."""
    import aiohttp

    peers, rng = await pushed_peers(3, 3, row_dtype="fp32")
    try:
        omap = peers[0].tables.map
        table = "ngram"
        slot = next(s for s in range(omap.n_slots(table))
                    if peers[0].tables.shards[table].has_slot(s) and int(peers[0].tables.shards[table].digest(s)[0]))
        primary, replica = (next(p for p in peers if p.id == o) for o in omap.owners(table, slot))
        assert [await p.audit_tables() for p in peers] == [0, 0, 0]  # all in step

        lo, _ = omap.slot_rows(table, slot)

        def perturb():  # the in-process test hook: the shard's own replica-update call, no route
            state = replica.tables.shards[table].read_state(np.array([lo]))
            state["rows"] = state["rows"] + 0.25
            replica.tables.shards[table].apply_replica_update(state)
        await replica.table_work(perturb)
        assert replica.tables.shards[table].checksum(slot) != primary.tables.shards[table].checksum(slot)

        assert await replica.audit_tables() == 1
        assert replica.tables.shards[table].checksum(slot) == primary.tables.shards[table].checksum(slot)
        assert any(e["kind"] == "table-repair" for e in replica.events)
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{replica.port}/metrics") as r:
                assert "swarm_table_replicas_repaired_total 1.0" in await r.text()
            # the digest route refuses what it cannot answer, with a reason
            for body, status in ((b"\x81\xa5table\xa4nope", 400),
                                 (msgpack.packb({"table": table, "view": "f" * 16, "slots": [slot]}), 409),
                                 (msgpack.packb({"table": table, "view": omap.view, "slots": []}), 400),
                                 (msgpack.packb({"table": table, "view": omap.view, "slots": ["x"]}), 400)):
                async with s.post(f"http://127.0.0.1:{primary.port}/v1/rows/digests", data=body,
                                  headers=signed(replica, primary, "POST", "/v1/rows/digests", body)) as r:
                    assert r.status == status, await r.text()
                    assert "error" in await r.json()
    finally:
        for p in peers:
            await p.close()


async def test_a_pull_that_offers_its_held_rows_gets_only_the_changed_ones_and_the_owners_rows():
    """Conditional pulls (local steps, tables/held.py): the second pull of the same rows carries the
    tags of the rows the first one brought; owners leave out the rows whose encoding did not
    change, and what the puller ends up with is, row for row, what a whole pull gives."""
    # (bodies plain: the byte bound below is on rows, and zstd shrinks a whole pull's more than a tag's)
    peers, rng = await pushed_peers(3, 5, row_dtype="int4", wire_compression="none")
    try:
        client = peers[1].table_client
        client.use_held(1 << 16)
        want = {t: np.unique(rng.integers(0, peers[0].cfg.table_rows, 400)) for t in TABLES}
        counts = peers[1].transport.counts
        r0 = counts.received.get("rows", 0)
        await client.pull(want)
        first_bytes = counts.received["rows"] - r0
        assert client.stats.rows_reused == 0  # nothing held yet
        client.next_window()
        moved = await push_random(peers[0], rng, key=f"{peers[0].id}:9", n=100)  # rows that change since
        r1 = counts.received["rows"]
        rows, missing = await client.pull(want)
        second_bytes = counts.received["rows"] - r1
        assert not any(len(v) for v in missing.values())
        omap = peers[0].tables.map
        remote = unmoved = 0
        for t in TABLES:
            for owner, sub in omap.plan(t, want[t]).items():
                peer = next(p for p in peers if p.id == owner)
                pos = torch.from_numpy(np.searchsorted(want[t], sub))
                exact = peer.tables.shards[t].read(sub)
                far = torch.from_numpy(~omap.owned_mask(peers[1].id, t, sub))  # else read here, exactly
                exact[far] = roundtrip(exact[far], "int4")
                remote += int(far.sum())
                unmoved += int((far.numpy() & ~np.isin(sub, moved[t])).sum())
                assert torch.equal(rows[t][pos], exact), (t, owner)
        # every remote row nobody pushed was left out (a pushed one too, when int4 did not see it move)
        assert client.stats.rows_offered == remote  # the second pull tagged every row the first brought
        assert unmoved <= client.stats.rows_reused < remote
        assert second_bytes < first_bytes * (1 - 0.5 * unmoved / remote)
        assert client.status()["rows_reused"] == client.stats.rows_reused
    finally:
        for p in peers:
            await p.close()


async def test_a_pull_waits_for_the_replay_its_push_answer_named_before_reading_its_replica_copy(monkeypatch):
    """Read-your-writes for replica rows (--push-ack applied: local steps): b pushes rows whose
    primary is a and of which b holds the replica; a answers once the flush is applied, naming its
    replay, and replicates after. A pull of those rows by b, which reads its own replica copy, waits
    for that replay and so sees its own push, as a pull from the primary would; a replay that
    never comes holds a pull REPLAY_WAIT_S once, not every pull after."""
    import swarm.tables.http as tables_http
    from swarm.transport import PeerUnreachable

    monkeypatch.setattr(tables_http, "REPLAY_WAIT_S", 1.0)
    peers = await start_peers(2, replicas=2, row_dtype="fp32", push_ack="applied")
    try:
        await until(lambda: settled(peers), what="a shared view")
        a, b = peers
        mine = a.tables.map.plan("ngram", np.arange(a.cfg.table_rows))[a.id][:300]  # a primary, b replica
        release = asyncio.Event()
        state = {"drop": False}
        real = a.transport.request

        async def held_back(method, url, **kw):
            if url.endswith("/v1/rows/replay"):
                if state["drop"]:
                    raise PeerUnreachable(url, "dropped by the test")
                await release.wait()
            if url.endswith("/v1/rows/replica") and state["drop"]:
                raise PeerUnreachable(url, "dropped by the test")  # no catch-up either
            return await real(method, url, **kw)

        a.transport.request = held_back
        rng = np.random.default_rng(5)
        g = torch.from_numpy(rng.standard_normal((len(mine), 128)).astype(np.float32)) * 0.01
        assert await b.table_client.push({"ngram": (mine, g)}, key=f"{b.id}:1")  # answered, not replicated
        assert b.table_client.replays.due({a.id}) == {a.id}
        pull = asyncio.ensure_future(b.table_client.pull({"ngram": mine}))
        await asyncio.sleep(0.3)
        assert not pull.done(), "the pull read the replica copy before the replay it was told of"
        release.set()
        rows, missing = await asyncio.wait_for(pull, 10)
        assert not len(missing.get("ngram", ()))
        primary = a.tables.shards["ngram"].read(mine)
        assert torch.equal(rows["ngram"], primary), "b's pull did not see its own push"
        st = b.table_client.status()
        assert st["replay_waits"] == 1 and st["replays_given_up"] == 0 and st["replay_wait_s"] >= 0.25
        assert st["rows_read_local"] >= len(mine)  # read from b's own copy, not pulled from a

        state["drop"] = True  # the next flush's replay to b never lands
        assert await b.table_client.push({"ngram": (mine, g)}, key=f"{b.id}:2")
        await b.table_client.pull({"ngram": mine})  # waits out REPLAY_WAIT_S, then reads its copy
        st = b.table_client.status()
        assert st["replay_waits"] == 2 and st["replays_given_up"] == 1 and st["replay_wait_s"] >= 0.25 + 1.0
        await b.table_client.pull({"ngram": mine})  # given up on: the next pull does not wait again
        st = b.table_client.status()
        assert st["replay_waits"] == 2 and st["replays_given_up"] == 1
    finally:
        for p in peers:
            await p.close()


async def test_an_evaluation_pull_reads_the_primaries_not_a_replica_copy_a_replay_has_not_reached():
    """pull(primaries=True), the evaluations' pull: rows of a slot we hold only as a replica come
    from its primary, so a replay still on its way (here: dropped, as for a flush that did not
    carry our push, whose replay no answer names) cannot make our evaluation read other rows than
    the others'; a slot whose primary is down is read from our copy, beside the slots we are
    primary of, in one local read."""
    from swarm.transport import PeerUnreachable

    peers = await start_peers(2, replicas=2, row_dtype="fp32", push_ack="applied")
    try:
        await until(lambda: settled(peers), what="a shared view")
        a, b = peers
        plan = a.tables.map.plan("ngram", np.arange(a.cfg.table_rows))
        theirs, ours = plan[a.id][:200], plan[b.id][:100]  # a primary (b replica), b primary
        real = a.transport.request

        async def no_replays(method, url, **kw):
            if url.endswith("/v1/rows/replay") or url.endswith("/v1/rows/replica"):
                raise PeerUnreachable(url, "dropped by the test")
            return await real(method, url, **kw)

        a.transport.request = no_replays
        g = torch.from_numpy(np.random.default_rng(7).standard_normal((len(theirs), 128)).astype(np.float32))
        # a's pusher is a itself, so no answer names the replay to b: the case the wait cannot cover
        assert await a.table_client.push({"ngram": (theirs, g * 0.01)}, key=f"{a.id}:1")
        primary = a.tables.shards["ngram"].read(theirs)
        copy = b.tables.shards["ngram"].read(theirs)
        assert not torch.equal(primary, copy), "the replay reached b: nothing left to show"
        assert not len(b.table_client.replays)  # nothing told b to wait

        want = {"ngram": np.sort(np.concatenate([theirs, ours]))}
        at = np.searchsorted(want["ngram"], theirs)
        local0 = b.table_client.stats.rows_read_local
        rows, missing = await b.table_client.pull(want)  # a training pull reads b's own copy
        assert torch.equal(rows["ngram"][at], copy) and not len(missing.get("ngram", ()))
        assert b.table_client.stats.rows_read_local - local0 == len(want["ngram"])

        local0, remote0 = b.table_client.stats.rows_read_local, b.table_client.stats.rows_pulled_remote
        rows, missing = await b.table_client.pull(want, dtype="fp32", primaries=True)
        assert torch.equal(rows["ngram"][at], primary), "an evaluation read b's stale replica copy"
        assert torch.equal(rows["ngram"][np.searchsorted(want["ngram"], ours)], b.tables.shards["ngram"].read(ours))
        assert b.table_client.stats.rows_read_local - local0 == len(ours)
        assert b.table_client.stats.rows_pulled_remote - remote0 == len(theirs)

        down = b.table_client.down
        b.table_client.down = lambda: down() | {a.id}  # a's slots are read where b holds them
        local0 = b.table_client.stats.rows_read_local
        rows, missing = await b.table_client.pull(want, dtype="fp32", primaries=True)
        assert torch.equal(rows["ngram"][at], copy) and not len(missing.get("ngram", ()))
        assert b.table_client.stats.rows_read_local - local0 == len(want["ngram"])
    finally:
        for p in peers:
            await p.close()
