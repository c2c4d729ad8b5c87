"""One rank of a host group under torchrun, for tests/test_group.py: real peers (HTTP servers,
membership, table services) whose rows move both ways, checked against each other.

Run as ``torchrun --nproc-per-node N tests/group_worker.py OUT_DIR [--replicas R] [--backend nccl
--device cuda] [--time REPS]``; each rank writes OUT_DIR/rank<r>.json with what it saw. Nothing
here asserts: the test reads the files. ``--time`` also times the group's share of a pull through
the collectives against the same rows pulled over HTTP (bench/gpu_check.sh prints the table).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarm.config import PeerConfig  # noqa: E402
from swarm.node import Peer  # noqa: E402

ROWS = 4096
WANT = 1500


def want_of(rank: int, table_index: int) -> np.ndarray:
    """The ids rank ``rank`` pulls and pushes (every rank can compute every rank's)."""
    rng = np.random.default_rng(1000 * rank + table_index)
    return np.unique(rng.integers(0, ROWS, WANT)).astype(np.int64)


async def settle(peer: Peer, world: int) -> bool:
    """Until every rank has the map of all ranks and no slot on the move (same answer everywhere)."""
    for _ in range(300):
        mine = f"{peer.tables.view}/{len(peer.tables.map.members)}/{len(peer.tables.moving)}"
        seen = await peer.work(peer.group.comm.all_gather_text, mine)
        if len(set(seen)) == 1 and seen[0].endswith(f"/{world}/0"):
            return True
        await asyncio.sleep(0.1)
    return False


async def main(out_dir: Path, replicas: int, backend: str, device: str, reps: int) -> None:
    cfg = PeerConfig(table_rows=ROWS, table_slots=64, replicas=replicas, batch_size=4, threads=1, device=device,
                     backend=backend, progress_interval=1e9, linger=0)
    peer = Peer(cfg, out=lambda line: None)
    await peer.start()
    comm, group = peer.group.comm, peer.group
    report: dict = {"rank": comm.rank, "id": peer.id, "settled": await settle(peer, comm.world)}
    tables = [s.name for s in peer.replica.table_specs]

    # Give every row a history: each rank pushes seeded gradients for its ids over HTTP (TableClient).
    g = torch.Generator().manual_seed(comm.rank)
    warm = {t: (want_of(comm.rank, i), torch.randn(len(want_of(comm.rank, i)), group.rows.dim, generator=g))
            for i, t in enumerate(tables)}
    report["warm_pushed"] = await peer.table_client.push(warm, key=f"{peer.id}:1000000")
    await peer.work(comm.all_gather_text, "warm")  # every rank's warm-up push (and its replays) is done

    # Pull through the group, then ask the same owners the same ids over HTTP.
    want = {t: want_of(comm.rank, i) for i, t in enumerate(tables)}
    omap = peer.tables.map
    per_rank, _ = group.rows.split_pull(omap, want)
    rows, missing = await group.pull(want)
    same, compared = True, 0
    for r, sub in per_rank.items():
        got, gone = await peer.table_client.pull_from(group.rank_ids[r], sub, omap.view)
        for t, ids in sub.items():
            pos = torch.from_numpy(np.searchsorted(want[t], ids))
            same &= got is not None and torch.equal(rows[t][pos], got[t])
            compared += len(ids)
    report.update(rows_equal_http=bool(same), rows_compared=compared,
                  missing=sum(len(v) for v in missing.values()), group_rows=vars(group.rows.stats).copy())

    # Push one gradient row per wanted id, through the group where the primary is another rank.
    before = peer.tables.shards
    steps_before = {t: _steps(before[t], omap, t, peer.id) for t in tables}
    await peer.work(comm.all_gather_text, "before-push")
    grads = {t: (want[t], torch.full((len(want[t]), group.rows.dim), 1e-3)) for t in tables}
    await group.push(grads, {}, step=7)
    await peer.drain_pushes(keep=0)
    await peer.work(comm.all_gather_text, "pushed")
    await asyncio.sleep(0.5)  # replays to replicas are sent in the background
    await peer.work(comm.all_gather_text, "replayed")
    report["updates"] = {}
    for i, t in enumerate(tables):
        ids, delta = _steps(peer.tables.shards[t], omap, t, peer.id)
        ids0, before_steps = steps_before[t]
        if not np.array_equal(ids, ids0):  # the map moved under the test: report it, compare nothing
            report["updates"][t] = {"rows": int(len(ids)), "exact": False, "moved": True}
            continue
        expected = sum(np.isin(ids, want_of(r, i)).astype(np.int64) for r in range(comm.world))
        report["updates"][t] = {"rows": int(len(ids)), "exact": bool(np.array_equal(delta - before_steps, expected)),
                                "applied": int((delta - before_steps).sum()), "expected": int(expected.sum())}
    report["group_rows_after"] = vars(group.rows.stats).copy()
    report["push_failures"] = peer.table_client.stats.push_failures
    if reps:
        report["timing"] = await time_pulls(peer, want, reps)
    (out_dir / f"rank{comm.rank}.json").write_text(json.dumps(report))
    await peer.work(comm.all_gather_text, "done")
    await peer.close()


async def time_pulls(peer: Peer, want: dict, reps: int) -> dict:
    """Median seconds for the group's share of a pull: through the collectives, then the same ids
    from the same owners over HTTP (all ranks start each repetition together)."""
    group, comm = peer.group, peer.group.comm
    omap = peer.tables.map
    per_rank, _ = group.rows.split_pull(omap, want)
    rows = sum(len(ids) for sub in per_rank.values() for ids in sub.values())

    async def collective() -> None:
        ex = await peer.work(group.rows.request, per_rank, omap.view)
        served = await peer.table_work(group.rows.serve, peer.tables, ex)
        await peer.work(group.rows.receive, ex, served)

    async def http() -> None:
        await asyncio.gather(*(peer.table_client.pull_from(group.rank_ids[r], sub, omap.view)
                               for r, sub in per_rank.items()))
        await peer.work(comm.all_gather_text, "http")  # the collective's time includes waiting for all ranks

    out = {}
    for name, fn in (("collective", collective), ("http", http)):
        times = []
        for _ in range(reps):
            await peer.work(comm.all_gather_text, "go")
            t0 = time.perf_counter()
            await fn()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
    return {"rows": rows, **out}


def _steps(shard, omap, table: str, me: str) -> tuple[np.ndarray, np.ndarray]:
    """Ids of every row this rank holds, and their update counters."""
    ids = np.concatenate([np.arange(*omap.slot_rows(table, int(s))) for s in shard.held_slots()]
                         or [np.zeros(0, dtype=np.int64)]).astype(np.int64)
    ids.sort()
    ids = ids[omap.owned_mask(me, table, ids)]  # owned now: not the slots kept a while for a hand-off
    return ids, shard.steps(ids).numpy()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, default=ROWS, help="rows of each table")
    ap.add_argument("--want", type=int, default=WANT, help="ids each rank draws per table")
    ap.add_argument("--time", type=int, default=0, help="repetitions of the timed pulls (0: none)")
    a = ap.parse_args()
    ROWS, WANT = a.rows, a.want
    torch.set_num_threads(1)
    asyncio.run(main(a.out_dir, a.replicas, a.backend, a.device, a.time))
