"""zstd bodies on the wire (swarm/encoding.py): what is compressed, what a receiver refuses, and a
swarm whose peers compress, or not, training to identical replicas."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time

import aiohttp
import numpy as np
import pytest
import torch
from aiohttp import web

from swarm import encoding
from swarm.codec import CodecConfig, Compressor, HEADER
from swarm.identity import PeerKey
from swarm.membership import Membership
from swarm.node import Peer
from swarm.transport import ByteCounts, PeerUnreachable, Transport

from .conftest import free_port, rel_l2, signed, small_cfg

pytestmark = pytest.mark.timeout(180)

try:
    from compression import zstd
except ImportError:
    from backports import zstd


def int4_like(n: int, seed: int = 0) -> bytes:
    """Bytes shaped like a row message's values: packed int4 nibbles of rounded Gaussians."""
    q = np.clip(np.rint(np.random.default_rng(seed).normal(0, 2.0, 2 * n)), -7, 7).astype(np.int8) & 0xF
    return (q[0::2] | (q[1::2] << 4)).astype(np.uint8).tobytes()


# ----------------------------------------------------------------------------- the codec itself

def test_compress_pays_or_leaves_the_body_as_it_is():
    rows = int4_like(64 * 1024)
    body, enc = encoding.compress(rows)
    assert enc == "zstd" and len(body) <= encoding.WORTH * len(rows)
    assert encoding.decompress(body, enc, len(rows)) == rows
    small = rows[:encoding.MIN_BYTES - 1]
    assert encoding.compress(small) == (small, None)  # a control message goes as it is
    noise = os.urandom(64 * 1024)
    assert encoding.compress(noise) == (noise, None)  # nothing to gain: no frame
    assert encoding.decompress(noise, None, len(noise)) == noise
    assert encoding.decompress(noise, "identity", len(noise)) == noise


def test_decompress_refuses_bombs_and_malformed_frames():
    limit = 100_000
    bomb = zstd.compress(bytes(limit + 1), level=1)  # ~20 bytes that inflate past the limit
    with pytest.raises(encoding.EncodingError) as e:
        encoding.decompress(bomb, "zstd", limit)
    assert e.value.status == 413 and "limit" in e.value.reason
    exact = zstd.compress(bytes(limit), level=1)
    assert encoding.decompress(exact, "zstd", limit) == bytes(limit)  # at the limit: taken
    good, _ = encoding.compress(int4_like(4096))
    for bad, needle in [(good[:-5], "truncated"), (good + b"xyz", "after its frame"),
                        (good + good, "after its frame"), (b"not a frame at all" * 10, "bad zstd"),
                        (b"", "truncated")]:
        with pytest.raises(encoding.EncodingError) as e:
            encoding.decompress(bad, "zstd", limit)
        assert e.value.status == 400 and needle in e.value.reason, (needle, e.value.reason)
    with pytest.raises(encoding.EncodingError) as e:
        encoding.decompress(good, "gzip", limit)
    assert e.value.status == 415 and "gzip" in e.value.reason
    # a frame that asks for a window over WINDOW_LOG is refused before its memory is taken
    wide = zstd.compress(os.urandom(1 << 16) * 64, options={zstd.CompressionParameter.window_log: 26,
                                                            zstd.CompressionParameter.compression_level: 3})
    with pytest.raises(encoding.EncodingError) as e:
        encoding.decompress(wide, "zstd", 1 << 23)
    assert e.value.status == 400


@pytest.mark.parametrize("header,ok", [("zstd", True), ("gzip, deflate, zstd", True), ("br, ZSTD;q=0.5", True),
                                       ("zstd;q=0", False), ("zstd; q=0.0", False), ("gzip", False), ("", False),
                                       (None, False), ("zstdx", False)])
def test_accept_encoding(header, ok):
    assert encoding.accepts(header) is ok
    body = int4_like(8192)
    out, headers = encoding.reply(body, header)
    assert (headers == {"Content-Encoding": "zstd"}) is ok and (out != body) is ok
    assert encoding.reply(body, header, on=False) == (body, {})


# ----------------------------------------------------------------------------- a peer's routes

def member_key(name: str) -> PeerKey:
    return PeerKey.from_seed(hashlib.sha256(name.encode()).digest())


@pytest.fixture
def peer(small_peer):
    return small_peer


async def post(p: Peer, path: str, body: bytes, headers: dict, key: PeerKey):
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{p.port}{path}", data=body,
                          headers={**headers, **signed(key, p, "POST", path, body)}) as r:
            return r.status, await r.json(content_type=None)


async def test_a_compressed_payload_is_taken_and_a_bomb_refused(peer):
    friend = member_key("friend")
    peer.members.handle_join(Membership(friend, "http://127.0.0.1:9", time.monotonic()).join_request(), time.monotonic())
    manifest = peer.replica.manifest
    enc = Compressor(manifest, CodecConfig(mode="topk-int8", ratio=0.05), sender=friend.id).compress(
        torch.randn(manifest.numel, generator=torch.Generator().manual_seed(0)), 0)
    packed = zstd.compress(enc.blob, level=1)
    hdr = {HEADER: enc.mode, "Content-Encoding": "zstd"}
    limit = manifest.numel * 4 + (1 << 16)  # the grads route's limit (server.grads_limit)
    for body, headers, status, needle in [
        (zstd.compress(bytes(limit + 1), level=1), hdr, 413, "inflates past"),
        (packed[:-3], hdr, 400, "truncated"),
        (packed + b"\0", hdr, 400, "after its frame"),
        (packed, {**hdr, "Content-Encoding": "br"}, 415, "not supported"),
        (enc.blob, hdr, 400, "bad zstd"),  # marked zstd, sent plain
    ]:
        got, reply = await post(peer, "/v1/grads", body, headers, friend)
        assert got == status and needle in reply["error"], (got, reply)
    assert peer.book.pending == {}  # nothing was filed
    before = peer.counts.wire()["received_plain"]
    got, reply = await post(peer, "/v1/grads", packed, hdr, friend)
    assert got == 200 and reply["result"] == "accepted", reply
    assert peer.book.senders(0) == [friend.id]
    # counted as it came over the wire, and as it was before
    assert peer.counts.received["grads"] == len(packed)
    assert peer.counts.wire()["received_plain"] - before == len(enc.blob)


async def test_the_signature_covers_the_compressed_bytes(peer):
    friend = member_key("friend")
    peer.members.handle_join(Membership(friend, "http://127.0.0.1:9", time.monotonic()).join_request(), time.monotonic())
    manifest = peer.replica.manifest
    blob = Compressor(manifest, CodecConfig(mode="topk-int8", ratio=0.05), sender=friend.id).compress(
        torch.randn(manifest.numel, generator=torch.Generator().manual_seed(1)), 0).blob
    packed = zstd.compress(blob, level=1)
    other = zstd.compress(blob, level=9)  # the same plain body, other bytes on the wire
    assert other != packed
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{peer.port}/v1/grads", data=other,
                          headers={HEADER: "topk-int8", "Content-Encoding": "zstd",
                                   **signed(friend, peer, "POST", "/v1/grads", packed)}) as r:
            assert r.status == 401
    assert peer.book.pending == {}


# ----------------------------------------------------------------------------- the client side

async def replying(body: bytes, headers: dict):
    """A one-route server answering every POST with ``body`` and ``headers``; its address."""
    async def handler(request):
        return web.Response(body=body, headers=headers)
    app = web.Application()
    app.router.add_post("/v1/x", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def test_transport_decodes_replies_within_their_limit():
    rows = int4_like(32 * 1024)
    packed, _ = encoding.compress(rows)
    counts = ByteCounts()
    t = Transport(counts)
    cases = [(packed, {"Content-Encoding": "zstd"}, None),
             (zstd.compress(bytes(1 << 20), level=1), {"Content-Encoding": "zstd"}, "inflates past"),
             (packed[:-4], {"Content-Encoding": "zstd"}, "truncated"),
             (packed, {"Content-Encoding": "snappy"}, "not supported")]
    try:
        for body, headers, needle in cases:
            runner, addr = await replying(body, headers)
            try:
                if needle is None:
                    got = await t.request("POST", addr + "/v1/x", to="@x", body=int4_like(2048), timeout=5.0,
                                          reply_limit=len(rows), kind="rows")
                    assert got == rows
                else:
                    with pytest.raises(PeerUnreachable) as e:
                        await t.request("POST", addr + "/v1/x", to="@x", body=b"{}", timeout=5.0,
                                        reply_limit=len(rows), kind="rows")
                    assert e.value.code == "encoding" and needle in e.value.reason, e.value.reason
            finally:
                await runner.cleanup()
    finally:
        await t.close()
    w = counts.wire()
    # the first call: a compressed body out, a compressed reply in; counted on the wire and plain
    assert w["received"] < w["received_plain"] and w["sent"] < w["sent_plain"]
    assert counts.received["rows"] == len(packed) + len(packed[:-4]) + len(packed) + len(zstd.compress(bytes(1 << 20), level=1))


async def test_transport_without_compression_sends_bodies_as_they_are():
    seen = []

    async def handler(request):
        seen.append((request.headers.get("Content-Encoding"), await request.read()))
        return web.Response(body=b"ok")
    app = web.Application()
    app.router.add_post("/v1/x", handler)
    runner = web.AppRunner(app, access_log=None, auto_decompress=False)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    addr = f"http://127.0.0.1:{port}"
    body = int4_like(16 * 1024)
    try:
        for compress in (False, True):
            t = Transport(ByteCounts(), compress=compress)
            try:
                await t.request("POST", addr + "/v1/x", to="@x", body=body, timeout=5.0)
            finally:
                await t.close()
    finally:
        await runner.cleanup()
    assert seen[0] == (None, body)
    assert seen[1][0] == "zstd" and zstd.decompress(seen[1][1]) == body and len(seen[1][1]) < len(body)


# ----------------------------------------------------------------------------- a swarm

async def test_peers_that_compress_and_one_that_does_not_train_to_identical_replicas():
    a = Peer(small_cfg(steps=12, min_peers=3), out=lambda line: None)
    await a.start()
    join = f"127.0.0.1:{a.port}"
    b = Peer(small_cfg(steps=12, min_peers=3, join=join), out=lambda line: None)
    await b.start()
    c = Peer(small_cfg(steps=12, min_peers=3, join=join, wire_compression="none"), out=lambda line: None)
    await c.start()
    try:
        results = await asyncio.wait_for(asyncio.gather(a.run(), b.run(), c.run()), 150)
    finally:
        for p in (a, b, c):
            await p.close()
    ra, rb, rc = results
    assert all(r["steps"] == 12 and r["rounds_timed_out"] == 0 for r in results)
    assert rel_l2(ra["param_sketch"], rb["param_sketch"]) <= 1e-3
    assert rel_l2(ra["param_sketch"], rc["param_sketch"]) <= 1e-3
    # a and b compressed what they sent (pushes, replays, payloads), c sent everything plain
    for r in (ra, rb):
        w = r["wire_encoding"]
        assert w["sent"] < 0.95 * w["sent_plain"], w
    wc = rc["wire_encoding"]
    assert wc["sent"] == wc["sent_plain"] > 0
    # every peer accepts zstd replies: c's pulls came back compressed from a and b
    assert wc["received"] < wc["received_plain"]
