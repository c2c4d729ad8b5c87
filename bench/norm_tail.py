#!/usr/bin/env python3
"""How far out honest payloads go: each round's payload norms over the round's median, clean runs.

The robust rules flag a payload whose norm exceeds robust.OUTLIER_FACTOR (4) x its round's median
as an outlier, and the scoreboard makes it pay for it (docs/design.md, "Scores and bans"). This
measures the honest side of that bar: N in-process peers of the built-in task (the tests'
small configuration by default: batch 4, 4096-row tables, one torch thread each) train RUNS clean
runs of STEPS steps, and every round each peer takes is logged (a Peer subclass reads
``last_report`` after ``apply_round``). Each round counts once (the first peer that took it).

The row pushes have the same bar (swarm/tables/robust_rows.py): a sender whose *level* (the median
norm of the rows it pushed in a flush) exceeds 4x the flush's reference level is an outlier there.
Each primary's flush verdicts are logged too (its TableClient.observe, wrapped), one per sender
and flush, from other senders only (a primary does not score itself).

One line per run (rounds, the largest ratio, payloads over 3x and 4x, outlier flags, bans, and the
lowest score any sender reached: ``min_score`` under the graded penalty, ``min_score_flat`` had
every outlier cost the whole penalty, replayed on the same rounds; and the same for the row
pushes under ``rows_*``), then, LAST, one JSON object over all runs: ``payloads``, ``p50``,
``p99``, ``p999``, ``max``, ``over_4`` (payloads past the outlier bar), ``runs_with_outlier``,
``min_score``, ``min_score_flat``, ``bans``, and ``rows``: the same over the row pushes' levels
(``min_score`` there is the lowest push score any primary held).

    python3 bench/norm_tail.py --runs 6 --steps 500
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from swarm import robust  # noqa: E402
from swarm.config import PeerConfig  # noqa: E402
from swarm.node import Peer  # noqa: E402
from swarm.tables.http import verdict_report  # noqa: E402

SMALL = dict(table_rows=4096, table_slots=256, threads=1, progress_interval=60.0, eval_every=0,
             warmup_steps=0, round_timeout=15.0, free_run=0)


class LoggingPeer(Peer):
    """A peer that files each round's robust report (its senders, norms and median) in ``log``, and,
    as a primary, each flush's verdicts of the other senders' row pushes (under ``"rows"``)."""

    def __init__(self, cfg: PeerConfig, log: dict):
        super().__init__(cfg, out=lambda line: None)
        self.log = log

    async def start(self) -> None:
        await super().start()
        observe = self.table_client.observe

        def logged(verdicts):
            others = [v for v in verdicts if v.sender != self.id]
            if others:
                self.log.setdefault("rows", []).append((self.id, others))
            return observe(verdicts)

        self.table_client.observe = logged

    def apply_round(self, result):
        n = super().apply_round(result)
        rep = self.last_report
        if rep is not None and rep.median_norm > 0 and rep.count >= robust.MIN_ROBUST:
            self.log.setdefault(result.step, rep)
        return n


def lowest_scores(reports: list[robust.Report]) -> tuple[float, float]:
    """The lowest score any sender reached over the run's rounds (in order) under the graded outlier
    penalty (the code) and under a flat one (every outlier the whole penalty: a report without norms)."""
    graded, flat = robust.Scoreboard(), robust.Scoreboard()
    low_g = low_f = 1.0
    for t, rep in enumerate(reports):
        graded.observe(rep, float(t))
        flat.observe(robust.Report(count=rep.count, senders=rep.senders, outliers=rep.outliers), float(t))
        low_g = min([low_g] + [v.score for v in graded.peers.values()])
        low_f = min([low_f] + [v.score for v in flat.peers.values()])
    return low_g, low_f


def lowest_row_scores(flushes: list[tuple[str, list]]) -> tuple[float, float]:
    """lowest_scores for the row pushes: each primary scores the senders of its own flushes."""
    by_primary: dict[str, list[robust.Report]] = {}
    for primary, verdicts in flushes:
        by_primary.setdefault(primary, []).append(verdict_report(verdicts))
    lows = [lowest_scores(reps) for reps in by_primary.values()]
    return min((g for g, _ in lows), default=1.0), min((f for _, f in lows), default=1.0)


async def one_run(a, seed: int) -> dict:
    log: dict = {}  # round -> its report; "rows" -> [(primary, [RowVerdict of another sender, ...]), ...] per flush
    kw = dict(SMALL, steps=a.steps, min_peers=a.peers, batch_size=a.batch_size, seed=seed)
    first = LoggingPeer(PeerConfig(**kw), log)
    await first.start()
    peers = [first]
    try:
        for _ in range(a.peers - 1):
            p = LoggingPeer(PeerConfig(**kw, join=f"127.0.0.1:{first.port}"), log)
            await p.start()
            peers.append(p)
        await asyncio.wait_for(asyncio.gather(*(p.run() for p in peers)), a.timeout)
        scores = [v for p in peers for v in p.status()["robust"]["peers"].values()]
        row_bans = sum(v["bans"] for p in peers for v in p.table_client.status()["push_scores"].values())
    finally:
        for p in peers:
            await p.close()
    rows = log.pop("rows", [])
    reports = [log[k] for k in sorted(log)]
    ratios = [x / r.median_norm for r in reports for x in r.norms]
    low, low_flat = lowest_scores(reports)
    verdicts = [v for _, vs in rows for v in vs]
    row_ratios = [v.ratio for v in verdicts if v.ratio > 0]
    agreements = [v.agreement for v in verdicts if v.agreement is not None]
    row_low, row_low_flat = lowest_row_scores(rows)
    return {"seed": seed, "rounds": len(log), "max": round(max(ratios, default=0.0), 3),
            "over_3": sum(x > 3 for x in ratios), "over_4": sum(x > robust.OUTLIER_FACTOR for x in ratios),
            "flags": sum(len(r.outliers) for r in reports), "min_score": round(low, 3),
            "min_score_flat": round(low_flat, 3), "bans": sum(v["bans"] for v in scores),
            "rows_verdicts": len(row_ratios), "rows_max": round(max(row_ratios, default=0.0), 3),
            "rows_over_4": sum(x > robust.OUTLIER_FACTOR for x in row_ratios),
            "rows_flags": sum(v.outlier for v in verdicts), "rows_disagreed": sum(v.disagreed for v in verdicts),
            "rows_judged": len(agreements), "rows_agreement_below_0": sum(x < 0 for x in agreements),
            "rows_agreement_min": round(min(agreements, default=0.0), 3),
            "rows_min_score": round(row_low, 3), "rows_min_score_flat": round(row_low_flat, 3),
            "rows_bans": row_bans, "ratios": ratios, "row_ratios": row_ratios, "agreements": agreements}


def quantile(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=3)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0, help="the first run's swarm seed (the model's init); run i uses seed + i")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    a = ap.parse_args()
    if a.peers < robust.MIN_ROBUST or a.runs < 1 or a.steps < 1 or a.batch_size < 1 or not a.timeout > 0:
        ap.error(f"need --peers >= {robust.MIN_ROBUST} (the robust rules' minimum) and positive --runs, --steps, "
                 "--batch-size, --timeout")
    torch.set_num_threads(1)
    ratios: list[float] = []
    row_ratios: list[float] = []
    agreements: list[float] = []
    runs = []
    for i in range(a.runs):
        t0 = time.monotonic()
        r = asyncio.run(one_run(a, a.seed + i))
        ratios += r.pop("ratios")
        row_ratios += r.pop("row_ratios")
        agreements += r.pop("agreements")
        runs.append(r)
        print(json.dumps({**r, "wall_s": round(time.monotonic() - t0, 1)}), flush=True)
    ratios.sort()
    row_ratios.sort()
    agreements.sort()
    print(json.dumps({"peers": a.peers, "batch_size": a.batch_size, "steps": a.steps, "runs": a.runs,
                      "payloads": len(ratios), "p50": round(quantile(ratios, 0.5), 3),
                      "p99": round(quantile(ratios, 0.99), 3), "p999": round(quantile(ratios, 0.999), 3),
                      "max": round(ratios[-1] if ratios else 0.0, 3),
                      "over_4": sum(x > robust.OUTLIER_FACTOR for x in ratios),
                      "runs_with_outlier": sum(r["over_4"] > 0 for r in runs),
                      "min_score": min(r["min_score"] for r in runs),
                      "min_score_flat": min(r["min_score_flat"] for r in runs), "bans": sum(r["bans"] for r in runs),
                      "rows": {"verdicts": len(row_ratios), "p50": round(quantile(row_ratios, 0.5), 3),
                               "p99": round(quantile(row_ratios, 0.99), 3),
                               "p999": round(quantile(row_ratios, 0.999), 3),
                               "max": round(row_ratios[-1] if row_ratios else 0.0, 3),
                               "over_4": sum(x > robust.OUTLIER_FACTOR for x in row_ratios),
                               "flags": sum(r["rows_flags"] for r in runs),
                               "disagreed": sum(r["rows_disagreed"] for r in runs),
                               "judged": sum(r["rows_judged"] for r in runs),
                               "agreement_below_0": sum(r["rows_agreement_below_0"] for r in runs),
                               "agreement_p001": round(quantile(agreements, 0.001), 3),
                               "agreement_p01": round(quantile(agreements, 0.01), 3),
                               "agreement_p50": round(quantile(agreements, 0.5), 3),
                               "agreement_min": round(agreements[0] if agreements else 0.0, 3),
                               "min_score": min(r["rows_min_score"] for r in runs),
                               "min_score_flat": min(r["rows_min_score_flat"] for r in runs),
                               "bans": sum(r["rows_bans"] for r in runs)}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
