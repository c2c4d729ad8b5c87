#!/usr/bin/env python3
"""glibc's default malloc thresholds against swarm/allocator.py's, side by side, one process each.

Two things a peer does every step, each timed (median) with the minor page faults it causes, with
and without keep_freed_memory(): a forward/backward of the default model on one batch
(Replica.compute; the rows come with the call, as pulled rows do), and a row-wise Adam step of
--rows random rows of one table shard (a 4-peer flush or replay). Each variant runs in its own
fresh interpreter (the setting is process-wide and cannot be undone), alternating, --rounds times;
the medians over rounds are printed and the LAST line is one JSON object.

    python3 bench/allocator.py
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, resource, sys, time
tune, rows, table_rows, steps = sys.argv[1] == "1", int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
if tune:
    from swarm.allocator import keep_freed_memory
    assert keep_freed_memory()
import numpy as np, torch
torch.set_num_threads(1)
from swarm.tasks import bytelm
from swarm.tables.ownership import OwnershipMap, TableSpec
from swarm.tables.shard import RowOptConfig, TableShard
from swarm.replica import Replica


def timed(fn, n, warm=3):
    for i in range(warm):
        fn(i)
    times, f0 = [], resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(n):
        t = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t)
    return {"ms": sorted(times)[len(times) // 2] * 1e3,
            "faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / n}


spec = TableSpec("ngram", table_rows, 128)
sh = TableShard(spec, OwnershipMap([spec], ["a"], slots=1024), RowOptConfig(lr=0.03))
sh.create_slots(list(range(1024)))
rng = np.random.default_rng(0)
batches = [(np.sort(rng.choice(table_rows, rows, replace=False)), torch.randn(rows, 128) * 1e-3) for _ in range(8)]
# warm-up: every batch once, so that each row the timed steps write has been written (the shard's
# pool maps a page the first time a row on it is written, as a peer's does while it trains)
adam = timed(lambda i: sh.apply_grads(*batches[i % len(batches)]), steps, warm=len(batches))

tr = Replica(bytelm.task(table_rows=table_rows))
tr.set_shard(0, 1, seed=0)
def train_step(i):
    batch, want = tr.sample()
    tr.compute(batch, want, {t: torch.randn(len(ids), 128) * 0.01 for t, ids in want.items()})
train = timed(train_step, max(10, steps // 10))
print(json.dumps({"adam": adam, "train": train}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2300, help="rows per Adam step (a 4-peer flush: ~2300)")
    ap.add_argument("--table-rows", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res: dict[str, list[dict]] = {"default": [], "tuned": []}
    for _ in range(a.rounds):
        for name, flag in (("default", "0"), ("tuned", "1")):
            out = subprocess.run([sys.executable, "-c", CHILD, flag, str(a.rows), str(a.table_rows), str(a.steps)],
                                 env=env, capture_output=True, text=True, check=True)
            res[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    summary: dict = {}
    for name, runs in res.items():
        summary[name] = {f"{what}_ms": round(statistics.median(r[what]["ms"] for r in runs), 2) for what in ("train", "adam")}
        summary[name].update({f"{what}_faults": round(statistics.median(r[what]["faults"] for r in runs), 1)
                              for what in ("train", "adam")})
    summary["speedup"] = {what: round(summary["default"][f"{what}_ms"] / summary["tuned"][f"{what}_ms"], 2)
                          for what in ("train", "adam")}
    for name in ("default", "tuned"):
        r = summary[name]
        print(f"{name:8s} training step {r['train_ms']:7.1f} ms ({r['train_faults']:7.1f} minor faults), "
              f"{a.rows}-row Adam step {r['adam_ms']:6.2f} ms ({r['adam_faults']:7.1f} minor faults)")
    print(json.dumps({"rows": a.rows, **summary}))

if __name__ == "__main__":
    main()
