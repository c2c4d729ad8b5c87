#!/usr/bin/env python3
"""One hostile member's row-gradient pushes, without and with the robust row combine (--row-clip).

5 in-process peers (swarm.node.Peer, as tests/test_byzantine.py), the built-in byte LM with its
hashed tables, the same seed for every run. One peer (the last to join) pushes its table row
gradients scaled by ``--scale`` (run A, x1000) and, in a second attack, by ``--flip`` (run B,
sign-flipped: x-1); its dense payloads stay honest (dense robust aggregation stays at its
defaults: it is another defence). For each attack: attacked with ``--row-clip 0`` (no defence: the
primaries sum every push as it came) and attacked with the default ``--row-clip`` (defended). A
clean run is the reference. The attacker's own primary never defends (``row_clip`` 0 on its
service): a hostile primary writes its own slots as it likes, which this defence does not cover.

The attack lives here only: it wraps the attacker's TableClient.push (never a production flag).

Printed: a table of the honest peers' final held-out val_loss (all replicas hold the same model;
mean over the 4 honest peers), the defended / clean ratio (target <= 1.10), rows the primaries
clipped, outlier flushes and bans. The LAST stdout line is one JSON object with every figure.

    python3 bench/row_attack.py                   # 40 steps, x1000 and x-1, one repeat (~3 min on 2 cores)
    python3 bench/row_attack.py --steps 30 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from swarm.config import PeerConfig  # noqa: E402
from swarm.identity import PeerKey  # noqa: E402
from swarm.node import Peer  # noqa: E402

PEERS = 5
SMALL = dict(table_rows=4096, table_slots=256, batch_size=4, threads=1, progress_interval=60.0, eval_batches=2,
             warmup_steps=0, round_timeout=15.0, free_run=0, replicas=1)


def make_row_attacker(peer: Peer, scale: float) -> None:
    """Scale every row gradient ``peer`` pushes by ``scale`` (valid pushes: finite, < MAX_GRAD)."""
    honest = peer.table_client.push

    async def push(grads: dict, key: str) -> bool:
        return await honest({t: (ids, g * scale) for t, (ids, g) in grads.items()}, key)

    peer.table_client.push = push
    peer.tables.row_clip = 0.0  # a hostile primary does not defend its own slots


def record_verdicts(peer: Peer) -> list:
    """Every RowVerdict ``peer``'s flushes score (its own part excluded, as observe does)."""
    seen: list = []
    observe = peer.table_client.observe

    def wrapped(verdicts):
        seen.extend(v for v in verdicts if v.sender != peer.id)
        return observe(verdicts)

    peer.table_client.observe = wrapped
    return seen


def quantiles(xs: list) -> list | None:
    """min, 5%, 25%, 50%, 75%, 95%, max (order statistics), or None for no values."""
    if not xs:
        return None
    xs = sorted(xs)
    return [round(xs[min(len(xs) - 1, int(f * len(xs)))], 3) for f in (0.0, 0.05, 0.25, 0.5, 0.75, 0.95)] + \
        [round(xs[-1], 3)]


def agreement_figures(verdicts: list, attacker: str) -> dict:
    """The agreement statistic (robust_rows.agreement) of honest and attacking senders' flush parts:
    quantiles, how many parts were judged (>= MIN_SHARED shared rows, >= 3 senders) and flagged."""
    out = {}
    for who, vs in (("honest", [v for v in verdicts if v.sender != attacker]),
                    ("attacker", [v for v in verdicts if v.sender == attacker])):
        ag = [v.agreement for v in vs if v.agreement is not None]
        out[f"{who}_parts"] = len(vs)
        out[f"{who}_judged"] = len(ag)
        out[f"{who}_flagged"] = sum(v.disagreed for v in vs)
        out[f"{who}_agreement_q"] = quantiles(ag)  # min, 5%, 25%, 50%, 75%, 95%, max
        out[f"{who}_agreements"] = [round(a, 4) for a in ag]
        out[f"{who}_shared_q"] = quantiles([v.shared for v in vs if v.agreement is not None])
        out[f"{who}_low"] = sorted((round(v.agreement, 3), v.shared) for v in vs
                                   if v.agreement is not None and v.agreement < 0.05)  # (agreement, shared rows)
    return out


async def settled(peers: list[Peer], timeout: float = 30.0) -> None:
    """Wait for one shared table view with no hand-off pending (as tests/test_byzantine.py)."""
    ids = sorted(p.id for p in peers)
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if all(p.tables.map is not None and list(p.tables.map.members) == ids and not p.tables.moving for p in peers):
            return
        await asyncio.sleep(0.05)


async def run_swarm(steps: int, seed: int, scale: float | None, row_clip: float) -> dict:
    """One run; ``scale`` None: clean. Returns the honest peers' figures."""
    kw = dict(SMALL, steps=steps, min_peers=PEERS, seed=seed, row_clip=row_clip)
    # fixed peer ids (keys from fixed seeds): every run trains on the same data shards (ids pick
    # them), so runs differ by the attack and the defence, and by the timing of flushes and rounds only
    keys = tempfile.mkdtemp(prefix="row_attack-")
    for i in range(PEERS):
        PeerKey.from_seed(hashlib.sha256(f"row_attack {seed} {i}".encode()).digest()).save(f"{keys}/{i}.key")
    first = Peer(PeerConfig(**kw, key_file=f"{keys}/0.key"), out=lambda line: None)
    await first.start()
    peers = [first]
    t0 = time.monotonic()
    try:
        for i in range(1, PEERS):
            p = Peer(PeerConfig(**kw, join=f"127.0.0.1:{first.port}", key_file=f"{keys}/{i}.key"), out=lambda line: None)
            await p.start()
            peers.append(p)
            await settled(peers)
        if scale is not None:
            make_row_attacker(peers[-1], scale)
        seen = [record_verdicts(p) for p in peers[:-1]]
        results = await asyncio.wait_for(asyncio.gather(*(p.run() for p in peers)), 600)
        honest, attacker = peers[:-1], peers[-1].id
        stats = [p.tables.stats for p in honest]
        scores = [p.table_client.scores.peers.get(attacker) for p in honest]
        honest_bans = sum(s.bans for p in honest for pid, s in p.table_client.scores.peers.items() if pid != attacker)
        vals = [r["val_loss"] for r in results[:-1]]
        return {"val_loss": sum(vals) / len(vals), "wall_s": round(time.monotonic() - t0, 1),
                "rows_pushed": sum(s.rows_updated + s.rows_combined for s in stats),
                "rows_clipped": sum(s.rows_clipped for s in stats),
                "outlier_pushes": sum(s.outlier_pushes for s in stats),
                "attacker_banned_by": sum(1 for s in scores if s is not None and s.bans),
                "refused_pushes": sum(s.refused for s in scores if s is not None),
                "honest_bans": honest_bans,  # bans of honest senders by honest primaries
                "rounds_timed_out": sum(r["rounds_timed_out"] for r in results),
                **agreement_figures([v for vs in seen for v in vs], attacker)}
    finally:
        for p in peers:
            await p.close()
        shutil.rmtree(keys, ignore_errors=True)


async def main_async(a) -> dict:
    runs: dict[str, list[dict]] = {}
    plan = [("clean", None, a.row_clip), ("clean off", None, 0.0)]
    for name, scale in (("x%g" % a.scale, a.scale), ("x%g" % a.flip, a.flip)):
        plan += [(f"{name} off", scale, 0.0), (f"{name} defended", scale, a.row_clip)]
    if a.runs:
        plan = [x for x in plan if x[0] in a.runs.split(",")]
    for rep in range(a.repeats):
        for name, scale, clip in plan:
            r = await run_swarm(a.steps, a.seed + rep, scale, clip)
            runs.setdefault(name, []).append(r)
            print(f"  [{rep}] {name:<18} val_loss {r['val_loss']:.4f}  ({r['wall_s']} s)  honest flagged "
                  f"{r['honest_flagged']}/{r['honest_judged']} judged of {r['honest_parts']}, agreement "
                  f"{r['honest_agreement_q']}; attacker flagged {r['attacker_flagged']}/{r['attacker_judged']} "
                  f"of {r['attacker_parts']}, agreement {r['attacker_agreement_q']}", flush=True)
    med = {name: statistics.median(r["val_loss"] for r in rs) for name, rs in runs.items()}
    # the agreement statistic over every judged flush part of every repeat of a run kind
    pooled = {name: {who: quantiles([a for r in rs for a in r.pop(f"{who}_agreements")]) for who in ("honest", "attacker")}
              for name, rs in runs.items()}
    clean = med["clean"]
    print(f"\n{PEERS} peers, {a.steps} steps, batch 4, --table-rows 4096, --row-clip {a.row_clip:g}, "
          f"{a.repeats} repeat(s) (median val_loss)")
    print(f"{'run':<20}{'val_loss':>10}{'/ clean':>9}{'pushed':>9}{'clipped':>9}{'outliers':>9}{'banned by':>10}"
          f"{'refused':>9}")
    for name, rs in runs.items():
        last = rs[-1]
        print(f"{name:<20}{med[name]:>10.4f}{med[name] / clean:>9.3f}{last['rows_pushed']:>9}{last['rows_clipped']:>9}"
              f"{last['outlier_pushes']:>9}{last['attacker_banned_by']:>10}{last['refused_pushes']:>9}")
    print("\nagreement of judged flush parts (all repeats; min, 5%, 25%, 50%, 75%, 95%, max), and flagged/judged:")
    for name, rs in runs.items():
        for who in ("honest", "attacker"):
            print(f"  {name:<18} {who:<9} {pooled[name][who]}  flagged {sum(r[who + '_flagged'] for r in rs)}"
                  f"/{sum(r[who + '_judged'] for r in rs)} of {sum(r[who + '_parts'] for r in rs)} parts"
                  + (f", honest senders banned {sum(r['honest_bans'] for r in rs)}" if who == "honest" else ""))
    out = {"peers": PEERS, "steps": a.steps, "row_clip": a.row_clip, "repeats": a.repeats,
           "val_loss": {k: round(v, 4) for k, v in med.items()}, "agreement": pooled,
           "defended_over_clean": {k: round(med[k] / clean, 4) for k in med if k.endswith("defended")},
           "runs": runs}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--scale", type=float, default=1000.0, help="attack A: the row gradients x this")
    ap.add_argument("--flip", type=float, default=-1.0, help="attack B: the row gradients x this (sign flip)")
    ap.add_argument("--row-clip", type=float, default=2.0, help="the defended runs' --row-clip")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each kind (seeds seed, seed+1, ...); medians")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", default="", help="only these runs (comma-separated names, e.g. 'clean,x-1 defended')")
    ap.add_argument("--json", default="", help="also write the JSON line to this file")
    a = ap.parse_args()
    torch.set_num_threads(1)
    out = asyncio.run(main_async(a))
    line = json.dumps(out)
    if a.json:
        Path(a.json).write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
