"""Authentication: the signing core (swarm/auth.py), the server's middleware over TLS, the status
token and the plain status port, a 2-peer swarm with a secret, and joiners with the wrong secret
(docs/security.md). Identity, TLS pinning and replay across members: tests/test_identity.py."""

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
from swarm.identity import PeerKey
from swarm.node import JoinError, Peer

from .conftest import free_port, pin, rel_l2, small_cfg

pytestmark = pytest.mark.timeout(180)

SECRET = "correct horse battery staple 42"
T0 = 1_700_000_000.0
KEY_A, KEY_B, KEY_C = (PeerKey.from_seed(bytes([i]) * 32) for i in (1, 2, 3))
ME = frozenset([KEY_B.id])  # the receiver of the core tests


def signed(method="POST", path="/v1/ping", body=b"x", now=T0, secret=SECRET, key=KEY_A, to=KEY_B.id, peer_id=None):
    return auth.Signer(key, peer_id, secret).headers(method, path, body, now, to)


def check(v, h, method="POST", path="/v1/ping", body=b"x", now=T0, receivers=ME):
    return v.verify(method, path, auth.body_hash(body), h, now, receivers)


# -- the core ------------------------------------------------------------------------------------

def test_sign_and_verify_round_trip_and_every_field_is_covered():
    v = auth.Verifier(SECRET)
    h = signed()
    assert set(h) == {*auth.HEADERS, auth.MAC} and len(h[auth.SIGNATURE]) == 86 and len(h[auth.MAC]) == 64
    assert check(v, h) == KEY_A.id
    # each field changed -> refused (fresh nonces so that replay is not what refuses them)
    for kw in [dict(method="GET"), dict(path="/v1/pong"), dict(path="/v1/ping?x=1"), dict(body=b"y")]:
        assert check(v, signed(), **kw) is None
    assert check(v, signed(secret="another secret of some length")) is None
    h2 = signed()
    for name, value in [(auth.TIMESTAMP, auth.format_timestamp(T0 + 1)), (auth.NONCE, auth.new_nonce()),
                        (auth.TO, KEY_C.id), (auth.FROM, KEY_C.id)]:
        assert check(v, {**h2, name: value}, receivers=frozenset([KEY_B.id, KEY_C.id])) is None, name
    assert check(v, h2) == KEY_A.id
    assert check(v, signed(), method="post") == KEY_A.id  # the method is upper-cased on both sides


def test_a_request_signed_for_one_peer_is_refused_by_another():
    v = auth.Verifier(SECRET)
    h = signed(to=KEY_C.id)
    assert check(v, h) is None  # meant for C: B refuses it before looking at the signature
    assert auth.Verifier(SECRET).verify("POST", "/v1/ping", auth.body_hash(b"x"), h, T0, {KEY_C.id}) == KEY_A.id
    # a first contact names the address dialled; only the peer that has that address takes it
    first = signed(to=auth.address_name("127.0.0.1", 7000))
    assert check(v, first, receivers={KEY_B.id, "@127.0.0.1:7001"}) is None
    assert check(v, first, receivers={KEY_B.id, "@127.0.0.1:7000"}) == KEY_A.id


def test_a_key_cannot_speak_for_another_peer():
    v = auth.Verifier(SECRET)
    h = signed()
    # A's signature and key, but claiming to be C: the key is not C's
    assert check(v, {**h, auth.FROM: KEY_C.id}) is None
    # C's key in the header, A's signature: the signature does not verify under C's key
    forged = auth.Signer(KEY_A, None, SECRET).headers("POST", "/v1/ping", b"x", T0, KEY_B.id)
    forged[auth.KEY] = signed(key=KEY_C)[auth.KEY]
    forged[auth.FROM] = KEY_C.id
    assert check(v, forged) is None
    with pytest.raises(ValueError):
        auth.Signer(KEY_A, KEY_C.id, SECRET)
    # a rank of A's host group signs with A's key and its own id
    assert check(v, signed(peer_id=f"{KEY_A.id}~3")) == f"{KEY_A.id}~3"
    forged = signed(peer_id=f"{KEY_A.id}~3")
    assert check(v, {**forged, auth.FROM: f"{KEY_A.id}~03"}) is None  # not the id it signed, nor canonical
    with pytest.raises(ValueError):
        auth.Signer(KEY_A, f"{KEY_A.id}~03", SECRET)


def test_an_open_swarm_still_checks_every_signature():
    v = auth.Verifier(None)
    h = signed(secret=None)
    assert auth.MAC not in h and check(v, h) == KEY_A.id
    assert check(v, signed(secret=None), body=b"y") is None
    assert check(v, signed(secret=SECRET)) == KEY_A.id  # a MAC is not needed, and not in the way
    assert check(auth.Verifier(SECRET), signed(secret=None)) is None  # a swarm with a secret needs it


def test_stale_and_future_timestamps_and_replays_are_refused():
    v = auth.Verifier(SECRET, skew=30)
    assert check(v, signed(now=T0 - 30.5)) is None
    assert check(v, signed(now=T0 + 30.5)) is None
    assert check(v, signed(now=T0 - 29)) == KEY_A.id
    h = signed(now=T0 + 29)
    assert check(v, h) == KEY_A.id
    for later in (T0, T0 + 10, T0 + 59):  # replayed while the timestamp is fresh: the nonce is known
        assert check(v, h, now=later) is None
    assert check(v, h, now=T0 + 60) is None  # then it is stale
    assert len(v) == 0  # and its nonce was forgotten: the cache never outgrows the window


def test_replay_cache_is_bounded_and_fails_closed():
    v = auth.Verifier(SECRET, skew=30, max_nonces=10)
    for i in range(10):
        assert check(v, signed("GET", "/v1/state", b"", now=T0), "GET", "/v1/state", b"", now=T0 + i)
    assert len(v) == 10
    assert check(v, signed("GET", "/v1/state", b"", now=T0 + 10), "GET", "/v1/state", b"", now=T0 + 10) is None
    assert len(v) == 10
    # once the first ones are stale they are forgotten and requests pass again
    assert check(v, signed("GET", "/v1/state", b"", now=T0 + 31), "GET", "/v1/state", b"", now=T0 + 31)
    assert len(v) == 1


def test_malformed_headers_are_refused_without_exceptions():
    v = auth.Verifier(SECRET)
    good = signed()
    bad = [{}, {k: v_ for k, v_ in good.items() if k != auth.NONCE},
           {k: v_ for k, v_ in good.items() if k != auth.MAC},
           {**good, auth.TIMESTAMP: "NaN"}, {**good, auth.TIMESTAMP: "inf"}, {**good, auth.TIMESTAMP: "-1"},
           {**good, auth.TIMESTAMP: "1e9"}, {**good, auth.TIMESTAMP: " " + good[auth.TIMESTAMP]},
           {**good, auth.NONCE: "short"}, {**good, auth.NONCE: "x" * 65}, {**good, auth.NONCE: "a b" * 8},
           {**good, auth.MAC: good[auth.MAC].upper()}, {**good, auth.MAC: "00"}, {**good, auth.MAC: "é" * 64},
           {**good, auth.SIGNATURE: good[auth.SIGNATURE][:-1]}, {**good, auth.SIGNATURE: "é" * 86},
           {**good, auth.SIGNATURE: "=" * 86}, {**good, auth.KEY: "A" * 44}, {**good, auth.KEY: "!" * 43},
           {**good, auth.FROM: "not-an-id"}, {**good, auth.FROM: KEY_A.id.upper()},
           {**good, auth.TO: "@"}, {**good, auth.TO: "x" * 300}]
    for h in bad:
        assert check(v, h) is None
    assert v.verify("POST", "/v1/ping", "not a hash", good, T0, ME) is None
    assert check(v, good) == KEY_A.id


def test_the_mac_is_compared_in_constant_time(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    v = auth.Verifier(SECRET)
    h = signed()
    h[auth.MAC] = "0" * 64
    assert check(v, h) is None
    assert len(calls) == 1 and auth.token_ok("abc", "abd") is False and len(calls) == 2


def test_keys_are_derived_and_distinct():
    assert auth.request_key(SECRET) != SECRET.encode()
    tok = auth.status_token(SECRET)
    assert tok != auth.request_key(SECRET).hex()[:40] and tok == auth.status_token(SECRET)
    assert auth.status_token(SECRET + "x") != tok
    proof = auth.proof(SECRET, "ab" * 32, "n" * 24)
    assert proof not in (tok, auth.request_key(SECRET).hex())
    assert len(auth.generate_secret()) >= 40 and auth.generate_secret() != auth.generate_secret()


def test_a_certificate_proof_binds_the_fingerprint_the_nonce_and_the_secret():
    fp, nonce = "ab" * 32, "n" * 24
    p = auth.proof(SECRET, fp, nonce)
    assert auth.proof_ok(SECRET, fp, nonce, p)
    assert not auth.proof_ok(SECRET, "cd" * 32, nonce, p)  # a man in the middle's certificate
    assert not auth.proof_ok(SECRET, fp, "m" * 24, p)  # replayed from another request
    assert not auth.proof_ok("another secret of some length", fp, nonce, p)
    for junk in (None, "", p.upper(), p[:-1], 5):
        assert not auth.proof_ok(SECRET, fp, nonce, junk)


@settings(max_examples=150, derandomize=True, deadline=None)
@given(field=st.sampled_from(["method", "path", "body", "ts", "nonce", "sig", "mac", "to", "from"]), data=st.data())
def test_any_change_to_a_signed_request_is_refused(field, data):
    v = auth.Verifier(SECRET)
    req = {"method": "POST", "path": "/v1/grads", "body": b"payload"}
    h = signed(req["method"], req["path"], req["body"])
    receivers = {KEY_B.id, KEY_C.id}
    if field in ("sig", "mac"):
        name = auth.SIGNATURE if field == "sig" else auth.MAC
        alphabet, size = (("ABCDEFabcdef0123456789_-", 86) if field == "sig" else ("0123456789abcdef", 64))
        new = data.draw(st.text(alphabet, min_size=size, max_size=size).filter(lambda s: s != h[name]))
        h = {**h, name: new}
    elif field == "body":
        req["body"] = data.draw(st.binary(max_size=64).filter(lambda b: b != b"payload"))
    elif field == "ts":
        new = data.draw(st.floats(T0 - 20, T0 + 20).map(auth.format_timestamp).filter(lambda s: s != h[auth.TIMESTAMP]))
        h = {**h, auth.TIMESTAMP: new}
    elif field == "nonce":
        new = data.draw(st.text("abcdefghijklmnop0123456789_-", min_size=16, max_size=64)
                        .filter(lambda s: s != h[auth.NONCE]))
        h = {**h, auth.NONCE: new}
    elif field == "to":
        h = {**h, auth.TO: KEY_C.id}
    elif field == "from":
        h = {**h, auth.FROM: data.draw(st.sampled_from([KEY_B.id, KEY_C.id, f"{KEY_A.id}~1"]))}
    else:
        req[field] = data.draw(st.text(min_size=1, max_size=20).filter(lambda s: s.upper() != req[field]))
    assert check(v, h, req["method"], req["path"], req["body"], receivers=receivers) is None


def test_config_checks_the_secret_and_identity_flags(tmp_path):
    PeerConfig(secret="generate").validate()
    PeerConfig(secret=SECRET, status_auth=1).validate()
    PeerConfig(secret=SECRET, join="127.0.0.1:9#" + "ab" * 32).validate()
    for kw, needle in [({"secret": "generate", "join": "127.0.0.1:9"}, "first peer"),
                       ({"secret": "short"}, "--secret"), ({"secret": " " + SECRET}, "--secret"),
                       ({"status_auth": 1}, "--status-auth"), ({"secret": SECRET, "status_auth": 2}, "--status-auth"),
                       ({"secret": SECRET, "join": "127.0.0.1:9#abc"}, "64 hex digits"),
                       ({"join": "127.0.0.1:9#" + "ab" * 32}, "needs a --secret"),
                       ({"key_file": str(tmp_path)}, "--key-file"), ({"status_port": 70000}, "--status-port"),
                       ({"name": " x"}, "--name")]:
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
    async with s.request(method, f"{p.addr}{path}", data=body, headers=headers or {}, ssl=pin(p)) as r:
        return r.status, await r.read()


def sig_headers(method, path, body, p: Peer, *, secret=SECRET, now=None, key=KEY_A, to=None):
    return auth.Signer(key, None, secret).headers(method, path, body, now or time.time(), to or p.id)


V1 = [("POST", "/v1/join"), ("POST", "/v1/ping"), ("POST", "/v1/ping-req"), ("POST", "/v1/sync"),
      ("POST", "/v1/leave"), ("POST", "/v1/grads"), ("GET", "/v1/state"), ("POST", "/v1/rows/pull"),
      ("POST", "/v1/rows/push"), ("POST", "/v1/rows/replay"), ("POST", "/v1/rows/replica"),
      ("POST", "/v1/rows/slots"), ("POST", "/v1/rows/digests"), ("POST", "/v1/no-such-route")]


async def test_missing_wrong_stale_misaddressed_and_replayed_requests_get_the_same_401(locked):
    p = locked
    assert p.addr.startswith("https://")
    members_before = [(m.peer_id, m.state) for m in p.members.members()]
    replies = set()
    async with aiohttp.ClientSession() as s:
        for method, path in V1:
            body = b"" if method == "GET" or "no-such" in path else msgpack.packb({"v": 1, "type": "ping"})
            good = sig_headers(method, path, body, p)
            cases = {
                "missing": {},
                "wrong secret": sig_headers(method, path, body, p, secret="not the swarm secret at all"),
                "no secret": sig_headers(method, path, body, p, secret=None),
                "stale": sig_headers(method, path, body, p, now=time.time() - 31),
                "future": sig_headers(method, path, body, p, now=time.time() + 31),
                "other body": sig_headers(method, path, body + b"!", p),
                "other path": sig_headers(method, path + "x", body, p),
                "other receiver": sig_headers(method, path, body, p, to=KEY_C.id),
                "bad signature": {**good, auth.SIGNATURE: "A" * 86},
                "another's id": {**sig_headers(method, path, body, p), auth.FROM: KEY_C.id},
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
        status, _ = await send(s, p, "POST", "/v1/ping", big, sig_headers("POST", "/v1/ping", big, p))
        assert status == 413
        status, _ = await send(s, p, "GET", "/v1/state", b"x", sig_headers("GET", "/v1/state", b"x", p))
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
        status, _ = await send(s, p, "GET", "/api/status", headers=sig_headers("GET", "/api/status", b"", p))
        assert status == 200
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as s:
        async with s.get(f"{p.addr}/?token={tok}", ssl=pin(p)) as r:
            assert r.status == 200 and "HttpOnly" in r.headers.get("Set-Cookie", "")
        async with s.get(f"{p.addr}/api/status", ssl=pin(p)) as r:  # the page's own fetch
            assert r.status == 200
        async with s.get(f"{p.addr}/api/events", ssl=pin(p)) as r:
            assert r.status == 200
            assert (await r.content.readline()).startswith(b"retry:")


async def test_with_a_secret_the_status_stays_open_by_default_and_the_plain_status_port_serves_only_it():
    port = free_port()
    p = await start_peer(secret=SECRET, status_port=port)
    try:
        async with aiohttp.ClientSession() as s:
            status, _ = await send(s, p, "GET", "/api/status")
            assert status == 200
            status, _ = await send(s, p, "POST", "/v1/ping", b"\x80")
            assert status == 401
            async with s.get(f"http://127.0.0.1:{port}/api/status") as r:
                assert r.status == 200 and (await r.json())["peer_id"] == p.id
            for method, path in V1[:3] + [("GET", "/v1/swarm")]:  # peer-to-peer routes: https only
                body = b"" if method == "GET" else b"\x80"
                async with s.request(method, f"http://127.0.0.1:{port}{path}", data=body,
                                     headers=sig_headers(method, path, body, p)) as r:
                    assert r.status == 404 and "https" in (await r.json())["error"], path
            with pytest.raises(aiohttp.ClientError):  # and the main port speaks TLS only
                async with s.get(f"http://127.0.0.1:{p.port}/api/status") as r:
                    await r.read()
    finally:
        await p.close()


async def test_two_peers_with_a_secret_train_together_over_tls():
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
        assert p.addr.startswith("https://") and p.verifier.accepted > 8 and p.verifier.refused == 0


async def test_a_peer_with_the_wrong_secret_or_none_cannot_join():
    a = await start_peer(secret=SECRET)
    try:
        b = Peer(small_cfg(secret="a different secret entirely", join=f"127.0.0.1:{a.port}"), out=lambda line: None)
        try:
            with pytest.raises(JoinError, match=r"refused to let us join: .*401"):
                await b.start()
        finally:
            await b.close()
        # without a secret it speaks plain HTTP, which a TLS port does not answer
        c = Peer(small_cfg(join=f"127.0.0.1:{a.port}", join_timeout=1.0), out=lambda line: None)
        try:
            with pytest.raises(JoinError, match=r"cannot reach .*--secret"):
                await c.start()
        finally:
            await c.close()
        assert [m.peer_id for m in a.members.members()] == [a.id]
    finally:
        await a.close()
