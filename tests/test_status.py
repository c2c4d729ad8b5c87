"""The status page's data: bounded series, /api/status fields, the assets, /metrics and /api/events."""

from __future__ import annotations

import asyncio
import json
import re
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from swarm.bodies import PROTOCOL_VERSION
from swarm.identity import PeerKey
from swarm.node import Peer
from swarm.status.routes import STATIC
from swarm.status.timeline import Series, Timeline
from swarm.versions import versions

from .conftest import signed, small_cfg

STRANGER = PeerKey.from_seed(b"status-test-stranger".ljust(32, b"\0"))  # signs requests of a non-member

pytestmark = pytest.mark.timeout(120)

# Keys /api/status had before the page; the page only adds keys.
LEGACY_KEYS = {"peer_id", "addr", "step", "active", "loss", "val_loss", "tokens_per_s", "members", "bytes_sent",
               "bytes_received", "dense_bytes", "compression_ratio", "rounds", "rejected", "dropped_sends",
               "events", "param_sketch"}
MEMBER_KEYS = {"peer_id", "addr", "state", "incarnation", "step", "active", "self", "lag", "loss",
               "tokens_per_s", "rtt_ms", "last_seen_s", "state_for_s", "bytes_in", "bytes_out"}


async def start_peer(**kw) -> Peer:
    peer = Peer(small_cfg(**kw), out=lambda line: None)
    await peer.start()
    return peer


async def get(p: Peer, path: str) -> tuple[int, str, bytes]:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{p.port}{path}") as r:
            return r.status, r.headers.get("Content-Type", ""), await r.read()


async def until(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


@pytest.fixture
async def pair():
    """Two peers training together until the test ends."""
    a = await start_peer(steps=0, min_peers=2)
    b = await start_peer(steps=0, min_peers=2, join=f"127.0.0.1:{a.port}")
    runs = [asyncio.ensure_future(p.run()) for p in (a, b)]
    try:
        yield a, b
    finally:
        for p in (a, b):
            p.stop()
        await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), 60)
        for p in (a, b):
            await p.close()


@pytest.fixture
async def idle_peer():
    p = await start_peer()
    yield p
    await p.close()


# -- Series / Timeline (no network) ---------------------------------------------------------------
def test_series_stays_bounded_keeps_order_and_recent_points_exact():
    s = Series(cap=40)
    for i in range(10_000):
        s.add(i, 2 * i)
        assert len(s) <= 40
    assert len(s) >= 30
    xs = [p[0] for p in s.points]
    assert xs == sorted(xs) and len(set(xs)) == len(xs)
    assert s.points[-20:] == [(float(i), 2.0 * i) for i in range(9980, 10_000)]  # the newest half, exact
    assert s.last() == (9999.0, 19998.0)
    assert s.points[0][0] < 1000  # the oldest history is still represented, coarsely
    assert all(p[1] == pytest.approx(2 * p[0]) for p in s.points)  # merging averages whole points
    gaps = [b - a for a, b in zip(xs, xs[1:8])]
    assert len(set(gaps)) == 1  # older buckets are evenly sized


def test_series_to_json_rounds_values_but_not_times():
    s = Series(cap=8)
    s.add(1_795_000_000.123456, 4.123456789)
    (t, v), = s.to_json()
    assert t == pytest.approx(1_795_000_000.12) and v == 4.12346


def test_series_rejects_tiny_caps():
    with pytest.raises(ValueError):
        Series(cap=4)


def test_rtt_is_smoothed_and_marks_the_peer_seen():
    tl = Timeline()
    tl.record_rtt("b", 0.010)
    tl.record_rtt("b", 0.020)
    assert tl.links["b"].rtt == pytest.approx(0.012)
    assert tl.links["b"].last_seen is not None


# -- /api/status ------------------------------------------------------------------------------------
async def test_status_of_a_training_pair_has_everything_the_page_draws(pair):
    a, b = pair
    await until(lambda: a.book.step >= 12 and b.book.step >= 12 and a.step_times.report()["steps"] >= 12
                and a.timeline.links.get(b.id)
                and a.timeline.links[b.id].rtt is not None and a.timeline.swarm_loss.last()
                and len(a.timeline.swarm_loss) and a.members.get(b.id).meta.get("loss") is not None)
    code, ctype, body = await get(a, "/api/status")
    assert code == 200 and ctype.startswith("application/json")
    s = json.loads(body)
    assert LEGACY_KEYS <= set(s)
    assert {"now", "compression", "swarm", "series", "log"} <= set(s)
    assert s["versions"] == versions() and s["versions"]["protocol"] == PROTOCOL_VERSION
    t = s["tables"]  # the sharded tables' map, as the page draws it
    assert t["view"] and t["slots"] > 0 and t["owners"] and set(t["by_peer"]) == {a.id, b.id}
    assert s["pull_latency_ms"]["p50"] is not None
    assert s["step_phases"]["steps"] >= 12 and s["step_phases"]["round"]["median_ms"] >= 0

    assert s["swarm"]["alive"] == 2 and s["swarm"]["dead"] == 0 and s["swarm"]["suspect"] == 0
    assert s["swarm"]["step"] >= 12 and s["swarm"]["tokens_per_s"] > 0
    assert 0 < s["swarm"]["loss"] < 6

    rows = {m["peer_id"]: m for m in s["members"]}
    assert set(rows) == {a.id, b.id}
    for m in rows.values():
        assert MEMBER_KEYS <= set(m)
    me, other = rows[a.id], rows[b.id]
    assert me["self"] and not other["self"]
    assert other["rtt_ms"] > 0 and other["last_seen_s"] >= 0 and other["lag"] >= 0
    assert other["bytes_out"] > 0 and other["bytes_in"] > 0
    assert other["loss"] is not None and other["tokens_per_s"] > 0
    # a's grads counter and its per-peer counts agree (one other peer: everything went to / came from b)
    assert other["bytes_out"] <= s["bytes_sent"]["grads"]
    assert other["bytes_in"] <= s["bytes_received"]["grads"]

    series = s["series"]
    assert len(series["loss"]) >= 10 and len(series["swarm_loss"]) >= 1 and len(series["wire"]) >= 10
    t, step, loss = series["loss"][-1]
    assert abs(t - s["now"]) < 60 and 0 <= step <= s["step"] and loss > 0
    w = series["wire"]
    assert all(w[i][1] <= w[i + 1][1] and w[i][3] <= w[i + 1][3] for i in range(len(w) - 1))  # cumulative
    assert any(e["source"] == "membership" and e["kind"] == "joined" for e in s["log"])
    assert [e["at"] for e in s["log"]] == sorted(e["at"] for e in s["log"])


async def test_validation_loss_enters_the_series_when_evaluated(idle_peer):
    p = idle_peer
    assert json.loads((await get(p, "/api/status"))[2])["series"]["val_loss"] == []
    p.progress.val_loss = 4.25
    s = json.loads((await get(p, "/api/status"))[2])
    assert s["series"]["val_loss"][-1][2] == 4.25
    p.progress.val_history.append((7, 4.0))
    s = json.loads((await get(p, "/api/status"))[2])
    assert s["series"]["val_loss"][-1][1:] == [7, 4.0]


async def test_rejected_payload_is_logged(idle_peer):
    p = idle_peer
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{p.port}/v1/grads", data=b"garbage",
                          headers={"X-Compression": "topk-int8",
                                   **signed(STRANGER, p, "POST", "/v1/grads", b"garbage")}) as r:
            assert r.status == 400
    st = json.loads((await get(p, "/api/status"))[2])
    assert st["rejected"] == {"codec": 1}
    rej = [e for e in st["log"] if e["source"] == "rejected"]
    assert len(rej) == 1 and rej[0]["kind"] == "codec" and "1 message rejected" in rej[0]["detail"]
    st = json.loads((await get(p, "/api/status"))[2])
    assert len([e for e in st["log"] if e["source"] == "rejected"]) == 1  # logged once, not per poll


# -- the page and its assets -------------------------------------------------------------------------
async def test_page_and_assets_are_served_by_the_peer_and_load_nothing_external(idle_peer):
    code, ctype, html = await get(idle_peer, "/")
    assert code == 200 and ctype.startswith("text/html")
    html = html.decode()
    assets = re.findall(r'(?:src|href)="(/static/[^"]+)"', html)
    assert {"/static/app.js", "/static/style.css", "/static/favicon.svg"} <= set(assets)
    for path in assets:
        code, ctype, body = await get(idle_peer, path)
        assert code == 200 and body, path
    for f in STATIC.iterdir():
        text = f.read_text()
        assert not re.search(r"(?:src|href|url\()\s*=?\s*[\"']?(?:https?:)?//", text), f"{f.name} loads something external"
        assert "import " not in text or f.suffix != ".js"
    assert (await get(idle_peer, "/static/../node.py"))[0] in (403, 404)


# -- /metrics ---------------------------------------------------------------------------------------
async def test_metrics_are_prometheus_text_from_a_registry_per_peer(pair):
    a, b = pair
    await until(lambda: a.book.step >= 3 and b.book.step >= 3)
    fams = {}
    for p in (a, b):
        code, ctype, body = await get(p, "/metrics")
        assert code == 200 and ctype.startswith("text/plain")
        fams[p.id] = {f.name: f for f in text_string_to_metric_families(body.decode())}
    for p in (a, b):
        f = fams[p.id]
        info = f["swarm_peer_info"].samples[0].labels
        assert info["peer_id"] == p.id  # each peer reports itself, not the other
        assert f["swarm_step"].samples[0].value >= 3
        assert f["swarm_tokens"].type == "counter" and f["swarm_tokens"].samples[0].value > 0
        sent = {s.labels["kind"]: s.value for s in f["swarm_bytes_sent"].samples if s.name.endswith("_total")}
        assert sent["grads"] > 0
        members = {s.labels["state"]: s.value for s in f["swarm_members"].samples}
        assert members["alive"] == 2
        assert f["swarm_compression_ratio"].samples[0].value > 10
        # two peers: under the contributor cap, whole payloads every round
        assert f["swarm_payload_share"].samples[0].value == 1 and f["swarm_payload_stride"].samples[0].value == 1
        # where its steps go: every phase, in seconds, and the share spent waiting on the other
        phases = {s.labels["phase"]: s.value for s in f["swarm_step_phase_seconds"].samples}
        assert set(phases) == {"rows", "compute", "send", "held", "round", "apply", "after"}
        assert phases["compute"] > 0 and all(v >= 0 for v in phases.values())
        assert 0 <= f["swarm_step_wait_share"].samples[0].value <= 1
    # the global registry is untouched
    from prometheus_client import REGISTRY, generate_latest
    assert b"swarm_step" not in generate_latest(REGISTRY)


# -- /api/events ------------------------------------------------------------------------------------
async def test_event_stream_sends_status_documents_and_close_does_not_hang(idle_peer):
    p = idle_peer
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{p.port}/api/events") as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            docs = []
            t0 = time.monotonic()
            while len(docs) < 2:
                line = await asyncio.wait_for(r.content.readline(), 5)
                if line.startswith(b"data: "):
                    docs.append(json.loads(line[6:]))
            assert 0.5 < time.monotonic() - t0 < 4  # about one a second
            assert docs[0]["peer_id"] == p.id and LEGACY_KEYS <= set(docs[0])
            # the stream is still open: closing the peer must end it promptly, not wait for a timeout
            t0 = time.monotonic()
            await asyncio.wait_for(p.close(), 10)
            assert time.monotonic() - t0 < 5
            rest = await asyncio.wait_for(r.content.read(), 5)
            assert b"event: bye" in rest or rest == b""


async def test_event_stream_ends_when_the_client_goes_away(idle_peer):
    p = idle_peer
    for _ in range(3):
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{p.port}/api/events") as r:
                await asyncio.wait_for(r.content.readline(), 5)
    await asyncio.sleep(1.5)  # the handlers notice on their next write
    code, _, body = await get(p, "/api/status")
    assert code == 200 and json.loads(body)["peer_id"] == p.id
