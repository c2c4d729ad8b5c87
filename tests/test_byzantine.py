"""A Byzantine peer: 1 of 5 sends sign-flipped gradients scaled x100 (valid payloads), with whole
payloads and with payloads split by the contributor cap.

Three in-process swarms of 5 peers on the same seed: clean (defaults), attacked with robust
aggregation (the defaults: CenteredClip, msg_clip 2, banning; the ban made long enough to outlast the
run on a slow machine), attacked with every defence off (mean, no clipping, no bans). Robust must end within 10% of clean; the plain mean clearly worse.
"""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch

from swarm.node import Peer

from .conftest import rel_l2, small_cfg, watch_shares

pytestmark = pytest.mark.timeout(240)

PEERS = 5
STEPS = 25
# the hashed tables' row pushes are outside this test (their attack: bench/row_attack.py, docs/design.md
# "Robust row pushes"): one owner per slot halves the table traffic of 5 peers in one process, and the test's time
TABLES = dict(replicas=1)
OFF = dict(aggregation="mean", msg_clip=0.0, ban_seconds=0.0)  # no defence at all


def make_byzantine(peer: Peer, scale: float = -100.0) -> None:
    """Negate and scale the gradient before it is encoded: the payload stays valid for the codec."""
    honest = peer.compressor.compress

    def compress(flat: torch.Tensor, step: int, **tags):
        return honest(flat * scale, step, **tags)

    peer.compressor.compress = compress


async def run_swarm(attack: bool, steps: int = STEPS, shares: list | None = None,
                    **kw) -> tuple[list[dict], list[Peer]]:
    """Run PEERS in-process peers to ``steps``; the last one is the attacker when ``attack``.
    ``shares``: gets the share of every honest payload (Compressor.compress's ``share``)."""
    kw = {**TABLES, **kw}
    first = Peer(small_cfg(steps=steps, min_peers=PEERS, **kw), out=lambda line: None)
    await first.start()
    peers = [first]
    try:
        for _ in range(PEERS - 1):
            p = Peer(small_cfg(steps=steps, min_peers=PEERS, join=f"127.0.0.1:{first.port}", **kw),
                     out=lambda line: None)
            await p.start()
            peers.append(p)
            await settled(peers)
        if shares is not None:
            for p in peers[:-1]:
                watch_shares(p, shares)
        if attack:
            make_byzantine(peers[-1])
        results = await asyncio.wait_for(asyncio.gather(*(p.run() for p in peers)), 200)
    finally:
        for p in peers:
            await p.close()
    return list(results), peers


async def settled(peers: list[Peer], timeout: float = 30.0) -> None:
    """Wait until the peers share one table-ownership view with no hand-off pending. Joining one at a
    time this way keeps hand-offs short (a slot's old owner is never itself still fetching it), and
    the first steps then do not wait on row pulls."""
    ids = sorted(p.id for p in peers)
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if all(p.tables.map is not None and list(p.tables.map.members) == ids and not p.tables.moving
               for p in peers):
            return
        await asyncio.sleep(0.05)


def val_loss(results: list[dict]) -> float:
    """The honest peers' held-out loss (all replicas are the same model; the attacker is last)."""
    vals = [r["val_loss"] for r in results[:PEERS - 1]]
    return sum(vals) / len(vals)


async def test_one_byzantine_peer_of_five_robust_vs_mean():
    t0 = time.monotonic()
    clean, _ = await run_swarm(False)
    robust, rpeers = await run_swarm(True, ban_seconds=600.0)  # defaults, with a ban that outlasts a slow run
    plain, _ = await run_swarm(True, **OFF)
    v_clean, v_robust, v_plain = val_loss(clean), val_loss(robust), val_loss(plain)
    print(f"val_loss clean {v_clean:.4f} attacked+robust {v_robust:.4f} attacked+mean {v_plain:.4f} "
          f"({time.monotonic() - t0:.0f} s)")
    assert all(r["steps"] == STEPS and r["rounds_timed_out"] == 0 for r in clean + robust)
    assert v_robust <= 1.10 * v_clean, (v_clean, v_robust)
    assert not math.isfinite(v_plain) or v_plain > 1.2 * v_clean, (v_clean, v_plain)

    assert_banned_alike(robust, rpeers)


def assert_banned_alike(robust: list[dict], rpeers: list[Peer]) -> None:
    """Every honest peer banned the attacker (last), at the same round, refused its later payloads
    and never banned an honest one, and the honest replicas stayed identical."""
    attacker = rpeers[-1].id
    outliers = set()
    for p in rpeers[:-1]:
        st = p.status()["robust"]
        assert st["peers"][attacker]["bans"] == 1 and st["peers"][attacker]["banned_until"] is not None
        # honest gradient norms are heavy-tailed: an honest payload may now and then be an outlier of
        # its round (docs/design.md, "Scores and bans"), at a small cost, but is never banned
        assert all(v["bans"] == 0 and v["score"] > 0.5 for pid, v in st["peers"].items() if pid != attacker)
        outliers.add(st["peers"][attacker]["outliers"])
    assert len(outliers) == 1 and outliers.pop() >= 1  # the same verdicts on every peer
    assert sum(p.status()["robust"]["refused_banned"] for p in rpeers[:-1]) > 0
    # the ban starts at the same round everywhere, so the honest replicas stay identical
    for r in robust[1:PEERS - 1]:
        assert rel_l2(robust[0]["param_sketch"], r["param_sketch"]) <= 1e-3


async def test_one_byzantine_peer_of_five_when_the_cap_splits_payloads():
    """--max-contributors 2 with 5 peers: every payload carries half its entries (the cap by bytes),
    so the robust rules work on sparser, less overlapping payloads (a receiver does not check a
    payload's share: its size is its sender's business); the attacker is still clipped and banned
    alike everywhere, and the swarm ends within 10% of the same swarm unattacked."""
    shares: list[int] = []
    clean, _ = await run_swarm(False, max_contributors=2)
    robust, rpeers = await run_swarm(True, max_contributors=2, ban_seconds=600.0, shares=shares)
    assert shares.count(2) >= 0.9 * len(shares) and len(shares) >= (PEERS - 1) * STEPS, shares
    v_clean, v_robust = val_loss(clean), val_loss(robust)
    print(f"split payloads: val_loss clean {v_clean:.4f} attacked+robust {v_robust:.4f}")
    assert all(r["steps"] == STEPS and r["rounds_timed_out"] == 0 for r in clean + robust)
    assert v_robust <= 1.10 * v_clean, (v_clean, v_robust)
    assert_banned_alike(robust, rpeers)
