"""Every route answers malformed or hostile input with a 4xx and a reason, and changes no parameter."""

from __future__ import annotations

import hashlib
import os
import time

import aiohttp
import msgpack
import pytest
import torch

from swarm import auth
from swarm.codec import CodecConfig, Compressor, HEADER, Manifest
from swarm.identity import PeerKey
from swarm.membership import Membership
from swarm.node import Peer
from swarm.bodies import PROTOCOL_VERSION


pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def peer(small_peer):
    return small_peer


def snapshot(p: Peer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in p.replica.model.state_dict().items()}


def member_key(name: str) -> PeerKey:
    """A deterministic key, and so peer id, for a made-up member."""
    return PeerKey.from_seed(hashlib.sha256(name.encode()).digest())


def admit(p: Peer, key: PeerKey) -> str:
    """Make the peer of ``key`` a member of p's swarm, as a join would; its id."""
    other = Membership(key, "http://127.0.0.1:9", time.monotonic())
    p.members.handle_join(other.join_request(), time.monotonic())
    return key.id


def payload(p: Peer, sender: str, step: int = 0, manifest: Manifest | None = None, mode="topk-int8"):
    manifest = manifest or p.replica.manifest
    comp = Compressor(manifest, CodecConfig(mode=mode, ratio=0.01), sender=sender)
    g = torch.randn(manifest.numel, generator=torch.Generator().manual_seed(step))
    return comp.compress(g, step)


TESTER = member_key("tester")  # signs the requests of these tests (every /v1/* request is signed)


async def post(p: Peer, path: str, body: bytes, headers: dict | None = None, key: PeerKey = TESTER):
    signed = auth.Signer(key).headers("POST", path, body, time.time(), p.id)
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{p.port}{path}", data=body, headers={**(headers or {}), **signed}) as r:
            if r.content_type == "application/msgpack":
                return r.status, msgpack.unpackb(await r.read())
            return r.status, await r.json(content_type=None)


CONTROL_ROUTES = ["/v1/join", "/v1/ping", "/v1/ping-req", "/v1/sync", "/v1/leave"]
GARBAGE = [b"", b"\x00\x01\x02", b"\xc1", msgpack.packb([1, 2, 3]), msgpack.packb({"type": "ping"}),
           msgpack.packb({"v": 2, "type": "ping", "from": 5}), msgpack.packb({"a": 1}) + b"trailing",
           os.urandom(512)]


@pytest.mark.parametrize("route", CONTROL_ROUTES)
async def test_control_routes_refuse_garbage(peer, route):
    before = snapshot(peer)
    members_before = [(m.peer_id, m.state) for m in peer.members.members()]
    for body in GARBAGE:
        status, reply = await post(peer, route, body)
        assert 400 <= status < 500, (route, body, status, reply)
        assert reply["error"]
    status, _ = await post(peer, route, b"\x80" * (300 * 1024))
    assert status == 413
    assert [(m.peer_id, m.state) for m in peer.members.members()] == members_before
    after = snapshot(peer)
    assert all(torch.equal(before[k], after[k]) for k in before)


async def test_join_refuses_another_task_or_protocol(peer):
    joiner = member_key("joiner")
    other = Membership(joiner, "http://127.0.0.1:9", time.monotonic())
    fp = peer.replica.fingerprint
    good = {"protocol": PROTOCOL_VERSION, "task": fp, "settings": peer.settings, "tables": peer.table_layout(),
            "membership": other.join_request()}
    for key, value, needle in [("task", {**fp, "data": "0" * 64}, "data"), ("task", {**fp, "model": "0" * 16}, "model"),
                               ("task", {**fp, "seed": "7"}, "seed"), ("task", {**fp, "name": "other"}, "task name"),
                               ("task", {**fp, "version": "9"}, "version"), ("task", "x", "fingerprint"),
                               ("protocol", 99, "protocol"), ("tables", "ngram:8x8/slots=1/replicas=9", "layout"),
                               ("settings", {**peer.settings, "seed": 9}, "--seed is a swarm-wide setting"),
                               ("settings", {**peer.settings, "ratio": "x"}, "malformed"),
                               ("settings", None, "malformed")]:
        status, reply = await post(peer, "/v1/join", msgpack.packb({**good, key: value}), key=joiner)
        assert status == 409 and needle in reply["error"], reply
    assert peer.members.get(joiner.id) is None
    status, reply = await post(peer, "/v1/join", msgpack.packb(good))  # signed by another than it names
    assert status == 400 and "sent by" in reply["error"] and peer.members.get(joiner.id) is None
    status, reply = await post(peer, "/v1/join", msgpack.packb(good), key=joiner)
    assert status == 200 and peer.members.get(joiner.id) is not None


async def test_grads_route_validates_everything_before_filing(peer):
    before = snapshot(peer)
    friend_key, stranger, clumsy = member_key("friend"), member_key("stranger"), member_key("clumsy")
    friend = admit(peer, friend_key)
    admit(peer, clumsy)  # sends the invalid payloads: they count against its score, signed by it
    enc = payload(peer, friend)
    hdr = {HEADER: enc.mode}
    other_manifest = Manifest.from_module(torch.nn.Linear(3, 2))
    cases = [
        (enc.blob, {}, friend_key, 400, HEADER),  # no X-Compression header
        (enc.blob, {HEADER: "gzip"}, friend_key, 400, HEADER),
        (enc.blob, {HEADER: "topk"}, clumsy, 400, "rejected"),  # header disagrees with the blob
        (enc.blob[: len(enc.blob) // 2], hdr, clumsy, 400, "rejected"),  # truncated
        (os.urandom(len(enc.blob)), hdr, clumsy, 400, "rejected"),
        (payload(peer, clumsy.id, manifest=other_manifest).blob, hdr, clumsy, 400, "rejected"),
        (enc.blob, hdr, stranger, 403, "signed by"),  # the friend's payload, sent by another
        (payload(peer, stranger.id).blob, hdr, stranger, 409, "not a live member"),
        (payload(peer, peer.id).blob, hdr, peer.key, 400, "this peer"),
        (payload(peer, friend, step=500).blob, hdr, friend_key, 409, "too-far-ahead"),
    ]
    for body, headers, key, status, needle in cases:
        got, reply = await post(peer, "/v1/grads", body, headers, key=key)
        assert got == status and needle in reply["error"], (got, reply)
    limit = peer.replica.manifest.numel * 4 + (1 << 16)
    got, _ = await post(peer, "/v1/grads", b"\0" * (limit + 1), hdr, key=friend_key)
    assert got == 413
    assert peer.book.pending == {}  # nothing was filed
    got, reply = await post(peer, "/v1/grads", enc.blob, hdr, key=friend_key)
    assert got == 200 and reply["result"] == "accepted"
    got, reply = await post(peer, "/v1/grads", enc.blob, hdr, key=friend_key)
    assert got == 409 and "duplicate" in reply["error"]
    assert peer.book.senders(0) == [friend]
    assert peer.robust.get(clumsy.id).invalid == 4 and peer.robust.get(friend).invalid == 0  # charged to the signer
    after = snapshot(peer)
    assert all(torch.equal(before[k], after[k]) for k in before)  # filed, never applied by a route


async def test_state_route_refuses_until_training_and_status_is_json(peer):
    async with aiohttp.ClientSession() as s:
        signed = auth.Signer(TESTER).headers("GET", "/v1/state", None, time.time(), peer.id)
        async with s.get(f"http://127.0.0.1:{peer.port}/v1/state", headers=signed) as r:
            assert r.status == 503 and "no state" in (await r.json())["error"]
        async with s.get(f"http://127.0.0.1:{peer.port}/api/status") as r:
            st = await r.json()
    assert st["peer_id"] == peer.id and st["step"] == 0
    assert [m["peer_id"] for m in st["members"]] == [peer.id]
    for key in ("loss", "bytes_sent", "bytes_received", "compression_ratio", "param_sketch"):
        assert key in st


async def test_state_blob_round_trip_and_hostile_blobs(peer):
    """load_state_blob checks everything before writing: a bad blob leaves the replica unchanged."""
    import json

    from safetensors.torch import save

    from swarm.replica import STATE_FORMAT, StateError

    t = peer.replica
    blob = t.state_blob()
    before = snapshot(peer)
    meta = {"format": STATE_FORMAT, "step": "3", "fingerprint": json.dumps(t.fingerprint), "optimizer":
            json.dumps({"state": {}, "param_groups": t.opt.state_dict()["param_groups"]}), "scheduler": "null"}
    bad = [b"", os.urandom(100), blob[:1000], save({"x": torch.zeros(1)}, metadata={"format": STATE_FORMAT})]
    tensors = {"p." + n: p.detach().clone() for n, p in zip(t.names, t.params)}
    tensors["p." + t.names[0]][0] = float("nan")
    bad.append(save(tensors, metadata=meta))  # a NaN parameter
    tensors["p." + t.names[0]][0] = 0.0
    bad.append(save(tensors, metadata={**meta, "fingerprint": json.dumps({**t.fingerprint, "data": "other"})}))
    bad.append(save(tensors, metadata={**meta, "optimizer": "{}"}))  # not this optimizer's state_dict
    bad.append(save(tensors, metadata={**meta, "optimizer": "[1"}))  # not JSON
    bad.append(save(tensors, metadata={**meta, "scheduler": json.dumps({"last_epoch": 1})}))  # another scheduler
    bad.append(save({**tensors, "o.0": torch.zeros(1)}, metadata=meta))  # a tensor nothing refers to
    for b in bad:
        with pytest.raises(StateError):
            t.load_state_blob(b)
    after = snapshot(peer)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert t.load_state_blob(blob) == 0
