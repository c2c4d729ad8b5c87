#!/usr/bin/env python3
"""Swarm size benchmark: swarms of 2, 4, 8 and 16 peers in turn on this machine (issue 19, item 5).

What it is for: to see what grows with the swarm. Per peer count it prints, per peer and step,
the bytes each peer's interface sent and received (ALL traffic: gradients, rows, membership,
TCP/IP headers), the gradient payload bytes sent and received (the peers' own counters), the step
time against the contended compute floor, the peak RSS, the time to join, whether every replica
finished bit-identical (their `param_sketch`es) and whether the loss fell. It judges the issue's
target "gradient bytes sent AND received per peer per step at 16 peers <= 2x those at 4 peers"
(`target_16_vs_4` in the last line): it measures whatever the peers do (pass a cap on the
contributors of a round, or anything else, with --peer-args).

Network: with root, each peer runs in its own network namespace with an UNSHAPED veth into a
bridge in a hub namespace (bench/wan.py's `Wan`, 10.77.0.0/24, addresses only inside these
namespaces), so each namespace's `wan0` counters are exactly that peer's traffic. Without root (or
with --loopback) every peer runs on 127.0.0.1: the per-peer interface counters do not exist there,
so the all-traffic figures are None ("all_traffic" says why); the peers' own counters still give
the gradient, row and control bytes.

Per peer count P, back to back:
  floor  P `peer.py` at once, each alone (its namespace's loopback, nobody to join): the same
         compute and codec work per step under the same CPU contention, no network wait
         (bench/wan.py's run_floor). Its step time is the floor.
  swarm  `peer.py` x P, peer 0 first, then the others with --join, all with --min-peers P, so
         every peer trains the same --steps from step 1.

Figures (each per peer count; "per peer step" = mean over peers):
  bytes_sent/received_per_peer_step      interface tx/rx over the training window (end of step 1 to
                                         the last step every peer reported) / its steps; the
                                         whole run's (join, state, evaluation, linger) / steps in
                                         *_run
  grad_bytes_sent/received_per_peer_step the peers' summaries: gradient request bodies sent /
                                         received over the run / rounds
  row_/control_bytes_*_per_peer_step     the same for table rows (pulls, pushes, replication) and
                                         control (membership, joins, round replies)
  payload_bytes                          one gradient payload: grads sent / (rounds the peer
                                         contributed x (P - 1) recipients), mean over peers; only
                                         where every peer sends every round (no cap below P)
  *_steady                               gradient bytes per peer step between two polls of every
                                         peer's /api/status after the codec's warmup (its first
                                         20 steps send up to 25x more entries)
  step_time_over_floor                   swarm step time / floor step time (each: mean seconds per
                                         step between the first and last step of the curve)
  rss_mb                                 the largest peak RSS (VmHWM) of a peer (rss_mb_median too)
  join_s                                 median over peers of process start -> its first step line
                                         (with --min-peers P that includes waiting for the last
                                         peer to start); join_s_max, listen_s (start -> listening)
  replicas_identical                     every peer printed a summary at the same step and all
                                         param_sketches are equal bit for bit
  loss_fell                              mean over peers of the running-mean loss (10 steps) at
                                         step 10 (the first window) > at the last step
  val_loss                               median over peers of the held-out loss each evaluated
                                         at the end (the peers' summaries)

The steady polls use `curl` (inside each peer's namespace); without it the *_steady figures are None.
The LAST stdout line is one JSON object; --out also gets it with every per-run record.

    python3 bench/scale.py                                    # 2, 4, 8, 16 peers, 60 steps (root: ~10 min here)
    python3 bench/scale.py --peers 2,4 --steps 30             # a short check
    python3 bench/scale.py --peer-args "--max-contributors 4" # peer flags passed to every peer
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import wan  # noqa: E402  bench/wan.py: namespaces, processes, curve helpers

ROOT = wan.ROOT
sys.path.insert(1, str(ROOT))  # swarm itself (paper_model), from a checkout that is not installed
WINDOW = wan.WINDOW  # peer.py's running-mean window of the loss
# flags the benchmark sets itself on every peer (refused in --peer-args)
OWN_FLAGS = ("--steps", "--batch-size", "--threads", "--join", "--host", "--port", "--name",
             "--min-peers", "--progress-interval", "--seed")
REQUIRED = ("bytes_sent_per_peer_step", "bytes_received_per_peer_step", "grad_bytes_sent_per_peer_step",
            "grad_bytes_received_per_peer_step", "step_time_over_floor", "rss_mb", "replicas_identical",
            "loss_fell", "join_s")

# ----------------------------------------------------------------------------- pure parts (tested)


class ArgError(ValueError):
    """Bad command-line input: printed as one line, exit 2."""


def parse_peers(text: str) -> list[int]:
    """"2,4,8,16" -> [2, 4, 8, 16]: integers >= 2, no repeats, in the order given."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():
            raise ArgError(f"--peers wants comma-separated peer counts like 2,4,8,16, got {text!r}")
        n = int(part)
        if n < 2:
            raise ArgError(f"--peers: a swarm needs at least 2 peers, got {n}")
        if n in out:
            raise ArgError(f"--peers: {n} is given twice")
        out.append(n)
    return out


def parse_peer_args(text: str) -> list[str]:
    """--peer-args "..." -> argv for every peer; the flags the benchmark sets itself are refused."""
    try:
        argv = shlex.split(text)
    except ValueError as e:
        raise ArgError(f"--peer-args: {e}") from None
    for a in argv:
        flag = a.split("=", 1)[0]
        if flag in OWN_FLAGS:
            raise ArgError(f"--peer-args: {flag} is set by the benchmark (use its own option, if it has one)")
    return argv


def flag_value(argv: list[str], flag: str, default: int) -> int:
    """The integer value of `flag` in argv ("--flag V" or "--flag=V"; the last wins), else default."""
    out = default
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv) and argv[i + 1].isdigit():
            out = int(argv[i + 1])
        elif a.startswith(flag + "=") and a[len(flag) + 1:].isdigit():
            out = int(a[len(flag) + 1:])
    return out


_LISTEN_RE = re.compile(r"listening on https?://(\S+?)/?(?:\s|$)")


def listen_addr(line: str) -> str | None:
    """peer.py's "listening on http://HOST:PORT ..." line -> "HOST:PORT" (None for other lines)."""
    m = _LISTEN_RE.search(line)
    return m.group(1) if m else None


def per_step(total: float | None, steps: int | None) -> float | None:
    """total / steps, rounded to a byte; None when either is missing or steps is 0."""
    if total is None or not steps:
        return None
    return round(total / steps, 1)


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b rounded to 3 places; None when either is missing or b is 0 (the floor ratio, 16 vs 4)."""
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 3)


def mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def loss_windows(curve: list[tuple[int, float, float]], window: int = WINDOW) -> tuple[float | None, float | None]:
    """(first window, last window) of a merged curve of running-mean losses: the point at step
    `window` (the mean of steps 1..window; the last point if the curve is shorter), and the last."""
    if not curve:
        return None, None
    first = next((loss for step, _, loss in curve if step >= window), curve[-1][2])
    return first, curve[-1][2]


def loss_fell(first: float | None, last: float | None) -> bool | None:
    if first is None or last is None or not (math.isfinite(first) and math.isfinite(last)):
        return None
    return last < first


def replicas_identical(summaries: list[dict | None], peers: int) -> bool:
    """Every one of `peers` printed a summary, all at the same step, with one param_sketch bit for bit."""
    if len(summaries) != peers or any(not s for s in summaries):
        return False
    sketches = [s.get("param_sketch") for s in summaries]
    steps = {s.get("steps") for s in summaries}
    return sketches[0] is not None and len(steps) == 1 and all(sk == sketches[0] for sk in sketches)


def payload_bytes(summaries: list[dict], peers: int) -> float | None:
    """One gradient payload: grads sent / (rounds contributed x (peers - 1)), mean over peers."""
    each = [s.get("bytes_sent", 0) / (s["steps_contributed"] * (peers - 1))
            for s in summaries if s and s.get("steps_contributed")]
    return None if not each else round(mean(each), 1)


def summary_rates(summaries: list[dict], rounds: int | None) -> dict:
    """Per peer step (mean over peers) of the byte counters in the peers' summaries."""
    def kind(s: dict, key: str, side: str, names: tuple[str, ...]) -> int:
        if key in s:
            return s[key] or 0
        return sum((s.get(side) or {}).get(n, 0) for n in names)

    rows = [s for s in summaries if s]
    pick = {
        "grad_bytes_sent_per_peer_step": lambda s: s.get("bytes_sent", 0),
        "grad_bytes_received_per_peer_step": lambda s: s.get("bytes_received", 0),
        "row_bytes_sent_per_peer_step": lambda s: kind(s, "row_bytes_sent", "sent_by_kind", ("rows", "replica")),
        "row_bytes_received_per_peer_step": lambda s: kind(s, "row_bytes_received", "received_by_kind",
                                                           ("rows", "replica")),
        "control_bytes_sent_per_peer_step": lambda s: (s.get("sent_by_kind") or {}).get("control", 0),
        "control_bytes_received_per_peer_step": lambda s: (s.get("received_by_kind") or {}).get("control", 0),
    }
    out = {k: per_step(mean(f(s) for s in rows), rounds) for k, f in pick.items()}
    for side in ("sent_by_kind", "received_by_kind"):  # every kind the peers count, per peer step
        kinds = sorted({k for s in rows for k in (s.get(side) or {})})
        out[f"{side}_per_peer_step"] = {k: per_step(mean((s.get(side) or {}).get(k, 0) for s in rows), rounds)
                                        for k in kinds}
    out["grad_bytes_sent_per_peer_step_max"] = per_step(max((s.get("bytes_sent", 0) for s in rows), default=None), rounds)
    out["grad_bytes_received_per_peer_step_max"] = per_step(
        max((s.get("bytes_received", 0) for s in rows), default=None), rounds)
    return out


def steady_rates(a: list[dict | None], b: list[dict | None]) -> dict:
    """Two polls of every peer's /api/status (each {"step", "bytes_sent", "bytes_received"} by kind)
    -> gradient bytes sent and received per step between them, mean over the peers polled twice:
    the rounds after the codec's warmup, without the start's larger payloads."""
    rates: dict[str, list[dict[str, float]]] = {"bytes_sent": [], "bytes_received": []}
    for x, y in zip(a, b):
        if not x or not y or (y.get("step") or 0) <= (x.get("step") or 0):
            continue
        d = y["step"] - x["step"]
        for side, acc in rates.items():
            bx, by = x.get(side) or {}, y.get(side) or {}
            acc.append({k: (by.get(k, 0) - bx.get(k, 0)) / d for k in {*bx, *by, "grads"}})

    def by_kind(side: str) -> dict[str, float]:
        kinds = sorted({k for r in rates[side] for k in r})
        return {k: round(mean(r.get(k, 0.0) for r in rates[side]), 1) for k in kinds}

    sent, recv = by_kind("bytes_sent"), by_kind("bytes_received")
    return {"grad_bytes_sent_per_peer_step_steady": sent.get("grads"),
            "grad_bytes_received_per_peer_step_steady": recv.get("grads"),
            "sent_by_kind_per_peer_step_steady": sent, "received_by_kind_per_peer_step_steady": recv,
            "steady_peers_polled": len(rates["bytes_sent"])}


def full_samples(samples: list[tuple[float, list]], n: int) -> list[tuple[float, list]]:
    """The counter samples taken once all n peers ran (earlier ones hold fewer peers)."""
    return [(t, v) for t, v in samples if len(v) == n]


def target_check(by_peers: dict[str, dict], small: str = "4", big: str = "16", factor: float = 2.0) -> dict | None:
    """The issue's target: gradient bytes sent AND received per peer per step at `big` peers <=
    factor x those at `small` peers. None unless both peer counts ran."""
    a, b = by_peers.get(small), by_peers.get(big)
    if not a or not b:
        return None
    sent = ratio(b.get("grad_bytes_sent_per_peer_step"), a.get("grad_bytes_sent_per_peer_step"))
    recv = ratio(b.get("grad_bytes_received_per_peer_step"), a.get("grad_bytes_received_per_peer_step"))
    met = None if sent is None or recv is None else (sent <= factor and recv <= factor)
    st_s = ratio(b.get("grad_bytes_sent_per_peer_step_steady"), a.get("grad_bytes_sent_per_peer_step_steady"))
    st_r = ratio(b.get("grad_bytes_received_per_peer_step_steady"), a.get("grad_bytes_received_per_peer_step_steady"))
    return {"sent_ratio": sent, "received_ratio": recv, "limit": factor, "met": met,
            "what": f"grad bytes per peer per step at {big} peers / at {small} peers (whole run)",
            "steady_sent_ratio": st_s, "steady_received_ratio": st_r,
            "met_steady": None if st_s is None or st_r is None else (st_s <= factor and st_r <= factor)}


REQUEST_BYTES = 512  # a payload's request and answer beyond its body: HTTP lines and headers, 326 B of them the signature's (an estimate)
# a payload body's part that does not shrink with its entries (codec header, block scales): fitted to
# the default model's topk-int8 payloads of 17,511 and 41 entries (32,986 and 347 B)
PAYLOAD_FIXED_BYTES = 270


def paper_model(payload: float | None, other_sent: float | None, other_received: float | None,
                contributors: int, sizes: tuple[int, ...] = (100, 1000)) -> dict | None:
    """Bytes per peer per step on paper at swarm sizes the machine cannot run. all_to_all: each
    peer sends its payload to every other member every step (payload x (P-1) sent and received).
    capped: the default rule as built (--cap-by bytes, swarm/pacing.py): every peer sends every
    step, each payload at 1/k of its entries, k = floor(P/C) (cadence.cap_stride without a limit),
    so about C payloads' entries each way at any size; what grows with P is the count of payloads,
    each with PAYLOAD_FIXED_BYTES that do not shrink (counted in sent and received) and a request
    of about REQUEST_BYTES beyond its body (``requests``, not counted in them).
    capped_by_rounds (--cap-by rounds): each peer sends a whole payload every k = floor(P/C) rounds,
    but k is at most cadence.MAX_STRIDE (8: a peer's summed steps must stay fresher than
    --max-staleness), so it sends (P-1)/k payloads a step and receives as many: about C up to 8C
    peers, then growing with P again, 8x below all-to-all. `other_*`: the measured row and control
    bytes per peer step (rows depend on the batch, not P; membership is per second)."""
    from swarm.core import cadence

    if payload is None:
        return None
    o_s, o_r = other_sent or 0.0, other_received or 0.0
    out = {"payload_bytes": payload, "contributors": contributors, "request_bytes": REQUEST_BYTES,
           "other_sent_per_step": other_sent, "other_received_per_step": other_received}
    for p in sizes:
        k, share = cadence.cap_stride(p, contributors), cadence.cap_stride(p, contributors, limit=None)
        fixed = min(payload, PAYLOAD_FIXED_BYTES)
        split = (payload - fixed) / share + fixed  # one payload at 1/share of its entries
        out[str(p)] = {
            "all_to_all": {"sent": round(payload * (p - 1) + o_s), "received": round(payload * (p - 1) + o_r)},
            "capped": {"sent": round(split * (p - 1) + o_s), "received": round(split * (p - 1) + o_r),
                       "payload_share": share, "requests": {"per_step": p - 1, "bytes": (p - 1) * REQUEST_BYTES}},
            "capped_by_rounds": {"sent": round(payload * (p - 1) / k + o_s), "received": round(payload * (p - 1) / k + o_r),
                                 "rounds_between_contributions": k,
                                 "requests": {"per_step": round((p - 1) / k, 1),
                                              "bytes": round((p - 1) / k * REQUEST_BYTES)}},
        }
    return out


def last_line(runs: dict[str, dict], all_traffic: str | None, extra: dict | None = None) -> dict:
    """The final JSON object: each figure a dict keyed by peer count (as a string)."""
    keys = (*REQUIRED, "bytes_sent_per_peer_step_run", "bytes_received_per_peer_step_run",
            "row_bytes_sent_per_peer_step", "row_bytes_received_per_peer_step",
            "control_bytes_sent_per_peer_step", "control_bytes_received_per_peer_step",
            "grad_bytes_sent_per_peer_step_max", "grad_bytes_received_per_peer_step_max", "payload_bytes",
            "grad_bytes_sent_per_peer_step_steady", "grad_bytes_received_per_peer_step_steady", "steady_window",
            "sent_by_kind_per_peer_step", "sent_by_kind_per_peer_step_steady", "max_contributors",
            "step_time_s", "floor_step_s", "rss_mb_median", "join_s_max", "listen_s", "loss_first_window",
            "loss_last_window", "val_loss", "steps_done", "exit_codes")
    out: dict = {k: {n: r.get(k) for n, r in runs.items()} for k in keys}
    out["target_16_vs_4"] = target_check(runs)
    out["all_traffic"] = all_traffic or "interface counters of each peer's own network namespace (wan0)"
    out.update(extra or {})
    return out


# ----------------------------------------------------------------------------- the network


class Net:
    """Where the peers run. With namespaces: peer i in bench/wan.py's namespace i (unshaped),
    counters from its wan0; on loopback: no prefix, no per-peer counters."""

    def __init__(self, n: int, namespaces: bool):
        self.n = n
        self.wan = wan.Wan(n, None, f"swwan{os.getpid()}") if namespaces else None

    def up(self) -> None:
        if self.wan:
            for ns in wan.stale_namespaces():
                wan.sh("ip", "netns", "del", ns, check=False)
            self.wan.up()

    def down(self) -> None:
        if self.wan:
            self.wan.down()

    def prefix(self, i: int) -> list[str]:
        return self.wan.exec(i) if self.wan else []

    def host(self, i: int) -> str:
        return self.wan.ip(i) if self.wan else "127.0.0.1"

    def counters(self, i: int) -> tuple[int, int] | None:
        """(rx, tx) bytes of peer i's interface now, None on loopback."""
        if not self.wan:
            return None
        out = wan.sh(*self.wan.exec(i), "cat", "/sys/class/net/wan0/statistics/rx_bytes",
                     "/sys/class/net/wan0/statistics/tx_bytes").split()
        return int(out[0]), int(out[1])


def proc_counters(pid: int, dev: str = "wan0") -> tuple[int, int] | None:
    """(rx, tx) bytes of `dev` in the network namespace of process `pid` (/proc/PID/net/dev)."""
    try:
        for line in Path(f"/proc/{pid}/net/dev").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name.strip() == dev:
                f = rest.split()
                return int(f[0]), int(f[8])
    except (OSError, ValueError, IndexError):
        return None
    return None


def peak_rss_mb(pid: int) -> float | None:
    """VmHWM (the peak resident set) of process `pid` in MB, None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass
class Sampler:
    """Every `period` s: each process's interface (rx, tx) and its peak RSS (the last seen is kept)."""
    pids: list[int]
    counters: bool
    period: float = 0.25
    rx: list[tuple[float, list[int | None]]] = field(default_factory=list)
    tx: list[tuple[float, list[int | None]]] = field(default_factory=list)
    rss: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.time()
            if self.counters:
                c = [proc_counters(p) for p in self.pids]
                self.rx.append((now, [x[0] if x else None for x in c]))
                self.tx.append((now, [x[1] if x else None for x in c]))
            for p in self.pids:
                r = peak_rss_mb(p)
                if r is not None:
                    self.rss[p] = max(r, self.rss.get(p, 0.0))
            self._stop.wait(self.period)

    def stop(self) -> None:
        self._stop.set()
        self._t.join(2)


def poll_status(prefix: list[str], addr: str) -> dict | None:
    """The step and byte counters of one peer's /api/status (curl inside its namespace), or None."""
    try:
        r = subprocess.run([*prefix, "curl", "-s", "-m", "10", f"http://{addr}/api/status"],
                               capture_output=True, text=True, timeout=20)
        doc = json.loads(r.stdout)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None
    step = doc.get("inner_step", doc.get("step"))  # inner steps (with --sync-every: not rounds), as the curve
    return {"step": step, "bytes_sent": doc.get("bytes_sent"), "bytes_received": doc.get("bytes_received")}


def steady_marks(steps: int, warmup: int = 20) -> tuple[int, int]:
    """The steps at which the peers are polled: after the codec's warmup (and at least half-way),
    and 5 steps before the end (every peer still runs)."""
    first = min(max(warmup + 5, steps // 2), steps - 10)
    return first, steps - 5


class Poller:
    """Polls every peer's /api/status once peer 0 has passed each mark (see steady_marks)."""

    def __init__(self, procs: list, prefixes: list[list[str]], marks: tuple[int, int]):
        self.procs, self.prefixes, self.marks = procs, prefixes, marks
        self.polls: list[list[dict | None]] = []
        self.steps_at: list[int] = []
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _step(self) -> int:
        pts, _ = wan.parse_peer_lines(list(self.procs[0].lines))
        return max(pts) if pts else 0

    def _run(self) -> None:
        for mark in self.marks:
            while self._step() < mark:
                if self.procs[0].p.poll() is not None:
                    return
                time.sleep(0.2)
            addrs = [next((x for _, line in list(p.lines) if (x := listen_addr(line))), None) for p in self.procs]
            self.steps_at.append(self._step())
            self.polls.append([poll_status(pre, ad) if ad else None for pre, ad in zip(self.prefixes, addrs)])

    def join(self, timeout: float = 30.0) -> None:
        self._t.join(timeout)


# ----------------------------------------------------------------------------- the runs


def peer_argv(a, i: int, host: str, port: int, extra: list[str]) -> list[str]:
    return [sys.executable, str(ROOT / "peer.py"), "--host", host, "--port", str(port), "--steps", str(a.steps),
            "--batch-size", str(a.batch_size), "--seed", str(a.seed), "--threads", "1", "--name", f"p{i}",
            "--progress-interval", "0", *a.peer_argv, *extra]


def run_floor(net: Net, a, n: int, log: Path) -> dict:
    """n peers at once, each alone on its own loopback: compute and codec only, the same contention."""
    procs = [wan.Proc([*net.prefix(i), *peer_argv(a, i, "127.0.0.1", 0, [])], log=log / f"floor{n}-p{i}.err")
             for i in range(n)]
    times = []
    for p in procs:
        code = p.wait(a.run_timeout)
        pts, _ = wan.parse_peer_lines(p.lines)
        times.append(wan.step_time(wan.merge_curves([pts])) if code == 0 else None)
    return {"floor_step_s": mean(times), "floor_exit_codes": [p.p.returncode for p in procs]}


def run_swarm(net: Net, a, n: int, log: Path) -> dict:
    """peer.py x n: peer 0, then (once it listens) the others joining it; every peer --min-peers n."""
    base = [net.counters(i) for i in range(n)]
    extra = ["--min-peers", str(n)]
    starts = [time.time()]
    procs = [wan.Proc([*net.prefix(0), *peer_argv(a, 0, net.host(0), 7100 if net.wan else 0, extra)],
                      log=log / f"swarm{n}-p0.err")]
    sampler = Sampler([procs[0].p.pid], counters=net.wan is not None)
    deadline = time.time() + 120
    addr = None
    while addr is None and time.time() < deadline and procs[0].p.poll() is None:
        addr = next((x for _, line in list(procs[0].lines) if (x := listen_addr(line))), None)
        time.sleep(0.1)
    if addr is None:
        sampler.stop()
        wan.kill(procs[0].p)
        return {"error": f"peer 0 did not listen (exit {procs[0].p.poll()}; see {log}/swarm{n}-p0.err)"}
    for i in range(1, n):
        starts.append(time.time())
        procs.append(wan.Proc([*net.prefix(i), *peer_argv(a, i, net.host(i), 7100 if net.wan else 0,
                                                          [*extra, "--join", addr])], log=log / f"swarm{n}-p{i}.err"))
        sampler.pids.append(procs[-1].p.pid)
    poller = Poller(procs, [net.prefix(i) for i in range(n)], steady_marks(a.steps, flag_value(a.peer_argv, "--warmup-steps", 20)))
    deadline = time.time() + a.run_timeout
    codes = [p.wait(max(1.0, deadline - time.time())) for p in procs]
    sampler.stop()
    poller.join()
    parsed = [wan.parse_peer_lines(p.lines) for p in procs]
    summaries = [s for _, s in parsed]
    curve = wan.merge_curves([pts for pts, _ in parsed])
    rounds = curve[-1][0] if curve else None
    out: dict = {"peers": n, "exit_codes": codes, "steps_done": rounds, "step_time_s": wan.step_time(curve)}
    # interface traffic: the training window, and the whole run
    if net.wan is not None:
        end = [net.counters(i) for i in range(n)]
        rx_run = [e[0] - b[0] for b, e in zip(base, end)]
        tx_run = [e[1] - b[1] for b, e in zip(base, end)]
        out["bytes_sent_per_peer_step_run"] = per_step(mean(tx_run), rounds)
        out["bytes_received_per_peer_step_run"] = per_step(mean(rx_run), rounds)
        if len(curve) >= 2:
            span = curve[-1][0] - curve[0][0]
            tx = wan.bytes_between(full_samples(sampler.tx, n), curve[0][1], curve[-1][1])
            rx = wan.bytes_between(full_samples(sampler.rx, n), curve[0][1], curve[-1][1])
            out["bytes_sent_per_peer_step"] = per_step(mean(tx or []), span)
            out["bytes_received_per_peer_step"] = per_step(mean(rx or []), span)
    out.update(summary_rates([s for s in summaries if s], rounds))
    s0 = next((s for s in summaries if s), None) or {}
    cap = out["max_contributors"] = (s0.get("settings") or {}).get("max_contributors")
    # one payload's size only where every peer sends to every other every round (no cap below n)
    out["payload_bytes"] = payload_bytes([s for s in summaries if s], n) if not cap or cap >= n else None
    if len(poller.polls) == 2:
        out.update(steady_rates(*poller.polls))
        out["steady_window"] = poller.steps_at
    rss = [sampler.rss.get(p.p.pid) for p in procs]
    out["rss_mb"] = None if not any(rss) else round(max(r for r in rss if r), 1)
    out["rss_mb_median"] = None if median(rss) is None else round(median(rss), 1)
    first = [min(pts.items())[1][0] if pts else None for pts, _ in parsed]
    joins = [None if f is None else f - s for f, s in zip(first, starts)]
    listens = [next((t - s for t, line in p.lines if listen_addr(line)), None) for p, s in zip(procs, starts)]
    out["join_s"] = None if median(joins) is None else round(median(joins), 2)
    out["join_s_max"] = None if not any(j is not None for j in joins) else round(max(j for j in joins if j is not None), 2)
    out["listen_s"] = None if median(listens) is None else round(median(listens), 2)
    out["replicas_identical"] = replicas_identical(summaries, n)
    first_w, last_w = loss_windows(curve)
    out["loss_first_window"] = None if first_w is None else round(first_w, 4)
    out["loss_last_window"] = None if last_w is None else round(last_w, 4)
    out["loss_fell"] = loss_fell(first_w, last_w)
    vals = [s["val_loss"] for s in summaries if s and isinstance(s.get("val_loss"), (int, float))]
    out["val_loss"] = None if not vals else round(median(vals), 4)  # median over peers, at the end
    out["steps_contributed"] = mean(s.get("steps_contributed") for s in summaries if s)
    # per peer, what says whether it trained the whole run: a late join (a state sync) or a re-sync
    # trains fewer steps, which the loss figures above then show
    out["per_peer"] = [None if not s else {k: s.get(k) for k in ("steps_contributed", "resyncs", "rounds_timed_out",
                                                                  "state_bytes_received", "val_loss")}
                       for s in summaries]
    out["settings"] = s0.get("settings")
    out["dense_values"] = (s0.get("task") or {}).get("dense_values")
    out["compression_ratio"] = s0.get("compression_ratio")
    return out


def _fmt(v, d: int = 0) -> str:
    return "-" if v is None else f"{v:,.{d}f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def table(runs: dict[str, dict]) -> str:
    head = ("| peers | sent B/peer/step | recv B/peer/step | grad sent | grad recv | rows sent | rows recv | "
            "control sent | step s | floor s | step/floor | peak RSS MB | join s | identical | loss first -> last |")
    rows = [head, "|" + " --- |" * (head.count("|") - 1)]
    for n, r in runs.items():
        rows.append(f"| {n} | {_fmt(r.get('bytes_sent_per_peer_step'))} | {_fmt(r.get('bytes_received_per_peer_step'))} "
                    f"| {_fmt(r.get('grad_bytes_sent_per_peer_step'))} | {_fmt(r.get('grad_bytes_received_per_peer_step'))} "
                    f"| {_fmt(r.get('row_bytes_sent_per_peer_step'))} | {_fmt(r.get('row_bytes_received_per_peer_step'))} "
                    f"| {_fmt(r.get('control_bytes_sent_per_peer_step'))} | {_fmt(r.get('step_time_s'), 3)} "
                    f"| {_fmt(r.get('floor_step_s'), 3)} | {_fmt(r.get('step_time_over_floor'), 2)} "
                    f"| {_fmt(r.get('rss_mb'))} | {_fmt(r.get('join_s'), 1)} | {_fmt(r.get('replicas_identical'))} "
                    f"| {_fmt(r.get('loss_first_window'), 3)} -> {_fmt(r.get('loss_last_window'), 3)} |")
    return "\n".join(rows)


def can_use_namespaces() -> str | None:
    """None when we can make network namespaces, else why not (then: loopback)."""
    if os.geteuid() != 0:
        return "not root"
    probe = f"swscaleprobe{os.getpid()}"
    try:
        wan.sh("ip", "netns", "add", probe)
    except (RuntimeError, OSError) as e:
        return f"ip netns add failed: {e}"
    wan.sh("ip", "netns", "del", probe, check=False)
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="swarms of 2..16 peers on this machine: bytes, step time, memory, "
                                             "join time and replica identity per peer count")
    ap.add_argument("--peers", default="2,4,8,16", help="peer counts to run in turn (default 2,4,8,16)")
    ap.add_argument("--steps", type=int, default=60, help="steps of every run, floors too (default 60)")
    ap.add_argument("--batch-size", type=int, default=2, help="per peer (default 2, so that 16 fit on 2 cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peer-args", default="", help='extra flags for every peer, e.g. "--max-contributors 4"')
    ap.add_argument("--model-contributors", type=int, default=4,
                    help="C of the paper model's capped rounds (default 4; the peers' max_contributors when they report one)")
    ap.add_argument("--no-floor", action="store_true", help="skip the compute floors (step_time_over_floor: None)")
    ap.add_argument("--loopback", action="store_true", help="run on 127.0.0.1 even as root (no all-traffic figures)")
    ap.add_argument("--run-timeout", type=float, default=900.0, help="seconds one run may take")
    ap.add_argument("--log-dir", default="/tmp/swarm-scale-logs")
    ap.add_argument("--out", default=None, help="results JSON (default: LOG_DIR/scale.json)")
    a = ap.parse_args(argv)
    try:
        peers = parse_peers(a.peers)
        a.peer_argv = parse_peer_args(a.peer_args)
        if a.steps < 2 * WINDOW:
            raise ArgError(f"--steps must be at least {2 * WINDOW} (two loss windows), got {a.steps}")
        if a.batch_size < 1 or a.model_contributors < 1:
            raise ArgError("--batch-size and --model-contributors must be at least 1")
    except ArgError as e:
        print(f"scale.py: error: {e}", file=sys.stderr)
        return 2
    why_not = None if not a.loopback else "--loopback"
    if why_not is None:
        why_not = can_use_namespaces()
    all_traffic = None if why_not is None else (f"unavailable ({why_not}): peers on loopback, which has no "
                                                f"per-peer interface counters")
    log = Path(a.log_dir)
    log.mkdir(parents=True, exist_ok=True)

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    net = Net(max(peers), namespaces=why_not is None)
    runs: dict[str, dict] = {}
    durations: dict[str, float] = {}
    t_start = time.time()
    try:
        net.up()
        print(f"scale: peers {','.join(map(str, peers))}, {a.steps} steps, batch {a.batch_size}/peer, peer args "
              f"{a.peer_argv or 'none'}; network: {'namespaces, unshaped veths' if net.wan else all_traffic}", flush=True)
        for n in peers:
            t0 = time.time()
            floor = {} if a.no_floor else run_floor(net, a, n, log)
            res = run_swarm(net, a, n, log)
            res.update(floor)
            res["step_time_over_floor"] = ratio(res.get("step_time_s"), floor.get("floor_step_s"))
            runs[str(n)] = res
            durations[str(n)] = round(time.time() - t0, 1)
            print(f"{n} peers: grad sent/recv {_fmt(res.get('grad_bytes_sent_per_peer_step'))}/"
                  f"{_fmt(res.get('grad_bytes_received_per_peer_step'))} B/peer/step, all traffic "
                  f"{_fmt(res.get('bytes_sent_per_peer_step'))}/{_fmt(res.get('bytes_received_per_peer_step'))}, "
                  f"step {_fmt(res.get('step_time_s'), 3)} s = {_fmt(res.get('step_time_over_floor'), 2)} x floor, "
                  f"RSS {_fmt(res.get('rss_mb'))} MB, join {_fmt(res.get('join_s'), 1)} s, identical "
                  f"{res.get('replicas_identical')}, loss fell {res.get('loss_fell')}, exit {res.get('exit_codes')}, "
                  f"{durations[str(n)]:.0f} s" + (f" ERROR {res['error']}" if res.get("error") else ""), flush=True)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        wan.kill_all()
        net.down()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    smallest, largest = runs.get(str(min(peers)), {}), runs.get(str(max(peers)), {})
    def reported(name: str):
        """A swarm setting as the runs' summaries report it (the first that does)."""
        return next((r["settings"].get(name) for r in runs.values()
                     if isinstance(r.get("settings"), dict) and r["settings"].get(name)), None)

    cap, cap_by = reported("max_contributors"), reported("cap_by")
    # rows and control per peer step at the largest swarm, the SENT side for both directions: a
    # peer's summary counts received reply bodies only (not pushes and replicas arriving as
    # requests), while over the swarm every byte sent is received, so the mean over peers is equal
    other = [(r.get("row_bytes_sent_per_peer_step") or 0) + (r.get("control_bytes_sent_per_peer_step") or 0)
             for r in (largest,) if r]
    other_r = other
    # one payload after the codec's warmup: the smallest swarm's steady gradient bytes per step / recipients
    steady = smallest.get("grad_bytes_sent_per_peer_step_steady")
    payload = round(steady / (min(peers) - 1), 1) if steady else smallest.get("payload_bytes")
    model = paper_model(payload, mean(other), mean(other_r), int(cap or a.model_contributors))
    if model:
        model["payload_from"] = (f"{min(peers)} peers' gradient bytes sent per step after the warmup (polled)" if steady
                                 else f"{min(peers)} peers' whole-run payload (warmup included)")
    result = last_line(runs, all_traffic, {
        "paper_model": model, "max_contributors_reported": cap, "cap_by_reported": cap_by, "peer_args": a.peer_argv, "steps": a.steps,
        "batch_size": a.batch_size, "run_seconds": durations, "seconds": round(time.time() - t_start, 1)})
    print(table(runs))
    out = Path(a.out) if a.out else log / "scale.json"
    out.write_text(json.dumps({"args": {k: v for k, v in vars(a).items()}, "summary": result, "runs": runs}, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
