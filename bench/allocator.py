#!/usr/bin/env python3
"""glibc's default malloc thresholds against swarm/allocator.py's, side by side, one process each.

A peer's table thread runs a row-wise Adam step on every flush and replay. Measured here on one
shard (--table-rows rows, dim 128): the time per step of --rows random rows and the minor page
faults each step causes, with and without keep_freed_memory(). Each variant runs in its own fresh
interpreter (the setting is process-wide and cannot be undone), alternating, --rounds times; the
medians are printed and the LAST line is one JSON object.

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
from swarm.tables.ownership import OwnershipMap, TableSpec
from swarm.tables.shard import RowOptConfig, TableShard
spec = TableSpec("ngram", table_rows, 128)
sh = TableShard(spec, OwnershipMap([spec], ["a"], slots=1024), RowOptConfig(lr=0.03))
sh.create_slots(list(range(1024)))
rng = np.random.default_rng(0)
batches = [(np.sort(rng.choice(table_rows, rows, replace=False)), torch.randn(rows, 128) * 1e-3) for _ in range(8)]
for ids, g in batches:
    sh.apply_grads(ids, g)
times = []
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(steps):
    ids, g = batches[i % len(batches)]
    t = time.perf_counter()
    sh.apply_grads(ids, g)
    times.append(time.perf_counter() - t)
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / steps
print(json.dumps({"ms": sorted(times)[len(times) // 2] * 1e3, "faults": faults}))
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
    summary = {name: {"adam_step_ms": round(statistics.median(r["ms"] for r in runs), 3),
                      "minor_faults_per_step": round(statistics.median(r["faults"] for r in runs), 1)}
               for name, runs in res.items()}
    summary["speedup"] = round(summary["default"]["adam_step_ms"] / summary["tuned"]["adam_step_ms"], 2)
    for name in ("default", "tuned"):
        print(f"{name:8s} {summary[name]['adam_step_ms']:7.3f} ms per {a.rows}-row Adam step, "
              f"{summary[name]['minor_faults_per_step']:7.1f} minor faults per step")
    print(json.dumps({"rows": a.rows, **summary}))


if __name__ == "__main__":
    main()
