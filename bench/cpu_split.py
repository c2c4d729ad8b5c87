#!/usr/bin/env python3
"""CPU per peer-step, split by thread role: N peers training together on loopback against the same
N peers each alone (no network), run back to back in pairs.

On a machine where the peers share the cores (4 peers on 2 here), a swarm step's wall time is set by
the CPU all peers spend on it, so the protocol's cost is best read as CPU per peer-step. Each run
starts --peers `peer.py` processes (1 torch thread each; together: --min-peers N and one --join
address; alone: --min-peers 1 each, no join), waits --warmup seconds, then reads utime + stime of every
thread (`/proc/PID/task/TID/stat`) at the start and end of a --window-second window, and divides by
the steps the peers finished inside it (their `step N ...` progress lines). Threads are told apart by
their native names (swarm/threads.py): the event loop (the main thread), swarm-train, swarm-tables,
swarm-helper. The ratio of a pair (together / alone) is what the protocol costs in CPU; the median
over --pairs is printed, and the LAST stdout line is one JSON object. Linux only (/proc).

    python3 bench/cpu_split.py                 # 4 peers, 3 pairs, ~4 minutes
    python3 bench/cpu_split.py --pair tls      # together in plain HTTP vs together with a secret (TLS)
    python3 bench/cpu_split.py --peer-args "--sync-every 32 --compression topk-int2"   # another mode

--peer-args adds the same peer.py flags to every peer of both runs of a pair (the swarm's mode, its
codec, ...), so the split can be read for a configuration other than the default one.

With --pair tls each pair is (together, tls): the same swarm without and with a --secret, so every
link TLS 1.3 and every request MACed; the difference is what TLS costs in CPU per peer-step.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROLES = {"swarm-train": "train", "swarm-tables": "tables", "swarm-helper": "helpers"}
TLS_SECRET = "swarm-cpu-split-benchmark-secret-0123"  # any secret: a swarm with one runs TLS
TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def thread_cpu(pids: list[int]) -> dict[str, float]:
    """CPU seconds so far per role, over every thread of ``pids`` (threads that ended are lost: the
    peers' pools live as long as the peer)."""
    out: dict[str, float] = {}
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
            base = f"/proc/{pid}/task/{tid}"
            try:
                stat = open(f"{base}/stat").read()
                comm = open(f"{base}/comm").read().strip()
            except OSError:
                continue  # the thread ended meanwhile
            fields = stat.rsplit(")", 1)[1].split()
            role = "loop" if int(tid) == pid else ROLES.get(comm, "other")
            out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / TICK
    return out


def steps_done(logs: list[Path]) -> list[int]:
    done = []
    for log in logs:
        try:
            done.append(sum(1 for line in log.read_text().splitlines() if line.startswith("step ")))
        except OSError:
            done.append(0)
    return done


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every peer's process group (each peer leaves the swarm), SIGKILL what is left after 30 s."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def peer_argv(a, mode: str, i: int, port: int, first: int | None) -> list[str]:
    """peer.py's command line for peer ``i`` of a run (``first``: the first peer's port, None for it)."""
    argv = [sys.executable, str(ROOT / "peer.py"), "--port", str(port), "--steps", str(a.steps),
            "--table-rows", str(a.table_rows), "--threads", "1", "--name", f"p{i}",
            "--progress-interval", "0", "--eval-every", "0", *a.peer_args]
    if mode == "tls":
        argv += ["--secret", TLS_SECRET]
    if mode in ("together", "tls"):
        argv += ["--min-peers", str(a.peers)]
        if first is not None:
            argv += ["--join", f"127.0.0.1:{first}"]
    else:
        argv += ["--min-peers", "1"]
    return argv


def run(mode: str, a, tmp: Path) -> dict:
    """One run of --peers peers (``mode``: "alone", "together", or "tls": together with a --secret);
    CPU ms per peer-step by role."""
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    first = None
    try:
        for i in range(a.peers):
            port = free_port()
            argv = peer_argv(a, mode, i, port, first)
            log = tmp / f"{mode}-{i}.out"
            logs.append(log)
            with log.open("w") as out:  # the child keeps its own descriptor
                procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.DEVNULL, env=env,
                                              cwd=ROOT, start_new_session=True))
            if first is None:
                first = port
                if mode != "alone":
                    time.sleep(2.0)  # the others join it
        time.sleep(a.warmup)
        pids = [p.pid for p in procs]
        c0, s0, w0 = thread_cpu(pids), steps_done(logs), time.monotonic()
        time.sleep(a.window)
        c1, s1, w1 = thread_cpu(pids), steps_done(logs), time.monotonic()
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"{mode}: a peer ended inside the window (raise --steps or lower --window)")
    finally:
        stop(procs)
    steps = sum(b - x for x, b in zip(s0, s1))
    if steps <= 0:
        raise RuntimeError(f"{mode}: no step finished inside the window")
    roles = {r: round((c1.get(r, 0.0) - c0.get(r, 0.0)) / steps * 1e3, 1) for r in sorted(set(c0) | set(c1))}
    total = round(sum(roles.values()), 1)
    return {"ms_per_peer_step": total, "by_role": roles, "peer_steps": steps,
            "wall_per_step_s": round((w1 - w0) / (steps / a.peers), 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=3, help="pairs of runs, back to back")
    ap.add_argument("--pair", choices=("alone", "tls"), default="alone",
                    help="alone: (peers alone, together); tls: (together, together with a secret: TLS)")
    ap.add_argument("--steps", type=int, default=400, help="each peer's --steps (it is stopped after the window)")
    ap.add_argument("--table-rows", type=int, default=32768)
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds before the window (start-up, hand-off)")
    ap.add_argument("--window", type=float, default=20.0, help="seconds measured")
    ap.add_argument("--peer-args", default="", metavar="FLAGS",
                    help="peer.py flags for every peer of both runs, one shell-quoted string "
                         "(e.g. \"--sync-every 32 --batch-size 16\")")
    a = ap.parse_args()
    try:
        a.peer_args = shlex.split(a.peer_args)
    except ValueError as e:
        print(f"--peer-args: {e}", file=sys.stderr)
        return 2
    if not os.path.isdir("/proc/self/task"):
        print("bench/cpu_split.py needs Linux's /proc; nothing measured")
        print(json.dumps({"skipped": "no /proc"}))
        return 0
    if a.peers < 2 or a.pairs < 1 or a.steps < 1 or a.warmup < 0 or a.window <= 0:
        print("--peers must be >= 2, --pairs >= 1, --steps >= 1, --warmup >= 0 and --window > 0", file=sys.stderr)
        return 2
    first, second = ("alone", "together") if a.pair == "alone" else ("together", "tls")
    pairs = []
    with tempfile.TemporaryDirectory(prefix="swarm-cpu-") as tmp:
        for k in range(a.pairs):
            try:
                x = run(first, a, Path(tmp))
                y = run(second, a, Path(tmp))
            except RuntimeError as e:  # a run too short for its window: say so, no traceback
                print(f"bench/cpu_split.py: {e}", file=sys.stderr)
                return 2
            ratio = round(y["ms_per_peer_step"] / x["ms_per_peer_step"], 3)
            pairs.append({first: x, second: y, "ratio": ratio})
            print(f"pair {k + 1}: {first} {x['ms_per_peer_step']} ms {x['by_role']}  |  {second} "
                  f"{y['ms_per_peer_step']} ms {y['by_role']}  |  ratio {ratio}", flush=True)
    modes = (first, second)
    roles = sorted({r for p in pairs for m in modes for r in p[m]["by_role"]})
    med = {m: {r: statistics.median(p[m]["by_role"].get(r, 0.0) for p in pairs) for r in roles} for m in modes}
    print(f"\nCPU ms per peer-step, median of {a.pairs} pairs ({a.peers} peers, loopback):")
    print(f"| role | {first} | {second} | extra |\n| --- | ---: | ---: | ---: |")
    for r in roles:
        print(f"| {r} | {med[first][r]:.1f} | {med[second][r]:.1f} | {med[second][r] - med[first][r]:+.1f} |")
    result = {
        "peers": a.peers,
        "pair": list(modes),
        "peer_args": a.peer_args,
        f"cpu_ratio_{second}_over_{first}": statistics.median(p["ratio"] for p in pairs),
        "ratios": [p["ratio"] for p in pairs],
        "ms_per_peer_step": {m: statistics.median(p[m]["ms_per_peer_step"] for p in pairs) for m in modes},
        "wall_per_step_s": {m: statistics.median(p[m]["wall_per_step_s"] for p in pairs) for m in modes},
        "by_role_median": med,
        "pairs": pairs,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
