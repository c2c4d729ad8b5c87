#!/usr/bin/env python3
"""Does a swarm of three `python peer.py` processes learn as well as one peer with 3x the batch?

Runs, one after another on this machine (loopback, unshaped):
  swarm   - `peer.py --port 0 --steps N` plus two joiners (`--join`), default settings otherwise
  single  - one `peer.py --steps N --batch-size 3B` (the data-parallel equivalent), same codec
  dense1  - the same single peer with `--compression none` (no compression at all: the floor)
  kill    - the swarm again, with the third peer SIGKILLed once it reaches step N/3

Prints a table and, as its LAST stdout line, one JSON object with the val_loss of each run, the
swarm's worst val_loss gap to `single`, the largest relative L2 gap between param_sketches, the
bytes_sent / dense_bytes of each swarm peer, and whether the kill run's survivors finished.

    python3 bench/convergence.py            # N=300, B=16 (about 8 minutes on 2 cores)
    python3 bench/convergence.py --steps 60 # quicker look
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOG = open(os.environ.get("SWARM_BENCH_LOG", os.devnull), "a")  # the peers' stderr (-v events)


class Proc:
    def __init__(self, args: list[str]):
        self.p = subprocess.Popen([sys.executable, str(ROOT / "peer.py"), "-v", "--threads", "1", *args], cwd=ROOT, text=True,
                                  stdout=subprocess.PIPE, stderr=LOG)
        self.lines: list[str] = []
        self.port: int | None = None
        self.step = 0
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self) -> None:
        for line in self.p.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            if m := re.search(r"listening on https?://[^:]+:(\d+)", line):
                self.port = int(m.group(1))
            if m := re.match(r"step (\d+) ", line):
                self.step = int(m.group(1))

    def wait_port(self) -> int:
        while self.port is None:
            if self.p.poll() is not None:
                raise SystemExit(f"peer exited early: {self.lines[-3:]}")
            time.sleep(0.05)
        return self.port

    def result(self, timeout: float = 1800) -> tuple[int, dict | None]:
        code = self.p.wait(timeout)
        self.t.join(5)
        try:
            return code, json.loads(self.lines[-1])
        except (IndexError, ValueError):
            return code, None


def rel_l2(a: list[float], b: list[float]) -> float:
    d = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)))
    return d / max(math.sqrt(sum(x * x for x in a)), math.sqrt(sum(y * y for y in b)), 1e-12)


def swarm(steps: int, common: list[str], kill_at: int | None = None) -> list[tuple[int, dict | None]]:
    first = Proc(["--port", "0", "--steps", str(steps), "--progress-interval", "1", *common])
    port = first.wait_port()
    joiners = [Proc(["--join", f"127.0.0.1:{port}", "--steps", str(steps), "--progress-interval", "1", *common])
               for _ in range(2)]
    if kill_at is not None:
        victim = joiners[-1]
        while victim.step < kill_at and victim.p.poll() is None:
            time.sleep(0.05)
        victim.p.send_signal(signal.SIGKILL)
        return [first.result(), joiners[0].result()]
    return [first.result()] + [j.result() for j in joiners]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--only", choices=["swarm", "single", "dense1", "kill"], action="append",
                    help="run only these parts (repeatable)")
    args = ap.parse_args()
    parts = set(args.only or ["swarm", "single", "dense1", "kill"])
    n, b = args.steps, args.batch_size
    common = ["--batch-size", str(b)]
    t0 = time.time()
    runs: dict[str, list[tuple[int, dict | None]]] = {}
    if "swarm" in parts:
        runs["swarm"] = swarm(n, common)
    if "single" in parts:
        runs["single"] = [Proc(["--steps", str(n), "--batch-size", str(3 * b)]).result()]
    if "dense1" in parts:
        runs["dense1"] = [Proc(["--steps", str(n), "--batch-size", str(3 * b), "--compression", "none"]).result()]
    if "kill" in parts:
        runs["kill"] = swarm(n, common, kill_at=n // 3)
    for name in ("swarm", "single", "dense1", "kill"):
        runs.setdefault(name, [])

    print(f"{'run':8} {'peer':18} {'exit':>4} {'steps':>5} {'first':>7} {'final':>7} {'val':>7} "
          f"{'sent MB':>8} {'sent/dense':>10}")
    for name, results in runs.items():
        for code, s in results:
            if s is None:
                print(f"{name:8} {'?':18} {code:>4}  (no summary)")
                continue
            frac = s["bytes_sent"] / s["dense_bytes"] if s["dense_bytes"] else float("nan")
            print(f"{name:8} {s['peer_id']:18} {code:>4} {s['steps']:>5} {s['first_loss']:7.3f} {s['final_loss']:7.3f} "
                  f"{s['val_loss']:7.4f} {s['bytes_sent'] / 1e6:8.2f} {frac:10.4f}")
    ok = [s for _, s in runs["swarm"] if s]
    single = runs["single"][0][1] if runs["single"] else None
    sk = [s["param_sketch"] for s in ok]
    out = {
        "steps": n, "batch_size": b, "seconds": round(time.time() - t0, 1),
        "swarm_exit_codes": [c for c, _ in runs["swarm"]],
        "swarm_val_loss": [s["val_loss"] for s in ok],
        "single_3x_batch_val_loss": single["val_loss"] if single else None,
        "single_3x_batch_dense_val_loss": runs["dense1"][0][1]["val_loss"] if runs["dense1"] and runs["dense1"][0][1]
        else None,
        "worst_val_gap_vs_single": max(abs(s["val_loss"] - single["val_loss"]) / single["val_loss"] for s in ok)
        if single and ok else None,
        "max_sketch_rel_l2": max((rel_l2(x, y) for i, x in enumerate(sk) for y in sk[i + 1:]), default=None),
        "bytes_sent_over_dense": [round(s["bytes_sent"] / s["dense_bytes"], 5) for s in ok if s["dense_bytes"]],
        "kill_exit_codes": [c for c, _ in runs["kill"]],
        "kill_survivor_steps": [s["steps"] if s else None for _, s in runs["kill"]],
        "kill_survivor_val_loss": [s["val_loss"] if s else None for _, s in runs["kill"]],
        "kill_survivor_first_loss": [s["first_loss"] if s else None for _, s in runs["kill"]],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
