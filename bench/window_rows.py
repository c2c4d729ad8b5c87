#!/usr/bin/env python3
"""The training thread's row work in windows of local steps, alone: WindowRows (swarm/tables/window.py)
driven as a peer drives it in a window, timed by call, without a network or a model.

Each window: clear(); then per inner step the step's new rows are added (as a pull brings them)
and every row of its batch gets one row-optimizer step (update); at the end the window's push
(pushes, with --ratio's share of the rows sent and the rest carried). Ids are drawn with a
Zipf-like skew, so a window's first steps bring most of its new rows, as n-gram ids do. One torch
thread; seeded, so two checkouts run the same work. Prints ms per window for each call, and as
its LAST stdout line one JSON object.

    python3 bench/window_rows.py                     # 2 tables of 32768 x 128, H = 32, 6 windows
    python3 bench/window_rows.py --rows 65536 --windows 10
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarm.tables import RowOptConfig  # noqa: E402
from swarm.tables.window import WindowRows  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32768, help="rows per table (bench/wan.py's model: 32768)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--tables", type=int, default=2)
    ap.add_argument("--sync-every", type=int, default=32, help="inner steps a window")
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--ids-per-step", type=int, default=8192, help="ids a step's batch draws per table (before dedup)")
    ap.add_argument("--ratio", type=float, default=0.25, help="--row-ratio: the share of a window's row deltas pushed")
    a = ap.parse_args()
    for name in ("rows", "dim", "tables", "sync_every", "windows", "ids_per_step"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if not 0 < a.ratio <= 1:
        ap.error(f"--ratio must be in (0, 1], got {a.ratio}")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    names = [f"t{i}" for i in range(a.tables)]
    w = WindowRows({t: a.dim for t in names}, RowOptConfig(kind="adam", lr=0.01), ratio=a.ratio)
    p = 1.0 / np.arange(1, a.rows + 1) ** 0.9
    p /= p.sum()
    spent = {"clear": 0.0, "add": 0.0, "update": 0.0, "pushes": 0.0}

    def timed(name: str, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        spent[name] += time.perf_counter() - t0
        return out

    pulled = []
    for _ in range(a.windows):
        timed("clear", w.clear)
        have = {t: np.zeros(0, np.int64) for t in names}
        for _ in range(a.sync_every):
            batch = {t: np.unique(rng.choice(a.rows, a.ids_per_step, p=p)) for t in names}
            new = {t: np.setdiff1d(batch[t], have[t], assume_unique=True) for t in names}
            timed("add", w.add, new, {t: torch.randn(len(v), a.dim) for t, v in new.items()}, {})
            have = {t: np.union1d(have[t], new[t]) for t in names}
            timed("update", w.update, {t: (ids, torch.randn(len(ids), a.dim) * 0.01) for t, ids in batch.items()})
        timed("pushes", w.pushes, 0.25)
        pulled.append(int(sum(len(v) for v in have.values())))
    per_window = {k: round(v / a.windows * 1000, 1) for k, v in spent.items()}
    print(f"ms per window (H = {a.sync_every}, {a.tables} tables of {a.rows} x {a.dim}): {per_window}; "
          f"rows a window {pulled[-1]}, carried {sum(len(c[0]) for c in w.carry.values())}")
    print(json.dumps({"ms_per_window": per_window, "total_ms_per_window": round(sum(per_window.values()), 1),
                      "rows_per_window": pulled, "args": vars(a)}))


if __name__ == "__main__":
    main()
