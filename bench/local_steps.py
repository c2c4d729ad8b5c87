#!/usr/bin/env python3
"""Local-step settings on loopback: val_loss and bytes per sample at one sample budget, per setting.

N `peer.py` processes (default 4) on 127.0.0.1, the built-in task, one after another for each
configuration given (a string of peer.py flags; "" = today's per-step swarm). No shaping, so this
measures what the settings do to the model and to the bytes, not time on a slow link
(bench/wan.py does that). One JSON line per configuration:

  val_loss          the held-out loss at the end of the budget (equal samples), mean over peers
  final_loss        the running mean of the last 10 training losses (for local steps: of the
                    peers' local models within a window, which flatters them; val_loss is the
                    global model's)
  bytes_per_sample  request bodies a peer sent (gradient payloads, row pulls and pushes, replica
                    replays, control), over the samples it trained, mean over peers; replies (rows
                    served to others) are not in it (bench/wan.py counts interface bytes)
  sent_by_kind      peer 0's request bytes by kind (on the wire: zstd-compressed where it paid)
  received_by_kind  peer 0's reply bytes by kind (the rows its pulls brought, ...)
  wire_encoding     peer 0's bodies sent and received, on the wire and before zstd
                    (--wire-compression; "--wire-compression none" sends them all plain)
  replay_waits      per peer, [pulls that waited for a replay to reach its replica copy, seconds
                    they waited] (docs/design.md, "When a primary answers a push")

    python3 bench/local_steps.py "" "--sync-every 32 --compression topk-int2 --ratio 0.02 --ef-decay 0.95"
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(extra: list[str], a) -> dict:
    base = [sys.executable, str(ROOT / "peer.py"), "--steps", str(a.steps), "--batch-size", str(a.batch_size),
            "--table-rows", str(a.table_rows), "--threads", "1", "--min-peers", str(a.peers),
            "--progress-interval", "60", "--seed", str(a.seed)]
    t0 = time.time()
    procs = [subprocess.Popen(base + ["--port", str(a.port)] + extra, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)]
    time.sleep(3)
    procs += [subprocess.Popen(base + ["--join", f"127.0.0.1:{a.port}"] + extra, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for _ in range(a.peers - 1)]
    outs = [p.communicate(timeout=a.timeout) for p in procs]
    summaries = []
    for (out, err), p in zip(outs, procs):
        lines = out.strip().splitlines()
        if p.returncode or not lines:
            return {"config": " ".join(extra), "error": (err.strip().splitlines() or ["no output"])[-1]}
        summaries.append(json.loads(lines[-1]))
    mean = lambda k: sum(s[k] for s in summaries) / len(summaries)  # noqa: E731
    return {"config": " ".join(extra), "val_loss": round(mean("val_loss"), 4), "final_loss": round(mean("final_loss"), 4),
            "bytes_per_sample": round(mean("bytes_per_sample")), "wall_s": round(time.time() - t0, 1),
            "rounds_timed_out": [s["rounds_timed_out"] for s in summaries], "sent_by_kind": summaries[0]["sent_by_kind"],
            # peer 0's: replies (rows served to it) by kind, and all bodies on the wire against before zstd
            "received_by_kind": summaries[0]["received_by_kind"], "wire_encoding": summaries[0].get("wire_encoding"),
            # per peer: pulls that waited for a replay before reading its replica copy, seconds waited
            "replay_waits": [[(s.get("rows") or {}).get("replay_waits"), (s.get("rows") or {}).get("replay_wait_s")]
                             for s in summaries]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="*", default=[""], help='peer.py flags per configuration ("" = per-step)')
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=192, help="inner steps (the peers end with a shorter window when it is not a multiple of a --sync-every)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--table-rows", type=int, default=32768)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=7750)
    ap.add_argument("--timeout", type=float, default=1500.0)
    a = ap.parse_args()
    for cfg in a.configs:
        print(json.dumps(run(cfg.split(), a)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
