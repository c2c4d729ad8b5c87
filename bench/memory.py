#!/usr/bin/env python3
"""Resident memory per peer: N `peer.py` processes on the default task, peak RSS of each.

Starts --peers `python3 peer.py` processes on 127.0.0.1 (the built-in task with its defaults; one
torch thread each so that they share the machine's cores; the first listens, the others --join it,
all with --min-peers N), polls every process's /proc/PID/status (VmHWM: the peak resident size the
kernel saw; VmRSS; RssAnon / RssFile: heap against mapped files such as libtorch) and, at the
peak, its /proc/PID/smaps_rollup, until every peer has exited after --steps. Extra peer.py flags
after `--` go to every peer; --env KEY=VALUE sets a variable for every peer. Prints one line per
peer, then the median peak, and as its LAST line one JSON object. ``--threads 1`` comes first, so
a --threads after `--` wins.

    python3 bench/memory.py --peers 4 --steps 40
    python3 bench/memory.py --peers 4 --steps 40 -- --row-state rowwise

Only loopback; every process started is killed on exit.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile")


def status_kb(pid: int) -> dict[str, int]:
    """The memory fields of /proc/PID/status, in kB ({} once the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in FIELDS:
            out[key] = int(rest.split()[0])
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--rollup", action="store_true", help="also print the first peer's smaps_rollup at its peak")
    ap.add_argument("extra", nargs="*", help="peer.py flags for every peer (after --)")
    a = ap.parse_args()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **dict(kv.split("=", 1) for kv in a.env)}
    port = free_port()
    base = [sys.executable, str(ROOT / "peer.py"), "--steps", str(a.steps), "--threads", "1",
            "--min-peers", str(a.peers), *a.extra]
    procs: list[subprocess.Popen] = []
    peak: list[dict[str, int]] = []
    last: list[dict[str, int]] = []
    try:
        for i in range(a.peers):
            argv = base + ["--name", f"m{i}"] + (["--port", str(port)] if i == 0 else ["--join", f"127.0.0.1:{port}"])
            procs.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                          text=True))
            peak.append({})
            last.append({})
            if i == 0:
                time.sleep(1.0)
        rollup: list[str] = [""] * a.peers
        deadline = time.monotonic() + a.timeout
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            for i, p in enumerate(procs):
                st = status_kb(p.pid)
                if not st:
                    continue
                last[i] = st
                if st.get("VmRSS", 0) >= peak[i].get("VmRSS", 0):
                    peak[i] = st
                    try:
                        rollup[i] = Path(f"/proc/{p.pid}/smaps_rollup").read_text()
                    except OSError:
                        pass
            time.sleep(0.2)
        summaries = []
        for p in procs:
            out = p.communicate(timeout=60)[0] if p.poll() is not None else ""
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]
            summaries.append(json.loads(lines[-1]) if lines else {})
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    rows = []
    for i, (s, pk, ls) in enumerate(zip(summaries, peak, last)):
        hwm = ls.get("VmHWM", 0) / 1024
        row = {"peer": i, "peak_rss_mb": round(hwm, 1), "rss_at_peak_mb": round(pk.get("VmRSS", 0) / 1024, 1),
               "anon_at_peak_mb": round(pk.get("RssAnon", 0) / 1024, 1),
               "file_at_peak_mb": round(pk.get("RssFile", 0) / 1024, 1),
               "steps": s.get("steps"), "val_loss": s.get("val_loss"), "final_loss": s.get("final_loss")}
        rows.append(row)
        print(json.dumps(row))
    med = statistics.median(r["peak_rss_mb"] for r in rows)
    print(f"median peak RSS per peer: {med:.1f} MB (max {max(r['peak_rss_mb'] for r in rows):.1f})")
    if a.rollup:
        print(rollup[0])
    print(json.dumps({"peers": a.peers, "steps": a.steps, "extra": a.extra, "env": a.env,
                      "median_peak_rss_mb": med, "max_peak_rss_mb": max(r["peak_rss_mb"] for r in rows),
                      "per_peer": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
