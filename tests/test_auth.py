"""Authentication: the signing core (swarm/auth.py), the server's middleware, the status token, a
2-peer swarm with a secret, and a joiner with the wrong secret (docs/security.md)."""

from __future__ import annotations

import asyncio
import hmac
import time

import aiohttp
import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from swarm import auth
from swarm.config import ConfigError, PeerConfig
from swarm.node import JoinError, Peer
from swarm.server import UNAUTHORIZED_REASON

from .conftest import rel_l2, small_cfg

pytestmark = pytest.mark.timeout(180)

SECRET = "correct horse battery staple 42"
T0 = 1_700_000_000.0


def signed(method="POST", path="/v1/ping", body=b"x", now=T0, secret=SECRET, nonce=None):
    return auth.sign(secret, method, path, auth.body_hash(body), auth.format_timestamp(now), nonce or auth.new_nonce())


# -- the core ------------------------------------------------------------------------------------

def test_sign_and_verify_round_trip_and_every_field_is_covered():
    v = auth.Verifier(SECRET)
    h = signed()
    assert set(h) == set(auth.HEADERS) and len(h[auth.SIGNATURE]) == 64
    bh = auth.body_hash(b"x")
    # each field changed -> refused (fresh nonces so that replay is not what refuses them)
    for method, path, body_h in [("GET", "/v1/ping", bh), ("POST", "/v1/pong", bh),
                                 ("POST", "/v1/ping?x=1", bh), ("POST", "/v1/ping", auth.body_hash(b"y"))]:
        assert not v.verify(method, path, body_h, signed(), T0)
    assert not v.verify("POST", "/v1/ping", bh, signed(secret="another secret of some length"), T0)
    h2 = signed()
    assert not v.verify("POST", "/v1/ping", bh, {**h2, auth.TIMESTAMP: auth.format_timestamp(T0 + 1)}, T0)
    assert not v.verify("POST", "/v1/ping", bh, {**h2, auth.NONCE: auth.new_nonce()}, T0)
    assert v.verify("POST", "/v1/ping", bh, h2, T0)
    assert v.verify("post", "/v1/ping", bh, signed(), T0)  # the method is upper-cased on both sides


def test_stale_and_future_timestamps_and_replays_are_refused():
    v = auth.Verifier(SECRET, skew=30)
    bh = auth.body_hash(b"x")
    assert not v.verify("POST", "/v1/ping", bh, signed(now=T0 - 30.5), T0)
    assert not v.verify("POST", "/v1/ping", bh, signed(now=T0 + 30.5), T0)
    assert v.verify("POST", "/v1/ping", bh, signed(now=T0 - 29), T0)
    h = signed(now=T0 + 29)
    assert v.verify("POST", "/v1/ping", bh, h, T0)
    for later in (T0, T0 + 10, T0 + 59):  # replayed while the timestamp is fresh: the nonce is known
        assert not v.verify("POST", "/v1/ping", bh, h, later)
    assert not v.verify("POST", "/v1/ping", bh, h, T0 + 60)  # then it is stale
    assert len(v) == 0  # and its nonce was forgotten: the cache never outgrows the window


def test_replay_cache_is_bounded_and_fails_closed():
    v = auth.Verifier(SECRET, skew=30, max_nonces=10)
    bh = auth.body_hash(b"")
    for i in range(10):
        assert v.verify("GET", "/v1/state", bh, signed("GET", "/v1/state", b"", now=T0), T0 + i)
    assert len(v) == 10
    assert not v.verify("GET", "/v1/state", bh, signed("GET", "/v1/state", b"", now=T0 + 10), T0 + 10)
    assert len(v) == 10
    # once the first ones are stale they are forgotten and requests pass again
    assert v.verify("GET", "/v1/state", bh, signed("GET", "/v1/state", b"", now=T0 + 31), T0 + 31)
    assert len(v) == 1


def test_malformed_headers_are_refused_without_exceptions():
    v = auth.Verifier(SECRET)
    bh = auth.body_hash(b"x")
    good = signed()
    bad = [{}, {k: v_ for k, v_ in good.items() if k != auth.NONCE},
           {**good, auth.TIMESTAMP: "NaN"}, {**good, auth.TIMESTAMP: "inf"}, {**good, auth.TIMESTAMP: "-1"},
           {**good, auth.TIMESTAMP: "1e9"}, {**good, auth.TIMESTAMP: " " + good[auth.TIMESTAMP]},
           {**good, auth.NONCE: "short"}, {**good, auth.NONCE: "x" * 65}, {**good, auth.NONCE: "a b" * 8},
           {**good, auth.SIGNATURE: good[auth.SIGNATURE].upper()}, {**good, auth.SIGNATURE: "00"},
           {**good, auth.SIGNATURE: "é" * 64}]
    for h in bad:
        assert not v.verify("POST", "/v1/ping", bh, h, T0)
    assert not v.verify("POST", "/v1/ping", "not a hash", good, T0)
    assert v.verify("POST", "/v1/ping", bh, good, T0)


def test_signature_is_compared_in_constant_time(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    v = auth.Verifier(SECRET)
    h = signed()
    h[auth.SIGNATURE] = "0" * 64
    assert not v.verify("POST", "/v1/ping", auth.body_hash(b"x"), h, T0)
    assert len(calls) == 1 and auth.token_ok("abc", "abd") is False and len(calls) == 2


def test_keys_are_derived_and_distinct():
    assert auth.request_key(SECRET) != SECRET.encode()
    tok = auth.status_token(SECRET)
    assert tok != auth.request_key(SECRET).hex()[:40] and tok == auth.status_token(SECRET)
    assert auth.status_token(SECRET + "x") != tok
    assert len(auth.generate_secret()) >= 40 and auth.generate_secret() != auth.generate_secret()
    with pytest.raises(ValueError):
        auth.Verifier("")


@settings(max_examples=200, derandomize=True, deadline=None)
@given(field=st.sampled_from(["method", "path", "body", "ts", "nonce", "sig"]), data=st.data())
def test_any_change_to_a_signed_request_is_refused(field, data):
    v = auth.Verifier(SECRET)
    req = {"method": "POST", "path": "/v1/grads", "body": b"payload", "ts": auth.format_timestamp(T0),
           "nonce": "n" * 24}
    h = auth.sign(SECRET, req["method"], req["path"], auth.body_hash(req["body"]), req["ts"], req["nonce"])
    if field == "sig":
        new = data.draw(st.text("0123456789abcdef", min_size=64, max_size=64).filter(lambda s: s != h[auth.SIGNATURE]))
        h = {**h, auth.SIGNATURE: new}
    elif field == "body":
        req["body"] = data.draw(st.binary(max_size=64).filter(lambda b: b != b"payload"))
    elif field == "ts":
        new = data.draw(st.floats(T0 - 20, T0 + 20).map(auth.format_timestamp).filter(lambda s: s != req["ts"]))
        h = {**h, auth.TIMESTAMP: new}
    elif field == "nonce":
        new = data.draw(st.text("abcdefghijklmnop0123456789_-", min_size=16, max_size=64)
                        .filter(lambda s: s != req["nonce"]))
        h = {**h, auth.NONCE: new}
    else:
        req[field] = data.draw(st.text(min_size=1, max_size=20).filter(lambda s: s.upper() != req[field]))
    assert not v.verify(req["method"], req["path"], auth.body_hash(req["body"]), h, T0)


def test_config_checks_the_secret_flags():
    PeerConfig(secret="generate").validate()
    PeerConfig(secret=SECRET, status_auth=1).validate()
    for kw, needle in [({"secret": "generate", "join": "127.0.0.1:9"}, "first peer"),
                       ({"secret": "short"}, "--secret"), ({"secret": " " + SECRET}, "--secret"),
                       ({"status_auth": 1}, "--status-auth"), ({"secret": SECRET, "status_auth": 2}, "--status-auth")]:
        with pytest.raises(ConfigError, match=needle):
            PeerConfig(**kw).validate()
    assert SECRET not in repr(PeerConfig(secret=SECRET))


# -- the server ----------------------------------------------------------------------------------

async def start_peer(**kw) -> Peer:
    peer = Peer(small_cfg(**kw), out=lambda line: None)
    await peer.start()
    return peer


@pytest.fixture
async def locked():
    p = await start_peer(secret=SECRET, status_auth=1)
    yield p
    await p.close()


async def send(s: aiohttp.ClientSession, p: Peer, method: str, path: str, body: bytes = b"", headers=None):
    async with s.request(method, f"http://127.0.0.1:{p.port}{path}", data=body, headers=headers or {}) as r:
        return r.status, await r.read()


def sig_headers(method, path, body, *, secret=SECRET, now=None, nonce=None):
    return auth.sign(secret, method, path, auth.body_hash(body), auth.format_timestamp(now or time.time()),
                     nonce or auth.new_nonce())


V1 = [("POST", "/v1/join"), ("POST", "/v1/ping"), ("POST", "/v1/ping-req"), ("POST", "/v1/sync"),
      ("POST", "/v1/leave"), ("POST", "/v1/grads"), ("GET", "/v1/state"), ("POST", "/v1/rows/pull"),
      ("POST", "/v1/rows/push"), ("POST", "/v1/rows/replay"), ("POST", "/v1/rows/replica"),
      ("POST", "/v1/rows/slots"), ("POST", "/v1/rows/digests"), ("POST", "/v1/no-such-route")]


async def test_missing_wrong_stale_and_replayed_requests_get_the_same_401(locked):
    p = locked
    members_before = [(m.peer_id, m.state) for m in p.members.members()]
    replies = set()
    async with aiohttp.ClientSession() as s:
        for method, path in V1:
            body = b"" if method == "GET" or "no-such" in path else msgpack.packb({"v": 1, "type": "ping"})
            good = sig_headers(method, path, body)
            cases = {
                "missing": {},
                "wrong secret": sig_headers(method, path, body, secret="not the swarm secret at all"),
                "stale": sig_headers(method, path, body, now=time.time() - 31),
                "future": sig_headers(method, path, body, now=time.time() + 31),
                "other body": sig_headers(method, path, body + b"!"),
                "other path": sig_headers(method, path + "x", body),
                "bad signature": {**good, auth.SIGNATURE: "f" * 64},
            }
            for name, hdrs in cases.items():
                status, reply = await send(s, p, method, path, body, hdrs)
                assert status == 401, (path, name, status, reply)
                replies.add(reply)
            status, reply = await send(s, p, method, path, body, good)  # authentic: reaches the route
            assert status != 401, (path, status, reply)
            status, reply = await send(s, p, method, path, body, good)  # the same request again
            assert status == 401, (path, "replayed", status)
            replies.add(reply)
    assert len(replies) == 1  # one answer for every failure: nothing about which check failed
    assert b"401" in replies.pop()
    assert [(m.peer_id, m.state) for m in p.members.members()] == members_before
    assert p.verifier.refused > 0


async def test_unsigned_oversized_bodies_are_refused_before_reading_and_signed_ones_hit_the_limit(locked):
    p = locked
    big = b"\x80" * (300 * 1024)
    async with aiohttp.ClientSession() as s:
        status, _ = await send(s, p, "POST", "/v1/ping", big)
        assert status == 401
        status, _ = await send(s, p, "POST", "/v1/ping", big, sig_headers("POST", "/v1/ping", big))
        assert status == 413
        status, _ = await send(s, p, "GET", "/v1/state", b"x", sig_headers("GET", "/v1/state", b"x"))
        assert status == 413  # no GET route takes a body


async def test_status_routes_need_the_token_when_status_auth_is_on(locked):
    p = locked
    tok = p.status_token
    async with aiohttp.ClientSession() as s:
        for path in ("/", "/api/status", "/metrics", "/api/status?token=wrong"):
            status, _ = await send(s, p, "GET", path)
            assert status == 401, path
        status, _ = await send(s, p, "GET", "/static/app.js")
        assert status == 200  # assets hold no data
        status, body = await send(s, p, "GET", f"/api/status?token={tok}")
        assert status == 200 and p.id.encode() in body
        status, _ = await send(s, p, "GET", "/metrics", headers={"Authorization": f"Bearer {tok}"})
        assert status == 200
        status, _ = await send(s, p, "GET", "/api/status", headers=sig_headers("GET", "/api/status", b""))
        assert status == 200
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as s:
        async with s.get(f"http://127.0.0.1:{p.port}/?token={tok}") as r:
            assert r.status == 200 and "HttpOnly" in r.headers.get("Set-Cookie", "")
        async with s.get(f"http://127.0.0.1:{p.port}/api/status") as r:  # the page's own fetch
            assert r.status == 200
        async with s.get(f"http://127.0.0.1:{p.port}/api/events") as r:
            assert r.status == 200
            assert (await r.content.readline()).startswith(b"retry:")


async def test_status_routes_stay_open_by_default_with_a_secret():
    p = await start_peer(secret=SECRET)
    try:
        async with aiohttp.ClientSession() as s:
            status, _ = await send(s, p, "GET", "/api/status")
            assert status == 200
            status, _ = await send(s, p, "POST", "/v1/ping", b"\x80")
            assert status == 401
    finally:
        await p.close()


async def test_two_peers_with_a_secret_train_together():
    a = await start_peer(steps=8, min_peers=2, secret=SECRET)
    b = await start_peer(steps=8, min_peers=2, secret=SECRET, join=f"127.0.0.1:{a.port}")
    try:
        ra, rb = await asyncio.wait_for(asyncio.gather(a.run(), b.run()), 150)
    finally:
        for p in (a, b):
            await p.close()
    for r in (ra, rb):
        assert r["steps"] == 8 and r["steps_contributed"] == 8 and r["rounds_timed_out"] == 0
        assert r["bytes_received"] > 0
    assert rel_l2(ra["param_sketch"], rb["param_sketch"]) <= 1e-3
    for p in (a, b):
        assert p.verifier.accepted > 8 and p.verifier.refused == 0


async def test_a_peer_with_the_wrong_secret_cannot_join():
    a = await start_peer(secret=SECRET)
    try:
        for secret in ("", "a different secret entirely"):
            b = Peer(small_cfg(secret=secret, join=f"127.0.0.1:{a.port}"), out=lambda line: None)
            try:
                with pytest.raises(JoinError, match=r"refused to let us join: .*401"):
                    await b.start()
            finally:
                await b.close()
        assert [m.peer_id for m in a.members.members()] == [a.id]
    finally:
        await a.close()


async def test_cli_generates_a_secret_and_a_wrong_one_exits_2(spawn):
    from .test_peer_cli import run_cli

    first = spawn("--secret", "generate", "--min-peers", "2")  # waits: no training load meanwhile
    m = await first.read_until(r"join this swarm with: python3 peer.py --join (\S+) --secret (\S+)")
    addr, secret = m.group(1), m.group(2)
    assert len(secret) >= 40
    loop = asyncio.get_running_loop()
    wrong = ("y" if secret[0] == "x" else "x") + secret[1:]  # a generated secret may start with "x"
    r = await loop.run_in_executor(None, lambda: run_cli("--table-rows", "4096", "--join", addr,
                                                         "--secret", wrong))
    assert r.returncode == 2
    err = [line for line in r.stderr.strip().splitlines() if line]
    assert len(err) == 1 and "refused to let us join" in err[0] and "401" in err[0], r.stderr
    assert "Traceback" not in r.stderr
    assert UNAUTHORIZED_REASON in err[0]
