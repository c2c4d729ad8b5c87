#!/usr/bin/env python3
"""Row pull throughput and latency: swarm's HTTP pull against torch.distributed gloo all_to_all.

N processes on loopback, run one after the other with the same tables, dtype and ids:

  http  N swarm peers (swarm.node.Peer, started, not training), tables sharded by rendezvous
        hashing with R replicas. Every peer pulls a batch of sorted-unique random row ids per
        table at the same time (TableClient.pull: cut by owner, one request per owner, rows of
        its own slots read in-process), `--rounds` times.
  gloo  N ranks of torch.distributed (gloo), tables sharded by fixed row ranges. Every rank pulls
        the same number of rows per round through the three all_to_all_single stages of a row
        pull (counts, ids, rows) — the reference design in shared/seeds/row_owners.py.txt.

Reported per transport: rows/s (all ranks' rows over the wall time of the rounds) and the p50/p99
latency of one rank's pull. The LAST stdout line is one JSON object with http_rows_per_s,
gloo_rows_per_s, pull_p50_ms, pull_p99_ms (HTTP), gloo_p50_ms, gloo_p99_ms and their ratio.

    python3 bench/rows.py                 # 4 processes, 4096 rows per table per pull, 30 rounds, ABBA x2
    python3 bench/rows.py --peers 3 --rows 2048 --rounds 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from pathlib import Path

import multiprocessing as mp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TABLES = ("ngram", "value")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def want_ids(rng: np.random.Generator, rows_total: int, k: int) -> dict[str, np.ndarray]:
    return {t: np.sort(rng.choice(rows_total, size=k, replace=False)).astype(np.int64) for t in TABLES}


# -- HTTP: swarm peers ---------------------------------------------------------------------------

def http_worker(rank: int, args, ports: list[int], out: mp.Queue, go: mp.Event) -> None:
    import torch

    torch.set_num_threads(1)
    from swarm.config import PeerConfig
    from swarm.node import Peer

    async def main() -> None:
        join = "" if rank == 0 else f"127.0.0.1:{ports[0]}"
        cfg = PeerConfig(port=ports[rank], join=join, table_rows=args.table_rows, table_slots=args.slots,
                         replicas=args.replicas, row_dtype=args.dtype, threads=1, batch_size=4, eval_batches=1)
        peer = Peer(cfg, out=lambda line: None)
        await peer.start()
        t0 = time.monotonic()
        while not (peer.tables.map is not None and len(peer.tables.map.members) == args.peers
                   and not peer.tables.moving):
            if time.monotonic() - t0 > 120:
                raise SystemExit("peers did not settle")
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # let every peer's hand-offs finish
        out.put(("ready", rank))
        while not go.is_set():
            await asyncio.sleep(0.01)
        rng = np.random.default_rng(rank)
        lat, rows = [], 0
        start = time.monotonic()
        for i in range(args.rounds + args.warmup):
            want = want_ids(rng, args.table_rows, args.rows)
            t = time.monotonic()
            got, missing = await peer.table_client.pull(want)
            if i >= args.warmup:
                lat.append((time.monotonic() - t) * 1000)
                rows += sum(len(v) for v in want.values())
            else:
                start = time.monotonic()
            assert not any(len(v) for v in missing.values())
        wall = time.monotonic() - start
        st = peer.table_client.stats
        out.put(("done", rank, lat, rows, wall, st.rows_pulled_remote / max(1, st.rows_pulled_remote + st.rows_read_local)))
        await asyncio.sleep(2.0)  # keep serving while the others finish
        await peer.close()

    asyncio.run(main())


def run_http(args) -> dict:
    ctx = mp.get_context("spawn")
    ports = [free_port() for _ in range(args.peers)]
    out, go = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=http_worker, args=(r, args, ports, out, go)) for r in range(args.peers)]
    for i, p in enumerate(procs):
        p.start()
        if i == 0:
            time.sleep(3.0)  # the first peer must be listening before the others join
    ready = 0
    while ready < args.peers:
        msg = out.get(timeout=180)
        ready += msg[0] == "ready"
    go.set()
    results = [out.get(timeout=600) for _ in range(args.peers)]
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    return summarize(results)


# -- gloo all_to_all ---------------------------------------------------------------------------------

def gloo_worker(rank: int, args, port: int, out: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.peers)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    per = args.table_rows // args.peers
    shard = {t: torch.randn(per, 128).to(dtype) for t in TABLES}
    bounds = np.arange(args.peers + 1, dtype=np.int64) * per
    rng = np.random.default_rng(rank)

    def pull(want: dict[str, np.ndarray]) -> None:
        for t in TABLES:
            ids = want[t]
            cuts = np.searchsorted(ids, bounds)
            send_counts = torch.from_numpy(np.diff(cuts).astype(np.int64))
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts)  # stage 1: counts
            asked = torch.empty(int(recv_counts.sum()), dtype=torch.int64)
            dist.all_to_all_single(asked, torch.from_numpy(ids), recv_counts.tolist(), send_counts.tolist())  # ids
            served = shard[t].index_select(0, asked - rank * per)
            got = served.new_empty((len(ids), 128))
            dist.all_to_all_single(got, served, send_counts.tolist(), recv_counts.tolist())  # stage 3: rows

    for _ in range(args.warmup):
        pull(want_ids(rng, per * args.peers, args.rows))
    dist.barrier()
    lat, rows = [], 0
    start = time.monotonic()
    for _ in range(args.rounds):
        want = want_ids(rng, per * args.peers, args.rows)
        t = time.monotonic()
        pull(want)
        lat.append((time.monotonic() - t) * 1000)
        rows += sum(len(v) for v in want.values())
    wall = time.monotonic() - start
    out.put(("done", rank, lat, rows, wall, 0))
    dist.destroy_process_group()


def run_gloo(args) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=gloo_worker, args=(r, args, port, out)) for r in range(args.peers)]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in range(args.peers)]
    for p in procs:
        p.join(30)
    return summarize(results)


def summarize(results: list) -> dict:
    lat = np.concatenate([np.asarray(r[2]) for r in results])
    rows = sum(r[3] for r in results)
    wall = max(r[4] for r in results)
    return {"rows_per_s": rows / wall, "p50_ms": float(np.percentile(lat, 50)),
            "p99_ms": float(np.percentile(lat, 99)), "rows": rows, "wall_s": wall,
            "remote_share": float(np.mean([r[5] for r in results]))}


def median_run(rs: list[dict]) -> dict:
    """Per field, the median over the repeats."""
    return {k: float(np.median([r[k] for r in rs])) for k in rs[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=4096, help="rows per table per pull")
    ap.add_argument("--table-rows", type=int, default=65536)
    ap.add_argument("--slots", type=int, default=4096)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--dtype", default="fp16", choices=["fp32", "fp16", "bf16", "int8"])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2,
                    help="ABBA repeats (gloo, http, http, gloo, ...): this machine is shared and noisy")
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"gloo": [], "http": []}
    order = []
    for r in range(args.repeats):
        order += ["gloo", "http"] if r % 2 == 0 else ["http", "gloo"]
    for name in order:
        runs[name].append((run_gloo if name == "gloo" else run_http)(args))
        print(f"  {name}: {runs[name][-1]['rows_per_s']:.0f} rows/s, p50 {runs[name][-1]['p50_ms']:.1f} ms", flush=True)
    http, gloo = median_run(runs["http"]), median_run(runs["gloo"])
    print(f"{args.peers} processes, {args.rows} rows x 2 tables per pull, {args.dtype}, {args.rounds} rounds, "
          f"median of {args.repeats}")
    print(f"{'transport':10} {'rows/s':>12} {'p50 ms':>9} {'p99 ms':>9}")
    for name, r in (("http", http), ("gloo", gloo)):
        print(f"{name:10} {r['rows_per_s']:12.0f} {r['p50_ms']:9.2f} {r['p99_ms']:9.2f}")
    print(json.dumps({
        "peers": args.peers, "rows_per_pull": 2 * args.rows, "dtype": args.dtype,
        "http_rows_per_s": round(http["rows_per_s"]), "gloo_rows_per_s": round(gloo["rows_per_s"]),
        "http_over_gloo": round(http["rows_per_s"] / gloo["rows_per_s"], 3),
        "http_over_gloo_each": [round(h["rows_per_s"] / g["rows_per_s"], 3) for h, g in zip(runs["http"], runs["gloo"])],
        "pull_p50_ms": round(http["p50_ms"], 2), "pull_p99_ms": round(http["p99_ms"], 2),
        "gloo_p50_ms": round(gloo["p50_ms"], 2), "gloo_p99_ms": round(gloo["p99_ms"], 2),
        "http_remote_row_share": round(http["remote_share"], 3),
    }))


if __name__ == "__main__":
    main()
