"""Per-step rounds with --overlap 1: step t + 1 computes while round t travels, its gradient taken
at extrapolated parameters (docs/design.md, "Overlapped rounds"). Every peer still applies the
same rounds in the same order."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarm import settings
from swarm.config import PeerConfig
from swarm.node import Peer
from swarm.replica import Replica

from .conftest import small_cfg, small_replica

pytestmark = pytest.mark.timeout(180)


def watch_computes(peer: Peer) -> list[tuple[int, int]]:
    """(rounds taken, steps computed before) at each of ``peer``'s forward/backward passes."""
    seen: list[tuple[int, int]] = []
    compute = peer.replica.compute

    def spy(*a, **kw):
        seen.append((peer.book.step, len(seen)))
        return compute(*a, **kw)

    peer.replica.compute = spy
    return seen


@pytest.mark.parametrize("overlap", [0, 1])
async def test_three_peers_overlapped_keep_identical_replicas_and_compute_one_round_ahead(overlap):
    kw = dict(steps=20, min_peers=3, overlap=overlap)
    a = Peer(small_cfg(**kw), out=lambda line: None)
    await a.start()
    others = [Peer(small_cfg(join=f"127.0.0.1:{a.port}", **kw), out=lambda line: None) for _ in range(2)]
    for p in others:
        await p.start()
    peers = [a, *others]
    seen = [watch_computes(p) for p in peers]
    try:
        results = await asyncio.wait_for(asyncio.gather(*(p.run() for p in peers)), 150)
    finally:
        for p in peers:
            await p.close()
    for r, s in zip(results, seen):
        assert r["steps"] == 20 and r["steps_contributed"] == 20 and r["rounds_timed_out"] == 0
        assert r["step_phases"]["steps"] == 20  # one entry per round
        assert r["final_loss"] < r["first_loss"]
        # step i computes on the model after round i - 1 (no overlap) or i - 2 (overlap)
        assert len(s) == 20 and all(taken == max(0, i - overlap) for taken, i in s), s
    sketches = [r["param_sketch"] for r in results]
    assert sketches[0] == sketches[1] == sketches[2]


def _flat(r: Replica) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in r.params])


def _step(r: Replica, ahead: bool = False):
    batch, want = r.sample()
    rows = {t: torch.zeros(len(ids), r.modules[t].embedding_dim) for t, ids in want.items()}
    return batch, want, rows, r.compute(batch, want, rows, ahead)


def test_a_step_computed_ahead_takes_its_gradient_at_the_extrapolated_parameters_and_leaves_thesmall_replica():
    r = small_replica()
    r.predict_ahead = True
    _, _, _, (stats, flat, _) = _step(r)
    before = _flat(r)
    r.apply_aggregate(flat, step=0, count=1)
    change = _flat(r) - before
    assert r.last_change is not None and torch.equal(torch.cat([c.reshape(-1) for c in r.last_change]), change)
    assert change.abs().max() > 0
    now, ptrs = _flat(r), [p.data.data_ptr() for p in r.params]
    batch, want, rows, (_, ahead_grad, _) = _step(r, ahead=True)
    # the replica's own tensors are put back, bit for bit (the optimizer holds them)
    assert torch.equal(_flat(r), now) and [p.data.data_ptr() for p in r.params] == ptrs
    # the same batch on a replica set to the extrapolated parameters gives the same gradient
    twin = small_replica()
    with torch.no_grad():
        for p, q, c in zip(twin.params, r.params, r.last_change):
            p.copy_(q + c)
    _, there, _ = twin.compute(batch, want, rows)
    assert torch.allclose(ahead_grad, there, atol=1e-6) and not torch.allclose(ahead_grad, r.compute(batch, want, rows)[1])
    # without predict_ahead (lockstep rounds) or before any round, ``ahead`` changes nothing
    r.predict_ahead = False
    assert torch.equal(r.compute(batch, want, rows, True)[1], r.compute(batch, want, rows)[1])
    fresh = small_replica()
    fresh.predict_ahead = True
    assert torch.equal(fresh.compute(batch, want, rows, True)[1], fresh.compute(batch, want, rows)[1])


def test_overlap_is_a_swarm_setting_off_by_default_and_allowed_per_step():
    assert PeerConfig().overlap == 0 and settings.of(PeerConfig())["overlap"] == 0
    PeerConfig(overlap=1).validate()  # per-step rounds may overlap too, not only windows
    joiner = PeerConfig()
    settings.adopt(joiner, settings.of(PeerConfig(overlap=1)))
    assert joiner.overlap == 1  # a joiner that leaves it out adopts the swarm's
    assert "--overlap" in settings.conflict(settings.of(PeerConfig()), settings.given(PeerConfig(overlap=1)))
