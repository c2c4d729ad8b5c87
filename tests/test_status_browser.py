"""The status page in a real browser: headless Chromium (Debian's ``chromium``) driven by Playwright.

Skipped, with the reason, where Playwright or the browser is missing (.ci/run installs both).
Playwright never downloads a browser here: it launches the system one.

``SWARM_STATUS_SCREENSHOT=path`` also saves the 3-peer screenshot there (docs/status.png is made
this way), after ``SWARM_STATUS_WAIT`` seconds of training (default: just enough for data).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time

import pytest

from swarm.node import Peer

from .conftest import small_cfg

pw = pytest.importorskip("playwright.async_api", reason="Playwright is not installed (pip install playwright)")

CHROMIUM = os.environ.get("SWARM_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(not os.path.exists(CHROMIUM),
                       reason=f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium; .ci/run does this)"),
]
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]


async def start_peer(**kw) -> Peer:
    peer = Peer(small_cfg(**kw), out=lambda line: None)
    await peer.start()
    return peer


async def until(cond, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.1)


class Browser:
    """One headless Chromium page that records console errors and uncaught exceptions."""

    def __init__(self):
        self.errors: list[str] = []

    async def __aenter__(self):
        self._pw = await pw.async_playwright().start()
        self.browser = await self._pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        self.page = await self.browser.new_page(viewport={"width": 1400, "height": 760})
        self.page.on("console", lambda m: self.errors.append(f"console: {m.text}") if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        return self

    async def __aexit__(self, *exc):
        await self.browser.close()
        await self._pw.stop()


async def ink(page, canvas_id: str) -> int:
    """Pixels of a canvas that are neither blank nor the grid grey."""
    return await page.evaluate("""(id) => {
        const c = document.getElementById(id);
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0;
        for (let i = 0; i < d.length; i += 4) {
            const [r, g, b, a] = [d[i], d[i + 1], d[i + 2], d[i + 3]];
            if (a > 200 && Math.max(r, g, b) - Math.min(r, g, b) > 60) n++;  // saturated: a data line
        }
        return n;
    }""", canvas_id)


async def test_page_of_a_three_peer_swarm_shows_peers_and_loss_chart_live(tmp_path):
    peers = [await start_peer(steps=0, min_peers=3)]
    join = f"127.0.0.1:{peers[0].port}"
    peers += [await start_peer(steps=0, min_peers=3, join=join) for _ in range(2)]
    runs = [asyncio.ensure_future(p.run()) for p in peers]
    a = peers[0]
    try:
        await until(lambda: all(p.book.step >= 10 for p in peers) and len(a.timeline.swarm_loss) > 3)
        await asyncio.sleep(float(os.environ.get("SWARM_STATUS_WAIT", "0")))
        async with Browser() as b:
            page = b.page
            await page.goto(f"http://127.0.0.1:{a.port}/", wait_until="load")
            rows = "#peers tbody tr[data-peer-id]"
            await page.wait_for_function(f"document.querySelectorAll('{rows}').length === 3", timeout=15_000)
            ids = await page.eval_on_selector_all(rows, "rs => rs.map(r => r.dataset.peerId)")
            assert sorted(ids) == sorted(p.id for p in peers)
            states = await page.eval_on_selector_all(f"{rows} .pill", "ps => ps.map(p => p.textContent)")
            assert states == ["alive"] * 3
            hint = await page.text_content("#peers-hint")  # robust aggregation's counts are on the page
            assert "centered-clip" in hint and "0 banned" in hint

            await page.wait_for_function("+document.getElementById('loss-chart').dataset.points > 10",
                                         timeout=15_000)
            assert await ink(page, "loss-chart") > 100  # lines are actually drawn
            assert await ink(page, "wire-chart") > 50

            # live: the stream (not polling) is in use, and the numbers move without a reload
            assert await page.text_content("#conn-text") == "live"
            step0 = await page.text_content("#c-step")
            await page.wait_for_function(f"document.getElementById('c-step').textContent !== {json.dumps(step0)}",
                                         timeout=15_000)
            assert await page.text_content("#c-peers") == "3"
            assert await page.text_content("#c-peers-sub") == "0 suspect · 0 dead · 0 left"
            tables = await page.text_content("#tables")  # the row-ownership map of the sharded tables
            assert "ngram" in tables and "value" in tables
            assert all(p.id[:8] in tables for p in peers)
            assert (await page.text_content("#pull")).startswith("p50 ")
            assert (await page.text_content("#row-health")).startswith("Rows: ")
            # where the step goes: one bar segment per phase that took time, compute among them
            await page.wait_for_selector("#phases .phase-bar div", timeout=15_000)
            phases = await page.eval_on_selector_all("#phases [data-phase]", "ss => ss.map(s => s.dataset.phase)")
            assert "compute" in phases and set(phases) <= {"rows", "compute", "send", "held", "round", "apply", "after"}
            assert "% waiting on other peers" in await page.text_content("#phases-hint")
            # every card's line is whole, none cut at this width (the wire card's bytes per sample)
            cut = await page.eval_on_selector_all(".card .sub, .card .value", "es => es.filter(e => "
                                                  "e.scrollWidth > e.clientWidth + 1).map(e => e.id)")
            assert cut == []
            assert "sent per sample" in await page.text_content("#c-wire-sub")
            v = a.status()["versions"]  # what this build is, in the footer (swarm/versions.py)
            assert await page.text_content("#versions") == (f"swarm {v['swarm']} · protocol {v['protocol']} · "
                                                            f"Python {v['python']} · torch {v['torch']}")

            shot = tmp_path / "status.png"
            await page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            if os.environ.get("SWARM_STATUS_SCREENSHOT"):
                shutil.copy(shot, os.environ["SWARM_STATUS_SCREENSHOT"])
            errors = list(b.errors)
        assert errors == []  # the browser is closed before the peers stop, so no failed fetches are expected
    finally:
        for p in peers:
            p.stop()
        await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), 60)
        for p in peers:
            await p.close()


def fake_status(n: int) -> dict:
    """An /api/status document of a 50-peer swarm with sharded tables (the optional keys)."""
    now = time.time()
    ids = [f"{i:02d}" + os.urandom(7).hex() for i in range(n)]
    members = [{"peer_id": pid, "addr": f"http://10.0.{i // 200}.{i % 200}:7000", "state":
                ("suspect" if i == 7 else "dead" if i == 9 else "alive"), "incarnation": 0, "step": 500 - i % 5,
                "active": True, "self": i == 0, "lag": i % 5, "loss": 3.0 + i / 100, "tokens_per_s": 5000,
                "rtt_ms": 1.5, "last_seen_s": 0.4, "state_for_s": 30.0, "bytes_in": 123456, "bytes_out": 654321}
               for i, pid in enumerate(ids)]
    loss = [[now - 300 + t, t, 5.5 - t / 100] for t in range(300)]
    wire = [[now - 300 + t, t * 1e5, t * 2e5, t * 2e4, t * 4e6] for t in range(300)]
    slots, per = 4096, 4096 // n
    owners = [{"table": tab, "first_slot": i * per, "last_slot": slots - 1 if i == n - 1 else (i + 1) * per - 1,
               "primary": ids[i], "replicas": [ids[(i + 1) % n]]} for tab in ("tok", "pos") for i in range(n)]
    return {
        "peer_id": ids[0], "addr": members[0]["addr"], "step": 500, "active": True, "loss": 3.0, "val_loss": 3.1,
        "sync_every": 4, "overlap": True, "inner_step": 2002, "bytes_per_sample": 2048.0,
        "pacing": {"max_contributors": 4, "stride": 1, "payload_share": 12, "free_running": False, "cap_by": "bytes"},
        "tokens_per_s": 5000.0, "members": members, "bytes_sent": {"grads": 10**9}, "bytes_received": {"grads": 2 * 10**9},
        "dense_bytes": 10**11, "compression_ratio": 190.0, "rounds": {}, "rejected": {"codec": 2}, "dropped_sends": 0,
        "events": [], "param_sketch": None, "now": now, "compression": "topk-int8",
        "swarm": {"alive": n - 2, "suspect": 1, "dead": 1, "left": 0, "step": 500, "tokens_per_s": 5000 * n,
                  "loss": 3.2, "epoch": 60},
        "series": {"loss": loss, "swarm_loss": loss[::3], "val_loss": [[now - 100, 200, 3.4]], "wire": wire},
        "log": [{"at": now - 5, "source": "membership", "kind": "suspect", "peer_id": ids[7], "detail": ""},
                {"at": now - 1, "source": "rejected", "kind": "codec", "peer_id": "", "detail": "2 messages rejected"}],
        "tables": {"slots": slots, "epoch": 60, "owners": owners,
                   "handoffs": [{"table": "tok", "first_slot": 0, "last_slot": per - 1, "from": ids[0], "to": ids[1],
                                 "progress": 0.5}]},
        "pull_latency_ms": {"p50": 3.2, "p95": 11.7},
        "step_phases": {"steps": 512, "rows": {"median_ms": 8.0, "mean_ms": 9.4},
                        "compute": {"median_ms": 228.0, "mean_ms": 230.1}, "send": {"median_ms": 0.5, "mean_ms": 11.0},
                        "held": {"median_ms": 0.0, "mean_ms": 24.0}, "round": {"median_ms": 0.0, "mean_ms": 9.6},
                        "apply": {"median_ms": 0.0, "mean_ms": 0.0}, "after": {"median_ms": 0.3, "mean_ms": 9.6},
                        "wait_share": 0.147},
        "rows": {"pulls": 1200, "rows_pulled_remote": 250000, "rows_read_local": 90000, "rows_missing": 0,
                 "push_failures": 2, "retries": 0, "rows_owed": {ids[3]: 40, ids[4]: 2}, "flushes_partial": 1,
                 "replay_waits": 3, "replay_wait_s": 0.734, "replays_given_up": 0},
    }


async def test_page_stays_usable_with_fifty_peers_and_draws_the_ownership_map(tmp_path):
    """The page's data is faked (50 peers, sharded tables) by intercepting /api/status and /api/events."""
    peer = await start_peer()
    doc = json.dumps(fake_status(50))
    try:
        async with Browser() as b:
            page = b.page
            await page.route("**/api/events", lambda r: r.fulfill(
                status=200, headers={"Content-Type": "text/event-stream"}, body=f"event: status\ndata: {doc}\n\n"))
            await page.route("**/api/status", lambda r: r.fulfill(
                status=200, headers={"Content-Type": "application/json"}, body=doc))
            await page.goto(f"http://127.0.0.1:{peer.port}/", wait_until="load")
            await page.wait_for_function("document.querySelectorAll('#peers tbody tr').length === 50", timeout=15_000)
            # the table scrolls inside its panel instead of stretching the page
            wrap = await page.eval_on_selector(".table-wrap", "w => [w.clientHeight, w.scrollHeight]")
            assert wrap[0] <= 450 < wrap[1]
            assert await page.eval_on_selector_all(".own-table", "ts => ts.length") == 2
            assert await page.eval_on_selector_all(".own-bar div", "ds => ds.length") == 100
            assert await page.eval_on_selector_all(".own-bar div.moving", "ds => ds.length") == 1
            assert "Hand-offs under way: 1" in await page.text_content("#tables")
            assert await page.text_content("#pull") == "p50 3.2 ms · p95 11.7 ms"
            assert await page.text_content("#row-health") == (
                "Rows: 1,200 pulls · 90,000 rows read here, 250,000 pulled · push failures 2 · rows owed to "
                "replicas 42 · partial flushes 1 · waits for a replay 3 (0.7 s)")
            # the step's phases: those that took time (apply took none here), in order, with the wait share
            phases = await page.eval_on_selector_all("#phases [data-phase]", "ss => ss.map(s => s.dataset.phase)")
            assert phases == ["rows", "compute", "send", "held", "round", "after"]
            assert await page.eval_on_selector_all("#phases .phase-bar div", "ds => ds.length") == 6
            assert await page.text_content("#phases-hint") == ("mean of its last 512 steps: 294 ms a step · 15% "
                                                               "waiting on other peers (rows, held, round)")
            assert "held for others' pushes 24.0 ms" in await page.text_content("#phases")
            assert await page.text_content("#c-peers") == "48"
            # a swarm in windows of local steps says so, and what it sends per sample
            assert "windows of 4 inner steps, overlapped (inner step 2,002)" in await page.text_content("#c-step-sub")
            # 48 contributors and a cap of 4: each window's payload at 1/12 of its entries
            assert "payloads at 1/12 of their entries (--max-contributors 4)" in await page.text_content("#c-step-sub")
            # per step: the share (--cap-by bytes), the stride (--cap-by rounds), or a free runner's both
            cap = "([p, every]) => capLine({sync_every: every, pacing: {max_contributors: 4, ...p}})"
            assert await page.evaluate(cap, [{"payload_share": 4, "stride": 1}, 1]) == (
                " · payloads at 1/4 of their entries (--max-contributors 4)")
            assert await page.evaluate(cap, [{"payload_share": 1, "stride": 4}, 1]) == (
                " · a payload every 4 rounds (--max-contributors 4, --cap-by rounds)")
            assert await page.evaluate(cap, [{"payload_share": 4, "stride": 3, "free_running": True}, 1]) == (
                " · payloads at 1/4 of their entries (--max-contributors 4) · a payload every 3 rounds (free-running)")
            assert await page.evaluate(cap, [{"payload_share": 1, "stride": 1}, 1]) == ""
            assert "sent per sample" in await page.text_content("#c-wire-sub")
            assert await page.text_content("#c-peers-sub") == "1 suspect · 1 dead · 0 left"
            assert await ink(page, "loss-chart") > 100
            await page.screenshot(path=str(tmp_path / "status-50.png"), full_page=True)
            errors = [e for e in b.errors if e.startswith("pageerror")]
        assert errors == []
    finally:
        await peer.close()
