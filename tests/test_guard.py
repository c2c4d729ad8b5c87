"""The per-client limits over HTTP (swarm/guard.py): a flood from 127.0.0.2 gets 429 with Retry-After
while members (by identity, or from a member host) still pass; connection and event-stream caps.

A tiny app stands in for a peer: ``screen``, a test-only authentication that names the sender from
a header (as the real one will from a verified signature), ``admit``."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from swarm.bodies import SENDER
from swarm.guard import Guard
from swarm.limits import CONNECTIONS, MEMBER, OUTSIDER, RATE, STREAMS, Budget, Limits

pytestmark = pytest.mark.timeout(60)

FLOOD = "127.0.0.2"


@web.middleware
async def fake_auth(request: web.Request, handler):
    """Test only: X-Test-Sender names a verified member; X-Test-Forged is a bad signature (401)."""
    if "X-Test-Forged" in request.headers:
        return web.json_response({"error": "unauthorized", "code": "unauthorized"}, status=401)
    if "X-Test-Sender" in request.headers:
        request[SENDER] = request.headers["X-Test-Sender"]
    return await handler(request)


async def ok(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def events(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    try:
        while True:
            await resp.write(b"data: {}\n\n")
            await asyncio.sleep(0.05)
    except (ConnectionError, asyncio.CancelledError):
        pass
    return resp


@pytest.fixture
async def server():
    limits = Limits(Budget(rate=1000, burst=1000, connections=4, streams=2),
                    Budget(rate=0.5, burst=5, connections=3, streams=1))
    guard = Guard(limits, hosts=lambda: {"127.0.0.1": 1}, tarpit=0.05)  # (the default holds refusals 1 s)
    guard.slept = []

    async def hold(seconds: float) -> None:  # the tarpit's wait, recorded instead of waited
        guard.slept.append(seconds)

    guard.sleep = hold
    app = web.Application(middlewares=[guard.screen, fake_auth, guard.admit])
    app.router.add_get("/v1/x", ok)
    app.router.add_get("/api/events", events)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1)
    await runner.setup()
    listener = await guard.listen(runner, "127.0.0.1", 0, ssl_context=None)
    yield guard, listener.port
    await listener.close()
    await runner.cleanup()


def session(source: str | None = None, limit: int = 100) -> aiohttp.ClientSession:
    # (idle connections kept long: a held refusal makes the flood's loop slow, and a member's
    # connection must not be dropped and remade meanwhile, or it is a new one from the flood's address)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(
        limit=limit, local_addr=(source, 0) if source else None, force_close=False, keepalive_timeout=600))


async def get(s: aiohttp.ClientSession, port: int, path: str = "/v1/x", **headers) -> tuple[int, dict, dict]:
    try:
        async with s.get(f"http://127.0.0.1:{port}{path}", headers=headers) as r:
            return r.status, dict(r.headers), await r.json(content_type=None)
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError):
        return 0, {}, {}  # refused before the reply could be read (a reset)


async def test_flood_gets_429_while_members_pass(server):
    guard, port = server
    async with session(FLOOD, limit=1) as member, session(FLOOD) as flood, session() as local:
        # a member on the flood's own address: its first request (charged to the address, then
        # refunded) makes its connection its own
        assert (await get(member, port, **{"X-Test-Sender": "m1"}))[0] == 200
        results = [await get(flood, port) for _ in range(30)]
        statuses = [r[0] for r in results]
        assert statuses[:4] == [200] * 4 and 429 in statuses and set(statuses) <= {200, 429, 0}
        first = next(r for r in results if r[0] == 429)
        assert int(first[1]["Retry-After"]) >= 1 and first[2]["code"] == "rate_limited"
        forged = [await get(flood, port, **{"X-Test-Forged": "1"}) for _ in range(5)]
        # refused before "authentication" ran (on a slow machine a token may have come back meanwhile:
        # that one reaches authentication, and its forged signature gets the 401)
        assert sum(f[0] in (429, 0) for f in forged) >= 3 and all(f[0] in (429, 0, 401) for f in forged)
        for _ in range(20):  # the member's requests on its connection: its own budget
            assert (await get(member, port, **{"X-Test-Sender": "m1"}))[0] == 200
        for _ in range(20):  # a member host (127.0.0.1) has the member budget
            assert (await get(local, port))[0] == 200
    st = guard.status()
    assert st[OUTSIDER]["refused"][RATE] >= 20
    # outsider refusals are held back (the tarpit: the connection waits; at accept, the refused
    # connection is answered a second later), no member's is
    assert guard.slept and set(guard.slept) == {0.05} and len(guard.slept) <= st[OUTSIDER]["refused"][RATE]
    assert st[MEMBER]["refused"] == {"rate": 0, "connections": 0, "streams": 0, "clients": 0}
    assert st[MEMBER]["clients"] == 2  # m1 and the host 127.0.0.1


async def raw_connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(FLOOD, 0))


async def test_connection_cap_refuses_cheaply_and_frees_on_close(server):
    guard, port = server
    held = [await raw_connect(port) for _ in range(3)]
    r, w = await raw_connect(port)
    reply = await asyncio.wait_for(r.read(), 5)  # a fixed 429, then the server closes
    assert reply.startswith(b"HTTP/1.1 429 ") and b"Retry-After: 1" in reply and b"rate_limited" in reply
    w.close()
    assert guard.status()[OUTSIDER]["refused"][CONNECTIONS] == 1
    # a member's connection from the same address is counted against the member once claimed
    async with session(FLOOD, limit=1) as member:
        for hr, hw in held[:1]:
            hw.close()
            await hw.wait_closed()
        for _ in range(50):  # the server sees the close
            if guard.limits.connections[OUTSIDER] < 3:
                break
            await asyncio.sleep(0.02)
        assert (await get(member, port, **{"X-Test-Sender": "m1"}))[0] == 200
        assert guard.limits.connections == {MEMBER: 1, OUTSIDER: 2}
        r, w = await raw_connect(port)  # the address has room again
        w.write(b"GET /v1/x HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(r.readline(), 5)).startswith(b"HTTP/1.1 200")
        w.close()
    for _, hw in held[1:]:
        hw.close()


async def test_event_stream_cap(server):
    guard, port = server
    async with session(FLOOD) as flood, session() as local:
        first = await flood.get(f"http://127.0.0.1:{port}/api/events")
        assert first.status == 200
        status, headers, body = await get(flood, port, "/api/events")
        assert status == 429 and headers["Retry-After"] and body["code"] == "rate_limited"
        # a member host's streams have their own cap (2 here)
        streams = [await local.get(f"http://127.0.0.1:{port}/api/events") for _ in range(2)]
        assert [s.status for s in streams] == [200, 200]
        assert (await get(local, port, "/api/events"))[0] == 429
        first.close()
        for s in streams:
            s.close()
    assert guard.status()[OUTSIDER]["refused"][STREAMS] == 1


async def test_a_peer_limits_an_outsider_and_reports_it():
    from swarm.node import Peer

    from .conftest import small_cfg

    peer = Peer(small_cfg(outsider_limits="rate=1,burst=3"), out=lambda line: None)
    await peer.start()
    try:
        async with session(FLOOD) as flood, session() as local:
            statuses = [(await get(flood, peer.port, "/api/status"))[0] for _ in range(8)]
            assert statuses[:3] == [200] * 3 and 429 in statuses
            status, _, doc = await get(local, peer.port, "/api/status")  # this peer's own host: a member's
            assert status == 200 and doc["limits"]["outsider"]["refused"]["rate"] >= 1
            assert doc["limits"]["outsider"]["budget"]["burst"] == 3
            async with local.get(f"http://127.0.0.1:{peer.port}/metrics") as r:
                text = await r.text()
            assert 'swarm_limited_total{client="outsider",reason="rate"}' in text
    finally:
        await peer.close()
